//! IncrCP's 2-D chunk list for the incremental checkpoints on one baseline.
//!
//! Column `c` holds the rows checkpoint `c` (counted from the baseline) wrote. A chunk in
//! row 0 still holds the newest value of its rows; extraction moves the rows a later
//! checkpoint `s` rewrote into a deeper chunk, marked `superseded_by = s`. Row depth is
//! implied: a chunk superseded by `s` sits at depth `newest - s + 1`, so every extraction
//! round pushes the older rows one deeper, exactly as in the paper's linked list.
//!
//! Restoring checkpoint `i` reads the rectangle of chunks with `column <= i` that serve
//! `i` (row 0, or superseded after `i`), in column order, newest column wins. Within one
//! column a row is in exactly one chunk. Across columns a row appears more than once only
//! when selective extraction skipped a chunk, and column order makes the newest win, so
//! restore needs no de-duplication pass.
//!
//! The list is stored as immutable versions `incrcp/<baseline>/list-<version>.cl`; the
//! highest version is current. A new version is written only after every file it names,
//! and files are deleted only after a version that no longer names them is committed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{CkptError, Store, envelope};

const MAGIC: &[u8; 8] = b"FTRECCLS";
const VERSION: u32 = 1;

/// Where the chunk list and files of the incremental checkpoints on `baseline` live.
pub fn prefix_for(baseline: &str) -> String {
    format!("incrcp/{baseline}/")
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListChunk {
    pub table: u32,
    /// Index (from 0, after the baseline) of the checkpoint whose row values these are.
    pub column: u32,
    /// `None` in row 0; `Some(s)` once checkpoint `s` rewrote these rows and they were
    /// extracted: they then serve only restores of checkpoints before `s`.
    pub superseded_by: Option<u32>,
    /// Object holding the chunk: a plain chunk file or a bundle of several.
    pub key: String,
    pub offset: u64,
    pub len: u64,
    /// CRC32C of the chunk's bytes.
    pub crc32c: u32,
    pub rows: u64,
    pub min_row: u32,
    pub max_row: u32,
}

impl ListChunk {
    /// Whether a restore of checkpoint `target` reads this chunk.
    pub fn serves(&self, target: u32) -> bool {
        self.column <= target && self.superseded_by.is_none_or(|s| target < s)
    }

    /// Reads the chunk's bytes and checks them against the list's length and checksum.
    pub fn read(&self, store: &dyn Store) -> Result<Vec<u8>, CkptError> {
        let bytes = store.get_range(&self.key, self.offset, self.len as usize)?;
        self.check(store, &bytes)?;
        Ok(bytes)
    }

    /// Checks bytes read for this chunk against the list's length and checksum.
    pub fn check(&self, store: &dyn Store, bytes: &[u8]) -> Result<(), CkptError> {
        if bytes.len() as u64 != self.len || crc32c::crc32c(bytes) != self.crc32c {
            return Err(self.mismatch(store));
        }
        Ok(())
    }

    /// The error for bytes that are not this chunk (another length or checksum).
    pub fn mismatch(&self, store: &dyn Store) -> CkptError {
        CkptError::corrupt(
            &store.describe(&self.key),
            format!(
                "chunk at bytes {}..{} differs from the chunk list's checksum or length",
                self.offset,
                self.offset + self.len
            ),
        )
    }

    /// Row of the 2-D list the chunk is in, given the newest column.
    pub fn depth(&self, newest: u32) -> u32 {
        self.superseded_by
            .map_or(0, |s| newest.saturating_sub(s) + 1)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkList {
    pub baseline: String,
    pub version: u64,
    /// Checkpoint ids by column.
    pub columns: Vec<String>,
    /// Newest column whose extraction round has been committed.
    pub extracted_through: Option<u32>,
    pub chunks: Vec<ListChunk>,
    /// Live chunks per object; an object is deleted when its count drops to zero.
    pub live: BTreeMap<String, u32>,
    /// Sizes of row-0 bundles, to find those mostly dead.
    #[serde(default)]
    pub object_bytes: BTreeMap<String, u64>,
}

impl ChunkList {
    pub fn new(baseline: &str) -> Self {
        Self {
            baseline: baseline.to_string(),
            version: 0,
            columns: Vec::new(),
            extracted_through: None,
            chunks: Vec::new(),
            live: BTreeMap::new(),
            object_bytes: BTreeMap::new(),
        }
    }

    pub fn key(&self) -> String {
        Self::key_for(&self.baseline, self.version)
    }

    pub fn key_for(baseline: &str, version: u64) -> String {
        format!("{}list-{version:012}.cl", prefix_for(baseline))
    }

    /// The column of checkpoint `id`.
    pub fn column_of(&self, id: &str) -> Option<u32> {
        self.columns.iter().position(|c| c == id).map(|c| c as u32)
    }

    /// The chunks a restore of column `target` reads, in the order to apply them.
    pub fn rectangle(&self, target: u32) -> Vec<&ListChunk> {
        let mut r: Vec<&ListChunk> = self.chunks.iter().filter(|c| c.serves(target)).collect();
        r.sort_by_key(|c| (c.table, c.column, c.min_row));
        r
    }

    /// Adds a chunk and counts it live in its object.
    pub fn push(&mut self, chunk: ListChunk) {
        *self.live.entry(chunk.key.clone()).or_default() += 1;
        self.chunks.push(chunk);
    }

    /// Removes the chunk at `index`; returns its object's key if that object has no live
    /// chunk left.
    pub fn remove(&mut self, index: usize) -> Option<String> {
        let chunk = self.chunks.swap_remove(index);
        let count = self.live.get_mut(&chunk.key)?;
        *count -= 1;
        if *count == 0 {
            self.live.remove(&chunk.key);
            self.object_bytes.remove(&chunk.key);
            Some(chunk.key)
        } else {
            None
        }
    }

    /// Whether the object `name` (relative to the list's prefix) is left over: an older
    /// list version, or a chunk file or bundle from a column or round this list already
    /// covers that it does not name. Newer objects may belong to a write in progress.
    pub fn is_garbage(&self, name: &str) -> bool {
        let key = format!("{}{name}", prefix_for(&self.baseline));
        if self.live.contains_key(&key) {
            return false;
        }
        let number = |s: &str| s.get(1..7).and_then(|n| n.parse::<u32>().ok());
        if let Some(v) = name
            .strip_prefix("list-")
            .and_then(|n| n.strip_suffix(".cl"))
        {
            v.parse::<u64>().is_ok_and(|v| v < self.version)
        } else if name.starts_with('c') && name.ends_with(".chunk") {
            number(name).is_some_and(|c| (c as usize) < self.columns.len())
        } else if name.starts_with('x') && name.ends_with(".bundle") {
            number(name).is_some_and(|r| self.extracted_through.is_some_and(|e| r <= e))
        } else {
            false
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, CkptError> {
        let json = serde_json::to_vec(self).map_err(|e| CkptError::Invalid(e.to_string()))?;
        Ok(envelope::wrap(MAGIC, VERSION, &json))
    }

    /// Decodes and checks a list: header, checksum, and that the live counters match the
    /// chunks (a mismatch would delete a file still in use).
    pub fn decode(key: &str, b: &[u8]) -> Result<Self, CkptError> {
        let json = envelope::unwrap(key, "chunk list", MAGIC, VERSION, b)?;
        let list: Self = serde_json::from_slice(json)
            .map_err(|e| CkptError::corrupt(key, format!("bad chunk list JSON: {e}")))?;
        let mut counted: BTreeMap<&str, u32> = BTreeMap::new();
        for c in &list.chunks {
            if c.column as usize >= list.columns.len() || c.min_row > c.max_row {
                return Err(CkptError::corrupt(
                    key,
                    format!(
                        "chunk in {} names column {} of {}",
                        c.key,
                        c.column,
                        list.columns.len()
                    ),
                ));
            }
            *counted.entry(&c.key).or_default() += 1;
        }
        let live: BTreeMap<&str, u32> = list.live.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        if counted != live {
            return Err(CkptError::corrupt(
                key,
                "live-chunk counters disagree with the chunks",
            ));
        }
        Ok(list)
    }

    /// The current (highest) version of `baseline`'s list, if one was committed.
    pub fn load_current(store: &dyn Store, baseline: &str) -> Result<Option<Self>, CkptError> {
        let Some(key) = Self::version_keys(store, baseline)?.pop() else {
            return Ok(None);
        };
        Self::decode(&store.describe(&key), &store.get(&key)?).map(Some)
    }

    /// Keys of every stored version of `baseline`'s list, oldest first.
    pub fn version_keys(store: &dyn Store, baseline: &str) -> Result<Vec<String>, CkptError> {
        let prefix = prefix_for(baseline);
        let mut keys: Vec<String> = store
            .list(&prefix)?
            .into_iter()
            .filter(|k| {
                k.strip_prefix(&prefix)
                    .is_some_and(|n| n.starts_with("list-") && n.ends_with(".cl"))
            })
            .collect();
        keys.sort();
        Ok(keys)
    }
}
