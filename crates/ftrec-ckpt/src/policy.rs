//! The checkpoint strategies as a policy over [`Checkpoints`] and a [`DeltaTracker`]:
//! which checkpoint to take next, with which rows and which parent.

use std::time::Instant;

use ftrec_model::ModelState;
use serde::{Deserialize, Serialize};

use crate::manifest::{CheckpointKind, Manifest};
use crate::{Checkpoints, CkptError, DeltaTracker, TenantId};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Every checkpoint is full.
    Full,
    /// Rows changed since the last full baseline (Check-N-Run).
    Differential,
    /// Rows changed since the previous checkpoint; restore replays the chain.
    NaiveIncremental,
}

/// Takes checkpoints of a training run according to a [`Strategy`].
pub struct Checkpointer {
    checkpoints: Checkpoints,
    strategy: Strategy,
    /// A full checkpoint every this many checkpoints (0: only the first).
    full_every: u64,
    tracker: DeltaTracker,
    tenant: TenantId,
    last: Option<String>,
    baseline: Option<String>,
    since_full: u64,
    /// Seconds spent in `track` and `compact`, to report the tracking overhead.
    tracking_seconds: f64,
}

impl Checkpointer {
    pub fn new(
        checkpoints: Checkpoints,
        strategy: Strategy,
        full_every: u64,
        tables: usize,
    ) -> Self {
        let mut tracker = DeltaTracker::new(tables);
        let tenant = tracker.register("checkpointer");
        Self {
            checkpoints,
            strategy,
            full_every,
            tracker,
            tenant,
            last: None,
            baseline: None,
            since_full: 0,
            tracking_seconds: 0.0,
        }
    }

    pub fn checkpoints(&self) -> &Checkpoints {
        &self.checkpoints
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// Records the rows of `table` a step updated (a no-op for the full strategy).
    pub fn track(&mut self, table: usize, rows: &[u32]) {
        if self.strategy != Strategy::Full {
            let t = Instant::now();
            self.tracker.track(table, rows);
            self.tracking_seconds += t.elapsed().as_secs_f64();
        }
    }

    /// De-duplicates tracked rows; call every few steps to bound memory.
    pub fn compact(&mut self) {
        if self.strategy != Strategy::Full {
            let t = Instant::now();
            self.tracker.compact();
            self.tracking_seconds += t.elapsed().as_secs_f64();
        }
    }

    pub fn tracking_seconds(&self) -> f64 {
        self.tracking_seconds
    }

    /// Takes the next checkpoint of `state` after `step`. The first checkpoint (also the
    /// first after a resume, whose tracked history is gone) is full.
    pub fn checkpoint(
        &mut self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let need_full = self.strategy == Strategy::Full
            || self.baseline.is_none()
            || (self.full_every > 0 && self.since_full + 1 >= self.full_every);
        let manifest = if need_full {
            let m = self.checkpoints.write_full(state, step, trainer)?;
            self.tracker.take(self.tenant);
            self.baseline = Some(m.id.clone());
            self.since_full = 0;
            m
        } else {
            let (kind, rows, parent) = match self.strategy {
                Strategy::Differential => (
                    CheckpointKind::Differential,
                    self.tracker.peek(self.tenant),
                    self.baseline.clone(),
                ),
                _ => (
                    CheckpointKind::NaiveIncremental,
                    self.tracker.take(self.tenant),
                    self.last.clone(),
                ),
            };
            let parent = parent
                .ok_or_else(|| CkptError::Invalid("delta checkpoint without a parent".into()))?;
            self.since_full += 1;
            self.checkpoints
                .write(state, step, kind, Some(&rows), vec![parent], trainer)?
        };
        self.last = Some(manifest.id.clone());
        Ok(manifest)
    }
}
