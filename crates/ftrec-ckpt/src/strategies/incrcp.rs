//! IncrCP (incrcp.txt §4): incremental checkpoints kept in a 2-D chunk list, with
//! selective extraction of rewritten rows into deeper rows and bundle files, so that any
//! checkpoint restores by reading only its rectangle.
//!
//! The foreground copies a checkpoint's changed rows out of the model into encoded chunks
//! ([`copy_increment`]); an [`IncrcpChain`] (run on a background thread by the
//! checkpointer) commits them and then runs one extraction round against row 0.

use std::collections::HashMap;
use std::time::Instant;

use fastbloom::BloomFilter;
use ftrec_model::ModelState;
use rayon::prelude::*;
use serde::Serialize;

use crate::chunklist::{ChunkList, ListChunk, prefix_for};
use crate::engine::{chunk_jobs, dense_entry, now_unix_ms};
use crate::manifest::{CheckpointKind, IncrcpRef, Manifest};
use crate::parts::Parts;
use crate::{Checkpoints, CkptError, Store, chunk};

/// The paper's threshold R (its evaluation uses 0.02): an extraction must move at least
/// this fraction of a row-0 chunk's rows, or it is skipped.
pub const DEFAULT_THRESHOLD: f64 = 0.02;
const BLOOM_FALSE_POSITIVE: f64 = 0.01;
/// Fixed, so the same run makes the same extraction decisions every time.
const BLOOM_SEED: u128 = 0x0066_7472_6563_5f62_6c6f_6f6d;

/// One table's rows of an increment, encoded as a chunk.
pub struct EncodedChunk {
    pub table: u32,
    pub rows: Vec<u32>,
    pub bytes: Vec<u8>,
}

/// An incremental checkpoint copied out of the model, not yet written.
pub struct Increment {
    pub manifest: Manifest,
    pub dense: Vec<u8>,
    pub chunks: Vec<EncodedChunk>,
}

impl Increment {
    /// Rows per table, for the extraction round this increment triggers.
    pub fn keys(&self, tables: usize) -> Vec<Vec<u32>> {
        let mut keys = vec![Vec::new(); tables];
        for c in &self.chunks {
            if let Some(k) = keys.get_mut(c.table as usize) {
                k.extend_from_slice(&c.rows);
            }
        }
        keys
    }
}

/// Where an increment goes in its baseline's chunk list.
pub struct IncrementPlace<'a> {
    pub id: String,
    pub step: u64,
    pub baseline: &'a str,
    pub column: u32,
    /// How its rows are stored (`Checkpoints::with_quant`).
    pub quant: crate::Quant,
}

/// Copies `rows` (per table, sorted and unique) and the dense state out of `state` in
/// chunks of about `chunk_bytes`: the only part of an IncrCP checkpoint that blocks
/// training.
pub fn copy_increment(
    state: &ModelState,
    place: IncrementPlace<'_>,
    rows: &[Vec<u32>],
    trainer: serde_json::Value,
    chunk_bytes: usize,
) -> Result<Increment, CkptError> {
    let IncrementPlace {
        id,
        step,
        baseline,
        column,
        quant,
    } = place;
    let quant = if quant.is_none() {
        quant
    } else {
        crate::Quant {
            dim: state.config().dim as u16,
            ..quant
        }
    };
    let chunks = chunk_jobs(state, rows, chunk_bytes)?
        .par_iter()
        .map(|&(t, _, part)| {
            let table = &state.tables()[t];
            Ok(EncodedChunk {
                table: t as u32,
                rows: part.to_vec(),
                bytes: chunk::encode(t as u32, table.stride(), quant, part, |r| {
                    table.row(r as usize)
                })?,
            })
        })
        .collect::<Result<Vec<_>, CkptError>>()?;
    let (dense, dense_bytes) = dense_entry(state, &id);
    let manifest = Manifest {
        id,
        kind: CheckpointKind::Incrcp,
        step,
        parents: vec![baseline.to_string()],
        created_unix_ms: now_unix_ms(),
        model: state.config().clone(),
        dense,
        chunks: Vec::new(),
        trainer,
        incrcp: Some(IncrcpRef {
            column,
            bytes: chunks.iter().map(|c| c.bytes.len() as u64).sum(),
        }),
        deck: None,
        branch: crate::branch::branch_of_id(baseline),
        fence: None,
        quantize: quant,
    };
    Ok(Increment {
        manifest,
        dense: dense_bytes,
        chunks,
    })
}

/// What one extraction round did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExtractionStats {
    pub round: u32,
    /// Row-0 chunks compared with the new checkpoint.
    pub candidates: u32,
    pub skipped_by_range: u32,
    pub skipped_by_bloom: u32,
    /// Loaded, but too few rows were actually duplicated.
    pub skipped_by_actual: u32,
    pub extracted_chunks: u32,
    pub extracted_rows: u64,
    /// Row-0 chunks moved out of bundles that had become mostly dead.
    pub compacted_chunks: u32,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub deleted_files: u32,
    pub seconds: f64,
}

enum Decision {
    Range,
    Bloom,
    Actual { bytes_read: u64 },
    Split(Split),
}

/// A chunk bound for this round's row-0 bundle: a remainder, or a chunk moved out of a
/// mostly dead bundle. `order` is (table, column, first row).
struct Row0Item<'a> {
    order: (u32, u32, u32),
    index: usize,
    bytes: &'a [u8],
    remainder: Option<&'a EncodedChunk>,
}

struct Split {
    index: usize,
    bytes_read: u64,
    /// Rows not rewritten by the new checkpoint: they stay in row 0.
    remainder: Option<EncodedChunk>,
    /// Rows the new checkpoint rewrote: they go one row down.
    extracted: EncodedChunk,
}

/// The 2-D chunk list of one baseline, with the in-memory Bloom filters of its row-0
/// chunks. Only the process writing the checkpoints holds one.
pub struct IncrcpChain {
    list: ChunkList,
    blooms: HashMap<(String, u64), BloomFilter>,
    threshold: f64,
}

fn bloom_of(rows: &[u32]) -> BloomFilter {
    BloomFilter::with_false_pos(BLOOM_FALSE_POSITIVE)
        .seed(&BLOOM_SEED)
        .items(rows.iter())
}

impl IncrcpChain {
    pub fn new(baseline: &str, threshold: f64) -> Self {
        Self {
            list: ChunkList::new(baseline),
            blooms: HashMap::new(),
            threshold,
        }
    }

    pub fn list(&self) -> &ChunkList {
        &self.list
    }

    /// Bytes a restore of `column` reads from the list (the baseline not counted).
    pub fn rectangle_bytes(&self, column: u32) -> u64 {
        self.list.rectangle(column).iter().map(|c| c.len).sum()
    }

    /// Writes an increment: its chunks as plain files and its dense file, then a list
    /// version naming them, then the manifest, which commits the checkpoint.
    pub fn commit(&mut self, ck: &Checkpoints, inc: Increment) -> Result<Manifest, CkptError> {
        let id = inc.manifest.id.clone();
        let parts = Parts::new(ck, &id);
        let committed = self.commit_parts(ck, &parts, inc);
        parts.finish(committed)
    }

    fn commit_parts(
        &mut self,
        ck: &Checkpoints,
        parts: &Parts,
        inc: Increment,
    ) -> Result<Manifest, CkptError> {
        let store = ck.store();
        let column = self.list.columns.len() as u32;
        let expected = inc.manifest.incrcp.as_ref().map(|r| r.column);
        if expected != Some(column) || inc.manifest.parents != [self.list.baseline.clone()] {
            return Err(CkptError::Invalid(format!(
                "checkpoint {} does not continue the chunk list of {} at column {column}",
                inc.manifest.id, self.list.baseline
            )));
        }
        let prefix = prefix_for(&self.list.baseline);
        let entries = inc
            .chunks
            .par_iter()
            .enumerate()
            .map(|(n, c)| {
                let key = format!("{prefix}c{column:06}-{n:06}.chunk");
                parts.put(&key, &c.bytes)?;
                Ok(list_chunk(c, column, None, key, 0))
            })
            .collect::<Result<Vec<_>, CkptError>>()?;
        parts.put(&inc.manifest.dense.key, &inc.dense)?;
        store.sync_parts(&format!("data/{}/", inc.manifest.id))?;
        store.sync_parts(&prefix)?;
        for (entry, c) in entries.into_iter().zip(&inc.chunks) {
            self.blooms
                .insert((entry.key.clone(), entry.offset), bloom_of(&c.rows));
            self.list.push(entry);
        }
        self.list.columns.push(inc.manifest.id.clone());
        self.publish(store, Vec::new())?;
        ck.commit_manifest(&inc.manifest)
    }

    /// Writes the next list version, then deletes the previous one and `dead` objects.
    fn publish(&mut self, store: &dyn Store, dead: Vec<String>) -> Result<(), CkptError> {
        let previous = (self.list.version > 0).then(|| self.list.key());
        self.list.version += 1;
        store.put(&self.list.key(), &self.list.encode()?)?;
        for key in previous.into_iter().chain(dead) {
            match store.delete(&key) {
                Ok(()) | Err(CkptError::NotFound(_)) => {}
                Err(e) => tracing::warn!("incrcp: could not delete {key}: {e}"),
            }
        }
        Ok(())
    }

    /// One extraction round for the checkpoint at `round`, whose rows per table are `keys`:
    /// every older row-0 chunk passes three filters (key range, Bloom filter hit ratio,
    /// actual duplicate ratio, each against the threshold R as a fraction of the chunk's
    /// rows), and those that pass are split into the rows kept in row 0 and the rewritten
    /// rows pushed one row down. The round's outputs are concatenated into one bundle per
    /// list row.
    pub fn extract(
        &mut self,
        store: &dyn Store,
        round: u32,
        keys: &[Vec<u32>],
    ) -> Result<ExtractionStats, CkptError> {
        let start = Instant::now();
        let mut stats = ExtractionStats {
            round,
            ..Default::default()
        };
        let candidates: Vec<usize> = (0..self.list.chunks.len())
            .filter(|&i| {
                let c = &self.list.chunks[i];
                c.superseded_by.is_none() && c.column < round
            })
            .collect();
        stats.candidates = candidates.len() as u32;
        let decisions = candidates
            .par_iter()
            .map(|&i| self.consider(store, i, keys))
            .collect::<Result<Vec<_>, CkptError>>()?;
        let mut splits = Vec::new();
        for d in decisions {
            match d {
                Decision::Range => stats.skipped_by_range += 1,
                Decision::Bloom => stats.skipped_by_bloom += 1,
                Decision::Actual { bytes_read } => {
                    stats.skipped_by_actual += 1;
                    stats.bytes_read += bytes_read;
                }
                Decision::Split(s) => {
                    stats.bytes_read += s.bytes_read;
                    stats.extracted_chunks += 1;
                    stats.extracted_rows += s.extracted.rows.len() as u64;
                    splits.push(s);
                }
            }
        }
        if splits.is_empty() {
            stats.seconds = start.elapsed().as_secs_f64();
            return Ok(stats);
        }
        // Grouped by table in the bundles, so a restore reads each table's part of a
        // bundle in one request.
        splits.sort_by_key(|s| {
            let c = &self.list.chunks[s.index];
            (c.table, c.column, c.min_row)
        });
        let prefix = prefix_for(&self.list.baseline);
        let row0_key = format!("{prefix}x{round:06}-row0.bundle");
        let row1_key = format!("{prefix}x{round:06}-row1.bundle");
        let moved = self.compaction_moves(store, &splits)?;
        stats.compacted_chunks = moved.len() as u32;
        // Row 0 of this round: the remainders and the chunks moved out of mostly dead
        // bundles, grouped by table.
        let mut row0_items: Vec<Row0Item> = Vec::new();
        for s in &splits {
            if let Some(rem) = &s.remainder {
                let c = &self.list.chunks[s.index];
                row0_items.push(Row0Item {
                    order: (c.table, c.column, rem.rows[0]),
                    index: s.index,
                    bytes: &rem.bytes,
                    remainder: Some(rem),
                });
            }
        }
        for (i, bytes) in &moved {
            let c = &self.list.chunks[*i];
            row0_items.push(Row0Item {
                order: (c.table, c.column, c.min_row),
                index: *i,
                bytes,
                remainder: None,
            });
        }
        row0_items.sort_by_key(|item| item.order);
        let (mut row0, mut row1) = (Vec::new(), Vec::new());
        let (mut added, mut new_blooms) = (Vec::new(), Vec::new());
        for item in &row0_items {
            let (column, index, bytes) = (item.order.1, item.index, item.bytes);
            let remainder = item.remainder;
            let offset = row0.len() as u64;
            match remainder {
                Some(rem) => {
                    added.push(list_chunk(rem, column, None, row0_key.clone(), offset));
                    new_blooms.push(((row0_key.clone(), offset), bloom_of(&rem.rows)));
                }
                None => {
                    let old = &self.list.chunks[index];
                    if let Some(b) = self.blooms.remove(&(old.key.clone(), old.offset)) {
                        new_blooms.push(((row0_key.clone(), offset), b));
                    }
                    added.push(ListChunk {
                        key: row0_key.clone(),
                        offset,
                        ..old.clone()
                    });
                }
            }
            row0.extend_from_slice(bytes);
        }
        for s in &splits {
            let column = self.list.chunks[s.index].column;
            let ex = &s.extracted;
            added.push(list_chunk(
                ex,
                column,
                Some(round),
                row1_key.clone(),
                row1.len() as u64,
            ));
            row1.extend_from_slice(&ex.bytes);
        }
        if !row0.is_empty() {
            store.put_part(&row0_key, &row0)?;
            self.list
                .object_bytes
                .insert(row0_key.clone(), row0.len() as u64);
        }
        store.put_part(&row1_key, &row1)?;
        store.sync_parts(&prefix)?;
        stats.bytes_written = (row0.len() + row1.len()) as u64;

        let mut indices: Vec<usize> = splits
            .iter()
            .map(|s| s.index)
            .chain(moved.iter().map(|(i, _)| *i))
            .collect();
        indices.sort_unstable_by(|a, b| b.cmp(a));
        let mut dead = Vec::new();
        for i in indices {
            let c = &self.list.chunks[i];
            self.blooms.remove(&(c.key.clone(), c.offset));
            dead.extend(self.list.remove(i));
        }
        self.blooms.extend(new_blooms);
        for c in added {
            self.list.push(c);
        }
        self.list.extracted_through = Some(round);
        stats.deleted_files = dead.len() as u32;
        self.publish(store, dead)?;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Row-0 chunks to move into this round's row-0 bundle because the bundle they sit in
    /// would be less than half live once `splits` leave it: without this, bundles whose
    /// chunks were mostly extracted would keep their dead bytes until the baseline resets.
    /// Returns the chunks' list indices and bytes.
    fn compaction_moves(
        &self,
        store: &dyn Store,
        splits: &[Split],
    ) -> Result<Vec<(usize, Vec<u8>)>, CkptError> {
        let leaving: std::collections::HashSet<usize> = splits.iter().map(|s| s.index).collect();
        let mut live: HashMap<&str, u64> = HashMap::new();
        for (i, c) in self.list.chunks.iter().enumerate() {
            if !leaving.contains(&i) {
                *live.entry(c.key.as_str()).or_default() += c.len;
            }
        }
        let sparse: std::collections::HashSet<&str> = self
            .list
            .object_bytes
            .iter()
            .filter(|(key, size)| live.get(key.as_str()).is_some_and(|&l| 2 * l < **size))
            .map(|(key, _)| key.as_str())
            .collect();
        self.list
            .chunks
            .iter()
            .enumerate()
            .filter(|(i, c)| {
                !leaving.contains(i) && c.superseded_by.is_none() && sparse.contains(c.key.as_str())
            })
            .collect::<Vec<_>>()
            .par_iter()
            .map(|&(i, c)| Ok((i, c.read(store)?)))
            .collect()
    }

    fn consider(
        &self,
        store: &dyn Store,
        index: usize,
        keys: &[Vec<u32>],
    ) -> Result<Decision, CkptError> {
        let c = &self.list.chunks[index];
        let Some(keys) = keys.get(c.table as usize) else {
            return Ok(Decision::Range);
        };
        // At least one row must move, and at least the fraction R of the chunk.
        let needed = (self.threshold * c.rows as f64).max(1.0);
        let lo = keys.partition_point(|&k| k < c.min_row);
        let hi = keys.partition_point(|&k| k <= c.max_row);
        let in_range = &keys[lo..hi];
        if (in_range.len() as f64) < needed {
            return Ok(Decision::Range);
        }
        if let Some(bloom) = self.blooms.get(&(c.key.clone(), c.offset)) {
            let hits = in_range.iter().filter(|k| bloom.contains(*k)).count();
            if (hits as f64) < needed {
                return Ok(Decision::Bloom);
            }
        }
        let bytes = c.read(store)?;
        let where_ = store.describe(&c.key);
        let mut kept: Vec<(u32, &[u8])> = Vec::new();
        let mut moved: Vec<(u32, &[u8])> = Vec::new();
        let mut k = in_range.iter().peekable();
        let header = chunk::decode(&where_, &bytes, |row, payload| {
            while k.next_if(|&&key| key < row).is_some() {}
            if k.next_if(|&&key| key == row).is_some() {
                moved.push((row, payload));
            } else {
                kept.push((row, payload));
            }
            Ok(())
        })?;
        if header.table != c.table {
            return Err(CkptError::corrupt(
                &where_,
                format!("chunk holds table {}, list says {}", header.table, c.table),
            ));
        }
        if (moved.len() as f64) < needed {
            return Ok(Decision::Actual { bytes_read: c.len });
        }
        let encode = |part: &[(u32, &[u8])]| {
            let rows: Vec<u32> = part.iter().map(|(r, _)| *r).collect();
            let bytes =
                chunk::encode_bytes(c.table, header.stride as usize, header.quant, &rows, |i| {
                    part[i].1
                });
            EncodedChunk {
                table: c.table,
                rows,
                bytes,
            }
        };
        Ok(Decision::Split(Split {
            index,
            bytes_read: c.len,
            remainder: (!kept.is_empty()).then(|| encode(&kept)),
            extracted: encode(&moved),
        }))
    }
}

fn list_chunk(
    c: &EncodedChunk,
    column: u32,
    superseded_by: Option<u32>,
    key: String,
    offset: u64,
) -> ListChunk {
    ListChunk {
        table: c.table,
        column,
        superseded_by,
        key,
        offset,
        len: c.bytes.len() as u64,
        crc32c: crc32c::crc32c(&c.bytes),
        rows: c.rows.len() as u64,
        min_row: c.rows.first().copied().unwrap_or(0),
        max_row: c.rows.last().copied().unwrap_or(0),
    }
}
