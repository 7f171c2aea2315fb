//! A rebuild's progress stream never goes quiet while the rebuild lives. The coordinator
//! reads a stream silent for the progress deadline as its sender frozen or cut off, and
//! a rebuild may legitimately say nothing for longer: it sends one message per table, a
//! large table takes a while to stream in and decode, and a background rebuild's tables
//! may be paced (`pace.rs`) or capped by `ec.rebuild_bytes_per_sec`. So the last progress goes out again whenever
//! a tick passes without news.

use std::time::Duration;

use futures::Stream;
use tokio::sync::mpsc::Receiver;
use tonic::Status;

use ftrec_proto::proto::RebuildReply;

/// The rebuild's replies from `rx`, and between them, after each `tick` without one, the
/// last progress again (never as `done` or `serving`, which the reader acts on once). The
/// stream ends when the rebuild's sender is dropped; dropping the stream (the reader went
/// away) makes the rebuild's sends fail.
pub(crate) fn with_ticks(
    rx: Receiver<Result<RebuildReply, Status>>,
    tick: Duration,
) -> impl Stream<Item = Result<RebuildReply, Status>> + Send + 'static {
    futures::stream::unfold(
        (rx, RebuildReply::default()),
        move |(mut rx, last)| async move {
            match tokio::time::timeout(tick, rx.recv()).await {
                Ok(Some(reply)) => {
                    let last = match &reply {
                        Ok(r) => RebuildReply {
                            done: false,
                            serving: false,
                            ..*r
                        },
                        Err(_) => last,
                    };
                    Some((reply, (rx, last)))
                }
                Ok(None) => None,
                Err(_) => Some((Ok(last), (rx, last))),
            }
        },
    )
}

/// The tick for a reader whose progress deadline is `deadline`: four within it, so that
/// a late tick or two (a busy runtime, a slow link) is no silence.
pub(crate) fn tick_for(deadline: Duration) -> Duration {
    (deadline / 4).max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn progress(tables_done: u32) -> RebuildReply {
        RebuildReply {
            tables_done,
            tables: 4,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_quiet_rebuild_repeats_its_last_progress_every_tick_and_ends_with_its_sender() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let tick = Duration::from_millis(40);
        let mut replies = Box::pin(with_ticks(rx, tick));
        let started = tokio::time::Instant::now();
        // Before any news: an empty progress, after a tick.
        assert_eq!(
            replies.next().await.unwrap().unwrap(),
            RebuildReply::default()
        );
        assert!(started.elapsed() >= tick);
        tx.send(Ok(RebuildReply {
            serving: true,
            ..progress(1)
        }))
        .await
        .unwrap();
        assert!(replies.next().await.unwrap().unwrap().serving);
        // Repeated, but never as `serving` or `done` again.
        for _ in 0..3 {
            assert_eq!(replies.next().await.unwrap().unwrap(), progress(1));
        }
        assert!(started.elapsed() >= tick * 4);
        tx.send(Ok(RebuildReply {
            done: true,
            ..progress(4)
        }))
        .await
        .unwrap();
        drop(tx);
        assert!(replies.next().await.unwrap().unwrap().done);
        assert!(replies.next().await.is_none());
    }

    #[test]
    fn four_ticks_fit_in_the_deadline() {
        assert_eq!(
            tick_for(Duration::from_secs(5)),
            Duration::from_millis(1250)
        );
        assert_eq!(tick_for(Duration::ZERO), Duration::from_millis(1));
    }
}
