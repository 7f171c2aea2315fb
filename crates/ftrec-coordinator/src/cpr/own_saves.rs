//! Uncoordinated per-server saves (`cpr.uncoordinated`, with `cluster.ft = "partial"`).
//!
//! Partial recovery reloads a lost shard from its own checkpoint and keeps everyone else's
//! progress, so it needs no consistent global state: each server may save its shard when
//! it likes. Here server `j` saves every interval, offset by `j/N` of it, so the saves
//! spread evenly over the interval.
//! A replacement reloads its slot's newest own save, and the PLS (Eq. 3) counts the
//! samples since that save. Each server keeps its own `checkpoint.keep` newest saves.
//!
//! The schedule is in steps (`checkpoint.every_steps`), or in seconds when CPR's Eq. 4
//! (`cpr.mtbf_seconds`) or `checkpoint.every_seconds` sets the interval.
//!
//! A save pauses nothing: the coordinator asks while it goes on granting steps, and each
//! server saves its shard as it stands (`ftrec-server`'s `own_save.rs`), at its applied
//! floor, which its reply names. Its cost is the time its copy held the shard's lock.
//!
//! Each server has at most one save in flight, and the servers' saves run independently:
//! one whose turn comes while another server's save is being written is asked at once.
//! (Rounds one at a time left turns waiting for the round before: a median 5-7 steps of
//! the test model late, up to 16 of a 20-step interval.)

use std::time::Duration;

use tokio::time::Instant;

/// Every server's own saves, and when the next ones are due.
#[derive(Clone, Debug)]
pub(crate) struct OwnSaves {
    /// Per server: its committed saves still on disk, oldest first (the newest is what a
    /// replacement reloads).
    retained: Vec<Vec<u64>>,
    /// Per server, with a schedule in seconds: when its next save is due.
    due_at: Vec<Option<Instant>>,
    interval: Option<Duration>,
    keep: usize,
    /// Per server, with a schedule in steps: the first step not granted when its last
    /// save was asked for (0: none yet). Its next save is due at the first step of its
    /// turn after that, so one that comes while its previous save is still being written
    /// is taken late, not skipped.
    asked_at: Vec<u64>,
    /// Servers whose save is due and not yet asked for.
    requested: Vec<usize>,
    /// Per server: its save is being taken (no other of its own starts meanwhile).
    running: Vec<bool>,
}

impl OwnSaves {
    pub(crate) fn new(servers: usize, keep: usize) -> Self {
        Self {
            retained: vec![Vec::new(); servers],
            due_at: vec![None; servers],
            interval: None,
            keep,
            asked_at: vec![0; servers],
            requested: Vec::new(),
            running: vec![false; servers],
        }
    }

    /// `servers`' saves are due before step `next`: the control loop asks them at its
    /// next turn (a grant wakes it).
    pub(crate) fn request(&mut self, servers: Vec<usize>, next: u64) {
        for j in servers {
            if self.busy(j) {
                continue;
            }
            if let Some(at) = self.asked_at.get_mut(j) {
                *at = next;
            }
            self.requested.push(j);
        }
    }

    /// The servers to ask now, if any; each counts as saving until
    /// [`OwnSaves::finished`] names it.
    pub(crate) fn start_round(&mut self) -> Option<Vec<usize>> {
        if self.requested.is_empty() {
            return None;
        }
        let servers = std::mem::take(&mut self.requested);
        for &j in &servers {
            if let Some(running) = self.running.get_mut(j) {
                *running = true;
            }
        }
        Some(servers)
    }

    /// The saves of `servers` ended (committed, failed or abandoned).
    pub(crate) fn finished(&mut self, servers: &[usize]) {
        for &j in servers {
            if let Some(running) = self.running.get_mut(j) {
                *running = false;
            }
        }
    }

    /// Some server's save is asked for or being taken.
    pub(crate) fn any_busy(&self) -> bool {
        (0..self.running.len()).any(|j| self.busy(j))
    }

    /// The idle servers whose newest save is not of `step`: those the final cut still
    /// asks (the job's last step, where every save is a save of the same state).
    pub(crate) fn not_saved_at(&self, step: u64) -> Vec<usize> {
        (0..self.retained.len())
            .filter(|&j| !self.busy(j) && self.newest(j) != Some(step))
            .collect()
    }

    /// Server `j`'s save is asked for or being taken: no other of its own is due.
    fn busy(&self, j: usize) -> bool {
        self.running.get(j).copied().unwrap_or(false) || self.requested.contains(&j)
    }

    /// Training starts: with an interval in seconds, server `j`'s first save is due
    /// `(j + 1)/N` of it from now.
    pub(crate) fn start(&mut self, now: Instant, interval: Option<Duration>) {
        self.interval = interval;
        let n = self.due_at.len().max(1) as u32;
        for (j, due) in self.due_at.iter_mut().enumerate() {
            *due = interval.map(|i| now + i * (j as u32 + 1) / n);
        }
    }

    /// The servers whose save is due before step `next` (none at step 0). In steps:
    /// server `j`'s turns are the steps `≡ j·every/N (mod every)`, and its save is due from
    /// its first turn after the last one it was asked for.
    pub(crate) fn due(&self, next: u64, every_steps: u64, now: Instant) -> Vec<usize> {
        if next == 0 {
            return Vec::new();
        }
        let n = self.due_at.len() as u64;
        (0..self.due_at.len())
            .filter(|&j| !self.busy(j))
            .filter(|&j| match (self.interval, self.due_at[j]) {
                (Some(_), Some(at)) => now >= at,
                _ if every_steps == 0 => false,
                _ => {
                    let turn = j as u64 * every_steps / n.max(1);
                    let after = self.asked_at[j] + 1;
                    let first = after + (turn + every_steps - after % every_steps) % every_steps;
                    next >= first
                }
            })
            .collect()
    }

    /// `server` committed its save of `step`. Returns the steps it keeps on disk when an
    /// older one is due for deletion (`checkpoint.keep`, 0 = all).
    pub(crate) fn saved(&mut self, server: usize, step: u64, now: Instant) -> Option<Vec<u64>> {
        if let (Some(interval), Some(due)) = (self.interval, self.due_at.get_mut(server)) {
            *due = Some(now + interval);
        }
        let kept = self.retained.get_mut(server)?;
        // A server that applied nothing since its last save names that save again.
        if kept.last() == Some(&step) {
            return None;
        }
        kept.push(step);
        let excess = kept.len().saturating_sub(self.keep);
        (self.keep > 0 && excess > 0).then(|| {
            kept.drain(..excess);
            kept.clone()
        })
    }

    /// The newest save of `server` (`None`: none yet, its initial shard).
    pub(crate) fn newest(&self, server: usize) -> Option<u64> {
        self.retained.get(server).and_then(|k| k.last().copied())
    }

    /// Every server's newest save, by slot (for the planner and the durable record).
    pub(crate) fn newest_all(&self) -> Vec<Option<u64>> {
        (0..self.retained.len()).map(|j| self.newest(j)).collect()
    }

    pub(crate) fn retained(&self) -> &[Vec<u64>] {
        &self.retained
    }

    /// A new leader takes over the record its predecessor kept; each server's next turn
    /// is its first after its newest save, so the takeover does not ask every server at
    /// once.
    pub(crate) fn restore_retained(&mut self, retained: Vec<Vec<u64>>) {
        if retained.len() == self.retained.len() {
            for (at, kept) in self.asked_at.iter_mut().zip(&retained) {
                *at = kept.last().copied().unwrap_or(0);
            }
            self.retained = retained;
            self.requested.clear();
            self.running.fill(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grants steps `steps`, asking for each save as it falls due (as the coordinator
    /// does), with the saves asked at a step in `busy` still being written through the
    /// steps `busy` names after it.
    fn rounds(
        own: &mut OwnSaves,
        steps: std::ops::Range<u64>,
        every: u64,
        busy: &[u64],
    ) -> Vec<(u64, Vec<usize>)> {
        let now = Instant::now();
        let mut asked: Vec<(u64, Vec<usize>)> = Vec::new();
        for s in steps {
            if !busy.contains(&s) {
                let all: Vec<usize> = asked.iter().flat_map(|(_, j)| j.clone()).collect();
                own.finished(&all);
            }
            let due = own.due(s, every, now);
            if !due.is_empty() {
                own.request(due, s);
                asked.push((s, own.start_round().unwrap()));
            }
        }
        asked
    }

    #[test]
    fn step_schedule_staggers_the_servers_over_the_interval() {
        let mut own = OwnSaves::new(4, 2);
        // Every 8 steps, offsets 0, 2, 4, 6.
        let due = rounds(&mut own, 0..17, 8, &[]);
        assert_eq!(
            due,
            vec![
                (2, vec![1]),
                (4, vec![2]),
                (6, vec![3]),
                (8, vec![0]),
                (10, vec![1]),
                (12, vec![2]),
                (14, vec![3]),
                (16, vec![0]),
            ]
        );
        // More servers than steps in the interval: some share a step, none is skipped.
        let mut own = OwnSaves::new(4, 2);
        let due = rounds(&mut own, 1..3, 2, &[]);
        assert_eq!(due, vec![(1, vec![2, 3]), (2, vec![0, 1])]);
    }

    #[test]
    fn a_turn_is_taken_at_once_while_another_server_saves_and_late_while_its_own_does() {
        let mut own = OwnSaves::new(4, 2);
        // Server 1's save (asked at step 2) runs through steps 3 and 4, over server 2's
        // turn at step 4: server 2 is asked at step 4 all the same.
        let due = rounds(&mut own, 0..14, 8, &[3, 4]);
        assert_eq!(
            due,
            vec![
                (2, vec![1]),
                (4, vec![2]),
                (6, vec![3]),
                (8, vec![0]),
                (10, vec![1]),
                (12, vec![2]),
            ]
        );
        // Saves that outlast their server's interval: every 2 steps, 2 servers (turns at
        // odd and even steps), saves written through steps 1-4. A turn that passes while
        // the server's own save runs (server 1's at step 3, server 0's at step 4) is taken
        // when it ends, once, not twice.
        let mut own = OwnSaves::new(2, 2);
        let due = rounds(&mut own, 0..7, 2, &[1, 2, 3, 4]);
        assert_eq!(
            due,
            vec![(1, vec![1]), (2, vec![0]), (5, vec![0, 1]), (6, vec![0])]
        );
        // Asked for twice before the control loop starts it: one save, not two.
        let mut own = OwnSaves::new(2, 2);
        own.request(vec![1], 3);
        own.request(vec![1, 0], 4);
        assert_eq!(own.start_round(), Some(vec![1, 0]));
        assert_eq!(own.due(5, 2, Instant::now()), Vec::<usize>::new());
        // A new leader takes over: each server's turn comes after its newest save.
        let mut own = OwnSaves::new(2, 0);
        own.restore_retained(vec![vec![8], vec![12]]);
        let due = rounds(&mut own, 13..24, 8, &[]);
        assert_eq!(due, vec![(16, vec![0]), (20, vec![1])]);
    }

    #[test]
    fn time_schedule_staggers_and_rearms_after_each_save() {
        let mut own = OwnSaves::new(2, 0);
        let t0 = Instant::now();
        own.start(t0, Some(Duration::from_secs(10)));
        assert!(own.due(5, 0, t0 + Duration::from_secs(4)).is_empty());
        assert_eq!(own.due(5, 0, t0 + Duration::from_secs(5)), vec![0]);
        assert_eq!(own.due(5, 0, t0 + Duration::from_secs(10)), vec![0, 1]);
        assert_eq!(own.saved(0, 5, t0 + Duration::from_secs(5)), None);
        assert_eq!(own.due(6, 0, t0 + Duration::from_secs(10)), vec![1]);
        assert_eq!(own.due(9, 0, t0 + Duration::from_secs(15)), vec![0, 1]);
    }

    #[test]
    fn each_server_keeps_its_own_newest_saves() {
        let mut own = OwnSaves::new(3, 2);
        let now = Instant::now();
        assert_eq!(own.newest(1), None);
        assert_eq!(own.saved(1, 10, now), None);
        assert_eq!(own.saved(1, 20, now), None);
        // Server 2's saves do not push server 1's out.
        assert_eq!(own.saved(2, 25, now), None);
        assert_eq!(own.saved(2, 35, now), None);
        assert_eq!(own.saved(1, 30, now), Some(vec![20, 30]));
        assert_eq!(own.newest_all(), vec![None, Some(30), Some(35)]);
        assert_eq!(own.retained()[2], vec![25, 35]);
    }
}
