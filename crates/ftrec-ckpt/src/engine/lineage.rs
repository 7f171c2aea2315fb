//! What a restore of a checkpoint reads: its parent chain back to a full checkpoint, the
//! cover of deltas and merged checkpoints for DECK, and the chunk list for IncrCP.

use super::Checkpoints;
use super::MAX_CHAIN;
use crate::chunklist::{ChunkList, prefix_for};
use crate::manifest::CheckpointKind;
use crate::{CkptError, Manifest};

impl Checkpoints {
    /// The checkpoints a restore of `id` reads, oldest (a full checkpoint) first.
    pub fn lineage(&self, id: &str) -> Result<Vec<Manifest>, CkptError> {
        let target = self.manifest(id)?;
        if matches!(target.kind, CheckpointKind::Delta | CheckpointKind::Merged) {
            return self.deck_lineage(&target);
        }
        let mut chain = vec![target];
        while let Some(last) = chain.last().filter(|m| m.kind != CheckpointKind::Full) {
            let parent = last.parents.first().ok_or_else(|| {
                CkptError::Invalid(format!(
                    "checkpoint {}: a {:?} checkpoint without a parent",
                    last.id, last.kind
                ))
            })?;
            if chain.len() >= MAX_CHAIN || chain.iter().any(|m| &m.id == parent) {
                return Err(CkptError::Invalid(format!(
                    "checkpoint {id}: parent chain loops or is too long"
                )));
            }
            let parent = self.manifest(parent).map_err(|e| match e {
                CkptError::NotFound(m) => {
                    CkptError::NotFound(format!("checkpoint {id} needs {parent}: {m}"))
                }
                other => other,
            })?;
            if parent.model != chain[0].model {
                return Err(CkptError::Invalid(format!(
                    "checkpoint {id}: parent {} has another model",
                    parent.id
                )));
            }
            chain.push(parent);
        }
        chain.reverse();
        Ok(chain)
    }

    /// The base of a DECK checkpoint and the fewest stored deltas and merged checkpoints
    /// that cover every delta up to it: greedily the one reaching furthest from each point.
    fn deck_lineage(&self, target: &Manifest) -> Result<Vec<Manifest>, CkptError> {
        let (Some(d), [base]) = (&target.deck, target.parents.as_slice()) else {
            return Err(CkptError::Invalid(format!(
                "checkpoint {}: a DECK checkpoint needs its delta range and one base",
                target.id
            )));
        };
        let base_manifest = self.manifest(base).map_err(|e| match e {
            CkptError::NotFound(m) => {
                CkptError::NotFound(format!("checkpoint {} needs {base}: {m}", target.id))
            }
            other => other,
        })?;
        if base_manifest.kind != CheckpointKind::Full || base_manifest.model != target.model {
            return Err(CkptError::Invalid(format!(
                "checkpoint {}: base {base} is not a full checkpoint of the same model",
                target.id
            )));
        }
        let siblings: Vec<Manifest> = self
            .list_readable()?
            .into_iter()
            .filter(|m| m.deck.is_some() && m.parents == target.parents)
            .collect();
        let mut chain = vec![base_manifest];
        let mut at = 0;
        while at < d.to {
            let next = siblings
                .iter()
                .filter_map(|m| m.deck.as_ref().map(|r| (m, r)))
                .filter(|(_, r)| r.from == at && r.to <= d.to && r.to > r.from)
                .max_by_key(|(m, r)| (r.to, m.id == target.id))
                .map(|(m, _)| m.clone())
                .ok_or_else(|| {
                    CkptError::NotFound(format!(
                        "checkpoint {}: no stored delta after {base} starts at delta {at}",
                        target.id
                    ))
                })?;
            at = next.deck.as_ref().map_or(d.to, |r| r.to);
            chain.push(next);
        }
        Ok(chain)
    }

    /// The current chunk list of an IncrCP checkpoint's baseline, and its column there.
    pub fn incrcp_list(&self, manifest: &Manifest) -> Result<(ChunkList, u32), CkptError> {
        let invalid = |m: &str| CkptError::Invalid(format!("checkpoint {}: {m}", manifest.id));
        let (Some(r), [baseline]) = (&manifest.incrcp, manifest.parents.as_slice()) else {
            return Err(invalid(
                "an IncrCP checkpoint needs its column and one baseline",
            ));
        };
        let list = ChunkList::load_current(&*self.store, baseline)?.ok_or_else(|| {
            CkptError::NotFound(format!(
                "checkpoint {}: no chunk list under {}",
                manifest.id,
                self.store.describe(&prefix_for(baseline))
            ))
        })?;
        if list.columns.get(r.column as usize) != Some(&manifest.id) {
            return Err(CkptError::corrupt(
                &self.store.describe(&list.key()),
                format!("column {} is not checkpoint {}", r.column, manifest.id),
            ));
        }
        Ok((list, r.column))
    }
}
