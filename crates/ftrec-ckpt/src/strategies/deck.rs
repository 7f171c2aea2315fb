//! DECK (deck.txt §3.2-3.3, §4.3): multi-layer staging of checkpoints (memory -> local
//! disk -> store) in fixed-size chunks, background hierarchical merging, and a lineage
//! retention policy.
//!
//! Training blocks while a checkpoint is copied out of the live tables: chunk by chunk
//! into memory and straight on to the local staging directory. An uploader thread then
//! streams the staged chunks to the store and commits the manifest; a merger thread
//! merges deltas and applies the retention policy. Memory for chunks is one budget of
//! [`RESIDENT_CHUNKS`] shared by the copy, the disk writer and the uploader, so its peak
//! does not depend on the model size.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, channel, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use ftrec_model::ModelState;
use serde::{Deserialize, Serialize};

use crate::engine::dense_entry;
use crate::manifest::{CheckpointKind, FileEntry, Manifest};
use crate::merge::{MergeReport, merge_pass};
use crate::parts::Parts;
use crate::retention::GcReport;
use rayon::prelude::*;

use crate::{Checkpoints, CkptError, chunk};

/// DECK's bound: at most this many chunks in memory at once, whatever the model size.
pub const RESIDENT_CHUNKS: usize = 4;

/// Which older full checkpoints survive a new one, for rolling back past data corruption
/// (deck.txt §4.3). Deltas and merged checkpoints of older bases are always purged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LineagePolicy {
    /// Keep older full checkpoints at least this many steps apart (0 = keep none): from
    /// the oldest, each one at least this far after the previous kept one. Decisions
    /// never change as new checkpoints arrive, so a kept checkpoint stays kept.
    pub keep_full_gap_steps: u64,
    /// Keep at most this many older full checkpoints (the newest of those spaced out).
    pub keep_full_max: u32,
}

impl Default for LineagePolicy {
    fn default() -> Self {
        Self {
            keep_full_gap_steps: 10_000,
            keep_full_max: 3,
        }
    }
}

/// DECK's knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeckOptions {
    /// A new full checkpoint after this many deltas (0 = no fixed interval).
    pub full_every_deltas: u32,
    /// ... or once the live delta volume exceeds this many times one delta (0 = off).
    pub live_factor: f64,
    /// Merge stride s.
    pub stride: u32,
    /// Merge in a background thread of the trainer (off: run `ftrec ckpt merge`).
    pub merge_in_background: bool,
    pub lineage: LineagePolicy,
    /// Local staging directory (default: a fresh directory under the system temp dir).
    pub staging_dir: Option<PathBuf>,
    pub chunk_bytes: usize,
}

impl Default for DeckOptions {
    fn default() -> Self {
        Self {
            full_every_deltas: 0,
            live_factor: 32.0,
            stride: 2,
            merge_in_background: true,
            lineage: LineagePolicy::default(),
            staging_dir: None,
            chunk_bytes: crate::CHUNK_BYTES,
        }
    }
}

impl DeckOptions {
    pub fn validate(&self) -> Result<(), CkptError> {
        if self.stride < 2 {
            return Err(CkptError::Invalid(format!(
                "deck stride {}: must be at least 2",
                self.stride
            )));
        }
        if !(self.live_factor >= 0.0 && self.live_factor.is_finite()) {
            return Err(CkptError::Invalid(format!(
                "deck live_factor {}: must be a non-negative number",
                self.live_factor
            )));
        }
        if self.chunk_bytes == 0 {
            return Err(CkptError::Invalid(
                "deck chunk_bytes must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Counts chunks in memory and blocks whoever would exceed the budget.
struct ChunkBudget {
    state: Mutex<(usize, usize)>,
    freed: Condvar,
    capacity: usize,
}

impl ChunkBudget {
    fn acquire(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 >= self.capacity {
            s = self.freed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.0 += 1;
        s.1 = s.1.max(s.0);
    }

    fn release(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 = s.0.saturating_sub(1);
        self.freed.notify_one();
    }

    fn peak(&self) -> usize {
        self.state.lock().map(|s| s.1).unwrap_or(0)
    }
}

/// A chunk on the local staging disk, waiting for upload.
struct StagedChunk {
    path: PathBuf,
    entry: FileEntry,
}

struct UploadJob {
    manifest: Manifest,
    dense: Vec<u8>,
    dir: PathBuf,
    staged: Vec<StagedChunk>,
}

/// What the background threads did.
#[derive(Debug)]
pub enum DeckEvent {
    Committed {
        manifest: Box<Manifest>,
        upload_seconds: f64,
    },
    Merged(MergeReport),
    Retained(GcReport),
    /// A merge or retention pass failed; the checkpoints it would have replaced remain,
    /// so nothing is lost and the next pass tries again.
    BackgroundFailed(String),
    /// Nothing to do in the background for a committed checkpoint.
    Idle,
}

impl DeckEvent {
    fn is_from_merger(&self) -> bool {
        !matches!(self, DeckEvent::Committed { .. })
    }
}

/// The staging pipeline and its background uploader and merger.
pub struct Stager {
    checkpoints: Checkpoints,
    /// This run's own staging directory, removed on drop.
    root: PathBuf,
    budget: Arc<ChunkBudget>,
    uploads: Option<SyncSender<UploadJob>>,
    events: Receiver<Result<DeckEvent, CkptError>>,
    threads: Vec<JoinHandle<()>>,
    /// Checkpoints staged but not yet reported committed (or failed).
    in_flight: usize,
    /// Committed checkpoints the merger has not reported on yet.
    merger_pending: usize,
}

impl Stager {
    pub fn start(checkpoints: Checkpoints, options: &DeckOptions) -> Result<Self, CkptError> {
        options.validate()?;
        // Each run stages under a directory of its own, named by its pid, so the next
        // start can tell a SIGKILLed run's leftovers (its process is gone) from a live
        // run's and remove them.
        let parent = options
            .staging_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        remove_dead_staging(&parent);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let root = parent.join(format!("{STAGING_PREFIX}{}-{nanos}", std::process::id()));
        fs::create_dir_all(&root).map_err(|e| io(&root, e))?;
        let budget = Arc::new(ChunkBudget {
            state: Mutex::new((0, 0)),
            freed: Condvar::new(),
            capacity: RESIDENT_CHUNKS,
        });
        let (uploads, upload_rx) = sync_channel::<UploadJob>(1);
        let (events_tx, events) = channel();
        let (merge_tx, merge_rx) = channel::<Manifest>();
        let uploader = {
            let (ck, budget, events_tx) = (checkpoints.clone(), budget.clone(), events_tx.clone());
            spawn("deck-uploader", move || {
                upload_loop(&ck, &budget, upload_rx, &events_tx, &merge_tx)
            })?
        };
        let merger = {
            let (ck, options) = (checkpoints.clone(), options.clone());
            spawn("deck-merger", move || {
                merge_loop(&ck, &options, merge_rx, &events_tx)
            })?
        };
        Ok(Self {
            checkpoints,
            root,
            budget,
            uploads: Some(uploads),
            events,
            threads: vec![uploader, merger],
            in_flight: 0,
            merger_pending: 0,
        })
    }

    pub fn checkpoints(&self) -> &Checkpoints {
        &self.checkpoints
    }

    /// The most chunks that were in memory at once so far.
    pub fn peak_resident_chunks(&self) -> usize {
        self.budget.peak()
    }

    /// Copies a checkpoint out of `state` to the staging disk and queues it for upload;
    /// returns once the copy is done. `template` names the checkpoint (its chunks and
    /// dense entry are filled in here); `rows` are the rows per table of a delta, `None`
    /// for a full checkpoint. Blocks first if the uploader already has one queued.
    pub fn stage(
        &mut self,
        state: &ModelState,
        mut template: Manifest,
        rows: Option<&[Vec<u32>]>,
        chunk_bytes: usize,
    ) -> Result<Manifest, CkptError> {
        let tables = state.tables();
        let quant = self.checkpoints.quant_for(state.config());
        if rows.is_some_and(|r| r.len() != tables.len()) {
            return Err(CkptError::Invalid(
                "row lists do not match the tables".into(),
            ));
        }
        let id = template.id.clone();
        let dir = self.root.join(&id);
        fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        // (table, first row, row count or explicit rows) per chunk, in key order.
        let mut specs: Vec<(usize, Vec<u32>)> = Vec::new();
        for (t, table) in tables.iter().enumerate() {
            let per_chunk = (chunk_bytes / (4 + 4 * table.stride())).max(1);
            match rows {
                Some(rows) => {
                    if rows[t].last().is_some_and(|&r| r as usize >= table.rows()) {
                        return Err(CkptError::Invalid(format!("table {t}: row out of range")));
                    }
                    specs.extend(rows[t].chunks(per_chunk).map(|p| (t, p.to_vec())));
                }
                None => {
                    let n = table.rows() as u32;
                    let mut at = 0u32;
                    while at < n {
                        let end = n.min(at.saturating_add(per_chunk as u32));
                        specs.push((t, (at..end).collect()));
                        at = end;
                    }
                }
            }
        }
        let budget = &self.budget;
        let staged = std::thread::scope(|scope| -> Result<Vec<StagedChunk>, CkptError> {
            let (tx, rx) = sync_channel::<(usize, StagedChunk, Vec<u8>)>(1);
            let writer = scope.spawn(move || -> Result<Vec<StagedChunk>, CkptError> {
                let mut staged = Vec::new();
                for (_, chunk, bytes) in rx {
                    let written = write_staged(&chunk.path, &bytes);
                    drop(bytes);
                    budget.release();
                    written?;
                    staged.push(chunk);
                }
                Ok(staged)
            });
            // Chunks are encoded in parallel (the copy out of the live tables is the part
            // training waits for); the budget bounds how many exist at once.
            // A row quantization refuses (beyond fp16) fails the checkpoint once the
            // writer has stopped.
            let refused = std::sync::Mutex::new(None::<CkptError>);
            self.checkpoints.on_io_pool(|| {
                specs
                    .par_iter()
                    .enumerate()
                    .for_each_with(tx, |tx, (n, (t, part))| {
                        budget.acquire();
                        let table = &tables[*t];
                        let encoded =
                            chunk::encode_with_crc(*t as u32, table.stride(), quant, part, |r| {
                                table.row(r as usize)
                            });
                        let (bytes, crc) = match encoded {
                            Ok(encoded) => encoded,
                            Err(e) => {
                                budget.release();
                                *refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                                return;
                            }
                        };
                        let staged = StagedChunk {
                            path: dir.join(format!("{n:06}.chunk")),
                            entry: FileEntry {
                                key: format!("data/{id}/t{t:04}-{n:06}.chunk"),
                                bytes: bytes.len() as u64,
                                crc32c: crc,
                                table: Some(*t as u32),
                                rows: part.len() as u64,
                            },
                        };
                        if tx.send((n, staged, bytes)).is_err() {
                            budget.release(); // the writer failed; its error is returned below
                        }
                    });
            });
            let mut staged = writer
                .join()
                .map_err(|_| CkptError::Invalid("staging writer panicked".into()))??;
            if let Some(e) = refused.into_inner().unwrap_or_else(|p| p.into_inner()) {
                return Err(e);
            }
            // The manifest lists chunks in key order.
            staged.sort_by(|a, b| a.entry.key.cmp(&b.entry.key));
            Ok(staged)
        })?;
        let (dense, dense_bytes) = dense_entry(state, &id);
        template.dense = dense;
        template.chunks = staged.iter().map(|s| s.entry.clone()).collect();
        let manifest = template.clone();
        let job = UploadJob {
            manifest: template,
            dense: dense_bytes,
            dir,
            staged,
        };
        self.uploads
            .as_ref()
            .and_then(|u| u.send(job).ok())
            .ok_or_else(|| CkptError::Invalid("the deck uploader has stopped".into()))?;
        self.in_flight += 1;
        Ok(manifest)
    }

    /// Events so far, without waiting.
    pub fn poll(&mut self) -> Vec<Result<DeckEvent, CkptError>> {
        let mut out = Vec::new();
        loop {
            match self.events.try_recv() {
                Ok(e) => {
                    self.count(&e);
                    out.push(e);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    if self.in_flight > 0 {
                        self.in_flight = 0;
                        out.push(Err(CkptError::Invalid("the deck uploader stopped".into())));
                    }
                    break;
                }
            }
        }
        out
    }

    fn count(&mut self, e: &Result<DeckEvent, CkptError>) {
        match e {
            Ok(e) if e.is_from_merger() => {
                self.merger_pending = self.merger_pending.saturating_sub(1)
            }
            Ok(_) => {
                self.in_flight = self.in_flight.saturating_sub(1);
                self.merger_pending += 1;
            }
            Err(_) => self.in_flight = self.in_flight.saturating_sub(1),
        }
    }

    /// Waits until every staged checkpoint is committed (merges may still run).
    pub fn wait_committed(&mut self) -> Vec<Result<DeckEvent, CkptError>> {
        self.wait(false)
    }

    /// Waits until every staged checkpoint is committed and the merger has finished
    /// with all of them.
    pub fn wait_idle(&mut self) -> Vec<Result<DeckEvent, CkptError>> {
        self.wait(true)
    }

    fn wait(&mut self, merges_too: bool) -> Vec<Result<DeckEvent, CkptError>> {
        let mut out = self.poll();
        while self.in_flight > 0 || (merges_too && self.merger_pending > 0) {
            match self.events.recv() {
                Ok(e) => {
                    self.count(&e);
                    out.push(e);
                }
                Err(_) => {
                    self.in_flight = 0;
                    self.merger_pending = 0;
                    out.push(Err(CkptError::Invalid("the deck uploader stopped".into())));
                }
            }
        }
        out
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        // Closing the upload queue lets the uploader drain it, which closes the merger's.
        self.uploads = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, CkptError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| CkptError::Invalid(format!("cannot start {name}: {e}")))
}

fn io(path: &Path, error: std::io::Error) -> CkptError {
    CkptError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// The name of a run's staging directory starts with this, then `<pid>-<nanos>`.
const STAGING_PREFIX: &str = "ftrec-staging-";

/// Removes the staging directories under `parent` whose process no longer runs: staged
/// chunks are not durable and are useless once their run is gone (the checkpoint they
/// belonged to was never committed).
fn remove_dead_staging(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(STAGING_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            match fs::remove_dir_all(entry.path()) {
                Ok(()) => tracing::info!(
                    "removed {}, the staging directory of a run that died",
                    entry.path().display()
                ),
                Err(e) => tracing::warn!("could not remove {}: {e}", entry.path().display()),
            }
        }
    }
}

/// Staging is not the commit (the store upload is), so no fsync: the page cache is the
/// fast layer that lets training resume.
fn write_staged(path: &Path, bytes: &[u8]) -> Result<(), CkptError> {
    fs::File::create(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| io(path, e))
}

fn upload_loop(
    ck: &Checkpoints,
    budget: &ChunkBudget,
    jobs: Receiver<UploadJob>,
    events: &std::sync::mpsc::Sender<Result<DeckEvent, CkptError>>,
    merger: &std::sync::mpsc::Sender<Manifest>,
) {
    // After a failed upload the deltas that follow have a gap under them: refuse them
    // until the next full checkpoint.
    let mut broken = false;
    for job in jobs {
        let start = Instant::now();
        let result = if broken && job.manifest.kind != CheckpointKind::Full {
            Err(CkptError::Invalid(format!(
                "checkpoint {} skipped: an earlier upload of its lineage failed",
                job.manifest.id
            )))
        } else {
            upload(ck, budget, &job)
        };
        let _ = fs::remove_dir_all(&job.dir);
        match result {
            Ok(committed) => {
                broken = false;
                // Committed is reported before the merger hears of it, so its own report
                // always comes later.
                let _ = events.send(Ok(DeckEvent::Committed {
                    manifest: Box::new(committed.clone()),
                    upload_seconds: start.elapsed().as_secs_f64(),
                }));
                let _ = merger.send(committed);
            }
            Err(e) => {
                broken = true;
                let _ = events.send(Err(e));
            }
        }
    }
}

fn upload(ck: &Checkpoints, budget: &ChunkBudget, job: &UploadJob) -> Result<Manifest, CkptError> {
    let parts = Parts::new(ck, &job.manifest.id);
    let uploaded = upload_parts(ck, &parts, budget, job);
    parts.finish(uploaded)
}

fn upload_parts(
    ck: &Checkpoints,
    parts: &Parts,
    budget: &ChunkBudget,
    job: &UploadJob,
) -> Result<Manifest, CkptError> {
    for s in &job.staged {
        budget.acquire();
        let result = fs::read(&s.path)
            .map_err(|e| io(&s.path, e))
            .and_then(|bytes| {
                // The staging disk is not trusted blindly either.
                if crc32c::crc32c(&bytes) != s.entry.crc32c {
                    return Err(CkptError::corrupt(
                        &s.path.display().to_string(),
                        "staged chunk changed on the local disk",
                    ));
                }
                parts.put(&s.entry.key, &bytes)
            });
        budget.release();
        result?;
    }
    parts.put(&job.manifest.dense.key, &job.dense)?;
    ck.store()
        .sync_parts(&format!("data/{}/", job.manifest.id))?;
    ck.commit_manifest(&job.manifest)
}

fn merge_loop(
    ck: &Checkpoints,
    options: &DeckOptions,
    committed: Receiver<Manifest>,
    events: &std::sync::mpsc::Sender<Result<DeckEvent, CkptError>>,
) {
    for m in committed {
        let result = match (m.kind, m.parents.first()) {
            (CheckpointKind::Full, _) => match retain_lineage(ck, &m.id, options.lineage) {
                // A merger or gc holds the location; the next full checkpoint tries again.
                Err(CkptError::Busy(why)) => {
                    tracing::debug!("deck: retention after {} skipped: {why}", m.id);
                    Ok(DeckEvent::Idle)
                }
                other => other.map(DeckEvent::Retained),
            },
            (_, Some(base)) if options.merge_in_background => {
                match merge_pass(ck, base, options.stride, options.chunk_bytes) {
                    // `ftrec ckpt merge` (or gc) is at work; the next delta tries again.
                    Err(CkptError::Busy(why)) => {
                        tracing::debug!("deck: merge after {} skipped: {why}", m.id);
                        Ok(DeckEvent::Idle)
                    }
                    other => other.map(DeckEvent::Merged),
                }
            }
            _ => Ok(DeckEvent::Idle),
        };
        let event = result.unwrap_or_else(|e| {
            tracing::warn!("deck: background pass after {} failed: {e}", m.id);
            DeckEvent::BackgroundFailed(format!("after {}: {e}", m.id))
        });
        if events.send(Ok(event)).is_err() {
            return;
        }
    }
}

/// Applies the lineage policy once `current` (a full checkpoint) is committed: the
/// deltas and merged checkpoints of older bases go, and of the older full checkpoints
/// only those spaced `keep_full_gap_steps` apart (the newest `keep_full_max`) stay.
pub fn retain_lineage(
    ck: &Checkpoints,
    current: &str,
    policy: LineagePolicy,
) -> Result<GcReport, CkptError> {
    // Deletes only under the merger lease, as gc and merges do: none of them may see a
    // checkpoint vanish halfway through its own work.
    let _lease = crate::merge::merger_lease(ck)?;
    // The policy works within the current base's branch: another branch's history is
    // never DECK's to thin out.
    let branch = crate::branch::branch_of_id(current);
    let all: Vec<Manifest> = ck
        .list_readable()?
        .into_iter()
        .filter(|m| m.branch == branch)
        .collect();
    let fulls: Vec<&Manifest> = all
        .iter()
        .filter(|m| m.kind == CheckpointKind::Full)
        .collect();
    let Some(current_at) = fulls.iter().position(|m| m.id == current) else {
        return Err(CkptError::NotFound(format!("full checkpoint {current}")));
    };
    let mut spaced: Vec<&Manifest> = Vec::new();
    if policy.keep_full_gap_steps > 0 {
        for m in &fulls[..current_at] {
            if spaced
                .last()
                .is_none_or(|k| m.step >= k.step + policy.keep_full_gap_steps)
            {
                spaced.push(m);
            }
        }
    }
    let kept_old: Vec<&str> = spaced
        .iter()
        .rev()
        .take(policy.keep_full_max as usize)
        .map(|m| m.id.as_str())
        .collect();
    let protected = ck.protected()?;
    let mut report = GcReport::default();
    for m in &all {
        let older_base = m.deck.is_some() && m.parents.first().is_some_and(|b| b != current);
        // A full checkpoint another strategy's delta builds on is not DECK's to drop.
        let old_full = m.kind == CheckpointKind::Full
            && m.step < fulls[current_at].step
            && !kept_old.contains(&m.id.as_str())
            && !all
                .iter()
                .any(|x| x.deck.is_none() && x.parents.contains(&m.id));
        // Only DECK's own checkpoints and the full ones older than the current base, and
        // none that is pinned or that a pinned one's restore reads.
        if (older_base || old_full) && !protected.contains(&m.id) {
            ck.delete_checkpoint(m)?;
            report.checkpoints.push(m.id.clone());
        }
    }
    Ok(report)
}
