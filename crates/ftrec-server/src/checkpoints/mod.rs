//! The shard's checkpoints: the writer lease, the job's checkpoint strategy over the
//! shard (its delta tracker fed by the update pipeline), writing a cut, restoring one, and
//! deleting the cuts the coordinator no longer keeps.
//!
//! Files: `context.rs` holds what checkpoints need ([`CheckpointContext`]) and its
//! invariants; this one writes, restores and prunes cuts; `own_save.rs` takes
//! `cpr.uncoordinated`'s saves while training goes on; `priority.rs` takes CPR's
//! prioritised partial saves. Each takes the update pipeline where it reads the shard.

mod context;
pub(crate) mod own_save;
pub(crate) mod priority;

pub(crate) use context::CheckpointContext;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ftrec_ckpt::lease::LeaseOptions;
use ftrec_ckpt::{BranchStart, Checkpointer, Checkpoints, GcOptions, Manifest};

use crate::pipeline::UpdatePipeline;
use crate::shard::{PostCommit, StagedRows};
use ftrec_proto::identity::{EcIdentity, ShardIdentity};
use ftrec_rpc::PsError;

/// The shard's checkpointer, shared by the server and its tracking observer. `None` until
/// the first cut (and again after a restore): a new one starts with a full checkpoint.
pub(super) type SharedCheckpointer = Arc<Mutex<Option<Checkpointer>>>;

fn lock(c: &SharedCheckpointer) -> MutexGuard<'_, Option<Checkpointer>> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// Feeds the strategy's delta tracker with the rows each update installed (local row
/// indices of the shard, which is what the checkpoint engine sees as rows).
pub(super) struct Tracking {
    pub(super) checkpointer: SharedCheckpointer,
    commits: AtomicU64,
}

/// Compact the tracked rows this often, as the trainer does, to bound their memory.
const COMPACT_EVERY: u64 = 16;

impl Tracking {
    pub(super) fn new(checkpointer: SharedCheckpointer) -> Self {
        Self {
            checkpointer,
            commits: AtomicU64::new(0),
        }
    }
}

impl PostCommit for Tracking {
    fn post_commit(&self, rows: &[StagedRows]) {
        let mut guard = lock(&self.checkpointer);
        let Some(ck) = guard.as_mut() else {
            return;
        };
        for r in rows {
            ck.track(r.table, &r.locals);
        }
        if self.commits.fetch_add(1, Ordering::Relaxed) % COMPACT_EVERY == COMPACT_EVERY - 1 {
            ck.compact();
        }
    }
}

impl CheckpointContext {
    /// What a shard checkpoint says of itself: whose shard, under which placement (with
    /// what a reader needs to invert it: the global table sizes and, for erasure coding,
    /// the code's parameters), of which job, epoch and step.
    pub(super) fn identity(
        &self,
        shard: &crate::shard::Shard,
        epoch: u64,
        step: u64,
    ) -> ShardIdentity {
        ShardIdentity {
            version: ShardIdentity::VERSION,
            fingerprint: self.job.fingerprint(),
            server: self.id,
            servers: self.layout.servers(),
            epoch,
            placement: self.layout.scheme(),
            global_table_rows: shard.global_config().table_rows.clone(),
            step,
            ec: self.layout.stripes().map(|stripes| EcIdentity {
                k: stripes.params.k,
                r: stripes.params.r,
                groups: stripes.params.groups,
            }),
            cpr_priority: None,
            applied_ahead: Vec::new(),
            batch_size: Some(self.job.config.train.batch_size as u64),
        }
    }

    /// A lease key shared by every process that holds this job's slot, so a replacement
    /// takes the lease over from its predecessor, which the coordinator declared dead and
    /// fenced off by epoch.
    pub(super) fn lease_options(&self) -> LeaseOptions {
        LeaseOptions {
            owner_key: Some(format!(
                "job {:016x} server {}",
                self.job.fingerprint(),
                self.id
            )),
            ..LeaseOptions::new(format!("ftrec server {}", self.id))
        }
    }

    /// The writing handle, started as a fresh run's when no restore started one.
    pub(super) fn writer(&self, checkpoints: &Checkpoints) -> Result<Checkpoints, PsError> {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = writer.as_ref() {
            return Ok(w.clone());
        }
        let part = self
            .resume_part
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let start = match (part, &self.resume) {
            // A resumed slot continues its own part's history (a fork when newer
            // checkpoints exist there); one whose shard was re-placed starts a branch of
            // its own beside the old job's, which stays as it was.
            (Some(from), _) => BranchStart::Resume { from },
            (None, Some(_)) => BranchStart::Fresh { new_branch: true },
            (None, None) => BranchStart::Fresh {
                new_branch: self.job.config.checkpoint.new_branch,
            },
        };
        let (w, _) = checkpoints.start_writing(start, &self.lease_options())?;
        *writer = Some(w.clone());
        Ok(w)
    }

    /// This shard's checkpoint of the cut at `step`: of any kind (a delta, an IncrCP
    /// increment, a DECK merged checkpoint standing in for its deltas), the one committed
    /// last, since an older one at the same step belongs to a cut that failed part-way and
    /// was rolled back below it. "Last" by fencing token ([`Manifest::commit_order`]: the
    /// writer lease's generation, then the commit count), never by wall clock: a host
    /// whose clock ran ahead would win otherwise. `all` is a listing, which leaves out
    /// the late commits of a writer whose lease was taken over, so a thawed zombie's part
    /// is never picked.
    fn cut_checkpoint(&self, all: &[Manifest], step: u64) -> Option<String> {
        Manifest::last_at_step(all, step).map(|m| m.id.clone())
    }

    /// Takes this shard's checkpoint of the cut at `step` with the job's strategy. Returns
    /// once the shard is copied (for DECK and IncrCP the commit goes on in the background),
    /// with whether it is committed already: the coordinator counts a cut only once every
    /// server's part is durable ([`CheckpointContext::cut_committed`]).
    pub(crate) fn write_cut(
        &self,
        pipeline: &UpdatePipeline,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<(Manifest, bool), PsError> {
        let shard = pipeline.shard_read()?;
        let steps = pipeline.steps();
        if !steps.is_cut_at(step) {
            return Err(PsError::BadRequest(format!(
                "checkpoint of step {step} asked for, but server {} has applied {} steps \
                 (every step below {} and {} more)",
                self.id,
                steps.count(),
                steps.low(),
                steps.count() - steps.low()
            )));
        }
        drop(steps);
        if let Some(done) = self.committed_part(checkpoints, step)? {
            return Ok((done, true));
        }
        let identity = self.identity(&shard, pipeline.live().epoch, step);
        let mut guard = lock(&self.checkpointer);
        if guard.is_none() {
            let tables = shard.state().tables().len();
            let writer = self.writer(checkpoints)?;
            let config = self.job.config.checkpoint.strategy_config()?;
            *guard = Checkpointer::start_configured(writer, config, tables)?;
        }
        let Some(ck) = guard.as_mut() else {
            return Err(PsError::Config(
                "checkpoint.strategy is none: the cluster cannot take cuts".into(),
            ));
        };
        // Pinned before it exists, so no merge can fold it away unprotected; kept through
        // merges and retention until the coordinator's prune lets the step go.
        if let Err(e) = ck.checkpoints().pin_step(step) {
            *guard = None;
            return Err(e.into());
        }
        let written = ck.checkpoint(shard.state(), step, identity.to_json());
        drop(shard);
        let manifest = match written {
            Ok(m) => m,
            Err(e) => {
                // Whatever the strategy held in flight is unknown now: start over with a
                // full checkpoint at the next cut.
                *guard = None;
                return Err(e.into());
            }
        };
        drop(guard);
        let committed = self.cut_committed(checkpoints, step)?;
        Ok((manifest, committed))
    }

    /// This shard's part of the cut at `step`, if an earlier attempt at this very cut
    /// committed it on the branch being written: that attempt was abandoned by another
    /// server's failure, and recovery went on without rolling this shard back (partial
    /// recovery, erasure coding), so the cut is asked for again at the same step. The
    /// shard has applied exactly the same steps since (a cut's steps are every step below
    /// it, and only a restore, which writes on another branch, takes steps back), so those
    /// bytes are this cut's; writing them again would collide with committed history.
    pub(super) fn committed_part(
        &self,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<Option<Manifest>, PsError> {
        let writer = self.writer(checkpoints)?;
        let branch = writer.branch();
        Ok(writer
            .list_readable()?
            .into_iter()
            .filter(|m| m.step == step && m.branch == branch)
            .max_by(|a, b| a.commit_order().cmp(&b.commit_order())))
    }

    /// Whether this shard's part of the cut at `step` is committed: a manifest at that
    /// step on the branch being written (a DECK merged checkpoint counts for the delta it
    /// replaced). A background write that failed is an error, and the next cut starts over
    /// with a full checkpoint.
    pub(crate) fn cut_committed(
        &self,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<bool, PsError> {
        {
            let mut guard = lock(&self.checkpointer);
            if let Some(ck) = guard.as_mut()
                && let Err(e) = ck.poll()
            {
                *guard = None;
                return Err(e.into());
            }
        }
        let writer = self.writer(checkpoints)?;
        let branch = writer.branch();
        Ok(writer
            .list_readable()?
            .iter()
            .any(|m| m.step == step && m.branch == branch))
    }

    /// Back to the initial shard: whatever this slot committed before is another history,
    /// so new checkpoints go to a branch of their own, with a new checkpointer (the old
    /// one's tracked rows and in-flight writes belong to the history left behind).
    pub(crate) fn restart_history(&self) -> Result<(), PsError> {
        // Held to the end, so no own save writes on the history being left.
        let mut own_save = own_save::lock(&self.own_save);
        own_save.forget_history();
        *lock(&self.checkpointer) = None;
        self.continue_from_part(None);
        if let Some(checkpoints) = &self.location {
            let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
            *writer = None;
            let start = BranchStart::Fresh { new_branch: true };
            *writer = Some(checkpoints.start_writing(start, &self.lease_options())?.0);
        }
        Ok(())
    }

    /// A rebuilt replacement continues its slot's history: it writes on the branch of the
    /// slot's newest checkpoint (its state is newer than all of them), with a new
    /// checkpointer, so its first cut is a full checkpoint.
    pub(crate) fn continue_history(&self) -> Result<(), PsError> {
        let Some(checkpoints) = &self.location else {
            return Ok(());
        };
        let mut own_save = own_save::lock(&self.own_save);
        own_save.forget_history();
        *lock(&self.checkpointer) = None;
        let newest = checkpoints
            .list_readable()?
            .into_iter()
            .max_by(|a, b| (a.step, a.commit_order()).cmp(&(b.step, b.commit_order())));
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        *writer = None;
        let start = match newest {
            Some(m) => BranchStart::Resume { from: m.id },
            None => BranchStart::Fresh {
                new_branch: self.job.config.checkpoint.new_branch,
            },
        };
        *writer = Some(checkpoints.start_writing(start, &self.lease_options())?.0);
        Ok(())
    }

    /// Restores the shard checkpoint of cut `step` (or this server's own save of that
    /// step), then writes on from there. Returns the state, the checkpoint's id, and the
    /// steps above `step` the state also holds (an own save's).
    pub(crate) fn restore_cut(
        &self,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<(ftrec_model::ModelState, String, Vec<u64>), PsError> {
        // An own save still writing finishes first, on the history it belongs to.
        let mut own_save = own_save::lock(&self.own_save);
        own_save.forget_history();
        let all = checkpoints.list_readable()?;
        let id = self.cut_checkpoint(&all, step).ok_or_else(|| {
            PsError::Config(format!(
                "server {}: no checkpoint of step {step} in {}",
                self.id,
                checkpoints.store().describe("")
            ))
        })?;
        let (state, manifest) = checkpoints.restore(&id)?;
        let what = checkpoints.store().describe(&id);
        let identity = ShardIdentity::from_json(&manifest.trainer, &what)?;
        identity.check_owner(self.id, &what)?;
        // A slot's folder also holds the parts of the layouts the job moved off (or
        // resumed from): a part of another server count holds other rows.
        if identity.servers != self.layout.servers() {
            return Err(PsError::Config(format!(
                "{what}: a part of a {}-server layout; this server is one of {}",
                identity.servers,
                self.layout.servers()
            )));
        }
        // The tracked history is gone with the state it described.
        *lock(&self.checkpointer) = None;
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // Let go of the old lease first; the same owner key could take it over anyway.
        *writer = None;
        let (w, started) = checkpoints.start_writing(
            BranchStart::Resume { from: id.clone() },
            &self.lease_options(),
        )?;
        if let Some(fork) = &started.forked_from {
            tracing::info!(
                "server {}: restored {fork}, newer checkpoints exist: writing branch {}",
                self.id,
                started.branch
            );
        }
        *writer = Some(w);
        drop(own_save);
        Ok((state, id, identity.applied_ahead))
    }

    /// Deletes every checkpoint of this shard except its part of the kept cuts (at
    /// `keep_steps`) and what their restores read, plus abandoned uncommitted data. Cuts
    /// are found by step, as a restore finds them: a DECK merge may have replaced a cut's
    /// delta by a merged checkpoint since. Returns how many checkpoints went.
    pub(crate) fn prune(&self, keep_steps: &[u64]) -> Result<u64, PsError> {
        let Some(checkpoints) = &self.location else {
            return Ok(0);
        };
        // Not beside an own save in progress: its data is not committed yet.
        let _own_save = own_save::lock(&self.own_save);
        let writer = self.writer(checkpoints)?;
        let all = writer.list_readable()?;
        // Another job's checkpoints in this location (the cut a resumed job started
        // from, and everything of that job) are not this job's to prune.
        let fingerprint = self.job.fingerprint();
        let others = all.iter().filter(|m| {
            ShardIdentity::from_json(&m.trainer, &m.id)
                .map_or(true, |i| i.fingerprint != fingerprint)
        });
        let keep: Vec<String> = keep_steps
            .iter()
            .filter_map(|&step| self.cut_checkpoint(&all, step))
            .chain(others.map(|m| m.id.clone()))
            .collect();
        writer.set_pinned_steps(keep_steps)?;
        let report = writer.gc_with(&GcOptions {
            keep_ids: Some(keep),
            ..GcOptions::default()
        })?;
        Ok(report.checkpoints.len() as u64)
    }
}

#[cfg(test)]
mod tests;
