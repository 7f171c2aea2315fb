//! Step calls sent again on a second connection when the first is slow ("The Tail at
//! Scale"; issue 44 §3). On a link that loses packets, a lost segment of a small call waits
//! for TCP's loss probe or retransmission timer, which the kernel keeps in whole ticks: at
//! least two ticks, 8 ms at 250 Hz, plus a tick of rounding, against calls that take about
//! a millisecond. A copy of the call on a connection of its own usually gets through at
//! once. The trigger is a small multiple of the kind's loss-free median, which the
//! recent calls' *fast quartile* ([`BASE_PERCENTILE`]) stands for: under loss the tail is
//! the timer itself, so a percentile of the tail would wait for it, and on a link losing
//! 5% of its packets so many of a bulk call's (a prepare's tens of segments) wait that
//! their median itself doubled, and the copy went out no sooner than TCP's own probe.
//!
//! Every call hedged here is safe to make twice: pulls read, and a server drops a push,
//! a prepare, a commit or a parity difference of a step it holds already (the same rule
//! that makes a retry after a lost reply harmless).

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

pub use ftrec_config::Hedge;

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
struct Window(VecDeque<Duration>);

impl Window {
    fn push(&mut self, took: Duration) {
        if self.0.len() == WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(took);
    }

    /// The `percent`th percentile, once there are [`MIN_SAMPLES`] times.
    fn percentile(&self, percent: usize) -> Option<Duration> {
        self.percentile_of(percent, MIN_SAMPLES)
    }

    /// The `percent`th percentile, once there are `min` times.
    fn percentile_of(&self, percent: usize, min: usize) -> Option<Duration> {
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

/// The percentile of a (kind, member)'s recent times that its copies' trigger multiplies:
/// the fast quartile, which stays near the loss-free median until half the calls are
/// slowed (it is the loss-free distribution's `25 / (100 - slowed%)` quantile), where
/// the median moves once a tenth are.
pub const BASE_PERCENTILE: usize = 25;

/// Each hedge is paid for by this many calls answered: at most one call in five is
/// sent twice, unless the member is found lossy ([`LOSSY_LATE`]). A link slowed for every
/// call (a congested or throttled one, not a lossy one) has a slow fast quartile of its
/// own and sends few copies; the budget bounds the rest, so copies never double the
/// traffic on a link that is short of it.
const CREDIT_PER_CALL: f64 = 0.2;
/// Copies that may be sent in a burst (a few losses in a row).
const BURST: f64 = 8.0;

/// The last calls of a (kind, member) whose lateness says whether its link loses packets.
const LOSSY_WINDOW: usize = 64;
/// A (kind, member) is lossy once at least this many of its last [`LOSSY_WINDOW`] calls
/// went unanswered past the copy's trigger (one in eight): for its next [`EAGER_CALLS`]
/// calls the copies go out with the call, not after the trigger, and outside the budget;
/// then it is measured again (with both copies out at once, its calls' own lateness
/// cannot be seen). Random loss makes a call's times bimodal (the loss-free calls, and
/// those that waited for TCP's probe), so many run past a multiple of the fast quartile;
/// a congested or throttled link slows every call, its fast quartile with them, and few
/// run past it: it is never taken for lossy, and its copies stay within the budget.
const LOSSY_LATE: usize = 8;
/// [`LOSSY_LATE`] for a link the kernel sees losing ([`Hedger::record_seen`]). Its copies
/// within the budget already answer most calls that a lost packet held back, so few of
/// its calls are late past the trigger: in a run with 5% loss on one server, 3 to 5 of 64
/// of that server's parity updates, never 8, and its copies stayed within the budget.
const LOSSY_LATE_SEEN: usize = 3;
/// How many times the other members' late calls a lossy member's must be.
const LOSSY_LEAD: usize = 3;
/// Calls sent with their copy at once after a lossy (kind, member) is found.
const EAGER_CALLS: usize = 256;
/// How many late calls, and how many times the other members', a member's calls need
/// before they get copies within the budget ([`Hedger::leads`]): the lead that makes a
/// member lossy, from fewer late calls, so copies start before its eager ones.
const LEAD_FOR_COPIES: usize = LOSSY_LEAD;

/// One kind of call to one member: its recent times, its budget of copies, and which of
/// its last calls were late.
#[derive(Default)]
struct Track {
    times: Window,
    credit: f64,
    late: VecDeque<bool>,
    /// Calls still to be sent with their copy at once.
    eager_left: usize,
}

impl Track {
    /// How many of its last calls were late.
    fn late_calls(&self) -> usize {
        self.late.iter().filter(|&&late| late).count()
    }
}

/// When to send a step call again: per kind of call and member, its recent fast
/// quartile and the copies it may still send (see [`CREDIT_PER_CALL`]).
#[derive(Default)]
pub struct Hedger {
    hedge: Option<Hedge>,
    tracks: BTreeMap<(&'static str, usize), Track>,
    counts: HedgeCounts,
}

impl Hedger {
    pub fn new(hedge: Option<Hedge>) -> Self {
        Self {
            hedge,
            ..Self::default()
        }
    }

    /// When a call of `kind` to `member` is sent again: never before the pair has
    /// [`HEDGE_MIN_SAMPLES`] answered calls, while its budget is spent, or at or past `limit` (a
    /// later mechanism, the call's suspicion or its deadline, decides there); at once
    /// while the pair is lossy ([`LOSSY_LATE`]).
    pub fn after(&self, kind: &'static str, member: usize, limit: Duration) -> Option<Duration> {
        self.after_seen(kind, member, limit, None)
    }

    /// [`Hedger::after`], knowing whether the member's link retransmitted lately
    /// (`lost`, [`crate::loss_watch`]): a link that did not gets no copy, one that did gets
    /// copies within the budget without leading the others; `None` (nothing watches the
    /// link) leaves it to the calls' lateness.
    pub fn after_seen(
        &self,
        kind: &'static str,
        member: usize,
        limit: Duration,
        lost: Option<bool>,
    ) -> Option<Duration> {
        if lost == Some(false) {
            return None;
        }
        let track = self.tracks.get(&(kind, member))?;
        let after = self.trigger(track)?;
        if track.eager_left > 0 {
            return Some(Duration::ZERO);
        }
        if track.credit < 1.0 || (lost.is_none() && !self.leads(kind, member)) {
            return None;
        }
        (after < limit).then_some(after)
    }

    /// Whether `member`'s late calls of `kind` lead the other members' enough for a copy:
    /// at least [`LEAD_FOR_COPIES`], and that many times the median of theirs (at least
    /// one). A copy helps a call that its link held back, and only a link of its own holds
    /// back one member's calls more than the others'. A host short of CPU is late to every
    /// member alike, and a copy there is more work for the cores that are short: in a
    /// failure-free `ec` run on 2 cores about one parity update in ten had been sent twice.
    /// With no other member to compare, the budget alone decides.
    fn leads(&self, kind: &'static str, member: usize) -> bool {
        let Some(others) = self.others_late_median(kind, member) else {
            return true;
        };
        let this = self.late_calls(kind, member);
        this >= LEAD_FOR_COPIES && this >= LEAD_FOR_COPIES * others.max(1)
    }

    /// How many of `member`'s last calls of `kind` were late.
    fn late_calls(&self, kind: &'static str, member: usize) -> usize {
        self.tracks
            .get(&(kind, member))
            .map_or(0, Track::late_calls)
    }

    /// The median of the other members' late calls of `kind`; `None` with no other member.
    fn others_late_median(&self, kind: &'static str, member: usize) -> Option<usize> {
        let mut others: Vec<usize> = self
            .tracks
            .range((kind, 0)..=(kind, usize::MAX))
            .filter(|((_, m), _)| *m != member)
            .map(|(_, t)| t.late_calls())
            .collect();
        others.sort_unstable();
        others.get(others.len() / 2).copied()
    }

    /// Whether `member`'s calls of `kind` are late as a lossy link makes them: at least
    /// [`LOSSY_LATE`] of its last [`LOSSY_WINDOW`], and [`LOSSY_LEAD`] times as many as
    /// the other members' of the same kind (the median of theirs, at least one). A host
    /// short of CPU delays its calls to every member alike, and is not taken for a lossy
    /// link; with no other member to compare, none is. `seen_losing`: the kernel counted
    /// the link's retransmissions ([`Hedger::record_seen`]); the late calls then suffice.
    fn lossy(&self, kind: &'static str, member: usize, seen_losing: bool) -> bool {
        // Every call ends here: the other members are looked at only once this one's late
        // calls are enough by themselves.
        let this = self.late_calls(kind, member);
        if seen_losing {
            return this >= LOSSY_LATE_SEEN;
        }
        if this < LOSSY_LATE {
            return false;
        }
        self.others_late_median(kind, member)
            .is_some_and(|others| this >= LOSSY_LEAD * others.max(1))
    }

    /// How long a call of `track` waits before its copy, when not lossy.
    fn trigger(&self, track: &Track) -> Option<Duration> {
        Some(
            self.hedge?.after(
                track
                    .times
                    .percentile_of(BASE_PERCENTILE, HEDGE_MIN_SAMPLES)?,
            ),
        )
    }

    /// A call of `kind` to `member` ended: `took` if it was answered; `hedged` if its copy
    /// was sent.
    pub fn record(
        &mut self,
        kind: &'static str,
        member: usize,
        took: Option<Duration>,
        hedged: bool,
    ) {
        self.record_seen(kind, member, took, hedged, None);
    }

    /// [`Hedger::record`], knowing whether the member's link retransmitted lately (`lost`,
    /// as in [`Hedger::after_seen`]). A link the kernel sees losing packets needs no lead
    /// over the other members to be taken for lossy: the lead tells a lossy link from a
    /// host short of CPU, which the kernel's count already does. Without this, a member
    /// whose own link is the lossy one never took its peers for lossy (every one of them
    /// is behind that link, so none leads), and its parity updates got copies only within
    /// the budget. Its eager copies also go on while its link keeps losing, rather than
    /// stopping to be measured again: with both copies out at once its calls' lateness
    /// cannot be seen, and the kernel's count can.
    pub fn record_seen(
        &mut self,
        kind: &'static str,
        member: usize,
        took: Option<Duration>,
        hedged: bool,
        lost: Option<bool>,
    ) {
        let trigger = self
            .tracks
            .get(&(kind, member))
            .and_then(|t| self.trigger(t));
        let track = self.tracks.entry((kind, member)).or_default();
        let eager = track.eager_left > 0;
        if eager {
            track.eager_left -= 1;
            if track.eager_left == 0 && lost == Some(true) {
                track.eager_left = EAGER_CALLS;
            }
        } else if let Some(trigger) = trigger {
            if track.late.len() == LOSSY_WINDOW {
                track.late.pop_front();
            }
            track.late.push_back(took.is_none_or(|took| took > trigger));
        }
        if let Some(took) = took {
            track.times.push(took);
            track.credit = (track.credit + CREDIT_PER_CALL).min(BURST);
        }
        if hedged {
            if !eager {
                track.credit -= 1.0;
            }
            self.counts.add(kind);
        }
        if !eager && self.lossy(kind, member, lost == Some(true)) {
            let track = self.tracks.entry((kind, member)).or_default();
            track.eager_left = EAGER_CALLS;
            track.late.clear();
        }
    }

    /// When a copy of `kind`'s calls to `member` would go out, budget and lead aside
    /// (tests).
    #[cfg(test)]
    fn trigger_at(&self, kind: &'static str, member: usize) -> Option<Duration> {
        self.trigger(self.tracks.get(&(kind, member))?)
    }

    /// The `percent`th percentile of `kind`'s recent times to `member` (tests).
    #[cfg(test)]
    fn times_at(&self, kind: &'static str, member: usize, percent: usize) -> Option<Duration> {
        self.tracks.get(&(kind, member))?.times.percentile(percent)
    }

    /// The calls sent again so far.
    pub fn counts(&self) -> &HedgeCounts {
        &self.counts
    }
}

/// Calls sent a second time, by kind: what `ftrec_hedged_calls_total` and the members'
/// logs report.
#[derive(Default, Debug)]
pub struct HedgeCounts(Mutex<BTreeMap<&'static str, u64>>);

impl HedgeCounts {
    pub fn add(&self, kind: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(kind)
            .or_default() += 1;
    }

    /// Every kind's count so far.
    pub fn snapshot(&self) -> BTreeMap<&'static str, u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Every kind's together.
    pub fn total(&self) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum()
    }

    /// "pull 3, prepare 1", or "none".
    pub fn summary(&self) -> String {
        let counts = self.snapshot();
        if counts.is_empty() {
            return "none".into();
        }
        counts
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    async fn answer(
        after: Duration,
        value: Result<u32, &'static str>,
    ) -> Result<u32, &'static str> {
        tokio::time::sleep(after).await;
        value
    }

    #[tokio::test(start_paused = true)]
    async fn a_fast_call_sends_no_copy() {
        let started = Instant::now();
        let a = first_answer(answer(ms(1), Ok(1)), Some((ms(4), answer(ms(1), Ok(2))))).await;
        assert_eq!((a.result, a.hedged), (Ok(1), false));
        assert_eq!(started.elapsed(), ms(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_call_is_overtaken_by_its_copy() {
        let started = Instant::now();
        // The first waits out a 12 ms loss probe; the copy, sent at 4 ms, takes 1 ms.
        let a = first_answer(answer(ms(12), Ok(1)), Some((ms(4), answer(ms(1), Ok(2))))).await;
        assert_eq!((a.result, a.hedged), (Ok(2), true));
        assert_eq!(started.elapsed(), ms(5));
        // The first still answers first if it is quicker than the copy.
        let started = Instant::now();
        let a = first_answer(answer(ms(6), Ok(1)), Some((ms(4), answer(ms(5), Ok(2))))).await;
        assert_eq!((a.result, a.hedged), (Ok(1), true));
        assert_eq!(started.elapsed(), ms(6));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_waits_for_the_other_answer() {
        // The copy fails at once (its connection refused): the first's answer still wins.
        let a = first_answer(
            answer(ms(10), Ok(1)),
            Some((ms(4), answer(ms(0), Err("refused")))),
        )
        .await;
        assert_eq!(a.result, Ok(1));
        // The first fails after the copy was sent: the copy's answer wins.
        let a = first_answer(
            answer(ms(6), Err("reset")),
            Some((ms(4), answer(ms(5), Ok(2)))),
        )
        .await;
        assert_eq!(a.result, Ok(2));
        // Both fail: the first call's error.
        let a = first_answer(
            answer(ms(6), Err("first")),
            Some((ms(4), answer(ms(5), Err("copy")))),
        )
        .await;
        assert_eq!(a.result, Err("first"));
        // Without a copy the call is the call.
        let a = first_answer(
            answer(ms(6), Err("only")),
            None::<(Duration, std::future::Ready<_>)>,
        )
        .await;
        assert_eq!((a.result, a.hedged), (Err("only"), false));
    }

    #[test]
    fn a_call_is_hedged_at_a_multiple_of_its_members_fast_quartile_with_a_floor_and_a_limit() {
        let mut h = Hedger::new(Some(Hedge {
            multiple: 4,
            floor: ms(2),
        }));
        for _ in 0..HEDGE_MIN_SAMPLES - 1 {
            h.record("pull", 0, Some(ms(1)), false);
        }
        assert_eq!(h.after("pull", 0, ms(250)), None, "too few samples");
        h.record("pull", 0, Some(ms(1)), false);
        assert_eq!(h.after("pull", 0, ms(250)), Some(ms(4)));
        // Each member by itself: another server's calls say nothing of this one's.
        assert_eq!(h.after("pull", 1, ms(250)), None);
        // Two calls in five slowed by a 12 ms loss probe (a lossy link's bulk prepares)
        // leave the trigger where the loss-free calls put it.
        for i in 0..WINDOW {
            h.record("push", 0, Some(ms(if i % 5 < 2 { 12 } else { 3 })), false);
        }
        assert_eq!(h.trigger_at("push", 0), Some(ms(12)));
        // Three in five: the median is the probe itself, and copies on it would go out no
        // sooner than the probe; the fast quartile still stands for the loss-free calls.
        for i in 0..WINDOW {
            h.record("push", 2, Some(ms(if i % 5 < 3 { 12 } else { 3 })), false);
        }
        assert_eq!(h.times_at("push", 2, 50), Some(ms(12)), "the median moved");
        assert_eq!(
            h.trigger_at("push", 2),
            Some(ms(12)),
            "the quartile did not"
        );
        // A member slow for every call has a slow quartile, so its calls wait longer.
        for _ in 0..WINDOW {
            h.record("push", 1, Some(ms(30)), false);
        }
        assert_eq!(h.trigger_at("push", 1), Some(ms(120)));
        // The floor, for calls far quicker than a tick.
        for _ in 0..WINDOW {
            h.record("commit", 0, Some(Duration::from_micros(200)), false);
        }
        assert_eq!(h.after("commit", 0, ms(250)), Some(ms(2)));
        // Never at or past the limit, and never when hedging is off.
        assert_eq!(h.after("commit", 0, ms(2)), None);
        let mut off = Hedger::new(None);
        for _ in 0..WINDOW {
            off.record("pull", 0, Some(ms(1)), false);
        }
        assert_eq!(off.after("pull", 0, ms(250)), None);
    }

    #[test]
    fn a_lossy_member_gets_its_copies_at_once_and_a_congested_or_starved_one_never() {
        let hedge = Hedge {
            multiple: 3,
            floor: ms(2),
        };
        let mut h = Hedger::new(Some(hedge));
        for m in 0..3 {
            for _ in 0..WINDOW {
                h.record("pull", m, Some(ms(1)), false);
            }
        }
        assert_eq!(h.trigger_at("pull", 0), Some(ms(3)));
        // None is late, so none gets a copy.
        assert_eq!(h.after("pull", 0, ms(250)), None);
        // One call in six to member 0 waits for a 12 ms probe, one in sixty to the others:
        // the eighth late one makes member 0 lossy.
        let mut calls = 0;
        while h.after("pull", 0, ms(250)) != Some(Duration::ZERO) {
            for m in 0..3 {
                let every = if m == 0 { 6 } else { 60 };
                let took = if calls % every == 0 { 12 } else { 1 };
                h.record("pull", m, Some(ms(took)), took > 3);
            }
            calls += 1;
            assert!(calls <= LOSSY_WINDOW, "never lossy");
        }
        assert!(calls > 40, "lossy after {calls} calls");
        assert_ne!(
            h.after("pull", 1, ms(250)),
            Some(Duration::ZERO),
            "the others are not"
        );
        // Its next calls go out with their copies at once, outside the budget, then it is
        // measured again.
        let spent = h.tracks[&("pull", 0)].credit;
        for _ in 0..EAGER_CALLS {
            assert_eq!(h.after("pull", 0, ms(250)), Some(Duration::ZERO));
            h.record("pull", 0, Some(ms(1)), true);
        }
        assert!(h.tracks[&("pull", 0)].credit >= spent);
        assert_eq!(h.after("pull", 0, ms(250)), None, "measured again");
        assert_eq!(h.trigger_at("pull", 0), Some(ms(3)));
        // A host short of CPU makes its calls to every member late alike: none is lossy.
        for i in 0..4 * WINDOW {
            for m in 0..3 {
                let took = if (i + m) % 5 == 0 { 12 } else { 1 };
                h.record("push", m, Some(ms(took)), false);
                assert_ne!(
                    h.after("push", m, ms(250)),
                    Some(Duration::ZERO),
                    "call {i}"
                );
            }
        }
        // A link slow for every call, twice as slow now and then (congested, not
        // lossy), is never lossy either: its calls stay within a multiple of its own fast
        // quartile.
        for i in 0..4 * WINDOW {
            let took = if i % 4 == 0 { 60 } else { 30 };
            h.record("commit", 1, Some(ms(took)), false);
            h.record("commit", 0, Some(ms(1)), false);
            assert_ne!(
                h.after("commit", 1, ms(250)),
                Some(Duration::ZERO),
                "call {i}"
            );
        }
    }

    /// A server whose own link loses packets finds every peer late alike, as a host short
    /// of CPU does: with nothing else to go on none is lossy. The kernel's count of the
    /// link's retransmissions (`lost`) tells them apart, and then the late calls alone make
    /// the peer lossy, and its copies go on at once while the link keeps losing.
    #[test]
    fn peers_behind_a_link_seen_losing_get_copies_at_once_though_none_leads() {
        let mut h = parity_calls_answered_in_1_ms(2);
        let late_alike = |h: &mut Hedger, lost: Option<bool>, calls: usize| {
            for i in 0..calls {
                for m in 0..2 {
                    let took = if i % 6 == 0 { 12 } else { 1 };
                    h.record_seen("parity", m, Some(ms(took)), false, lost);
                }
            }
        };
        late_alike(&mut h, None, 4 * LOSSY_WINDOW);
        assert_ne!(
            h.after_seen("parity", 0, ms(250), None),
            Some(Duration::ZERO),
            "late alike, unseen: not lossy"
        );
        late_alike(&mut h, Some(true), LOSSY_WINDOW);
        for m in 0..2 {
            assert_eq!(
                h.after_seen("parity", m, ms(250), Some(true)),
                Some(Duration::ZERO),
                "member {m}, seen losing"
            );
        }
        // Past one eager window, still seen losing: still at once.
        for _ in 0..2 * EAGER_CALLS {
            h.record_seen("parity", 0, Some(ms(1)), true, Some(true));
        }
        assert_eq!(
            h.after_seen("parity", 0, ms(250), Some(true)),
            Some(Duration::ZERO)
        );
        // The link clean again: no copy at all, and its eager window runs out.
        assert_eq!(h.after_seen("parity", 0, ms(250), Some(false)), None);
        for _ in 0..EAGER_CALLS {
            h.record_seen("parity", 0, Some(ms(1)), true, Some(false));
        }
        assert_ne!(
            h.after_seen("parity", 0, ms(250), None),
            Some(Duration::ZERO),
            "eager after the link was seen clean"
        );
    }

    /// A hedger (copies at 3 x the fast quartile) whose parity calls to each of `members`
    /// were all answered in 1 ms.
    fn parity_calls_answered_in_1_ms(members: usize) -> Hedger {
        let mut h = Hedger::new(Some(Hedge {
            multiple: 3,
            floor: ms(2),
        }));
        for m in 0..members {
            for _ in 0..WINDOW {
                h.record("parity", m, Some(ms(1)), false);
            }
        }
        h
    }

    /// Copies within the budget go to a member whose calls are late more often than the
    /// others', never to members late alike (a host short of CPU).
    #[test]
    fn only_a_member_late_more_than_the_others_gets_copies() {
        let mut h = parity_calls_answered_in_1_ms(3);
        // Every member late one call in ten: no copy to any.
        for i in 0..2 * WINDOW {
            for m in 0..3 {
                let took = if (i + m) % 10 == 0 { 8 } else { 1 };
                assert_eq!(h.after("parity", m, ms(250)), None, "call {i} to {m}");
                h.record("parity", m, Some(ms(took)), false);
            }
        }
        // Member 1 late every other call, the others as before: member 1 gets copies once
        // its late calls are three times theirs; the others still none.
        let mut copied = 0;
        for i in 0..WINDOW {
            for m in 0..3 {
                let late = if m == 1 {
                    i % 2 == 0
                } else {
                    (i + m) % 10 == 0
                };
                let copy = h.after("parity", m, ms(250));
                if m != 1 {
                    assert_eq!(copy, None, "call {i} to {m}");
                }
                copied += usize::from(m == 1 && copy.is_some());
                h.record(
                    "parity",
                    m,
                    Some(ms(if late { 8 } else { 1 })),
                    copy.is_some(),
                );
            }
        }
        assert!(copied > 0, "member 1 got no copy");
    }

    /// What the kernel says of the link decides first: no retransmission, no copy, however
    /// late; a retransmission, copies within the budget without leading the others.
    #[test]
    fn a_link_seen_clean_gets_no_copy_and_one_seen_lossy_needs_no_lead() {
        let mut h = parity_calls_answered_in_1_ms(2);
        // Late alike: no lead, so copies only where the link is seen lossy.
        for i in 0..WINDOW {
            for m in 0..2 {
                h.record("parity", m, Some(ms(if i % 3 == 0 { 9 } else { 1 })), false);
            }
        }
        assert_eq!(h.after("parity", 0, ms(250)), None);
        assert_eq!(h.after_seen("parity", 0, ms(250), Some(false)), None);
        assert_eq!(h.after_seen("parity", 0, ms(250), Some(true)), Some(ms(3)));
        // Even a member taken for lossy by its lateness gets none on a link seen clean.
        h.tracks.entry(("parity", 1)).or_default().eager_left = 3;
        assert_eq!(
            h.after_seen("parity", 1, ms(250), None),
            Some(Duration::ZERO)
        );
        assert_eq!(h.after_seen("parity", 1, ms(250), Some(false)), None);
    }

    #[test]
    fn copies_are_bounded_by_the_budget() {
        let mut h = Hedger::new(Some(Hedge {
            multiple: 4,
            floor: ms(2),
        }));
        for _ in 0..WINDOW {
            h.record("pull", 0, Some(ms(1)), false);
        }
        // Every call slow and sent twice: the burst, then one copy per five calls.
        let mut sent = 0;
        for _ in 0..1000 {
            let hedged = h.after("pull", 0, ms(250)).is_some();
            sent += usize::from(hedged);
            h.record("pull", 0, Some(ms(1)), hedged);
        }
        assert!((150..=215).contains(&sent), "{sent} copies for 1000 calls");
        assert_eq!(h.counts().total(), sent as u64);
        assert_eq!(h.counts().summary(), format!("pull {sent}"));
    }

    #[test]
    fn counts_are_kept_by_kind() {
        let counts = HedgeCounts::default();
        assert_eq!(counts.summary(), "none");
        counts.add("pull");
        counts.add("prepare");
        counts.add("pull");
        assert_eq!(counts.summary(), "prepare 1, pull 2");
    }
}
