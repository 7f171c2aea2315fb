//! Writing, listing, verifying and restoring checkpoints in a [`Store`].

use std::time::{SystemTime, UNIX_EPOCH};

use ftrec_model::ModelState;
use rayon::prelude::*;

use crate::manifest::{CheckpointKind, FileEntry, Manifest};
use crate::{CkptError, Store, chunk, dense};

/// Target size of one row chunk.
pub const CHUNK_BYTES: usize = 4 << 20;

pub struct Checkpoints {
    store: Box<dyn Store>,
}

impl Checkpoints {
    pub fn new(store: Box<dyn Store>) -> Self {
        Self { store }
    }

    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// The id of a checkpoint taken after `step`: sorts by step.
    pub fn id_for(step: u64, kind: CheckpointKind) -> String {
        let kind = match kind {
            CheckpointKind::Full => "full",
        };
        format!("{step:012}-{kind}")
    }

    /// Writes a full checkpoint of `state` after `step`: every table as row chunks (written
    /// in parallel), the dense file, then the manifest, which commits it.
    pub fn write_full(
        &self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let id = Self::id_for(step, CheckpointKind::Full);
        let mut jobs = Vec::new();
        for (t, table) in state.tables().iter().enumerate() {
            let per_chunk = (CHUNK_BYTES / (4 + 4 * table.stride())).max(1);
            for (n, start) in (0..table.rows()).step_by(per_chunk).enumerate() {
                jobs.push((t, n, start, (start + per_chunk).min(table.rows())));
            }
        }
        let mut chunks = jobs
            .par_iter()
            .map(|&(t, n, start, end)| {
                let table = &state.tables()[t];
                let rows: Vec<u32> = (start as u32..end as u32).collect();
                let bytes =
                    chunk::encode(t as u32, table.stride(), &rows, |r| table.row(r as usize));
                let key = format!("data/{id}/t{t:04}-{n:06}.chunk");
                self.store.put(&key, &bytes)?;
                Ok(FileEntry {
                    key,
                    bytes: bytes.len() as u64,
                    crc32c: crc32c::crc32c(&bytes),
                    table: Some(t as u32),
                    rows: rows.len() as u64,
                })
            })
            .collect::<Result<Vec<_>, CkptError>>()?;
        chunks.sort_by(|a, b| a.key.cmp(&b.key));
        let dense_bytes = dense::encode(
            &state.dense.params,
            &state.dense.optimizer_state,
            state.dense.step,
        );
        let dense_key = format!("data/{id}/dense.bin");
        self.store.put(&dense_key, &dense_bytes)?;
        let manifest = Manifest {
            id: id.clone(),
            kind: CheckpointKind::Full,
            step,
            parents: Vec::new(),
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            model: state.config().clone(),
            dense: FileEntry {
                key: dense_key,
                bytes: dense_bytes.len() as u64,
                crc32c: crc32c::crc32c(&dense_bytes),
                table: None,
                rows: 0,
            },
            chunks,
            trainer,
        };
        self.store
            .put(&Manifest::key_for(&id), &manifest.encode()?)?;
        Ok(manifest)
    }

    /// All committed checkpoints, oldest first. A damaged manifest is an error naming it.
    pub fn list(&self) -> Result<Vec<Manifest>, CkptError> {
        self.store
            .list("manifests/")?
            .iter()
            .filter(|k| k.ends_with(".man"))
            .map(|k| Manifest::decode(&self.store.describe(k), &self.store.get(k)?))
            .collect()
    }

    pub fn manifest(&self, id: &str) -> Result<Manifest, CkptError> {
        let key = Manifest::key_for(id);
        Manifest::decode(&self.store.describe(&key), &self.store.get(&key)?)
    }

    /// The newest checkpoint, if any.
    pub fn latest(&self) -> Result<Option<Manifest>, CkptError> {
        Ok(self
            .list()?
            .into_iter()
            .max_by_key(|m| (m.step, m.created_unix_ms)))
    }

    fn fetch(&self, entry: &FileEntry) -> Result<Vec<u8>, CkptError> {
        let bytes = self.store.get(&entry.key)?;
        let where_ = self.store.describe(&entry.key);
        if bytes.len() as u64 != entry.bytes {
            return Err(CkptError::corrupt(
                &where_,
                format!(
                    "length is {} bytes, manifest says {}",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        if crc32c::crc32c(&bytes) != entry.crc32c {
            return Err(CkptError::corrupt(
                &where_,
                "checksum differs from the manifest's",
            ));
        }
        Ok(bytes)
    }

    /// Restores the exact state of checkpoint `id` into a fresh [`ModelState`]. Files are
    /// read and checked in parallel (one table per task); any damage fails the whole restore.
    pub fn restore(&self, id: &str) -> Result<(ModelState, Manifest), CkptError> {
        let manifest = self.manifest(id)?;
        let mut state = ModelState::zeroed(&manifest.model)?;
        let mut by_table: Vec<Vec<&FileEntry>> = vec![Vec::new(); state.tables().len()];
        for c in &manifest.chunks {
            let t = c
                .table
                .map(|t| t as usize)
                .filter(|&t| t < by_table.len())
                .ok_or_else(|| {
                    CkptError::corrupt(&c.key, "chunk names a table the model does not have")
                })?;
            by_table[t].push(c);
        }
        state
            .tables_mut()
            .par_iter_mut()
            .zip(&by_table)
            .enumerate()
            .try_for_each(|(t, (table, files))| -> Result<(), CkptError> {
                let mut covered = 0u64;
                // A full checkpoint stores rows 0..rows in key order, each exactly once.
                let mut next_row = 0usize;
                let full = manifest.kind == CheckpointKind::Full;
                for entry in files {
                    let bytes = self.fetch(entry)?;
                    let where_ = self.store.describe(&entry.key);
                    let header = chunk::decode(&where_, &bytes, |row, payload| {
                        if row as usize >= table.rows() || payload.len() != table.stride() * 4 {
                            return Err(CkptError::corrupt(
                                &where_,
                                format!("row {row} does not fit table {t}"),
                            ));
                        }
                        if full && row as usize != next_row {
                            return Err(CkptError::corrupt(
                                &where_,
                                format!("full checkpoint: row {row} where row {next_row} was due"),
                            ));
                        }
                        next_row += 1;
                        for (d, c) in table
                            .row_mut(row as usize)
                            .iter_mut()
                            .zip(payload.chunks_exact(4))
                        {
                            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                        Ok(())
                    })?;
                    if header.table as usize != t {
                        return Err(CkptError::corrupt(
                            &where_,
                            format!("holds table {}, manifest says {t}", header.table),
                        ));
                    }
                    covered += header.rows;
                }
                if manifest.kind == CheckpointKind::Full && covered != table.rows() as u64 {
                    return Err(CkptError::Invalid(format!(
                        "checkpoint {id}: table {t} has {covered} of {} rows",
                        table.rows()
                    )));
                }
                Ok(())
            })?;
        let dense_bytes = self.fetch(&manifest.dense)?;
        let dense = &mut state.dense;
        dense.step = dense::decode(
            &self.store.describe(&manifest.dense.key),
            &dense_bytes,
            &mut dense.params,
            &mut dense.optimizer_state,
        )?;
        Ok((state, manifest))
    }

    /// Checks every object of checkpoint `id` (lengths and checksums, and each chunk's
    /// internal block checksums) without building a model.
    pub fn verify(&self, id: &str) -> Result<Manifest, CkptError> {
        let manifest = self.manifest(id)?;
        manifest.chunks.par_iter().try_for_each(|entry| {
            let bytes = self.fetch(entry)?;
            chunk::decode(&self.store.describe(&entry.key), &bytes, |_, _| Ok(())).map(|_| ())
        })?;
        self.fetch(&manifest.dense)?;
        Ok(manifest)
    }
}
