//! CPR's prioritised partial checkpoints on one server (cpr.txt §4.2, `cpr.priority =
//! mfu | ssu | scar` with `cluster.ft = "partial"`): a tracker per prioritised table fed
//! by the update pipeline, and, between full cuts, a save of the `r·N` rows that matter
//! most (all rows of the other tables) as a delta on this shard's newest checkpoint. It
//! goes through the checkpoint engine like every other checkpoint, so a partial restore
//! reads it with the same code: the full cut, then the deltas after it, newest rows
//! winning.
//!
//! MFU counts *steps* that updated a row, not lookups: a server sees each step's unique
//! rows (workers aggregate a row's gradient over the batch before pushing).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

use ftrec_ckpt::{CheckpointKind, Checkpoints, Manifest};
use ftrec_cpr::Prioritizer;
use ftrec_model::EmbeddingTable;

use super::CheckpointContext;
use crate::pipeline::UpdatePipeline;
use crate::shard::{PostCommit, Shard, StagedRows};
use ftrec_rpc::PsError;

/// One tracker per local table; `None` for tables saved in full at every save.
pub(crate) struct PriorityState {
    trackers: Vec<Option<Box<dyn Prioritizer>>>,
    /// Time spent recording accesses, all the run: on each push's path, so it is what
    /// tracking costs training. Kept across restores.
    tracking: Duration,
}

pub(crate) type SharedPriority = Arc<Mutex<PriorityState>>;

fn lock(p: &SharedPriority) -> MutexGuard<'_, PriorityState> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a prioritised save wrote and cost.
pub(crate) struct PrioritySave {
    pub(crate) manifest: Manifest,
    pub(crate) tracker_bytes: u64,
    pub(crate) select_seconds: f64,
    /// [`PriorityState::tracking`] so far, seconds.
    pub(crate) tracking_seconds: f64,
}

impl PriorityState {
    /// Trackers for the job's prioritised tables (`cpr.tables`, default the largest that
    /// hold 99% of the rows) over this server's local tables; `None` when the job saves
    /// no prioritised checkpoints.
    pub(crate) fn for_job(
        job: &ftrec_rpc::Job,
        shard: &Shard,
        id: usize,
    ) -> Option<SharedPriority> {
        let c = &job.config;
        if c.cluster.ft != ftrec_config::FaultTolerance::Partial
            || c.cpr.priority == ftrec_config::CprPriority::None
        {
            return None;
        }
        let global_rows = &shard.global_config().table_rows;
        let chosen = ftrec_cpr::tables::prioritized_tables(c.cpr.tables.as_deref(), global_rows);
        let trackers = shard
            .state()
            .tables()
            .iter()
            .enumerate()
            .map(|(t, table)| {
                chosen.contains(&t).then(|| {
                    ftrec_cpr::build_prioritizer(
                        c.cpr.priority,
                        table,
                        c.cpr.r,
                        c.cpr.ssu_period,
                        c.seed ^ ((id as u64) << 32) ^ t as u64,
                    )
                })
            })
            .collect();
        Some(Arc::new(Mutex::new(Self {
            trackers,
            tracking: Duration::ZERO,
        })))
    }

    /// Runs `f` on each local table's tracker (tables saved in full have none).
    fn each_tracker(
        &mut self,
        shard: &Shard,
        mut f: impl FnMut(usize, &EmbeddingTable, &mut dyn Prioritizer),
    ) {
        for (t, (table, tracker)) in shard
            .state()
            .tables()
            .iter()
            .zip(self.trackers.iter_mut())
            .enumerate()
        {
            if let Some(tracker) = tracker {
                f(t, table, tracker.as_mut());
            }
        }
    }

    fn memory_bytes(&self) -> u64 {
        self.trackers
            .iter()
            .flatten()
            .map(|t| t.memory_bytes() as u64)
            .sum()
    }
}

/// Feeds each committed update's rows to the trackers.
pub(crate) struct PriorityTracking(pub(crate) SharedPriority);

impl PostCommit for PriorityTracking {
    fn post_commit(&self, rows: &[StagedRows]) {
        let mut state = lock(&self.0);
        let started = Instant::now();
        for r in rows {
            if let Some(Some(tracker)) = state.trackers.get_mut(r.table) {
                tracker.record(&r.locals);
            }
        }
        state.tracking += started.elapsed();
    }
}

impl CheckpointContext {
    /// A restore replaced the shard: every row equals its checkpoint, and what the
    /// trackers hold (counts, sampled rows, SCAR's copy) belongs to steps that are gone.
    /// The caller holds the shard's write lock and the commit turn, so no update records
    /// between the restore and this.
    pub(crate) fn reset_priority(&self, shard: &Shard) {
        let Some(priority) = &self.priority else {
            return;
        };
        lock(priority).each_tracker(shard, |_, table, tracker| tracker.reset(table));
    }

    /// Writes this shard's prioritised save at `step`: the selected rows of each tracked
    /// table and every row of the others, as a delta whose parent is the shard's newest
    /// checkpoint on its branch (the last full cut or the previous save).
    pub(crate) fn write_priority(
        &self,
        pipeline: &UpdatePipeline,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<PrioritySave, PsError> {
        let Some(priority) = &self.priority else {
            return Err(PsError::Config(format!(
                "server {}: a prioritised save asked for, but cpr.priority is none",
                self.id
            )));
        };
        let shard = pipeline.shard_read()?;
        if !pipeline.steps().is_cut_at(step) {
            return Err(PsError::BadRequest(format!(
                "prioritised save of step {step} asked for, but server {} is not at a step \
                 boundary there",
                self.id
            )));
        }
        let writer = self.writer(checkpoints)?;
        let branch = writer.branch();
        let parent = writer
            .list_readable()?
            .into_iter()
            .filter(|m| m.branch == branch && m.step <= step)
            .max_by(|a, b| (a.step, a.commit_order()).cmp(&(b.step, b.commit_order())))
            .ok_or_else(|| {
                PsError::BadRequest(format!(
                    "server {}: no checkpoint to save step {step} against (the first save \
                     of a run is a full cut)",
                    self.id
                ))
            })?;
        let started = Instant::now();
        let mut state = lock(priority);
        let rows: Vec<Vec<u32>> = shard
            .state()
            .tables()
            .iter()
            .zip(state.trackers.iter_mut())
            .map(|(table, tracker)| match tracker {
                Some(tracker) => tracker.choose(table),
                None => (0..table.rows() as u32).collect(),
            })
            .collect();
        let select_seconds = started.elapsed().as_secs_f64();
        let tracker_bytes = state.memory_bytes();
        let tracking_seconds = state.tracking.as_secs_f64();
        drop(state);
        let mut identity = self.identity(&shard, pipeline.live().epoch, step);
        identity.cpr_priority = Some(self.job.config.cpr.priority.name().into());
        writer.pin_step(step)?;
        let manifest = writer.write(
            shard.state(),
            step,
            CheckpointKind::NaiveIncremental,
            Some(&rows),
            vec![parent.id],
            identity.to_json(),
        )?;
        // Durable now: the chosen rows count as saved. Not before: a failed write must
        // leave them unsaved, to be chosen again (the shard read lock held since the
        // choice keeps every update that could have moved them out).
        lock(priority).each_tracker(&shard, |t, table, tracker| {
            tracker.forget(table, &rows[t]);
        });
        Ok(PrioritySave {
            manifest,
            tracker_bytes,
            select_seconds,
            tracking_seconds,
        })
    }
}
