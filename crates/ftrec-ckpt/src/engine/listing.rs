//! What a location holds: its committed checkpoints (strictly, leniently, or the
//! readable ones), the newest to resume from, and the pinned ones that no merge, retention
//! or gc may delete.

use super::Checkpoints;
use crate::fence::Fences;
use crate::{CkptError, Manifest};

/// A location's manifests, read.
#[derive(Default)]
pub(crate) struct Listing {
    /// Committed checkpoints, oldest first ([`Checkpoints::list`]).
    pub good: Vec<Manifest>,
    /// Late commits of superseded writers: never listed or restored (`history/fence.rs`).
    pub fenced: Vec<Manifest>,
    /// Manifests that do not read back, by id, with why.
    pub damaged: Vec<(String, CkptError)>,
}

fn pin_key(step: u64) -> String {
    format!("pins/{step:012}.pin")
}

impl Checkpoints {
    /// Pins the checkpoints at `step`: merges, DECK retention and gc (of any process)
    /// delete none of them (a delta, or the merged checkpoint that stands in for it) nor
    /// what their restores read, until [`Checkpoints::set_pinned_steps`] leaves the step
    /// out. A pin is an empty object `pins/<step:012>.pin`, written before the checkpoint
    /// is taken, so no merge can fold the checkpoint away before it is protected. A cluster
    /// server pins its cuts: a DECK merger would otherwise fold the last committed cut's
    /// delta into a newer one that other servers have not committed.
    pub fn pin_step(&self, step: u64) -> Result<(), CkptError> {
        match self.store.put(&pin_key(step), b"") {
            Ok(()) | Err(CkptError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Makes exactly `steps` the pinned steps.
    pub fn set_pinned_steps(&self, steps: &[u64]) -> Result<(), CkptError> {
        for &step in steps {
            self.pin_step(step)?;
        }
        for (key, step) in self.pinned_steps()? {
            if !steps.contains(&step) {
                match self.store.delete(&key) {
                    Ok(()) | Err(CkptError::NotFound(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    fn pinned_steps(&self) -> Result<Vec<(String, u64)>, CkptError> {
        Ok(self
            .store
            .list("pins/")?
            .into_iter()
            .filter_map(|key| {
                let step = key
                    .trim_start_matches("pins/")
                    .trim_end_matches(".pin")
                    .parse()
                    .ok()?;
                Some((key, step))
            })
            .collect())
    }

    /// The checkpoints at pinned steps, and everything their restores read.
    pub(crate) fn protected(&self) -> Result<std::collections::BTreeSet<String>, CkptError> {
        let steps: Vec<u64> = self.pinned_steps()?.into_iter().map(|(_, s)| s).collect();
        let mut protected = std::collections::BTreeSet::new();
        if steps.is_empty() {
            return Ok(protected);
        }
        for m in self.list_readable()? {
            if !steps.contains(&m.step) {
                continue;
            }
            match self.lineage(&m.id) {
                Ok(chain) => protected.extend(chain.into_iter().map(|c| c.id)),
                // Deleted meanwhile by the merger that replaced it.
                Err(CkptError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
            protected.insert(m.id);
        }
        Ok(protected)
    }

    /// Every manifest in the location, read and judged by the fence records
    /// (`history/fence.rs`). Manifests deleted between listing and reading (gc, a DECK
    /// merge) are skipped; one that a damaged fence record judges counts as damaged.
    pub(crate) fn list_all(&self) -> Result<Listing, CkptError> {
        let mut listing = Listing::default();
        let mut fences = Fences::load(self.store())?;
        for key in self
            .store
            .list("manifests/")?
            .iter()
            .filter(|k| k.ends_with(".man"))
        {
            match self
                .store
                .get(key)
                .and_then(|b| Manifest::decode(&self.store.describe(key), &b))
            {
                Ok(m) => match fences.is_fenced(&m) {
                    Ok(true) => listing.fenced.push(m),
                    Ok(false) => listing.good.push(m),
                    // A damaged fence record cannot clear what it judges: such a manifest
                    // is neither restored nor deleted, like a damaged one.
                    Err(e) => listing.damaged.push((m.id, e)),
                },
                Err(CkptError::NotFound(_)) => {}
                Err(e) => {
                    let id = key
                        .trim_start_matches("manifests/")
                        .trim_end_matches(".man")
                        .to_string();
                    listing.damaged.push((id, e));
                }
            }
        }
        listing
            .good
            .sort_by(|a, b| (a.step, a.commit_order()).cmp(&(b.step, b.commit_order())));
        for m in &listing.fenced {
            tracing::debug!(
                "{}: a superseded writer's late commit, left out",
                self.store.describe(&Manifest::key_for(&m.id))
            );
        }
        Ok(listing)
    }

    /// All committed checkpoints, oldest first (by step, then as committed:
    /// [`Manifest::commit_order`]). A damaged manifest is an error naming it. A superseded
    /// writer's late commit is left out (`history/fence.rs`).
    pub fn list(&self) -> Result<Vec<Manifest>, CkptError> {
        let listing = self.list_all()?;
        match listing.damaged.into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(listing.good),
        }
    }

    /// Like [`Checkpoints::list`], but damaged manifests are returned apart, with their
    /// ids, instead of failing the listing (`--fallback`, `ls`, `verify`, `gc`).
    #[allow(clippy::type_complexity)]
    pub fn list_lenient(&self) -> Result<(Vec<Manifest>, Vec<(String, CkptError)>), CkptError> {
        let listing = self.list_all()?;
        Ok((listing.good, listing.damaged))
    }

    /// The committed checkpoints whose manifests read back, oldest first; a damaged one is
    /// logged and left out (and so never deleted). For work that one unrelated damaged
    /// manifest must not stop: DECK lineage, merging, retention, shard restores.
    pub fn list_readable(&self) -> Result<Vec<Manifest>, CkptError> {
        let (good, bad) = self.list_lenient()?;
        for (id, e) in bad {
            tracing::warn!(
                "{}: damaged manifest left alone: {e}",
                self.store.describe(&id)
            );
        }
        Ok(good)
    }

    pub fn manifest(&self, id: &str) -> Result<Manifest, CkptError> {
        let key = Manifest::key_for(id);
        Manifest::decode(&self.store.describe(&key), &self.store.get(&key)?)
    }

    /// The newest commit of the newest branch that has one, if any: what `--resume DIR`
    /// continues from.
    pub fn latest(&self) -> Result<Option<Manifest>, CkptError> {
        let all = self.list()?;
        let newest_branch = all.iter().map(|m| m.branch).max();
        Ok(all
            .into_iter()
            .rev()
            .find(|m| Some(m.branch) == newest_branch))
    }
}
