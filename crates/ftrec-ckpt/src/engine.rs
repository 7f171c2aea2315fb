//! Writing, listing, verifying and restoring checkpoints in a [`Store`].

mod lineage;
mod listing;
mod restore;
pub mod timing;
mod verify;

pub(crate) use restore::{check_named_chunk, store_row};

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ftrec_model::ModelState;
use rayon::prelude::*;

use crate::format::quant::Quant;
use crate::lease::Lease;
use crate::manifest::{CheckpointKind, FileEntry, Manifest};
use crate::parts::Parts;
use crate::{CkptError, Store, chunk, dense};

/// Target size of one row chunk.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Longest parent chain a restore follows before declaring the lineage broken.
const MAX_CHAIN: usize = 100_000;

/// One chunk to encode: table, chunk number within the table, rows.
pub(crate) type ChunkJob<'a> = (usize, usize, &'a [u32]);

/// `rows` (per table, sorted and unique) cut into chunks of about `chunk_bytes`; rows out
/// of a table's range are an error.
pub(crate) fn chunk_jobs<'a>(
    state: &ModelState,
    rows: &'a [Vec<u32>],
    chunk_bytes: usize,
) -> Result<Vec<ChunkJob<'a>>, CkptError> {
    if rows.len() != state.tables().len() {
        return Err(CkptError::Invalid(format!(
            "row lists for {} tables, model has {}",
            rows.len(),
            state.tables().len()
        )));
    }
    let mut jobs = Vec::new();
    for (t, table) in state.tables().iter().enumerate() {
        if rows[t].last().is_some_and(|&r| r as usize >= table.rows()) {
            return Err(CkptError::Invalid(format!("table {t}: row out of range")));
        }
        let per_chunk = (chunk_bytes / (4 + 4 * table.stride())).max(1);
        jobs.extend(
            rows[t]
                .chunks(per_chunk)
                .enumerate()
                .map(|(n, part)| (t, n, part)),
        );
    }
    Ok(jobs)
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The encoded dense file of `state` for checkpoint `id`, and its manifest entry.
pub(crate) fn dense_entry(state: &ModelState, id: &str) -> (FileEntry, Vec<u8>) {
    let bytes = dense::encode(
        &state.dense.params,
        &state.dense.optimizer_state,
        state.dense.step,
    );
    let entry = FileEntry {
        key: format!("data/{id}/dense.bin"),
        bytes: bytes.len() as u64,
        crc32c: crc32c::crc32c(&bytes),
        table: None,
        rows: 0,
    };
    (entry, bytes)
}

/// Bytes of the dense file's payload.
pub(crate) fn dense_bytes(state: &ModelState) -> u64 {
    4 * (state.dense.params.len() + state.dense.optimizer_state.len()) as u64
}

/// Concurrent reads and writes while a checkpoint is written or restored. Storage I/O
/// waits more than it computes: on this machine's virtio disk, 8 outstanding requests
/// restore a cold 678 MB checkpoint in 0.52 s against 0.77 s with 2 (median of 3).
const IO_THREADS: usize = 8;

/// Checkpoints in one store. Cloning shares the store (and the I/O thread pool), so
/// background writers can hold it.
#[derive(Clone)]
pub struct Checkpoints {
    store: Arc<dyn Store>,
    io: Option<Arc<rayon::ThreadPool>>,
    /// The branch new checkpoints go to (see `branch.rs`), fixed by
    /// [`Checkpoints::start_writing`]; 0 for a handle that only reads.
    pub(crate) branch: u32,
    /// The writer lease, when this handle writes: checked before every commit.
    pub(crate) lease: Option<Arc<Lease>>,
    /// How the rows it writes are stored (`checkpoint.quantize`); reads follow each
    /// chunk's own header whatever this says.
    pub(crate) quant: Quant,
}

impl Checkpoints {
    pub fn new(store: Box<dyn Store>) -> Self {
        Self::from_arc(Arc::from(store))
    }

    /// Like [`Checkpoints::new`], for a store the caller keeps a handle to.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        // Building a pool fails only when threads cannot be spawned; then the caller's
        // pool does the work.
        let io = rayon::ThreadPoolBuilder::new()
            .num_threads(IO_THREADS)
            .thread_name(|i| format!("ckpt-io-{i}"))
            .build()
            .map_err(|e| tracing::warn!("no checkpoint I/O pool ({e}); using the caller's"))
            .ok();
        Self {
            store,
            io: io.map(Arc::new),
            branch: 0,
            lease: None,
            quant: Quant::NONE,
        }
    }

    /// This handle writes rows stored as `quant` says (its `dim` is filled in from each
    /// model written). Lossy unless `QuantKind::None`: a restore is then close to the
    /// saved state, not equal to it.
    pub fn with_quant(mut self, quant: Quant) -> Self {
        self.quant = quant;
        self
    }

    /// How this handle stores the rows of `state`'s model.
    pub(crate) fn quant_for(&self, config: &ftrec_model::ModelConfig) -> Quant {
        if self.quant.is_none() {
            return Quant::NONE;
        }
        Quant {
            dim: config.dim as u16,
            ..self.quant
        }
    }

    pub(crate) fn store_arc(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    /// The branch this handle writes to.
    pub fn branch(&self) -> u32 {
        self.branch
    }

    /// Commits a checkpoint by creating its manifest, after every file it names, and
    /// returns it as committed. A writer first proves at the store that it still holds its
    /// lease, and stamps the manifest with the token that proof hands out; a takeover of
    /// the lease, however recent, refuses the commit with [`CkptError::Fenced`] (see
    /// `history/fence.rs` for the whole protocol). Refused too when the id is taken:
    /// history is never rewritten. A handle without the writer lease commits the
    /// manifest's token as it is.
    pub(crate) fn commit_manifest(&self, manifest: &Manifest) -> Result<Manifest, CkptError> {
        let mut manifest = manifest.clone();
        if let Some(lease) = &self.lease {
            manifest.fence = Some(lease.fence_commit()?);
        }
        self.store
            .put(&Manifest::key_for(&manifest.id), &manifest.encode()?)?;
        Ok(manifest)
    }

    /// Fails early, with the numbers, when a checkpoint of `bytes` will not fit where it
    /// goes (with 5% to spare), instead of dying on ENOSPC halfway.
    pub(crate) fn check_free_space(&self, what: &str, bytes: u64) -> Result<(), CkptError> {
        let Some(free) = self.store.free_bytes() else {
            return Ok(());
        };
        let needed = bytes + bytes / 20;
        if free < needed {
            return Err(CkptError::Io {
                path: self.store.describe("").into(),
                error: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{what} needs about {:.1} MB but only {:.1} MB are free; free space or lower the retention (checkpoint.keep)",
                        needed as f64 / 1e6,
                        free as f64 / 1e6
                    ),
                ),
            });
        }
        Ok(())
    }

    /// Runs `f` on the I/O pool, where the engine's parallel reads and writes go.
    pub fn on_io_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.io {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }

    pub fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// The id of a checkpoint taken after `step` on this handle's branch: sorts by step.
    pub fn id_for(&self, step: u64, kind: CheckpointKind) -> String {
        Self::id_on_branch(step, kind, self.branch)
    }

    /// The id of a checkpoint taken after `step` on `branch`.
    pub fn id_on_branch(step: u64, kind: CheckpointKind, branch: u32) -> String {
        format!(
            "{step:012}-{}{}",
            kind.tag(),
            crate::branch::id_suffix(branch)
        )
    }

    /// Writes a full checkpoint of `state` after `step`.
    pub fn write_full(
        &self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        self.write(state, step, CheckpointKind::Full, None, Vec::new(), trainer)
    }

    /// Writes a checkpoint: the given rows of each table (all rows when `rows` is `None`)
    /// as row chunks written in parallel, the dense file, then the manifest, which commits
    /// it. `rows[t]` must be sorted and unique.
    pub fn write(
        &self,
        state: &ModelState,
        step: u64,
        kind: CheckpointKind,
        rows: Option<&[Vec<u32>]>,
        parents: Vec<String>,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let id = self.id_for(step, kind);
        if (kind == CheckpointKind::Full) != rows.is_none()
            || (kind == CheckpointKind::Full) != parents.is_empty()
        {
            return Err(CkptError::Invalid(format!(
                "checkpoint {id}: a full checkpoint has all rows and no parents; a delta has row lists and a parent"
            )));
        }
        let all_rows: Vec<Vec<u32>>;
        let rows = match rows {
            Some(r) => r,
            None => {
                all_rows = state
                    .tables()
                    .iter()
                    .map(|t| (0..t.rows() as u32).collect())
                    .collect();
                &all_rows
            }
        };
        let jobs = chunk_jobs(state, rows, CHUNK_BYTES)?;
        let quant = self.quant_for(state.config());
        let row_bytes: u64 = jobs
            .iter()
            .map(|&(t, _, part)| {
                part.len() as u64 * (4 + quant.row_bytes(state.tables()[t].stride()) as u64)
            })
            .sum();
        self.check_free_space(&format!("checkpoint {id}"), row_bytes + dense_bytes(state))?;
        let parts = Parts::new(self, &id);
        let written = (|| {
            let mut chunks = self.on_io_pool(|| {
                jobs.par_iter()
                    .map(|&(t, n, part)| {
                        let table = &state.tables()[t];
                        let (bytes, crc) =
                            chunk::encode_with_crc(t as u32, table.stride(), quant, part, |r| {
                                table.row(r as usize)
                            })?;
                        let key = format!("data/{id}/t{t:04}-{n:06}.chunk");
                        parts.put(&key, &bytes)?;
                        Ok(FileEntry {
                            key,
                            bytes: bytes.len() as u64,
                            crc32c: crc,
                            table: Some(t as u32),
                            rows: part.len() as u64,
                        })
                    })
                    .collect::<Result<Vec<_>, CkptError>>()
            })?;
            chunks.sort_by(|a, b| a.key.cmp(&b.key));
            let (dense, dense_bytes) = dense_entry(state, &id);
            parts.put(&dense.key, &dense_bytes)?;
            self.store.sync_parts(&format!("data/{id}/"))?;
            let manifest = Manifest {
                id: id.clone(),
                kind,
                step,
                parents,
                created_unix_ms: now_unix_ms(),
                model: state.config().clone(),
                dense,
                chunks,
                trainer,
                incrcp: None,
                deck: None,
                branch: self.branch,
                fence: None,
                quantize: quant,
            };
            self.commit_manifest(&manifest)
        })();
        parts.finish(written)
    }

    /// An object's bytes, read into `bytes`, with the length checked against the manifest;
    /// the caller checks the CRC (chunks combine it from their block checksums while
    /// decoding).
    pub(crate) fn fetch_unchecked(
        &self,
        entry: &FileEntry,
        bytes: &mut Vec<u8>,
    ) -> Result<(), CkptError> {
        self.store.get_into(&entry.key, bytes)?;
        if bytes.len() as u64 != entry.bytes {
            return Err(CkptError::corrupt(
                &self.store.describe(&entry.key),
                format!(
                    "length is {} bytes, manifest says {}",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn fetch(&self, entry: &FileEntry) -> Result<Vec<u8>, CkptError> {
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
}
