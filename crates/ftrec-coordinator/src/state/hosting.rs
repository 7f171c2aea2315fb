//! Spares on survivors' hosts (issue 42, hole 8): a lost server slot that waits past
//! `cluster.survivor_spare_after_s` with no replacement asks a live server to start a
//! spare beside itself, so the job trains on instead of standing still. What was asked of
//! whom and since when, and which hosted processes were told to make way for a spare
//! from elsewhere. The decisions that touch other groups are `crate::hosting`'s.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

/// How long a server asked to start a spare has for that spare to join before the ask
/// goes to another server: a spare joins before it allocates anything, so this covers a
/// process start and a refused memory check with room to spare.
pub(crate) const ASK_PATIENCE: Duration = ftrec_rpc::SPARE_ASK_PATIENCE;

/// One ask: `server` is to start a spare; `answered` once a spare it started joined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostAsk {
    pub(crate) server: usize,
    pub(crate) at: Instant,
    pub(crate) answered: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Hosting {
    /// Since when some lost slot has had no process and no spare to give it.
    pub(crate) waiting_since: Option<Instant>,
    /// The latest ask.
    pub(crate) ask: Option<HostAsk>,
    /// Servers asked during this wait whose spare has not joined: the next ask goes to
    /// another one (its host may lack the memory, or its binary may be gone).
    pub(crate) asked: BTreeSet<usize>,
    /// Incarnations of hosted processes whose slot moved to a spare from elsewhere: their
    /// next heartbeat is told to stop (they are not zombies, and nothing is wrong).
    pub(crate) handed_over: BTreeSet<u64>,
}

impl Hosting {
    /// Whether to ask a server for a spare at `now`, given whether a lost slot waits
    /// (`waiting`) and how long a wait lasts before one asks (`after`). A wait that ends
    /// forgets its asks; an ask is made again once [`ASK_PATIENCE`] has passed.
    pub(crate) fn due(&mut self, now: Instant, waiting: bool, after: Duration) -> bool {
        if !waiting {
            self.waiting_since = None;
            self.ask = None;
            self.asked.clear();
            return false;
        }
        let since = *self.waiting_since.get_or_insert(now);
        if now.duration_since(since) < after {
            return false;
        }
        self.ask
            .as_ref()
            .is_none_or(|a| now.duration_since(a.at) >= ASK_PATIENCE)
    }

    /// The server to ask among `candidates` (live, ready, in slot order): the first not
    /// asked during this wait, or, once all were, the first again.
    pub(crate) fn pick(&mut self, candidates: &[usize]) -> Option<usize> {
        let fresh = candidates.iter().find(|c| !self.asked.contains(c)).copied();
        let server = match fresh {
            Some(server) => server,
            None => {
                self.asked.clear();
                *candidates.first()?
            }
        };
        Some(server)
    }

    /// Records that `server` is asked at `now`.
    pub(crate) fn asked_of(&mut self, server: usize, now: Instant) {
        self.asked.insert(server);
        self.ask = Some(HostAsk {
            server,
            at: now,
            answered: false,
        });
    }

    /// Whether `server`'s heartbeat reply is to say "start a spare": on every beat of the
    /// server asked until a spare it started joins or the ask is [`ASK_PATIENCE`] old. A
    /// heartbeat goes over two links at once and the reply of either may win, so a flag
    /// sent once was lost in one CI run; the server starts at most one spare per
    /// [`ASK_PATIENCE`] however often it is told.
    pub(crate) fn tell(&self, server: usize, now: Instant) -> bool {
        self.ask.as_ref().is_some_and(|ask| {
            ask.server == server && !ask.answered && now.duration_since(ask.at) < ASK_PATIENCE
        })
    }

    /// A spare that `host` started joined: its ask is answered.
    pub(crate) fn answered_by(&mut self, host: usize) {
        if let Some(ask) = self.ask.as_mut().filter(|a| a.server == host) {
            ask.answered = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ask_comes_after_the_wait_and_again_elsewhere_after_the_patience() {
        let mut h = Hosting::default();
        let t0 = Instant::now();
        let after = Duration::from_secs(30);
        assert!(!h.due(t0, true, after), "the wait just began");
        assert!(!h.due(t0 + Duration::from_secs(29), true, after));
        assert!(h.due(t0 + after, true, after));
        assert_eq!(h.pick(&[0, 2]), Some(0));
        h.asked_of(0, t0 + after);
        assert!(!h.due(t0 + after + Duration::from_secs(1), true, after));
        // Told on each of server 0's beats until its spare joins, and only it.
        let soon = t0 + after + Duration::from_secs(1);
        assert!(!h.tell(2, soon));
        assert!(h.tell(0, soon));
        assert!(h.tell(0, soon));
        assert!(
            !h.tell(0, t0 + after + ASK_PATIENCE),
            "an expired ask is not told"
        );
        h.answered_by(2);
        assert!(h.tell(0, soon), "another server's spare answers nothing");
        h.answered_by(0);
        assert!(!h.tell(0, soon));
        // No spare came: the next ask goes to server 2, then back to 0.
        let later = t0 + after + ASK_PATIENCE;
        assert!(h.due(later, true, after));
        assert_eq!(h.pick(&[0, 2]), Some(2));
        h.asked_of(2, later);
        assert_eq!(h.pick(&[0, 2]), Some(0));
        assert_eq!(h.pick(&[]), None);
    }

    #[test]
    fn a_wait_that_ends_forgets_its_asks() {
        let mut h = Hosting::default();
        let t0 = Instant::now();
        let after = Duration::from_secs(1);
        assert!(!h.due(t0, true, after));
        h.asked_of(1, t0 + after);
        assert!(!h.due(t0 + after, false, after));
        assert_eq!(h.ask, None);
        assert!(h.asked.is_empty());
        // A new loss waits its own full delay.
        let t1 = t0 + Duration::from_secs(100);
        assert!(!h.due(t1, true, after));
        assert!(h.due(t1 + after, true, after));
    }
}
