//! What may be deleted, and when: `gc`, and the verification of whole lineages.
//!
//! Committed checkpoints go only by an explicit policy: `keep` retains the newest `n`
//! checkpoints *of each branch* and everything their restores read. Uncommitted objects (a
//! crash between data and manifest) are abandoned when no writer holds the location's
//! lease, or, while one does, when they are older than `abandoned_after`: age, not step
//! numbers, because a merger or a forked run writes below the newest step. `gc` holds the
//! merger lease while it works, so it never races a merge. A superseded writer's late
//! commit (`fence.rs`) is no checkpoint at all: `gc` deletes it and its data at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Serialize;

use crate::chunklist::ChunkList;
use crate::engine::now_unix_ms;
use crate::lease::{self, Lease, LeaseOptions};
use crate::{Checkpoints, CkptError, Manifest};

/// What [`Checkpoints::gc`] removed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcReport {
    pub checkpoints: Vec<String>,
    pub files: u64,
    /// Uncommitted objects left alone because a live writer may still commit them.
    pub kept_in_flight: u64,
}

#[derive(Clone, Debug)]
pub struct GcOptions {
    /// Retain the newest `n` checkpoints of every branch (and their lineage); `None`
    /// retains every committed checkpoint.
    pub keep: Option<usize>,
    /// Remove these branches' checkpoints entirely (those another retained checkpoint's
    /// restore reads excepted): the explicit way to drop a branch.
    pub drop_branches: Vec<u32>,
    /// Uncommitted objects this old are abandoned even while a writer holds the lease.
    pub abandoned_after: Duration,
    /// Retain exactly these checkpoints (and what their restores read), whatever their
    /// branch; `keep` and `drop_branches` are then not used. A cluster keeps its newest
    /// consistent cuts this way.
    pub keep_ids: Option<Vec<String>>,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            keep: None,
            drop_branches: Vec::new(),
            abandoned_after: Duration::from_secs(3600),
            keep_ids: None,
        }
    }
}

/// The id of the checkpoint an object key belongs to: `data/<id>/...` or
/// `incrcp/<baseline>/...`.
fn owner_of(key: &str) -> Option<&str> {
    key.split('/').nth(1)
}

impl Checkpoints {
    /// Keeps the newest `keep` checkpoints of each branch (all when `None`); see
    /// [`Checkpoints::gc_with`].
    pub fn gc(&self, keep: Option<usize>) -> Result<GcReport, CkptError> {
        self.gc_with(&GcOptions {
            keep,
            ..GcOptions::default()
        })
    }

    /// Deletes what the policy does not retain (module docs). Manifests go first, so a
    /// checkpoint disappears at once. A damaged manifest's data is never touched.
    pub fn gc_with(&self, options: &GcOptions) -> Result<GcReport, CkptError> {
        if options.keep == Some(0) {
            return Err(CkptError::Invalid(
                "gc --keep 0 would delete every checkpoint; keep at least 1 per branch".into(),
            ));
        }
        let _merger = Lease::acquire(
            self.store_arc(),
            lease::MERGER,
            &LeaseOptions::new("ftrec ckpt gc"),
        )?;
        let listing = self.list_all()?;
        let (all, damaged) = (listing.good, listing.damaged);
        let mut by_branch: BTreeMap<u32, Vec<&Manifest>> = BTreeMap::new();
        for m in &all {
            by_branch.entry(m.branch).or_default().push(m);
        }
        let mut retained: BTreeSet<String> = BTreeSet::new();
        if let Some(ids) = &options.keep_ids {
            retained.extend(
                all.iter()
                    .filter(|m| ids.contains(&m.id))
                    .map(|m| m.id.clone()),
            );
        } else {
            for (branch, ms) in &by_branch {
                if options.drop_branches.contains(branch) {
                    continue;
                }
                let n = options.keep.unwrap_or(usize::MAX);
                retained.extend(ms.iter().rev().take(n).map(|m| m.id.clone()));
            }
        }
        for id in retained.clone() {
            for m in self.lineage(&id)? {
                retained.insert(m.id);
            }
        }
        retained.extend(damaged.iter().map(|(id, _)| id.clone()));
        retained.extend(self.protected()?);
        let committed: BTreeSet<&str> = all.iter().map(|m| m.id.as_str()).collect();
        let mut report = GcReport::default();
        for m in all.iter().filter(|m| !retained.contains(&m.id)) {
            self.store().delete(&Manifest::key_for(&m.id))?;
            report.checkpoints.push(m.id.clone());
        }
        // Its writer wrote everything it names before the manifest, and commits nothing
        // more: its data is garbage now, whatever its age.
        let fenced: BTreeSet<&str> = listing.fenced.iter().map(|m| m.id.as_str()).collect();
        for m in &listing.fenced {
            self.store().delete(&Manifest::key_for(&m.id))?;
            report.checkpoints.push(m.id.clone());
        }
        // Asked afresh at each decision, after the keys were listed: a writer that took the
        // lease before the listing is seen, and one that took it later made none of them.
        let abandoned = |keys: &[String]| -> Result<bool, CkptError> {
            if lease::live_holder(self.store(), lease::WRITER)?.is_none() {
                return Ok(true);
            }
            let limit = now_unix_ms().saturating_sub(options.abandoned_after.as_millis() as u64);
            for key in keys {
                if self
                    .store()
                    .modified_unix_ms(key)?
                    .is_some_and(|t| t > limit)
                {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        // Data directories, grouped by the checkpoint they belong to.
        let mut data: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for key in self.store().list("data/")? {
            if let Some(id) = owner_of(&key) {
                data.entry(id.to_string()).or_default().push(key);
            }
        }
        for (id, keys) in &data {
            if retained.contains(id) {
                continue;
            }
            let garbage = committed.contains(id.as_str()) || fenced.contains(id.as_str());
            if !garbage && !abandoned(keys)? {
                report.kept_in_flight += keys.len() as u64;
                continue;
            }
            for key in keys {
                self.store().delete(key)?;
                report.files += 1;
            }
        }
        let mut lists: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for key in self.store().list("incrcp/")? {
            if let Some(baseline) = owner_of(&key) {
                lists.entry(baseline.to_string()).or_default().push(key);
            }
        }
        for (baseline, keys) in &lists {
            let dead: Vec<&String> = if retained.contains(baseline) {
                let list = ChunkList::load_current(self.store(), baseline)?;
                let prefix = format!("incrcp/{baseline}/");
                let mut dead = Vec::new();
                for key in keys {
                    let name = key.trim_start_matches(&prefix);
                    let garbage = list.as_ref().is_some_and(|l| l.is_garbage(name));
                    // A chunk of an increment being committed is not in the list yet.
                    if garbage && abandoned(std::slice::from_ref(key))? {
                        dead.push(key);
                    }
                }
                dead
            } else if committed.contains(baseline.as_str())
                || fenced.contains(baseline.as_str())
                || abandoned(keys)?
            {
                keys.iter().collect()
            } else {
                report.kept_in_flight += keys.len() as u64;
                Vec::new()
            };
            for key in dead {
                self.store().delete(key)?;
                report.files += 1;
            }
        }
        Ok(report)
    }

    /// Checks everything a restore of each committed checkpoint reads, reading every
    /// checkpoint's own files once: a delta over a damaged ancestor is damaged too.
    /// Returns per id (oldest first) `Ok` or the first damage in its lineage; damaged
    /// manifests are listed with their error.
    #[allow(clippy::type_complexity)]
    pub fn verify_all(&self) -> Result<Vec<(String, Result<(), CkptError>)>, CkptError> {
        let (all, damaged) = self.list_lenient()?;
        let mut own: BTreeMap<String, Result<(), String>> = BTreeMap::new();
        let mut out = Vec::new();
        for m in &all {
            let checked = self.lineage(&m.id).and_then(|chain| {
                for link in &chain {
                    let result = own
                        .entry(link.id.clone())
                        .or_insert_with(|| self.verify_own(link).map_err(|e| e.to_string()));
                    if let Err(e) = result {
                        let whose = if link.id == m.id {
                            String::new()
                        } else {
                            format!("its ancestor {} is damaged: ", link.id)
                        };
                        return Err(CkptError::Invalid(format!("{whose}{e}")));
                    }
                }
                // A DECK restore may read a merged checkpoint instead of the target's
                // own delta; the target's dense file is read in every case.
                if !chain.iter().any(|c| c.id == m.id) {
                    self.fetch(&m.dense)?;
                }
                Ok(())
            });
            out.push((m.id.clone(), checked));
        }
        out.extend(damaged.into_iter().map(|(id, e)| (id, Err(e))));
        // Branch records are checksummed too: a damaged one would misplace a fork. So are
        // fence records: a damaged one could let a late commit through.
        out.extend(crate::branch::verify_each(self.store())?);
        out.extend(crate::fence::verify_each(self.store())?);
        Ok(out)
    }
}
