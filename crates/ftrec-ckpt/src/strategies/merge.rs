//! DECK's hierarchical delta merging (deck.txt §3.3): once `stride` consecutive
//! checkpoints sit in layer `i`, they are merged into one in layer `i + 1` and deleted.
//! The merger keeps no state of its own (everything is read from the manifests), so it
//! runs as a background thread of the trainer or as `ftrec ckpt merge` on another host.
//!
//! A merge streams: per table, a k-way merge over the inputs' sorted row chunks with one
//! chunk per input in memory, the newest input winning a row.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::engine::now_unix_ms;
use crate::format::quant::Quant;
use crate::lease::{self, Lease, LeaseOptions};
use crate::manifest::{CheckpointKind, DeckRef, FileEntry, Manifest};
use crate::parts::Parts;
use crate::{Checkpoints, CkptError, chunk};

/// What merging did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MergeReport {
    /// Merged checkpoints written.
    pub merged: Vec<String>,
    /// Checkpoints deleted because a merged one covers them.
    pub deleted: Vec<String>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    /// The base merged on (empty for several).
    pub base: String,
    /// Bytes of delta and merged checkpoints left on the bases merged.
    pub live_bytes: u64,
}

impl MergeReport {
    pub fn absorb(&mut self, other: MergeReport) {
        self.merged.extend(other.merged);
        self.deleted.extend(other.deleted);
        self.bytes_in += other.bytes_in;
        self.bytes_out += other.bytes_out;
        self.seconds += other.seconds;
        self.live_bytes += other.live_bytes;
        if self.base != other.base {
            self.base.clear();
        }
    }

    /// Merge throughput over the input bytes.
    pub fn bytes_per_second(&self) -> f64 {
        self.bytes_in as f64 / self.seconds.max(1e-9)
    }
}

/// Takes the merger lease, so that two mergers (the trainer's background one and
/// `ftrec ckpt merge`) or a merger and `ftrec ckpt gc` never work on one location at
/// once: two mergers would write the same merged id.
pub(crate) fn merger_lease(ck: &Checkpoints) -> Result<Lease, CkptError> {
    Lease::acquire(
        ck.store_arc(),
        lease::MERGER,
        &LeaseOptions::new(format!("DECK merger ({})", std::process::id())),
    )
}

/// Merges every complete group of the deltas on `base`, lowest layer first, until none is
/// left. [`CkptError::Busy`] when another merger (or gc) holds the location.
pub fn merge_pass(
    ck: &Checkpoints,
    base: &str,
    stride: u32,
    chunk_bytes: usize,
) -> Result<MergeReport, CkptError> {
    let _lease = merger_lease(ck)?;
    merge_base(ck, base, stride, chunk_bytes)
}

fn merge_base(
    ck: &Checkpoints,
    base: &str,
    stride: u32,
    chunk_bytes: usize,
) -> Result<MergeReport, CkptError> {
    if stride < 2 {
        return Err(CkptError::Invalid(format!(
            "merge stride {stride}: must be at least 2"
        )));
    }
    let start = Instant::now();
    let mut report = MergeReport {
        base: base.to_string(),
        ..Default::default()
    };
    loop {
        let protected = ck.protected()?;
        let mut on_base: Vec<Manifest> = ck
            .list_readable()?
            .into_iter()
            .filter(|m| m.deck.is_some() && m.parents.len() == 1 && m.parents[0] == base)
            .collect();
        // A pinned checkpoint a merged one covers stays (a cluster's committed cut), but
        // the merger no longer sees it: no plan needs it for anything newer.
        let all = on_base.clone();
        on_base.retain(|m| !(protected.contains(&m.id) && is_covered(m, &all)));
        // Leftovers of a merger killed while deleting inputs: covered by a larger merged
        // checkpoint, so no restore plan uses them.
        let covered: Vec<&Manifest> = on_base.iter().filter(|m| is_covered(m, &on_base)).collect();
        if !covered.is_empty() {
            for m in covered {
                ck.delete_checkpoint(m)?;
                report.deleted.push(m.id.clone());
            }
            continue;
        }
        let Some(inputs) = next_group(&on_base, stride) else {
            report.live_bytes = on_base.iter().map(|m| m.bytes()).sum();
            break;
        };
        let (merged, bytes_in) = merge(ck, &inputs, chunk_bytes)?;
        report.bytes_in += bytes_in;
        report.bytes_out += merged.bytes();
        report.merged.push(merged.id);
        // The merged checkpoint is committed: its inputs go, newest first, so a merger
        // killed in between leaves the oldest inputs, which still restore.
        for m in inputs.iter().rev() {
            if protected.contains(&m.id) {
                continue;
            }
            ck.delete_checkpoint(m)?;
            report.deleted.push(m.id.clone());
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Runs [`merge_pass`] on every base that has deltas.
pub fn merge_all(
    ck: &Checkpoints,
    stride: u32,
    chunk_bytes: usize,
) -> Result<MergeReport, CkptError> {
    let _lease = merger_lease(ck)?;
    let mut bases: Vec<String> = ck
        .list_readable()?
        .into_iter()
        .filter(|m| m.deck.is_some())
        .filter_map(|m| m.parents.first().cloned())
        .collect();
    bases.sort();
    bases.dedup();
    let mut report = MergeReport::default();
    for base in bases {
        report.absorb(merge_base(ck, &base, stride, chunk_bytes)?);
    }
    Ok(report)
}

/// Whether another checkpoint on the same base covers a strictly larger range
/// including all of `m`'s.
fn is_covered(m: &Manifest, on_base: &[Manifest]) -> bool {
    let Some(d) = &m.deck else { return false };
    on_base
        .iter()
        .filter_map(|o| o.deck.as_ref())
        .any(|o| o.from <= d.from && d.to <= o.to && o.to - o.from > d.to - d.from)
}

/// The lowest-layer run of `stride` checkpoints that together cover one aligned span of
/// the next layer.
fn next_group(on_base: &[Manifest], stride: u32) -> Option<Vec<Manifest>> {
    let max_layer = on_base
        .iter()
        .filter_map(|m| m.deck.as_ref())
        .map(|d| d.layer)
        .max()?;
    for layer in 0..=max_layer {
        let span = stride.checked_pow(layer)?;
        let next_span = span.checked_mul(stride)?;
        let at_layer: Vec<&Manifest> = on_base
            .iter()
            .filter(|m| {
                m.deck
                    .as_ref()
                    .is_some_and(|d| d.layer == layer && d.to - d.from == span)
            })
            .collect();
        for first in &at_layer {
            let from = first.deck.as_ref()?.from;
            if from % next_span != 0 {
                continue;
            }
            let group: Option<Vec<Manifest>> = (0..stride)
                .map(|i| {
                    at_layer
                        .iter()
                        .find(|m| m.deck.as_ref().is_some_and(|d| d.from == from + i * span))
                        .map(|m| (*m).clone())
                })
                .collect();
            if group.is_some() {
                return group;
            }
        }
    }
    None
}

/// Writes the merged checkpoint of `inputs` (consecutive, oldest first): per table the
/// union of their rows, newest winning; the dense state and progress of the newest.
/// Returns its manifest and the row bytes read.
fn merge(
    ck: &Checkpoints,
    inputs: &[Manifest],
    chunk_bytes: usize,
) -> Result<(Manifest, u64), CkptError> {
    let (Some(first), Some(last)) = (inputs.first(), inputs.last()) else {
        return Err(CkptError::Invalid("nothing to merge".into()));
    };
    let Some(a) = &first.deck else {
        return Err(CkptError::Invalid(
            "merge inputs must be DECK checkpoints".into(),
        ));
    };
    let layer = a.layer + 1;
    // A merged checkpoint belongs to its inputs' branch.
    let id = format!(
        "{:012}-merged{layer}-{:06}{}",
        last.step,
        a.from,
        crate::branch::id_suffix(last.branch)
    );
    // Files under this id without its manifest are a killed merger's: the merger lease
    // this merger holds says no other is writing them.
    for key in ck.store().list(&format!("data/{id}/"))? {
        ck.store().delete(&key)?;
    }
    let parts = Parts::new(ck, &id);
    let merged = merge_into(ck, &parts, inputs, &id, chunk_bytes);
    parts.finish(merged)
}

fn merge_into(
    ck: &Checkpoints,
    parts: &Parts,
    inputs: &[Manifest],
    id: &str,
    chunk_bytes: usize,
) -> Result<(Manifest, u64), CkptError> {
    let (Some(first), Some(last)) = (inputs.first(), inputs.last()) else {
        return Err(CkptError::Invalid("nothing to merge".into()));
    };
    let (Some(a), Some(b)) = (&first.deck, &last.deck) else {
        return Err(CkptError::Invalid(
            "merge inputs must be DECK checkpoints".into(),
        ));
    };
    let layer = a.layer + 1;
    let tables = first.model.table_rows.len();
    let outputs = (0..tables)
        .into_par_iter()
        .map(|t| merge_table(parts, inputs, t, id, chunk_bytes, last.quantize))
        .collect::<Result<Vec<_>, CkptError>>()?;
    let mut chunks = Vec::new();
    let mut bytes_in = 0;
    for (entries, read) in outputs {
        chunks.extend(entries);
        bytes_in += read;
    }
    let dense_bytes = ck.fetch(&last.dense)?;
    let dense = FileEntry {
        key: format!("data/{id}/dense.bin"),
        ..last.dense.clone()
    };
    parts.put(&dense.key, &dense_bytes)?;
    ck.store().sync_parts(&format!("data/{id}/"))?;
    let manifest = Manifest {
        id: id.to_string(),
        kind: CheckpointKind::Merged,
        step: last.step,
        parents: last.parents.clone(),
        created_unix_ms: now_unix_ms(),
        model: last.model.clone(),
        dense,
        chunks,
        trainer: last.trainer.clone(),
        incrcp: None,
        deck: Some(DeckRef {
            from: a.from,
            to: b.to,
            layer,
        }),
        branch: last.branch,
        // A merger without the writer lease (`ftrec ckpt merge`) keeps its newest input's
        // token: the merged rows are that commit's, and fenced with it if it is.
        fence: last.fence,
        quantize: last.quantize,
    };
    Ok((ck.commit_manifest(&manifest)?, bytes_in))
}

/// One input's rows of one table, a chunk at a time.
struct RowStream<'a> {
    ck: &'a Checkpoints,
    files: Vec<&'a FileEntry>,
    next_file: usize,
    bytes: Vec<u8>,
    /// Row ids and payload offsets of the loaded chunk.
    rows: Vec<(u32, usize)>,
    pos: usize,
    stride: usize,
    /// How the loaded chunk stores its rows.
    quant: Quant,
    bytes_read: u64,
}

impl<'a> RowStream<'a> {
    fn peek(&mut self) -> Result<Option<u32>, CkptError> {
        while self.pos == self.rows.len() {
            let Some(entry) = self.files.get(self.next_file) else {
                return Ok(None);
            };
            self.next_file += 1;
            let bytes = self.ck.fetch(entry)?;
            let base = bytes.as_ptr() as usize;
            let mut rows = Vec::new();
            let header = chunk::decode(&self.ck.store().describe(&entry.key), &bytes, |r, p| {
                rows.push((r, p.as_ptr() as usize - base));
                Ok(())
            })?;
            self.stride = header.stride as usize;
            self.quant = header.quant;
            self.bytes_read += bytes.len() as u64;
            self.bytes = bytes;
            self.rows = rows;
            self.pos = 0;
        }
        Ok(Some(self.rows[self.pos].0))
    }

    fn payload(&self) -> &[u8] {
        let offset = self.rows[self.pos].1;
        &self.bytes[offset..offset + self.quant.row_bytes(self.stride)]
    }
}

fn merge_table(
    parts: &Parts,
    inputs: &[Manifest],
    t: usize,
    id: &str,
    chunk_bytes: usize,
    out: Quant,
) -> Result<(Vec<FileEntry>, u64), CkptError> {
    let ck = parts.checkpoints();
    let mut streams: Vec<RowStream> = inputs
        .iter()
        .map(|m| RowStream {
            ck,
            files: m
                .chunks
                .iter()
                .filter(|c| c.table == Some(t as u32))
                .collect(),
            next_file: 0,
            bytes: Vec::new(),
            rows: Vec::new(),
            pos: 0,
            stride: 0,
            quant: Quant::NONE,
            bytes_read: 0,
        })
        .collect();
    // Rows are moved as stored, never quantized twice; the output takes the newest
    // input's storage (`out`), and a row of an input stored otherwise (the job changed
    // `checkpoint.quantize` between them) is converted once.
    let mut values = Vec::new();
    let (mut rows, mut payload) = (Vec::new(), Vec::new());
    let mut entries = Vec::new();
    let mut stride = 0;
    let flush = |rows: &mut Vec<u32>,
                 payload: &mut Vec<u8>,
                 stride: usize,
                 quant: Quant,
                 entries: &mut Vec<FileEntry>| {
        if rows.is_empty() {
            return Ok(());
        }
        let row_bytes = quant.row_bytes(stride);
        let bytes = chunk::encode_bytes(t as u32, stride, quant, rows, |i| {
            &payload[i * row_bytes..(i + 1) * row_bytes]
        });
        let key = format!("data/{id}/t{t:04}-{:06}.chunk", entries.len());
        parts.put(&key, &bytes)?;
        entries.push(FileEntry {
            key,
            bytes: bytes.len() as u64,
            crc32c: crc32c::crc32c(&bytes),
            table: Some(t as u32),
            rows: rows.len() as u64,
        });
        rows.clear();
        payload.clear();
        Ok::<(), CkptError>(())
    };
    loop {
        let mut lowest: Option<u32> = None;
        for s in streams.iter_mut() {
            if let Some(r) = s.peek()? {
                lowest = Some(lowest.map_or(r, |l| l.min(r)));
            }
        }
        let Some(row) = lowest else { break };
        // The newest input holding the row wins; every input holding it moves on.
        let mut winner = None;
        for (i, s) in streams.iter_mut().enumerate() {
            if s.peek()? == Some(row) {
                winner = Some(i);
            }
        }
        let Some(w) = winner else { break };
        if stride != 0 && streams[w].stride != stride {
            return Err(CkptError::Invalid(format!(
                "merging table {t}: inputs disagree on the row width"
            )));
        }
        stride = streams[w].stride;
        rows.push(row);
        if streams[w].quant == out {
            payload.extend_from_slice(streams[w].payload());
        } else {
            values.resize(stride, 0.0);
            streams[w]
                .quant
                .decode_row(streams[w].payload(), &mut values);
            out.encode_row(&values, &mut payload)
                .map_err(|e| CkptError::Invalid(format!("merging table {t}, row {row}: {e}")))?;
        }
        for s in streams.iter_mut() {
            if s.peek()? == Some(row) {
                s.pos += 1;
            }
        }
        if rows.len() >= (chunk_bytes / (4 + out.row_bytes(stride))).max(1) {
            flush(&mut rows, &mut payload, stride, out, &mut entries)?;
        }
    }
    flush(&mut rows, &mut payload, stride, out, &mut entries)?;
    Ok((entries, streams.iter().map(|s| s.bytes_read).sum()))
}
