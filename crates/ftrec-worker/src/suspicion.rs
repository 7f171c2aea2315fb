//! Finding a server cut off from this worker within a second, not a step deadline.
//!
//! A step's calls share one deadline (`cluster.deadlines.step_ms`, 5 s by default), long
//! enough for a call that is slow for a good reason: rows decoded while a shard rebuilds,
//! a loaded host. A partition between this worker and one server looks the same from the
//! call: no answer. So a call unanswered after a small multiple of what its kind usually
//! takes (the p99 of the last calls, with a floor) is only *suspected*: the worker opens a
//! connection of its own to that server and asks it a trivial question
//! ([`Connector::reaches`]). Any answer means the server is reachable and the call goes
//! on waiting up to the deadline; none within the failure timeout means it is cut off (or
//! frozen), and the step is lost at once, naming the server as confirmed unreachable. The
//! coordinator, which still reaches that server, then fences it after this one report
//! instead of two (issue 44 §2). A link that is slow but passes packets answers the probe,
//! so it is never declared dead.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use ftrec_rpc::PsError;
use ftrec_rpc::client::Connector;
pub(crate) use ftrec_rpc::hedge::CallTimes;

/// A call is suspected after this many times its kind's p99.
const P99_MULTIPLE: u32 = 10;

/// The worker's settings for suspecting a call (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Suspicion {
    /// No call is suspected sooner than this.
    pub floor: Duration,
    /// How long the probe's own connection may take to bring an answer.
    pub probe_within: Duration,
}

impl Suspicion {
    /// A quarter of the failure timeout as the floor, the failure timeout for the probe:
    /// a host too loaded to answer a fresh connection in that time would miss its
    /// heartbeats too.
    pub fn of(failure_timeout: Duration) -> Self {
        Self {
            floor: failure_timeout / 4,
            probe_within: failure_timeout,
        }
    }

    /// When a call of `kind` is suspected: `P99_MULTIPLE` times its p99, at least the
    /// floor; never, before the kind has enough samples or past `deadline`.
    pub(crate) fn after(
        &self,
        times: &CallTimes,
        kind: &str,
        deadline: Duration,
    ) -> Option<Duration> {
        let after = times
            .p99(kind)?
            .saturating_mul(P99_MULTIPLE)
            .max(self.floor);
        (after < deadline).then_some(after)
    }
}

/// A call's watch: when it is suspected, and the probe that then decides.
pub(crate) struct Watch {
    pub(crate) after: Duration,
    pub(crate) probe: BoxFuture<'static, bool>,
    pub(crate) probe_within: Duration,
}

impl Watch {
    /// Built for every watched call and polled only for a suspected one: two reference
    /// counts, not a copy of the connector (its TLS settings) per call.
    pub(crate) fn new(
        suspicion: &Suspicion,
        after: Duration,
        connector: &Arc<Connector>,
        address: &Arc<str>,
    ) -> Self {
        let connector = Arc::clone(connector);
        let address = Arc::clone(address);
        let within = suspicion.probe_within;
        Self {
            after,
            probe: Box::pin(async move { connector.reaches(&address, within).await }),
            probe_within: within,
        }
    }
}

/// What one watched call came to.
pub(crate) struct Called<Rep> {
    pub(crate) result: Result<Rep, PsError>,
    /// How long it took, when it succeeded.
    pub(crate) took: Option<Duration>,
    /// It was suspected and the probe found its server unreachable.
    pub(crate) confirmed_unreachable: bool,
}

/// One call, bounded by the deadline its step's calls share; a call still unanswered then
/// is `Unavailable`: its server is silent (frozen, cut off), as far as this step can tell.
/// With a `watch`, a call unanswered at `watch.after` is probed (module docs).
pub(crate) async fn within<Rep>(
    give_up: Instant,
    what: &str,
    call: impl Future<Output = Result<tonic::Response<Rep>, tonic::Status>>,
    watch: Option<Watch>,
) -> Called<Rep> {
    let started = Instant::now();
    let done = |result: Result<tonic::Response<Rep>, tonic::Status>| {
        let result = result
            .map(tonic::Response::into_inner)
            .map_err(|status| PsError::rpc(what, &status));
        Called {
            took: result.is_ok().then(|| started.elapsed()),
            result,
            confirmed_unreachable: false,
        }
    };
    let mut call = std::pin::pin!(call);
    if let Some(watch) = watch {
        let suspected = (started + watch.after).min(give_up);
        match tokio::time::timeout_at(suspected, &mut call).await {
            Ok(result) => return done(result),
            Err(_) if suspected >= give_up => {}
            Err(_) => {
                tracing::debug!(
                    "{what}: no answer after {:?}; probing its server",
                    watch.after
                );
                let mut probe = watch.probe;
                tokio::select! {
                    result = &mut call => return done(result),
                    reachable = &mut probe => if !reachable {
                        return Called {
                            result: Err(PsError::Unavailable(format!(
                                "{what}: no answer after {:?}, and a connection of its own \
                                 got none within {:?}: the server is unreachable from this \
                                 worker",
                                watch.after, watch.probe_within
                            ))),
                            took: None,
                            confirmed_unreachable: true,
                        };
                    }
                }
            }
        }
    }
    match tokio::time::timeout_at(give_up, call).await {
        Ok(result) => done(result),
        Err(_) => Called {
            result: Err(PsError::Unavailable(format!(
                "{what}: no answer within the step deadline (cluster.deadlines.step_ms)"
            ))),
            took: None,
            confirmed_unreachable: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_rpc::hedge::{MIN_SAMPLES, WINDOW};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_kind_is_suspected_after_ten_times_its_p99_with_a_floor() {
        let suspicion = Suspicion::of(ms(1000));
        let mut times = CallTimes::default();
        for _ in 0..MIN_SAMPLES - 1 {
            times.record("pull", ms(2));
        }
        assert_eq!(
            suspicion.after(&times, "pull", ms(5000)),
            None,
            "too few samples"
        );
        times.record("pull", ms(2));
        assert_eq!(
            suspicion.after(&times, "pull", ms(5000)),
            Some(ms(250)),
            "the floor"
        );
        // One slow call in a hundred is the p99.
        for i in 0..WINDOW {
            times.record("push", ms(if i % 100 == 0 { 40 } else { 3 }));
        }
        assert_eq!(times.p99("push"), Some(ms(40)));
        assert_eq!(suspicion.after(&times, "push", ms(5000)), Some(ms(400)));
        // Never past the deadline: the deadline decides alone.
        assert_eq!(suspicion.after(&times, "push", ms(300)), None);
        assert_eq!(suspicion.after(&times, "commit", ms(5000)), None);
    }

    #[test]
    fn the_window_forgets_old_calls() {
        let mut times = CallTimes::default();
        for _ in 0..WINDOW {
            times.record("pull", ms(900));
        }
        for _ in 0..WINDOW {
            times.record("pull", ms(1));
        }
        assert_eq!(times.p99("pull"), Some(ms(1)));
    }

    async fn answer_after(wait: Duration) -> Result<tonic::Response<u32>, tonic::Status> {
        tokio::time::sleep(wait).await;
        Ok(tonic::Response::new(7))
    }

    fn watch(after: Duration, reachable: bool) -> Watch {
        Watch {
            after,
            probe: Box::pin(async move {
                tokio::time::sleep(ms(100)).await;
                reachable
            }),
            probe_within: ms(100),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_call_to_a_reachable_server_waits_for_its_answer() {
        let give_up = Instant::now() + ms(5000);
        let called = within(
            give_up,
            "pull",
            answer_after(ms(2000)),
            Some(watch(ms(250), true)),
        )
        .await;
        assert_eq!(called.result.unwrap(), 7);
        assert!(!called.confirmed_unreachable);
        assert_eq!(called.took, Some(ms(2000)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_the_probe_cannot_reach_loses_the_call_at_once() {
        let started = Instant::now();
        let give_up = started + ms(5000);
        let called = within(
            give_up,
            "pull",
            answer_after(ms(60_000)),
            Some(watch(ms(250), false)),
        )
        .await;
        assert!(called.confirmed_unreachable);
        assert!(matches!(called.result, Err(PsError::Unavailable(_))));
        assert_eq!(
            started.elapsed(),
            ms(350),
            "suspected at 250 ms, probed for 100 ms"
        );
        // Without a watch, the same call waits out the deadline and confirms nothing.
        let started = Instant::now();
        let called = within(started + ms(5000), "pull", answer_after(ms(60_000)), None).await;
        assert!(!called.confirmed_unreachable && called.result.is_err());
        assert_eq!(started.elapsed(), ms(5000));
    }
}
