//! Branches of a checkpoint history (DECK §4.3: roll back after bad data, then train on).
//!
//! Committed checkpoints are never rewritten, so a run that resumes from a checkpoint
//! that is not the newest of its branch cannot write its later steps under the old names:
//! it starts a new branch, recorded in `branches/<n:06>.branch`, and its ids carry the
//! branch (`<step:012>-<tag>.b<n>`; branch 0 keeps the plain `<step:012>-<tag>`). Both
//! branches stay restorable until a retention policy removes one on purpose.

use serde::{Deserialize, Serialize};

use crate::engine::now_unix_ms;
use crate::{CkptError, Store, envelope};

const MAGIC: &[u8; 8] = b"FTRECBRN";
const VERSION: u32 = 1;

/// Where a branch left its parent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkPoint {
    pub branch: u32,
    /// The checkpoint the branch's first run resumed from.
    pub checkpoint: String,
    pub step: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchRecord {
    pub branch: u32,
    /// `None`: an independent history (a fresh run with `--new-branch`, or branch 0).
    pub parent: Option<ForkPoint>,
    pub created_unix_ms: u64,
    /// Who started it, for `ckpt ls`.
    pub started_by: String,
}

impl BranchRecord {
    pub fn key_for(branch: u32) -> String {
        format!("branches/{branch:06}.branch")
    }

    pub fn encode(&self) -> Result<Vec<u8>, CkptError> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| CkptError::Invalid(e.to_string()))?;
        Ok(envelope::wrap(MAGIC, VERSION, &json))
    }

    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self, CkptError> {
        let json = envelope::unwrap(key, "branch record", MAGIC, VERSION, bytes)?;
        serde_json::from_slice(json)
            .map_err(|e| CkptError::corrupt(key, format!("bad branch record JSON: {e}")))
    }
}

/// The id suffix of `branch`: empty for branch 0.
pub fn id_suffix(branch: u32) -> String {
    if branch == 0 {
        String::new()
    } else {
        format!(".b{branch}")
    }
}

/// The branch an id belongs to (its `.b<n>` suffix; none is branch 0).
pub fn branch_of_id(id: &str) -> u32 {
    id.rsplit_once(".b")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// The step an id was taken at (its leading number).
pub fn step_of_id(id: &str) -> Option<u64> {
    id.split(['-', '.']).next().and_then(|s| s.parse().ok())
}

/// Every recorded branch, by number. A damaged record is an error naming it.
pub fn list(store: &dyn Store) -> Result<Vec<BranchRecord>, CkptError> {
    let mut out = store
        .list("branches/")?
        .iter()
        .filter(|k| k.ends_with(".branch"))
        .map(|k| BranchRecord::decode(&store.describe(k), &store.get(k)?))
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_by_key(|b| b.branch);
    Ok(out)
}

/// A stored record's key, and whether it checked out.
pub type Verdict = (String, Result<(), CkptError>);

/// Every branch record's key with whether it decodes (magic, version, checksum, JSON).
pub fn verify_each(store: &dyn Store) -> Result<Vec<Verdict>, CkptError> {
    Ok(store
        .list("branches/")?
        .into_iter()
        .filter(|k| k.ends_with(".branch"))
        .map(|k| {
            let checked = store
                .get(&k)
                .and_then(|bytes| BranchRecord::decode(&store.describe(&k), &bytes))
                .map(|_| ());
            (k, checked)
        })
        .collect())
}

/// Records a new branch numbered above every branch recorded or seen in `ids`. Creation
/// is exclusive, so two processes racing here get different numbers.
pub fn create(
    store: &dyn Store,
    parent: Option<ForkPoint>,
    started_by: &str,
    ids: &[String],
) -> Result<BranchRecord, CkptError> {
    let recorded = list(store)?.iter().map(|b| b.branch).max();
    let seen = ids.iter().map(|id| branch_of_id(id)).max();
    let mut next = match recorded.max(seen) {
        Some(n) => n + 1,
        None => 0,
    };
    loop {
        let record = BranchRecord {
            branch: next,
            parent: parent.clone(),
            created_unix_ms: now_unix_ms(),
            started_by: started_by.to_string(),
        };
        match store.put(&BranchRecord::key_for(next), &record.encode()?) {
            Ok(()) => return Ok(record),
            Err(CkptError::AlreadyExists { .. }) => next += 1,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_branch_and_step() {
        assert_eq!(id_suffix(0), "");
        assert_eq!(branch_of_id("000000000012-incr"), 0);
        assert_eq!(
            branch_of_id(&format!("000000000012-incr{}", id_suffix(3))),
            3
        );
        assert_eq!(branch_of_id("000000000012-merged1-000004.b12"), 12);
        assert_eq!(step_of_id("000000000012-incr.b3"), Some(12));
        assert_eq!(step_of_id("000000000040-merged2-000000"), Some(40));
    }

    #[test]
    fn new_branches_are_numbered_past_every_known_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::LocalStore::open(dir.path()).unwrap();
        let root = create(&store, None, "a", &[]).unwrap();
        assert_eq!(root.branch, 0);
        let ids = vec!["000000000004-full.b5".to_string()];
        let fork = ForkPoint {
            branch: 0,
            checkpoint: "000000000004-full".into(),
            step: 4,
        };
        let b = create(&store, Some(fork.clone()), "b", &ids).unwrap();
        assert_eq!(b.branch, 6);
        let listed = list(&store).unwrap();
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[1].parent, Some(fork));
    }
}
