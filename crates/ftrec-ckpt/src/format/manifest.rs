//! The manifest of one checkpoint: what it contains and where. Writing it is the commit
//! point: a checkpoint without a manifest does not exist, so data files are written first.

use ftrec_model::ModelConfig;
use serde::{Deserialize, Serialize};

use crate::format::quant::Quant;
use crate::{CkptError, envelope};

const MAGIC: &[u8; 8] = b"FTRECMAN";
const VERSION: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointKind {
    /// Every row of every table.
    Full,
    /// Rows changed since the baseline full checkpoint (its only parent), Check-N-Run style.
    Differential,
    /// Rows changed since the previous checkpoint (its only parent); restore replays the
    /// chain back to a full checkpoint.
    NaiveIncremental,
    /// Rows changed since the previous checkpoint, kept in the 2-D chunk list of its
    /// baseline (the only parent); restore reads only its rectangle of that list.
    Incrcp,
    /// DECK: rows changed over one checkpoint interval after a full base (its only parent).
    Delta,
    /// DECK: the union of consecutive deltas after the same base, newest rows winning.
    Merged,
}

impl CheckpointKind {
    /// Short name used in checkpoint ids.
    pub fn tag(self) -> &'static str {
        match self {
            CheckpointKind::Full => "full",
            CheckpointKind::Differential => "diff",
            CheckpointKind::NaiveIncremental => "incr",
            CheckpointKind::Incrcp => "incrcp",
            CheckpointKind::Delta => "delta",
            CheckpointKind::Merged => "merged",
        }
    }
}

/// One stored object of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub key: String,
    pub bytes: u64,
    /// CRC32C of the whole object, checked by `verify` and before a restore uses it.
    pub crc32c: u32,
    /// Table of a row chunk (`None` for the dense file).
    pub table: Option<u32>,
    pub rows: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub id: String,
    pub kind: CheckpointKind,
    /// Training step the state was taken after.
    pub step: u64,
    /// Checkpoints this one builds on (none for a full checkpoint).
    pub parents: Vec<String>,
    pub created_unix_ms: u64,
    pub model: ModelConfig,
    pub dense: FileEntry,
    pub chunks: Vec<FileEntry>,
    /// Trainer-defined state (data position, counters), restored as is.
    pub trainer: serde_json::Value,
    /// For an IncrCP checkpoint, its place in the baseline's chunk list (its rows live
    /// there, not in `chunks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incrcp: Option<IncrcpRef>,
    /// For a DECK delta or merged checkpoint, the deltas it covers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deck: Option<DeckRef>,
    /// The branch of history this checkpoint belongs to (`branch.rs`); 0 for manifests
    /// written before branches existed.
    #[serde(default)]
    pub branch: u32,
    /// The writer lease under which it was committed (`fence.rs`): restores and listings
    /// leave out a commit its holder's successor never saw. `None`: written before tokens
    /// existed, or by a handle that holds no writer lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<FenceToken>,
    /// How its rows are stored (`checkpoint.quantize`); absent: f32, exact. Each chunk's
    /// header says so too, and a reader follows the header.
    #[serde(default, skip_serializing_if = "Quant::is_none")]
    pub quantize: Quant,
}

/// A commit's fencing token: the writer lease's generation (one more at every
/// acquisition, takeovers included) and the holder's count of its commits. Tokens order
/// a location's commits as they were made, whatever the writers' clocks say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FenceToken {
    pub generation: u64,
    pub seq: u64,
}

/// The deltas after a base that a DECK checkpoint covers: delta number `k` (from 1)
/// covers `(k-1, k]`; a merged checkpoint at `layer` covers `stride^layer` of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeckRef {
    pub from: u32,
    pub to: u32,
    pub layer: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncrcpRef {
    pub column: u32,
    /// Bytes of row chunks this checkpoint wrote.
    pub bytes: u64,
}

impl Manifest {
    pub fn key_for(id: &str) -> String {
        format!("manifests/{id}.man")
    }

    pub fn bytes(&self) -> u64 {
        self.dense.bytes
            + self.chunks.iter().map(|c| c.bytes).sum::<u64>()
            + self.incrcp.as_ref().map_or(0, |i| i.bytes)
    }

    pub fn encode(&self) -> Result<Vec<u8>, CkptError> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| CkptError::Invalid(e.to_string()))?;
        Ok(envelope::wrap(MAGIC, VERSION, &json))
    }

    /// This commit's place among a location's commits, without wall clocks: by fencing
    /// token, then branch (numbered in creation order), then id. Commits without a token
    /// (older ones, or unleased writes) come first. `created_unix_ms` is for people only:
    /// a host whose clock runs ahead would otherwise win every comparison.
    pub fn commit_order(&self) -> (Option<FenceToken>, u32, &str) {
        (self.fence, self.branch, &self.id)
    }

    /// Of `all`, the checkpoint at `step` committed last ([`Manifest::commit_order`]): a
    /// cut's part after a rollback re-took it on a new branch, or a DECK merged checkpoint
    /// standing in for its delta.
    pub fn last_at_step(all: &[Manifest], step: u64) -> Option<&Manifest> {
        all.iter()
            .filter(|m| m.step == step)
            .max_by(|a, b| a.commit_order().cmp(&b.commit_order()))
    }

    pub fn decode(key: &str, b: &[u8]) -> Result<Self, CkptError> {
        let json = envelope::unwrap(key, "manifest", MAGIC, VERSION, b)?;
        serde_json::from_slice(json)
            .map_err(|e| CkptError::corrupt(key, format!("bad manifest JSON: {e}")))
    }
}
