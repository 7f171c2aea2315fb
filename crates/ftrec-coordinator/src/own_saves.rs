//! Uncoordinated per-server saves (`cpr.uncoordinated`, with `cluster.ft = "partial"`).
//!
//! Partial recovery reloads a lost shard from its own checkpoint and keeps everyone else's
//! progress, so it needs no consistent global state: each server may save its shard when
//! it likes. Here server `j` saves every interval, offset by `j/N` of it, so the saves
//! spread evenly and each stops training for one shard's write, not all of them at once.
//! A replacement reloads its slot's newest own save, and the PLS (Eq. 3) counts the
//! samples since that save. Each server keeps its own `checkpoint.keep` newest saves.
//!
//! The schedule is in steps (`checkpoint.every_steps`), or in seconds when CPR's Eq. 4
//! (`cpr.mtbf_seconds`) or `checkpoint.every_seconds` sets the interval.

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
}

impl OwnSaves {
    pub(crate) fn new(servers: usize, keep: usize) -> Self {
        Self {
            retained: vec![Vec::new(); servers],
            due_at: vec![None; servers],
            interval: None,
            keep,
        }
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
    /// server `j` saves when `next ≡ j·every/N (mod every)`.
    pub(crate) fn due(&self, next: u64, every_steps: u64, now: Instant) -> Vec<usize> {
        if next == 0 {
            return Vec::new();
        }
        let n = self.due_at.len() as u64;
        (0..self.due_at.len())
            .filter(|&j| match (self.interval, self.due_at[j]) {
                (Some(_), Some(at)) => now >= at,
                _ => every_steps > 0 && next % every_steps == j as u64 * every_steps / n.max(1),
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

    /// A new leader takes over the record its predecessor kept.
    pub(crate) fn restore_retained(&mut self, retained: Vec<Vec<u64>>) {
        if retained.len() == self.retained.len() {
            self.retained = retained;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_schedule_staggers_the_servers_over_the_interval() {
        let own = OwnSaves::new(4, 2);
        let now = Instant::now();
        // Every 8 steps, offsets 0, 2, 4, 6.
        let due: Vec<(u64, Vec<usize>)> = (0..17)
            .map(|s| (s, own.due(s, 8, now)))
            .filter(|(_, d)| !d.is_empty())
            .collect();
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
        let own = OwnSaves::new(4, 2);
        let due: Vec<usize> = (1..=2).flat_map(|s| own.due(s, 2, now)).collect();
        assert_eq!(due, vec![2, 3, 0, 1]);
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
