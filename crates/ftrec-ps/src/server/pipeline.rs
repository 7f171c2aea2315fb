//! One push through the shard's update pipeline: stage, pre-commit observers (which may
//! await or veto), commit, post-commit observers, all within the commit turn.

use super::Core;
use crate::PsError;
use crate::shard::Update;

/// What became of a push.
pub(super) enum Pushed {
    /// Installed; the shard now holds this many steps, and the update changed these rows.
    Applied { steps: u64, rows: usize },
    /// The step was applied here already (a dead worker's step granted again): ignored.
    Duplicate { steps: u64 },
    /// 2PC phase 1 done: staged and held as prepare `id` until phase 2.
    Prepared { id: u64, rows: usize },
}

impl Core {
    pub(super) async fn run_update(&self, epoch: u64, update: Update) -> Result<Pushed, PsError> {
        let _turn = self.commit_turn.lock().await;
        self.check_epoch(epoch)?;
        if self.steps().contains(update.step) {
            self.metrics.add("ftrec_duplicate_pushes_total", 1);
            return Ok(Pushed::Duplicate {
                steps: self.steps().count(),
            });
        }
        let staged = {
            let shard = self
                .shard
                .read()
                .map_err(|_| PsError::Refused("shard lock poisoned".into()))?;
            shard.stage(&update)?
        };
        for observer in &self.pre_commit {
            // A veto aborts the update: the staged rows are dropped, nothing is installed.
            observer.pre_commit(&staged).await?;
        }
        let steps = {
            let mut shard = self
                .shard
                .write()
                .map_err(|_| PsError::Refused("shard lock poisoned".into()))?;
            // Restores take the turn too, so this holds; checked where it matters anyway.
            self.check_epoch(epoch)?;
            shard.commit(&staged);
            self.publish(epoch, |steps| {
                steps.insert(update.step);
            })
        };
        for observer in &self.post_commit {
            observer.post_commit(staged.rows());
        }
        Ok(Pushed::Applied {
            steps,
            rows: staged.rows_changed(),
        })
    }
}
