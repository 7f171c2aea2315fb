//! Server-streamed replies with a bound on their silence. A call's deadline
//! (`Endpoint::timeout`) ends when the reply's headers arrive; after that a sender that
//! froze (SIGSTOP) or lost its link mid-stream would leave its reader waiting forever, as
//! neither HTTP/2 nor TCP ever gives up on a quiet stream by itself. Every reader of a
//! stream goes through [`Progressing`]: no message for the deadline ends the stream as a
//! failed call to its sender, [`PsError::Unavailable`], which callers already treat as a
//! member that may be dead.

use std::time::Duration;

use futures::{Stream, StreamExt};

use crate::PsError;

/// What [`Progressing::next_or_stall`] read.
pub enum Read<T> {
    Message(T),
    /// The stream ended.
    End,
    /// No message within the deadline: the error a reader that gives up returns.
    Stalled(PsError),
}

/// A stream of replies whose next message must come within `deadline`.
pub struct Progressing<S> {
    stream: S,
    deadline: Duration,
    what: String,
}

/// Bounds the silence of any stream of gRPC replies (a `tonic::Streaming`).
pub trait ProgressDeadline: Sized {
    /// This stream, each of whose messages must come within `deadline` of the last (or
    /// of the first read); `what` names the stream and its sender in the error.
    fn with_progress_deadline(
        self,
        deadline: Duration,
        what: impl Into<String>,
    ) -> Progressing<Self>;
}

impl<S, T> ProgressDeadline for S
where
    S: Stream<Item = Result<T, tonic::Status>> + Unpin,
{
    fn with_progress_deadline(
        self,
        deadline: Duration,
        what: impl Into<String>,
    ) -> Progressing<Self> {
        Progressing {
            stream: self,
            deadline,
            what: what.into(),
        }
    }
}

impl<S, T> Progressing<S>
where
    S: Stream<Item = Result<T, tonic::Status>> + Unpin,
{
    /// The next message, `None` at the stream's end. A silence past the deadline is an
    /// `Unavailable` status without details, so that [`PsError::rpc`] reads it as the
    /// sender unreachable (not as a sender that answered about a peer).
    pub async fn message(&mut self) -> Result<Option<T>, tonic::Status> {
        match tokio::time::timeout(self.deadline, self.stream.next()).await {
            Ok(next) => next.transpose(),
            Err(_) => Err(tonic::Status::unavailable(self.silence())),
        }
    }

    /// [`Progressing::message`], its failures typed: a silence past the deadline is
    /// [`PsError::Unavailable`] naming the stream.
    pub async fn next_message(&mut self) -> Result<Option<T>, PsError> {
        match tokio::time::timeout(self.deadline, self.stream.next()).await {
            Ok(next) => next
                .transpose()
                .map_err(|status| PsError::rpc(self.what.clone(), &status)),
            Err(_) => Err(PsError::Unavailable(self.silence())),
        }
    }

    /// [`Progressing::next_message`] with a silence past the deadline told apart: the
    /// sender answered and then stalled, which a reader that can ask again from where the
    /// stream stopped may take as a hiccup rather than a failure.
    pub async fn next_or_stall(&mut self) -> Result<Read<T>, PsError> {
        match tokio::time::timeout(self.deadline, self.stream.next()).await {
            Ok(Some(Ok(message))) => Ok(Read::Message(message)),
            Ok(None) => Ok(Read::End),
            Ok(Some(Err(status))) => Err(PsError::rpc(self.what.clone(), &status)),
            Err(_) => Ok(Read::Stalled(PsError::Unavailable(self.silence()))),
        }
    }

    /// The deadline this stream's messages must keep.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    fn silence(&self) -> String {
        tracing::warn!(
            "{}: no message for {} ms; giving the stream up",
            self.what,
            self.deadline.as_millis()
        );
        format!(
            "{}: no message for {} ms mid-stream (its sender froze or lost its link)",
            self.what,
            self.deadline.as_millis()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Item = Result<u32, tonic::Status>;

    fn after(ms: u64, item: u32) -> impl Stream<Item = Item> {
        futures::stream::once(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(item)
        })
    }

    /// Each gap within the deadline, the whole longer than it: only silence counts. (Real
    /// time: tokio's paused clock would need its `test-util` feature in every build.)
    #[tokio::test]
    async fn a_stream_that_goes_silent_fails_after_its_deadline_and_not_before() {
        let deadline = Duration::from_millis(400);
        let slow = futures::stream::iter([Ok(1)])
            .chain(after(150, 2))
            .chain(after(150, 3))
            .chain(after(150, 4))
            .chain(futures::stream::pending::<Item>());
        let mut s = Box::pin(slow).with_progress_deadline(deadline, "server 7's rows");
        let started = tokio::time::Instant::now();
        for expected in 1..=4 {
            assert_eq!(s.next_message().await.unwrap(), Some(expected));
        }
        assert!(started.elapsed() > deadline);
        let silent_from = tokio::time::Instant::now();
        match s.next_message().await {
            Err(PsError::Unavailable(m)) => {
                assert!(m.contains("server 7's rows"), "{m}");
                assert!(m.contains("400 ms"), "{m}");
            }
            other => panic!("a silent stream must end as its sender unavailable: {other:?}"),
        }
        assert!(silent_from.elapsed() >= deadline);
    }

    /// The status form reads back, through `PsError::rpc`, as the sender unreachable.
    #[tokio::test]
    async fn the_status_of_a_silence_is_the_sender_unreachable_and_the_end_and_errors_pass() {
        let silent = futures::stream::pending::<Item>();
        let mut s = silent.with_progress_deadline(Duration::from_millis(50), "a rebuild");
        let status = s.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        let e = PsError::rpc("server 2", &status);
        assert_eq!(e.unreachable_server(2), Some(2), "{e:?}");

        let ended = futures::stream::iter([Ok(5)]);
        let mut s = ended.with_progress_deadline(Duration::from_secs(5), "rows");
        assert_eq!(s.message().await.unwrap(), Some(5));
        assert_eq!(s.message().await.unwrap(), None);

        let refused =
            futures::stream::iter([Item::Err(PsError::StaleEpoch { got: 1, current: 2 }.into())]);
        let mut s = refused.with_progress_deadline(Duration::from_secs(5), "rows");
        assert!(matches!(
            s.next_message().await,
            Err(PsError::StaleEpoch { got: 1, current: 2 })
        ));
    }
}
