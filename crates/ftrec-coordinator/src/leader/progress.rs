//! What a launcher reads of the durable record while the job runs: progress, whether it
//! failed for good, and the processes in the slots (to fire its timed kills). A view of
//! the record's own fields, so the two cannot drift apart (the test below writes a record
//! and reads the view back).

use serde::Deserialize;

pub use super::durable::STATE_KEY;

/// The durable record as a launcher reads it; the rest of the record is the leader's.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct JobProgress {
    pub epoch: u64,
    pub started: bool,
    pub done: bool,
    /// Why the job cannot go on: a launcher stops with it.
    #[serde(default)]
    pub fatal: Option<String>,
    /// Every step below it is applied on every server.
    pub settled_through: u64,
    pub samples_settled: u64,
    pub servers: Vec<SlotProcess>,
    pub workers: Vec<SlotProcess>,
    /// Slots rebuilding in the background.
    pub rebuilding: Vec<usize>,
}

/// The process in a slot (0 before one joined).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SlotProcess {
    pub pid: u32,
}

impl JobProgress {
    /// The process in slot `id` of `role`, if one has joined.
    pub fn pid_of(&self, role: ftrec_proto::proto::Role, id: usize) -> Option<u32> {
        let slots = match role {
            ftrec_proto::proto::Role::Server => &self.servers,
            _ => &self.workers,
        };
        slots.get(id).map(|s| s.pid).filter(|&p| p != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_proto::proto::Role;

    #[test]
    fn a_written_record_reads_as_the_launchers_view() {
        let record = super::super::durable::tests::record(true);
        let bytes = serde_json::to_vec(&record).unwrap();
        let view: JobProgress = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(view.epoch, record.epoch);
        assert_eq!(view.started, record.started);
        assert_eq!(view.done, record.done);
        assert_eq!(view.fatal, record.fatal);
        assert_eq!(view.settled_through, record.settled_through);
        assert_eq!(view.samples_settled, record.samples_settled);
        assert_eq!(view.rebuilding, record.rebuilding);
        assert_eq!(view.pid_of(Role::Server, 1), Some(record.servers[1].pid));
        assert_eq!(view.pid_of(Role::Worker, 0), Some(record.workers[0].pid));
        assert_eq!(view.pid_of(Role::Server, 7), None);
    }
}
