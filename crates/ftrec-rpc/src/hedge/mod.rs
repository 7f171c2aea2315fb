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

mod race;
#[cfg(test)]
mod tests;
mod times;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

pub use ftrec_config::Hedge;
pub use race::{Answered, first_answer};
use times::Window;
pub use times::{CallTimes, HEDGE_MIN_SAMPLES, MIN_SAMPLES, WINDOW};

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
/// cannot be seen), unless the kernel still sees its link losing ([`Hedger::record_seen`]). Random loss makes a call's times bimodal (the loss-free calls, and
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
