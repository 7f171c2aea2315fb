//! Fence records: what a new writer found committed when it took the writer lease, so
//! that a superseded writer's late commit is never listed or restored.
//!
//! The protocol, from commit to restore:
//!
//! 1. Every acquisition of the writer lease raises its generation (`lease.rs`).
//! 2. A commit first proves at the store that its writer still holds the lease: a
//!    compare-and-swap of the lease object from the version the writer wrote last
//!    ([`crate::lease::Lease::fence_commit`]). A takeover since fails it, with
//!    [`CkptError::Fenced`], and the manifest is never written. A successful swap hands out
//!    the commit's [`FenceToken`] (generation, then the holder's commit count), which the
//!    manifest carries.
//! 3. A writer that took the lease lists the committed checkpoints, and before it commits
//!    anything writes its fence record, `fences/<generation:012>-<from:012>.fence`: for
//!    every older generation from `from` (the newest generation with a record of its own,
//!    or 0) up to its own, the commit counts it found.
//! 4. A manifest's PUT can still land after a takeover that came between its swap and its
//!    PUT (its writer froze in that window). Such a manifest is *fenced*: a record covering
//!    its generation (`from <= generation < record's`) did not find it. Listings leave it
//!    out, a restore refuses it, and `gc` deletes it. A commit every covering record found
//!    landed before its writer's successor looked, so the successor built on it.
//!
//! Tokens, not clocks, also order the commits at one step: of a cut retaken after a
//! rollback, the part committed last is the one with the larger token
//! ([`crate::Manifest::commit_order`]). A manifest without a token (older ones, or one
//! written by a handle without the writer lease) is never fenced.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::{CkptError, FenceToken, Manifest, Store, envelope};

const MAGIC: &[u8; 8] = b"FTRECFNC";
const VERSION: u32 = 1;
const PREFIX: &str = "fences/";

/// The commits of one older generation that a new writer found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenCommits {
    pub generation: u64,
    /// Commit counts found, as inclusive ranges, ascending.
    pub seqs: Vec<[u64; 2]>,
}

/// One writer's fence record (module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceRecord {
    /// The writer lease's generation this writer holds.
    pub generation: u64,
    /// The oldest generation this record judges.
    pub from: u64,
    /// The branch it writes, and who it is, for people.
    pub branch: u32,
    pub started_by: String,
    /// Per generation in `from..generation`, the commits found; a generation not listed
    /// had none.
    pub seen: Vec<SeenCommits>,
}

impl FenceRecord {
    pub fn key_for(generation: u64, from: u64) -> String {
        format!("{PREFIX}{generation:012}-{from:012}.fence")
    }

    pub fn encode(&self) -> Result<Vec<u8>, CkptError> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| CkptError::Invalid(e.to_string()))?;
        Ok(envelope::wrap(MAGIC, VERSION, &json))
    }

    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self, CkptError> {
        let json = envelope::unwrap(key, "fence record", MAGIC, VERSION, bytes)?;
        serde_json::from_slice(json)
            .map_err(|e| CkptError::corrupt(key, format!("bad fence record JSON: {e}")))
    }

    /// Whether this record judges commits of `generation`.
    pub fn covers(&self, generation: u64) -> bool {
        self.from <= generation && generation < self.generation
    }

    /// Whether the writer found commit `token` (of a generation it covers).
    pub fn saw(&self, token: FenceToken) -> bool {
        self.seen
            .iter()
            .filter(|s| s.generation == token.generation)
            .flat_map(|s| &s.seqs)
            .any(|[a, b]| (*a..=*b).contains(&token.seq))
    }

    /// The record of writer `generation` that found `committed`, judging every generation
    /// from `from`.
    pub fn new(
        generation: u64,
        from: u64,
        branch: u32,
        started_by: &str,
        committed: &[Manifest],
    ) -> Self {
        let mut by_generation: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for token in committed.iter().filter_map(|m| m.fence) {
            if from <= token.generation && token.generation < generation {
                by_generation
                    .entry(token.generation)
                    .or_default()
                    .push(token.seq);
            }
        }
        let seen = by_generation
            .into_iter()
            .map(|(generation, seqs)| SeenCommits {
                generation,
                seqs: ranges(seqs),
            })
            .collect();
        Self {
            generation,
            from,
            branch,
            started_by: started_by.to_string(),
            seen,
        }
    }
}

/// `seqs` as ascending inclusive ranges.
fn ranges(mut seqs: Vec<u64>) -> Vec<[u64; 2]> {
    seqs.sort_unstable();
    seqs.dedup();
    let mut out: Vec<[u64; 2]> = Vec::new();
    for s in seqs {
        match out.last_mut() {
            Some(last) if last[1] + 1 == s => last[1] = s,
            _ => out.push([s, s]),
        }
    }
    out
}

/// The `(generation, from)` a fence record's key names.
fn parse_key(key: &str) -> Option<(u64, u64)> {
    let name = key.strip_prefix(PREFIX)?.strip_suffix(".fence")?;
    let (generation, from) = name.split_once('-')?;
    Some((generation.parse().ok()?, from.parse().ok()?))
}

/// The fence records of a location, read only where a manifest needs judging.
pub struct Fences<'a> {
    store: &'a dyn Store,
    /// `(generation, from, key)` of every record, by generation.
    keys: Vec<(u64, u64, String)>,
    loaded: HashMap<String, FenceRecord>,
}

impl<'a> Fences<'a> {
    /// The records in `store` (one listing; their contents are read when needed).
    pub fn load(store: &'a dyn Store) -> Result<Self, CkptError> {
        let mut keys: Vec<(u64, u64, String)> = store
            .list(PREFIX)?
            .into_iter()
            .filter_map(|k| parse_key(&k).map(|(g, f)| (g, f, k)))
            .collect();
        keys.sort();
        Ok(Self {
            store,
            keys,
            loaded: HashMap::new(),
        })
    }

    /// The newest generation that has a record.
    pub fn newest(&self) -> Option<u64> {
        self.keys.last().map(|(g, _, _)| *g)
    }

    /// The `from` of a new record for writer `generation`: the newest generation below it
    /// with a record (that record's own commits are this one's to judge), or 0.
    pub fn from_for(&self, generation: u64) -> u64 {
        self.keys
            .iter()
            .map(|(g, _, _)| *g)
            .filter(|g| *g < generation)
            .max()
            .unwrap_or(0)
    }

    /// Whether `m` is a superseded writer's late commit (module docs). A damaged record
    /// that covers it is an error naming the record: it could hide such a commit.
    pub fn is_fenced(&mut self, m: &Manifest) -> Result<bool, CkptError> {
        let Some(token) = m.fence else {
            return Ok(false);
        };
        let covering: Vec<String> = self
            .keys
            .iter()
            .filter(|(g, from, _)| *from <= token.generation && token.generation < *g)
            .map(|(_, _, k)| k.clone())
            .collect();
        for key in covering {
            if !self.loaded.contains_key(&key) {
                let record =
                    FenceRecord::decode(&self.store.describe(&key), &self.store.get(&key)?)?;
                self.loaded.insert(key.clone(), record);
            }
            if self.loaded.get(&key).is_some_and(|r| !r.saw(token)) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// [`CkptError::Fenced`] for `m` when it is fenced.
    pub fn check(&mut self, m: &Manifest) -> Result<(), CkptError> {
        if self.is_fenced(m)? {
            return Err(CkptError::Fenced(format!(
                "checkpoint {} of {} was committed by a writer whose lease had been taken \
                 over (generation {}), after its successor looked: it is never restored",
                m.id,
                self.store.describe(""),
                m.fence.map_or(0, |t| t.generation)
            )));
        }
        Ok(())
    }
}

/// Every fence record's key with whether it decodes (magic, version, checksum, JSON).
pub fn verify_each(store: &dyn Store) -> Result<Vec<crate::branch::Verdict>, CkptError> {
    Ok(store
        .list(PREFIX)?
        .into_iter()
        .filter(|k| parse_key(k).is_some())
        .map(|k| {
            let checked = store
                .get(&k)
                .and_then(|bytes| FenceRecord::decode(&store.describe(&k), &bytes))
                .map(|_| ());
            (k, checked)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_commits_are_kept_as_ranges_and_judged_per_generation() {
        assert_eq!(ranges(vec![5, 1, 2, 3, 7, 2]), vec![[1, 3], [5, 5], [7, 7]]);
        let record = FenceRecord {
            generation: 4,
            from: 2,
            branch: 1,
            started_by: "t".into(),
            seen: vec![SeenCommits {
                generation: 3,
                seqs: vec![[1, 3], [5, 5]],
            }],
        };
        let token = |generation, seq| FenceToken { generation, seq };
        assert!(record.saw(token(3, 2)) && record.saw(token(3, 5)));
        assert!(!record.saw(token(3, 4)) && !record.saw(token(2, 1)));
        assert!(record.covers(2) && record.covers(3));
        assert!(!record.covers(1) && !record.covers(4));
        let key = FenceRecord::key_for(4, 2);
        assert_eq!(parse_key(&key), Some((4, 2)));
        let back = FenceRecord::decode(&key, &record.encode().unwrap()).unwrap();
        assert_eq!(back, record);
    }
}
