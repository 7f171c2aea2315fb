//! A call raced against its copy: the first answer wins.

use std::future::Future;
use std::time::Duration;

/// What [`first_answer`] came to.
pub struct Answered<T> {
    pub result: T,
    /// The second copy was sent.
    pub hedged: bool,
}

/// `call`, and `second` (the same call on another connection) once `call` has gone
/// unanswered for `after`: the first success wins and the other is dropped (cancelled).
/// A failure of one waits for the other, so a copy refused at once (a connection not yet
/// open) never hides an answer on the way; when both fail, the first call's error is the
/// one returned. `second` is not polled before `after`, so it sends nothing until then.
pub async fn first_answer<T, E>(
    call: impl Future<Output = Result<T, E>>,
    second: Option<(Duration, impl Future<Output = Result<T, E>>)>,
) -> Answered<Result<T, E>> {
    let mut call = std::pin::pin!(call);
    let Some((after, second)) = second else {
        return Answered {
            result: call.await,
            hedged: false,
        };
    };
    // Biased, as every select on a path the simulation drives: tokio picks among ready
    // branches at random otherwise, and a seed would not replay.
    tokio::select! {
        biased;
        result = &mut call => return Answered { result, hedged: false },
        _ = tokio::time::sleep(after) => {}
    }
    let mut second = std::pin::pin!(second);
    let result = tokio::select! {
        biased;
        first = &mut call => match first {
            Ok(answer) => Ok(answer),
            Err(e) => second.await.map_err(|_| e),
        },
        copy = &mut second => match copy {
            Ok(answer) => Ok(answer),
            Err(_) => call.await,
        },
    };
    Answered {
        result,
        hedged: true,
    }
}
