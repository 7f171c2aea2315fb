//! Starting to write: the writer lease, and the branch new checkpoints go to.
//!
//! - A fresh run into an empty location writes branch 0.
//! - A fresh run into a location that holds checkpoints is refused, unless it asks for a
//!   new, independent branch (`--new-branch`): it would otherwise interleave its steps
//!   with another run's history.
//! - A resume from the newest commit of its branch continues that branch; from any older
//!   checkpoint it starts a new branch forked there, so the old branch's later
//!   checkpoints stay exactly as they were.
//! - A writer continues a branch only if it is the branch of the lease's previous holder
//!   and that holder let go (or its process is gone from this host). Otherwise it forks:
//!   a holder that was taken over without letting go (a frozen cluster server whose
//!   replacement took its lease, or one expired on a frozen or distant host) may thaw and
//!   write its data files on its own branch, and they must never collide with this
//!   writer's names.
//! - Before its first commit, the writer records which commits it found
//!   (`fence.rs`), so a superseded writer's commit that lands later is never restored.

use std::sync::Arc;

use serde::Serialize;

use crate::branch::{self, ForkPoint};
use crate::fence::{FenceRecord, Fences};
use crate::lease::{self, Lease, LeaseOptions};
use crate::{Checkpoints, CkptError, Manifest};

/// How a writer starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BranchStart {
    /// A run from scratch; `new_branch` allows it into a location with history.
    Fresh { new_branch: bool },
    /// A run restored from checkpoint `from`.
    Resume { from: String },
}

/// Where a writer landed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WriterStart {
    pub branch: u32,
    /// Set when this writer started a new branch forked at a checkpoint.
    pub forked_from: Option<String>,
    /// Whether the branch is new (forked, independent, or the first one).
    pub new_branch: bool,
    /// Objects of crashed writes on this branch that were removed before writing.
    pub cleaned: usize,
}

impl Checkpoints {
    /// Takes the writer lease and picks the branch (module docs); the returned handle
    /// writes there and holds the lease until it and its clones are dropped. A live
    /// writer elsewhere is [`CkptError::Busy`], naming it.
    pub fn start_writing(
        &self,
        start: BranchStart,
        options: &LeaseOptions,
    ) -> Result<(Checkpoints, WriterStart), CkptError> {
        let held = Lease::acquire(self.store_arc(), lease::WRITER, options)?;
        let listing = self.list_all()?;
        let (good, damaged) = (&listing.good, &listing.damaged);
        let ids: Vec<String> = good.iter().map(|m| m.id.clone()).collect();
        // Every name in use, late commits and damaged manifests included: a branch is
        // continued only above all of them.
        let taken: Vec<String> = ids
            .iter()
            .cloned()
            .chain(listing.fenced.iter().map(|m| m.id.clone()))
            .chain(damaged.iter().map(|(id, _)| id.clone()))
            .collect();
        let describe = |m: &Manifest| format!("{} (branch {})", m.id, m.branch);
        let (branch, forked_from, new_branch, head_step) = match &start {
            BranchStart::Fresh { new_branch } => {
                if good.is_empty() && damaged.is_empty() {
                    // Nothing committed: take over the newest recorded branch (a run that
                    // died before its first commit) if its writer is gone and it holds no
                    // late commit, or start a branch.
                    let newest = branch::list(self.store())?.last().map(|b| b.branch);
                    match newest.filter(|b| {
                        held.may_continue(*b)
                            && !taken.iter().any(|id| branch::branch_of_id(id) == *b)
                    }) {
                        Some(b) => (b, None, false, None),
                        None => (
                            branch::create(self.store(), None, &options.purpose, &taken)?.branch,
                            None,
                            true,
                            None,
                        ),
                    }
                } else if !new_branch {
                    let newest = self.latest()?;
                    return Err(CkptError::Invalid(format!(
                        "{} already holds checkpoints (newest: {}); resume from one (--resume), or start an independent branch with --new-branch",
                        self.store().describe(""),
                        newest
                            .as_ref()
                            .map_or("a damaged manifest".into(), describe)
                    )));
                } else {
                    let b = branch::create(self.store(), None, &options.purpose, &taken)?;
                    (b.branch, None, true, None)
                }
            }
            BranchStart::Resume { from } => {
                let m = match good.iter().find(|m| &m.id == from) {
                    Some(m) => m.clone(),
                    None => {
                        let m = self.manifest(from)?;
                        self.check_unfenced(std::slice::from_ref(&m))?;
                        m
                    }
                };
                let newest_on_branch = taken
                    .iter()
                    .filter(|id| branch::branch_of_id(id) == m.branch)
                    .filter_map(|id| branch::step_of_id(id))
                    .max()
                    .unwrap_or(m.step);
                if m.step >= newest_on_branch && held.may_continue(m.branch) {
                    (m.branch, None, false, Some(m.step))
                } else {
                    let fork = ForkPoint {
                        branch: m.branch,
                        checkpoint: m.id.clone(),
                        step: m.step,
                    };
                    let b = branch::create(self.store(), Some(fork), &options.purpose, &taken)?;
                    tracing::info!(
                        "resuming from {} ({}): new branch {}",
                        m.id,
                        if m.step < newest_on_branch {
                            "not the newest of its branch"
                        } else {
                            "its branch may still have another writer"
                        },
                        b.branch
                    );
                    (b.branch, Some(m.id.clone()), true, None)
                }
            }
        };
        self.record_fence(
            &held,
            branch,
            &options.purpose,
            &listing.good,
            &listing.fenced,
        )?;
        let mut writer = self.clone();
        writer.branch = branch;
        writer.lease = Some(Arc::new(held));
        // A damaged manifest still commits its data: never treat that as a crashed write.
        let committed: Vec<String> = ids
            .iter()
            .cloned()
            .chain(damaged.iter().map(|(id, _)| id.clone()))
            .collect();
        let cleaned = writer.clean_crashed_writes(&committed, head_step)?;
        Ok((
            writer,
            WriterStart {
                branch,
                forked_from,
                new_branch,
                cleaned,
            },
        ))
    }

    /// Writes this writer's fence record (`fence.rs`): the commits of older generations it
    /// found in `committed`. The lease first records the branch, and its generation is
    /// raised above every token and record in the location, in case the lease object was
    /// deleted and counting started over.
    fn record_fence(
        &self,
        held: &Lease,
        branch: u32,
        started_by: &str,
        committed: &[Manifest],
        fenced: &[Manifest],
    ) -> Result<(), CkptError> {
        let fences = Fences::load(self.store())?;
        let floor = committed
            .iter()
            .chain(fenced)
            .filter_map(|m| m.fence.map(|t| t.generation))
            .chain(fences.newest())
            .max()
            .unwrap_or(0);
        held.start_session(floor, branch)?;
        let generation = held.generation();
        let from = fences.from_for(generation);
        let record = FenceRecord::new(generation, from, branch, started_by, committed);
        match self
            .store()
            .put(&FenceRecord::key_for(generation, from), &record.encode()?)
        {
            // Generations are handed out by compare-and-swap: a record of ours that is
            // there already means someone else holds this generation.
            Err(CkptError::AlreadyExists { key }) => Err(CkptError::Fenced(format!(
                "{key}: another writer holds generation {generation} of this location's lease"
            ))),
            other => other,
        }
    }

    /// Removes the uncommitted objects a crashed writer of this branch left after
    /// `head_step` (all of them when `None`): the lease says no one else writes here, and
    /// this writer is about to reuse their names.
    fn clean_crashed_writes(
        &self,
        committed: &[String],
        head_step: Option<u64>,
    ) -> Result<usize, CkptError> {
        let mut removed = 0;
        for key in self
            .store()
            .list("data/")?
            .into_iter()
            .chain(self.store().list("incrcp/")?)
        {
            let Some(id) = key.split('/').nth(1) else {
                continue;
            };
            let crashed = branch::branch_of_id(id) == self.branch
                && !committed.iter().any(|c| c == id)
                && branch::step_of_id(id).is_some_and(|s| head_step.is_none_or(|head| s > head));
            if crashed {
                self.store().delete(&key)?;
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(
                "removed {removed} objects of crashed checkpoint writes on branch {}",
                self.branch
            );
        }
        Ok(removed)
    }
}
