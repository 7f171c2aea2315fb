//! Restoring a checkpoint: its full ancestor, then every delta on the way to it (rows,
//! DECK merges, IncrCP chunk lists), each file checked before it is applied.

use ftrec_model::{EmbeddingTable, ModelState};
use rayon::prelude::*;

use super::Checkpoints;
use crate::chunklist::ListChunk;
use crate::manifest::{CheckpointKind, FileEntry, Manifest};
use crate::{CkptError, chunk, dense};

/// Merges a restore may meet in a row before it gives up, each with a changed plan: a
/// bound on a merger that never stops, far above what one merge pass does.
const MAX_MERGE_RACES: u32 = 64;

fn chain_ids(chain: &[Manifest]) -> Vec<String> {
    chain.iter().map(|m| m.id.clone()).collect()
}

impl Checkpoints {
    /// Restores the exact state of checkpoint `id` into a fresh [`ModelState`]: its full
    /// ancestor, then every delta on the way to it, newer rows overwriting older ones; the
    /// dense state is the checkpoint's own. Files are read and checked in parallel (one
    /// table per task); any damage fails the whole restore.
    pub fn restore(&self, id: &str) -> Result<(ModelState, Manifest), CkptError> {
        // A DECK merger may replace the deltas a restore is reading by an equivalent
        // merged checkpoint; planning again then finds the replacement. When the target
        // delta itself was merged away, the merged checkpoint ending at its step stands in
        // for it: same rows, and the target's own dense state (found by a proptest seed).
        // A merger works through its groups one after another, so a slow restore can meet
        // several merges in a row (CI met four, with three retries allowed): it plans again
        // as long as each failure came with a changed plan, and fails at once when the
        // plan it read is still the plan (a file really missing).
        let mut attempts = 0;
        let mut target = id.to_string();
        loop {
            let chain = self.lineage(&target);
            let planned = chain.as_ref().ok().map(|c| chain_ids(c));
            let result = match chain {
                Ok(chain) => self.on_io_pool(|| self.restore_once(&target, chain)),
                Err(e) => Err(e),
            };
            match result {
                Err(CkptError::NotFound(m)) if attempts < MAX_MERGE_RACES => {
                    match self.manifest(&target) {
                        Ok(t) if t.deck.is_some() => {
                            let now = self.lineage(&target).ok().map(|c| chain_ids(&c));
                            if planned.is_some() && now == planned {
                                return Err(CkptError::NotFound(m));
                            }
                        }
                        Err(CkptError::NotFound(_)) => match self.merged_stand_in(&target)? {
                            Some(stand_in) => target = stand_in,
                            None => return Err(CkptError::NotFound(m)),
                        },
                        _ => return Err(CkptError::NotFound(m)),
                    }
                    tracing::debug!("restore of {id} raced a merge ({m}); planning again");
                    attempts += 1;
                }
                other => return other,
            }
        }
    }

    /// Only the dense state of checkpoint `id` (its own dense file, checksum checked),
    /// with its manifest: for a reader that needs none of its rows (a resumed job's server
    /// whose dense range overlaps an old server's, but none of whose rows it holds).
    pub fn restore_dense(
        &self,
        id: &str,
    ) -> Result<(ftrec_model::DenseState, Manifest), CkptError> {
        let target = self.manifest(id)?;
        self.check_unfenced(std::slice::from_ref(&target))?;
        let mut dense = ftrec_model::DenseState::initial(&target.model, 0)?;
        self.read_dense(&target, &mut dense)?;
        Ok((dense, target))
    }

    /// Fills `dense` (shaped for `target`'s model) from `target`'s dense file.
    fn read_dense(
        &self,
        target: &Manifest,
        dense: &mut ftrec_model::DenseState,
    ) -> Result<(), CkptError> {
        let bytes = self.fetch(&target.dense)?;
        dense.step = dense::decode(
            &self.store.describe(&target.dense.key),
            &bytes,
            &mut dense.params,
            &mut dense.optimizer_state,
        )?;
        Ok(())
    }

    /// The merged checkpoint that replaced DECK delta `id` (gone): the one ending at the
    /// delta's step, committed last.
    fn merged_stand_in(&self, id: &str) -> Result<Option<String>, CkptError> {
        let Some(step) = id.split('-').next().and_then(|s| s.parse::<u64>().ok()) else {
            return Ok(None);
        };
        let is_delta = id.contains("-delta");
        Ok(self
            .list_readable()?
            .into_iter()
            .filter(|m| is_delta && m.kind == CheckpointKind::Merged && m.step == step)
            .max_by(|a, b| a.commit_order().cmp(&b.commit_order()))
            .map(|m| m.id))
    }

    /// Fails with [`CkptError::Fenced`] when any checkpoint of `chain` is a superseded
    /// writer's late commit (`history/fence.rs`): its rows are never restored.
    pub(crate) fn check_unfenced(&self, chain: &[Manifest]) -> Result<(), CkptError> {
        let mut fences = crate::fence::Fences::load(self.store())?;
        chain.iter().try_for_each(|m| fences.check(m))
    }

    fn restore_once(
        &self,
        id: &str,
        chain: Vec<Manifest>,
    ) -> Result<(ModelState, Manifest), CkptError> {
        // A DECK restore may read a merged checkpoint in place of the target's deltas;
        // the dense state and trainer progress are always the target's own.
        let target = match chain.last() {
            Some(last) if last.id == id => last.clone(),
            _ => self.manifest(id)?,
        };
        self.check_unfenced(&chain)?;
        self.check_unfenced(std::slice::from_ref(&target))?;
        let mut state = ModelState::zeroed(&target.model)?;
        for manifest in &chain {
            self.apply_rows(manifest, &mut state)?;
        }
        self.read_dense(&target, &mut state.dense)?;
        Ok((state, target))
    }

    /// Applies the rows checkpoint `id` stores beyond its full ancestor (for a full
    /// checkpoint, all of it) onto `state`, as a restore does after loading the baseline,
    /// and returns the row bytes read. Benchmarks time this part alone, as the IncrCP
    /// paper does.
    pub fn replay_increments(&self, id: &str, state: &mut ModelState) -> Result<u64, CkptError> {
        self.on_io_pool(|| self.replay_on_pool(id, state))
    }

    fn replay_on_pool(&self, id: &str, state: &mut ModelState) -> Result<u64, CkptError> {
        let chain = self.lineage(id)?;
        self.check_unfenced(&chain)?;
        let skip = usize::from(chain.len() > 1);
        let mut bytes = 0;
        for m in &chain[skip..] {
            bytes += self.apply_rows(m, state)?;
        }
        Ok(bytes)
    }

    /// Writes the rows of an IncrCP checkpoint into `state` (already holding its
    /// baseline): the chunks of its rectangle, per table in column order, newest wins.
    /// Each table's spans are read into one buffer reused across tables, and each chunk
    /// is checked in the same pass that applies it: block checksums before any row of the
    /// block is written, the whole-chunk checksum (accumulated in the same pass) against the
    /// chunk list's.
    fn apply_incrcp(&self, manifest: &Manifest, state: &mut ModelState) -> Result<u64, CkptError> {
        let started = std::time::Instant::now();
        let (list, column) = self.incrcp_list(manifest)?;
        let rectangle = list.rectangle(column);
        let bytes = rectangle.iter().map(|c| c.len).sum();
        tracing::debug!(
            checkpoint = %manifest.id,
            list_chunks = list.chunks.len(),
            rectangle_chunks = rectangle.len(),
            rectangle_bytes = bytes,
            list_ms = started.elapsed().as_secs_f64() * 1e3,
            "IncrCP restore planned"
        );
        let mut by_table: Vec<Vec<&ListChunk>> = vec![Vec::new(); state.tables().len()];
        for c in rectangle {
            by_table
                .get_mut(c.table as usize)
                .ok_or_else(|| {
                    CkptError::corrupt(&c.key, "chunk names a table the model does not have")
                })?
                .push(c);
        }
        state
            .tables_mut()
            .par_iter_mut()
            .zip(&by_table)
            .enumerate()
            .try_for_each_init(Vec::new, |buffer, (t, (table, chunks))| {
                let spans = self.read_spans(chunks, buffer)?;
                for c in chunks {
                    let (file_start, at) = spans[c.key.as_str()];
                    let at = at + (c.offset - file_start) as usize;
                    let bytes = buffer.get(at..at + c.len as usize).unwrap_or_default();
                    let where_ = self.store.describe(&c.key);
                    let quant = chunk::header(&where_, bytes)?.quant;
                    let (header, crc) = chunk::decode_with_crc(&where_, bytes, |row, payload| {
                        store_row(table, t, &where_, quant, row, payload)
                    })?;
                    if crc != c.crc32c {
                        return Err(c.mismatch(&*self.store));
                    }
                    if header.table as usize != t {
                        return Err(CkptError::corrupt(
                            &where_,
                            format!("holds table {}, chunk list says {t}", header.table),
                        ));
                    }
                }
                Ok(())
            })?;
        Ok(bytes)
    }

    /// Reads, per object, the span covering `chunks` in one request (bundles hold one
    /// table's chunks of an extraction round next to each other), all into `buffer`.
    /// Returns per object the span's offset in the object and in `buffer`.
    fn read_spans<'a>(
        &self,
        chunks: &[&'a ListChunk],
        buffer: &mut Vec<u8>,
    ) -> Result<std::collections::HashMap<&'a str, (u64, usize)>, CkptError> {
        let mut spans: std::collections::HashMap<&str, (u64, u64)> = Default::default();
        for c in chunks {
            let span = spans.entry(c.key.as_str()).or_insert((c.offset, c.offset));
            span.0 = span.0.min(c.offset);
            span.1 = span.1.max(c.offset + c.len);
        }
        buffer.clear();
        spans
            .into_iter()
            .map(|(key, (start, end))| {
                let at = buffer.len();
                self.store
                    .get_range_into(key, start, (end - start) as usize, buffer)?;
                Ok((key, (start, at)))
            })
            .collect()
    }

    /// Writes the rows stored by one checkpoint into `state`; returns the row bytes read.
    fn apply_rows(&self, manifest: &Manifest, state: &mut ModelState) -> Result<u64, CkptError> {
        if manifest.kind == CheckpointKind::Incrcp {
            return self.apply_incrcp(manifest, state);
        }
        let tables = state.tables().len();
        let mut by_table: Vec<Vec<&FileEntry>> = vec![Vec::new(); tables];
        for c in &manifest.chunks {
            let t = c
                .table
                .map(|t| t as usize)
                .filter(|&t| t < tables)
                .ok_or_else(|| {
                    CkptError::corrupt(&c.key, "chunk names a table the model does not have")
                })?;
            by_table[t].push(c);
        }
        let bytes = manifest.chunks.iter().map(|c| c.bytes).sum();
        if manifest.kind == CheckpointKind::Full {
            self.apply_full(manifest, state, &by_table)?;
            return Ok(bytes);
        }
        state
            .tables_mut()
            .par_iter_mut()
            .zip(&by_table)
            .enumerate()
            .try_for_each_init(
                Vec::new,
                |bytes, (t, (table, files))| -> Result<(), CkptError> {
                    // A delta stores each row at most once, ascending.
                    let mut next_row = 0usize;
                    for entry in files {
                        self.fetch_unchecked(entry, bytes)?;
                        let where_ = self.store.describe(&entry.key);
                        let quant = chunk::header(&where_, bytes)?.quant;
                        let (header, crc) =
                            chunk::decode_with_crc(&where_, bytes, |row, payload| {
                                let r = row as usize;
                                if r < next_row {
                                    return Err(CkptError::corrupt(
                                        &where_,
                                        format!(
                                            "row {r} out of order: rows from {next_row} were due"
                                        ),
                                    ));
                                }
                                next_row = r + 1;
                                store_row(table, t, &where_, quant, row, payload)
                            })?;
                        check_named_chunk(&where_, entry, t, &header, crc)?;
                    }
                    Ok(())
                },
            )?;
        Ok(bytes)
    }

    /// A full checkpoint's rows, chunk by chunk in parallel. Chunk `n` of a table holds the
    /// `rows` rows after those of chunks `0..n` (the manifest's counts), so every chunk
    /// decodes straight into its own disjoint slice of the table. Parallel per chunk rather
    /// than per table because Criteo-shaped tables are skewed: the largest holds 30% of
    /// the rows, and one thread reading it alone bounded the whole restore.
    fn apply_full(
        &self,
        manifest: &Manifest,
        state: &mut ModelState,
        by_table: &[Vec<&FileEntry>],
    ) -> Result<(), CkptError> {
        let mut jobs = Vec::with_capacity(manifest.chunks.len());
        for (t, (table, files)) in state.tables_mut().iter_mut().zip(by_table).enumerate() {
            let (rows, stride) = (table.rows(), table.stride());
            let listed: u64 = files.iter().map(|f| f.rows).sum();
            if listed != rows as u64 {
                return Err(CkptError::Invalid(format!(
                    "checkpoint {}: table {t} has {listed} of {rows} rows",
                    manifest.id
                )));
            }
            let mut rest = table.as_mut_slice();
            let mut first = 0u64;
            for entry in files {
                let (own, tail) = rest.split_at_mut(entry.rows as usize * stride);
                jobs.push((t, stride, *entry, own, first));
                rest = tail;
                first += entry.rows;
            }
        }
        jobs.into_par_iter().try_for_each_init(
            Vec::new,
            |bytes, (t, stride, entry, rows, first)| -> Result<(), CkptError> {
                let where_ = self.store.describe(&entry.key);
                let out: &mut [u8] = bytemuck::cast_slice_mut(rows);
                let mut decode = |reader: &mut dyn std::io::Read| {
                    chunk::read_consecutive_into(&where_, reader, first, stride, out)
                };
                let (header, crc) = match self.store.open_reader(&entry.key)? {
                    // Local files: the payload is read straight into the table.
                    Some((mut reader, len)) => {
                        if len != entry.bytes {
                            return Err(CkptError::corrupt(
                                &where_,
                                format!("length is {len} bytes, manifest says {}", entry.bytes),
                            ));
                        }
                        decode(&mut reader)?
                    }
                    // Object stores: one GET into the reused buffer, decoded from there.
                    None => {
                        self.fetch_unchecked(entry, bytes)?;
                        decode(&mut bytes.as_slice())?
                    }
                };
                if header.file_len() != entry.bytes {
                    return Err(CkptError::corrupt(
                        &where_,
                        format!(
                            "length is {} bytes but the header describes {}",
                            entry.bytes,
                            header.file_len()
                        ),
                    ));
                }
                check_named_chunk(&where_, entry, t, &header, crc)
            },
        )
    }
}

/// A decoded chunk, every block of which checked out, must also be the file the manifest
/// names: the right table, and the manifest's CRC (not, say, a valid chunk of another
/// checkpoint).
pub(crate) fn check_named_chunk(
    where_: &str,
    entry: &FileEntry,
    table: usize,
    header: &chunk::ChunkHeader,
    crc: u32,
) -> Result<(), CkptError> {
    if header.table as usize != table {
        return Err(CkptError::corrupt(
            where_,
            format!("holds table {}, manifest says {table}", header.table),
        ));
    }
    if crc != entry.crc32c {
        return Err(CkptError::corrupt(
            where_,
            "checksum differs from the manifest's",
        ));
    }
    Ok(())
}

/// Writes one row's stored payload (f32, or quantized as `quant` says) into table `t`.
pub(crate) fn store_row(
    table: &mut EmbeddingTable,
    t: usize,
    where_: &str,
    quant: crate::Quant,
    row: u32,
    payload: &[u8],
) -> Result<(), CkptError> {
    let row = row as usize;
    if row >= table.rows() || payload.len() != quant.row_bytes(table.stride()) {
        return Err(CkptError::corrupt(
            where_,
            format!("row {row} does not fit table {t}"),
        ));
    }
    if quant.is_none() {
        // The format is little-endian f32, as memory is on every target this crate
        // builds for (lib.rs refuses big-endian), so a row is one copy.
        bytemuck::cast_slice_mut::<f32, u8>(table.row_mut(row)).copy_from_slice(payload);
    } else {
        quant.decode_row(payload, table.row_mut(row));
    }
    Ok(())
}
