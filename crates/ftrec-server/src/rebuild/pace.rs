//! A background rebuild paces itself from what it measures (issue 45 §1), instead of a
//! cap set by hand per host or a renice that needs a privilege.
//!
//! The replacement sees every step commit (it is a 2PC participant of each), so it knows
//! training's committed-step rate while it rebuilds; the coordinator sends the rate the
//! job committed before the failure. Window by window the pace compares the two:
//! - while training keeps at least `ec.rebuild_training_share` of its failure-free rate,
//!   the rebuild runs as fast as it goes (or climbs back towards that, by a quarter a
//!   window);
//! - when training falls below it, the rebuild's rate is cut in proportion to the
//!   shortfall, down to a floor of half its fastest unpaced window's rate: the pace never
//!   stretches the window without redundancy past about twice its unpaced length. (A floor
//!   of an eighth let a simulated link's latency, which slowed training whatever the
//!   rebuild did, stretch a rebuild until a second crash found its group still rebuilding:
//!   `ftrec-sim` schedules::ec, seed 11. Training that slows for another cause gains
//!   nothing from a slower rebuild, and the exposure is the larger risk.)
//!
//! The caller paces only where the group survives another loss meanwhile (fewer of its
//! members lost than `ec.r`): with r = 1 nothing is paced (`rebuild/mod.rs`).
//!
//! The pace never slows what a pull or push needs: those rows are decoded on demand
//! whatever the pace. A user's cap (`ec.rebuild_bytes_per_sec`) still bounds it.

use std::time::Duration;

use tokio::time::Instant;

/// Windows are at least this long: a shorter one holds too few steps to rate.
const MIN_WINDOW: Duration = Duration::from_millis(100);
/// And at most this long: a slow job must still be paced within a rebuild of seconds.
const MAX_WINDOW: Duration = Duration::from_secs(1);
/// Failure-free steps a window should hold.
const STEPS_PER_WINDOW: f64 = 4.0;
/// The most a window's shortfall cuts the rate by, and how fast it climbs back.
const MAX_CUT: f64 = 0.5;
const CLIMB: f64 = 1.25;
/// The floor, as a share of the fastest unpaced window's rate.
const FLOOR_SHARE: f64 = 0.5;

/// One background rebuild's pace.
#[derive(Debug)]
pub(crate) struct Pace {
    /// Steps per second before the failure; the pace only follows a user's cap without.
    failure_free: f64,
    share: f64,
    /// The user's cap in bytes per second (0: none).
    cap: f64,
    window: Duration,
    started: Instant,
    bytes_at_start: u64,
    from: Instant,
    applied_from: u64,
    bytes_from: u64,
    /// The pace's own limit in bytes per second; `None`: as fast as it goes.
    limit: Option<f64>,
    /// The fastest window's rate, the goal a climb ends at, and the floor's base.
    fastest: Option<f64>,
    floor: Option<f64>,
    /// Windows in which training fell below its share.
    pub(crate) backoffs: u32,
}

impl Pace {
    /// `applied` and `bytes`: the committed-step floor and the bytes rebuilt at `now`.
    pub(crate) fn new(
        failure_free_steps_per_sec: f64,
        share: f64,
        cap_bytes_per_sec: u64,
        now: Instant,
        applied: u64,
        bytes: u64,
    ) -> Self {
        let paced = failure_free_steps_per_sec.is_finite()
            && failure_free_steps_per_sec > 0.0
            && share > 0.0;
        let window = if paced {
            Duration::from_secs_f64(STEPS_PER_WINDOW / failure_free_steps_per_sec)
                .clamp(MIN_WINDOW, MAX_WINDOW)
        } else {
            MIN_WINDOW
        };
        Self {
            failure_free: if paced {
                failure_free_steps_per_sec
            } else {
                0.0
            },
            share,
            cap: cap_bytes_per_sec as f64,
            window,
            started: now,
            bytes_at_start: bytes,
            from: now,
            applied_from: applied,
            bytes_from: bytes,
            limit: None,
            fastest: None,
            floor: None,
            backoffs: 0,
        }
    }

    /// After a range installed: how long to wait before the next, with `bytes` rebuilt so
    /// far and steps below `applied` committed, at `now`. The slower of the pace and the
    /// user's cap holds; the cap is kept over the whole rebuild (a range is larger than a
    /// low cap allows in one window).
    pub(crate) fn after(&mut self, now: Instant, bytes: u64, applied: u64) -> Duration {
        let elapsed = now.saturating_duration_since(self.from);
        let mut wait = Duration::ZERO;
        if elapsed >= self.window {
            self.close_window(elapsed.as_secs_f64(), bytes, applied);
            self.from = now;
            self.applied_from = applied;
            self.bytes_from = bytes;
        } else if let Some(limit) = self.limit {
            wait = due(bytes.saturating_sub(self.bytes_from), limit).saturating_sub(elapsed);
        }
        if self.cap > 0.0 {
            let capped = due(bytes.saturating_sub(self.bytes_at_start), self.cap)
                .saturating_sub(now.saturating_duration_since(self.started));
            wait = wait.max(capped);
        }
        wait
    }

    /// The limit the pace holds now (`None`: as fast as it goes), in bytes per second.
    #[cfg(test)]
    pub(crate) fn limit(&self) -> Option<f64> {
        self.limit
    }

    fn close_window(&mut self, seconds: f64, bytes: u64, applied: u64) {
        let rate = bytes.saturating_sub(self.bytes_from) as f64 / seconds;
        if self.limit.is_none() {
            let fastest = self.fastest.map_or(rate, |f| f.max(rate));
            self.fastest = Some(fastest);
            self.floor = Some(fastest * FLOOR_SHARE);
        }
        if self.failure_free <= 0.0 {
            return;
        }
        let committed = applied.saturating_sub(self.applied_from) as f64 / seconds;
        let kept = committed / self.failure_free;
        if kept < self.share {
            self.backoffs += 1;
            let from = self.limit.map_or(rate, |l| l.min(rate.max(1.0)));
            let cut = from * (kept / self.share).max(MAX_CUT);
            self.limit = Some(cut.max(self.floor.unwrap_or(0.0)));
        } else if let Some(limit) = self.limit {
            let up = limit * CLIMB;
            self.limit = match self.fastest {
                Some(fastest) if up < fastest => Some(up),
                _ => None,
            };
        }
    }
}

/// When `bytes` are due at `bytes_per_sec`.
fn due(bytes: u64, bytes_per_sec: f64) -> Duration {
    Duration::from_secs_f64(bytes as f64 / bytes_per_sec.max(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    /// 10 failure-free steps a second: windows of 0.4 s.
    fn pace(share: f64, cap: u64) -> (Pace, Instant) {
        let t0 = Instant::now();
        (Pace::new(10.0, share, cap, t0, 100, 0), t0)
    }

    fn at(t0: Instant, seconds: f64) -> Instant {
        t0 + Duration::from_secs_f64(seconds)
    }

    #[test]
    fn training_at_its_share_leaves_the_rebuild_unpaced() {
        let (mut p, t0) = pace(0.5, 0);
        assert_eq!(p.window, Duration::from_millis(400));
        // 100 MB in the first 0.4 s window, training at 5 steps/s of 10: no wait.
        assert_eq!(p.after(at(t0, 0.2), 50 * MB, 101), Duration::ZERO);
        assert_eq!(p.after(at(t0, 0.4), 100 * MB, 102), Duration::ZERO);
        assert_eq!((p.limit(), p.backoffs), (None, 0));
    }

    #[test]
    fn a_shortfall_cuts_the_rate_in_proportion_and_a_recovery_lets_it_go() {
        let (mut p, t0) = pace(0.625, 0);
        // Window 1: 400 MB/s, training at 5 steps/s: 0.5 of failure-free, 0.8 of its share.
        p.after(at(t0, 0.4), 160 * MB, 102);
        let limit = p.limit().unwrap();
        assert!((limit - 320e6).abs() < 1.0, "{limit}");
        assert_eq!(p.backoffs, 1);
        // Within the next window the pace holds it: 64 MB due at 0.2 s, asked at 0.05 s.
        let wait = p.after(at(t0, 0.45), 224 * MB, 102);
        assert!((wait.as_secs_f64() - 0.15).abs() < 1e-6, "{wait:?}");
        // Training back above its share: the limit climbs by a quarter, to the fastest
        // window's rate, where the pace lets go.
        p.after(at(t0, 0.8), 288 * MB, 105);
        assert_eq!((p.limit(), p.backoffs), (None, 1));
    }

    #[test]
    fn no_cut_goes_below_half_the_fastest_rate_and_the_climb_is_gradual() {
        let (mut p, t0) = pace(0.5, 0);
        // Training stopped dead: the cut is at most half, which is the floor too.
        p.after(at(t0, 0.4), 160 * MB, 100);
        assert!((p.limit().unwrap() - 200e6).abs() < 1.0);
        let mut ms = 400;
        let mut bytes = 160 * MB;
        let mut window = |p: &mut Pace, applied: u64| {
            ms += 400;
            bytes += (p.limit().unwrap_or(400e6) * 0.4) as u64;
            p.after(t0 + Duration::from_millis(ms), bytes, applied);
        };
        for _ in 0..10 {
            window(&mut p, 100);
        }
        // However long training stays down, the rebuild keeps half its fastest rate: the
        // window without redundancy is at most about twice as long.
        assert!((p.limit().unwrap() - 200e6).abs() < 1.0, "{:?}", p.limit());
        assert_eq!(p.backoffs, 11);
        // Training back at full speed (4 steps a window): 250, 312.5, 390.6 MB/s, and past
        // the fastest window's 400 MB/s, unpaced.
        let mut applied = 100;
        for _ in 0..3 {
            applied += 4;
            window(&mut p, applied);
        }
        assert!((p.limit().unwrap() - 200e6 * 1.25f64.powi(3)).abs() < 10.0);
        applied += 4;
        window(&mut p, applied);
        assert_eq!(p.limit(), None);
    }

    #[test]
    fn without_a_failure_free_rate_only_the_users_cap_holds() {
        let t0 = Instant::now();
        let mut p = Pace::new(0.0, 0.5, 0, t0, 0, 0);
        assert_eq!(p.after(at(t0, 0.05), 500 * MB, 0), Duration::ZERO);
        p.after(at(t0, 0.2), 900 * MB, 0);
        assert_eq!((p.limit(), p.backoffs), (None, 0));
        // A cap of 100 MB/s: 10 MB is due at 0.1 s.
        let mut capped = Pace::new(f64::NAN, 0.5, 100 * MB, t0, 0, 0);
        let wait = capped.after(at(t0, 0.02), 10 * MB, 0);
        assert!((wait.as_secs_f64() - 0.08).abs() < 1e-6, "{wait:?}");
    }

    #[test]
    fn the_slower_of_the_users_cap_and_the_pace_holds() {
        let (mut p, t0) = pace(0.5, 100 * MB);
        // Unpaced, the cap holds over the whole rebuild: 30 MB is due at 0.3 s.
        assert_eq!(p.after(at(t0, 0.2), 20 * MB, 101), Duration::ZERO);
        let wait = p.after(at(t0, 0.21), 30 * MB, 101);
        assert!((wait.as_secs_f64() - 0.09).abs() < 1e-6, "{wait:?}");
        // Training at a quarter of failure-free: the pace halves the window's 100 MB/s...
        p.after(at(t0, 0.4), 40 * MB, 101);
        assert!((p.limit().unwrap() - 50e6).abs() < 1.0);
        // ...and its 50 MB/s, slower than the cap, holds: 10 MB more is due 0.2 s in.
        let wait = p.after(at(t0, 0.41), 50 * MB, 101);
        assert!((wait.as_secs_f64() - 0.19).abs() < 1e-6, "{wait:?}");
    }

    #[test]
    fn a_low_cap_holds_with_ranges_larger_than_a_window_allows() {
        // 1 MB/s with 6 MB ranges: each range waits its whole 6 s, window or not.
        let t0 = Instant::now();
        let mut p = Pace::new(10.0, 0.5, MB, t0, 0, 0);
        let wait = p.after(at(t0, 0.01), 6 * MB, 0);
        assert!((wait.as_secs_f64() - 5.99).abs() < 1e-6, "{wait:?}");
        let wait = p.after(at(t0, 6.0), 12 * MB, 60);
        assert!((wait.as_secs_f64() - 6.0).abs() < 1e-6, "{wait:?}");
    }

    #[test]
    fn share_zero_turns_the_pacing_off() {
        let t0 = Instant::now();
        let mut p = Pace::new(10.0, 0.0, 0, t0, 0, 0);
        p.after(at(t0, 0.2), 100 * MB, 0);
        assert_eq!((p.limit(), p.backoffs), (None, 0));
    }
}
