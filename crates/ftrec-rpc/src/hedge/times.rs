//! The recent times of each kind of call: the window the hedge's triggers and the
//! worker's suspicion are read from.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// Calls of each kind whose durations are kept.
pub const WINDOW: usize = 256;
/// Below this many, a kind's times say nothing yet: no call of it is suspected.
pub const MIN_SAMPLES: usize = 32;
/// Below this many answered calls of a (kind, member), none of its calls is hedged. Fewer
/// than [`MIN_SAMPLES`]: a copy's trigger is the fast quartile, which 8 calls already
/// place (the second fastest), and a copy costs one call's work where a suspicion costs a
/// recovery. On a link lossy from the start, the first 32 steps' calls had gone without
/// copies: 0.1-0.2 s of a 400-step run's loss.
pub const HEDGE_MIN_SAMPLES: usize = 8;

/// The last [`WINDOW`] times of one kind of call.
#[derive(Default)]
pub(super) struct Window(VecDeque<Duration>);

impl Window {
    pub(super) fn push(&mut self, took: Duration) {
        if self.0.len() == WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(took);
    }

    /// The `percent`th percentile, once there are [`MIN_SAMPLES`] times.
    pub(super) fn percentile(&self, percent: usize) -> Option<Duration> {
        self.percentile_of(percent, MIN_SAMPLES)
    }

    /// The `percent`th percentile, once there are `min` times.
    pub(super) fn percentile_of(&self, percent: usize, min: usize) -> Option<Duration> {
        if self.0.len() < min.max(1) {
            return None;
        }
        let mut sorted: Vec<Duration> = self.0.iter().copied().collect();
        sorted.sort_unstable();
        let rank = (sorted.len() * percent).div_ceil(100).max(1) - 1;
        Some(sorted[rank])
    }
}

/// How long each kind of call took, the last [`WINDOW`] of them that succeeded.
#[derive(Default)]
pub struct CallTimes {
    kinds: BTreeMap<&'static str, Window>,
}

impl CallTimes {
    pub fn record(&mut self, kind: &'static str, took: Duration) {
        self.kinds.entry(kind).or_default().push(took);
    }

    /// The 99th percentile of `kind`'s recent calls, once there are enough of them.
    pub fn p99(&self, kind: &str) -> Option<Duration> {
        self.kinds.get(kind)?.percentile(99)
    }

    /// "pull 1.0/2.3/9.1 ms, push ..." (each kind's median, 90th and 99th percentile of
    /// its recent calls), or "none": where a slow step spends its time, for the worker's
    /// last log line.
    pub fn summary(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let kinds: Vec<String> = self
            .kinds
            .iter()
            .filter_map(|(kind, window)| {
                let [p50, p90, p99] = [50, 90, 99].map(|p| window.percentile(p));
                Some(format!(
                    "{kind} {:.1}/{:.1}/{:.1} ms",
                    ms(p50?),
                    ms(p90?),
                    ms(p99?)
                ))
            })
            .collect();
        if kinds.is_empty() {
            "none".into()
        } else {
            kinds.join(", ")
        }
    }
}
