//! Peak resident memory of each server slot, read from `/proc` while the cluster runs: the
//! memory a redundancy scheme really takes (allocator slack, buffers, the runtime), not
//! what its layout says it should.

use ftrec_proto::proto::Role;

/// The largest `VmHWM` seen per server slot, over every process that held it.
#[derive(Debug, Default)]
pub(super) struct PeakRss {
    per_server: Vec<Option<u64>>,
    /// The largest peak of a spare while it waited for a slot (its memory reserve,
    /// `ec.spare_reserve`): what standing by costs, beside what serving costs.
    waiting_spare: Option<u64>,
}

impl PeakRss {
    pub(super) fn new(servers: usize) -> Self {
        Self {
            per_server: vec![None; servers],
            waiting_spare: None,
        }
    }

    /// Reads the peak of each slot's current process (`pid_of`); a process that has
    /// exited or a host without `/proc` leaves the slot as it was.
    pub(super) fn sample(&mut self, pid_of: impl Fn(Role, usize) -> Option<u32>) {
        for (id, peak) in self.per_server.iter_mut().enumerate() {
            let Some(bytes) = pid_of(Role::Server, id).and_then(read_peak_rss) else {
                continue;
            };
            *peak = Some(peak.map_or(bytes, |p| p.max(bytes)));
        }
    }

    pub(super) fn per_server(&self) -> Vec<Option<u64>> {
        self.per_server.clone()
    }

    /// Reads the peak of each waiting spare in `pids`.
    pub(super) fn sample_spares(&mut self, pids: &[u32]) {
        for &pid in pids {
            if let Some(bytes) = read_peak_rss(pid) {
                self.waiting_spare = Some(self.waiting_spare.map_or(bytes, |p| p.max(bytes)));
            }
        }
    }

    pub(super) fn waiting_spare(&self) -> Option<u64> {
        self.waiting_spare
    }
}

/// A process's peak resident set, in bytes.
fn read_peak_rss(pid: u32) -> Option<u64> {
    ftrec_rpc::metrics::peak_rss_bytes(&pid.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_largest_peak_of_each_slot() {
        let me = std::process::id();
        let mut peaks = PeakRss::new(2);
        peaks.sample(|_, id| (id == 0).then_some(me));
        let first = peaks.per_server()[0].expect("this process has a /proc entry");
        assert!(first > 0);
        assert_eq!(peaks.per_server()[1], None);
        // Held: a later sample of a process with no entry changes nothing.
        peaks.sample(|_, _| Some(u32::MAX));
        assert_eq!(peaks.per_server()[0], Some(first));
    }
}
