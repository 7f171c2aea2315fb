//! `ftrec ckpt ...`: inspect, verify and restore checkpoints.

use clap::{Subcommand, ValueEnum};
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use ftrec_ckpt::merge::merge_all;
use ftrec_ckpt::{
    CHUNK_BYTES, CheckpointKind, Checkpoints, GcOptions, Manifest, export_safetensors, open_store,
};
use ftrec_train::{Progress, snapshot};
use serde_json::json;

mod cluster;

#[derive(Subcommand, Debug)]
pub enum CkptCommand {
    /// List committed checkpoints.
    Ls {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Print a checkpoint's manifest.
    Show { dir: PathBuf, id: String },
    /// Check everything a restore of one checkpoint (or of each) reads, its whole lineage
    /// included; exits non-zero on any damage.
    Verify {
        dir: PathBuf,
        id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Export a checkpoint (newest by default) as named tensors.
    Export {
        dir: PathBuf,
        #[arg(long)]
        id: Option<String>,
        #[arg(long, value_enum, default_value_t = ExportFormat::Safetensors)]
        format: ExportFormat,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Merge DECK deltas hierarchically (stride s), as the trainer's background merger
    /// does; run it on any host that reaches the store, e.g. with
    /// `checkpoint.deck.merge_in_background = false` in the trainer.
    Merge {
        dir: PathBuf,
        #[arg(long, default_value_t = 2)]
        stride: u32,
        /// Keep merging as new deltas arrive, checking every this many seconds.
        #[arg(long)]
        watch: Option<f64>,
        #[arg(long)]
        json: bool,
    },
    /// Delete checkpoints not retained and the data of crashed writes.
    Gc {
        dir: PathBuf,
        /// Keep the newest N checkpoints of every branch (and every checkpoint their
        /// restore needs).
        #[arg(long)]
        keep: Option<usize>,
        /// Delete branch B entirely (repeatable): the explicit way to drop a branch.
        #[arg(long = "drop-branch", value_name = "B")]
        drop_branch: Vec<u32>,
        /// While a writer holds the location, uncommitted data this old (seconds) is
        /// taken as abandoned; without a live writer, all uncommitted data is.
        #[arg(long, default_value_t = 3600.0)]
        abandoned_after: f64,
        /// While a merger holds the location, try again for up to this many seconds
        /// rather than fail at once: a merger that watches with a short period would
        /// otherwise hold the lease at nearly every instant gc looks.
        #[arg(long, default_value_t = 0.0)]
        wait: f64,
        #[arg(long)]
        json: bool,
    },
    /// Restore a checkpoint (newest by default): report its state digest and the restore
    /// time, and with `--out` save it as a model snapshot file.
    Restore {
        dir: PathBuf,
        #[arg(long)]
        id: Option<String>,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    /// Loadable by Python's `safetensors` and PyTorch; names in FORMAT.md.
    Safetensors,
}

/// `DIR` or `DIR@ID`. A path that exists as given is taken whole, so directories whose
/// names contain `@` still work.
pub fn parse_location(spec: &str) -> (PathBuf, Option<String>) {
    if Path::new(spec).exists() || (spec.contains("://") && !spec.contains('@')) {
        return (PathBuf::from(spec), None);
    }
    match spec.rsplit_once('@') {
        Some((dir, id)) if !id.is_empty() => (PathBuf::from(dir), Some(id.to_string())),
        _ => (PathBuf::from(spec), None),
    }
}

/// A checkpoint location: a local directory that must exist, or an `s3://` URL.
fn open(dir: &Path) -> Result<Checkpoints> {
    let location = dir.to_string_lossy();
    if !location.contains("://") && !dir.is_dir() {
        bail!("{}: no such checkpoint directory", dir.display());
    }
    Ok(Checkpoints::new(open_store(&location)?))
}

/// The given checkpoint id, or the newest one.
fn resolve(ck: &Checkpoints, dir: &Path, id: Option<String>) -> Result<String> {
    match id {
        Some(id) => Ok(id),
        None => match ck.latest()? {
            Some(m) => Ok(m.id),
            None => bail!("{}: no checkpoints", dir.display()),
        },
    }
}

fn summary(m: &Manifest) -> serde_json::Value {
    json!({
        "id": m.id, "kind": m.kind, "step": m.step, "parents": m.parents,
        "bytes": m.bytes(), "time": m.created_unix_ms as f64 / 1e3, "branch": m.branch,
    })
}

/// Refuses a location with nothing in it: an empty `ls`, `verify` or `gc` is more often a
/// wrong path than a fact worth exit code 0.
fn require_history(dir: &Path, good: usize, damaged: usize) -> Result<()> {
    if good + damaged == 0 {
        bail!("{}: no checkpoints here", dir.display());
    }
    Ok(())
}

/// What `ckpt ls` reads of one location: the readable manifests, the damaged ones with
/// their errors, and the branch records.
struct Listing {
    all: Vec<Manifest>,
    damaged: Vec<(String, ftrec_ckpt::CkptError)>,
    branches: Vec<ftrec_ckpt::branch::BranchRecord>,
}

impl Listing {
    fn read(dir: &Path) -> Result<Self> {
        let ck = open(dir)?;
        let (all, damaged) = ck.list_lenient()?;
        require_history(dir, all.len(), damaged.len())?;
        let branches = ftrec_ckpt::branch::list(ck.store())?;
        Ok(Self {
            all,
            damaged,
            branches,
        })
    }

    /// `--json`'s entries: one per checkpoint, each with its branch and where that branch
    /// forked; a damaged manifest is an entry with its error.
    fn entries(&self) -> Vec<serde_json::Value> {
        let fork_of = |b: u32| {
            self.branches
                .iter()
                .find(|r| r.branch == b)
                .and_then(|r| r.parent.as_ref())
                .map(|f| f.checkpoint.clone())
        };
        let mut entries: Vec<serde_json::Value> = self
            .all
            .iter()
            .map(|m| {
                let mut e = summary(m);
                e["branch_forked_from"] = json!(fork_of(m.branch));
                e
            })
            .collect();
        entries.extend(
            self.damaged
                .iter()
                .map(|(id, e)| json!({"id": id, "error": e.to_string()})),
        );
        entries
    }

    /// The text listing: each branch with where it forked, then its checkpoints; each
    /// damaged manifest with its error.
    fn print(&self) -> Result<()> {
        let mut numbers: Vec<u32> = self.all.iter().map(|m| m.branch).collect();
        numbers.extend(self.branches.iter().map(|b| b.branch));
        numbers.sort_unstable();
        numbers.dedup();
        for b in numbers {
            let record = self.branches.iter().find(|r| r.branch == b);
            let origin = match record.and_then(|r| r.parent.as_ref()) {
                Some(f) => format!("forked from {} (branch {})", f.checkpoint, f.branch),
                None => "independent".into(),
            };
            outln!("branch {b}: {origin}");
            for m in self.all.iter().filter(|m| m.branch == b) {
                outln!(
                    "  {}  {:?}  step {:>8}  {:>12} bytes",
                    m.id,
                    m.kind,
                    m.step,
                    m.bytes()
                );
            }
        }
        for (id, e) in &self.damaged {
            outln!("{id}: DAMAGED MANIFEST: {e}");
        }
        Ok(())
    }

    /// Fails, after the listing was shown, when a manifest is damaged.
    fn check(&self) -> Result<()> {
        if !self.damaged.is_empty() {
            bail!("{} manifests are damaged", self.damaged.len());
        }
        Ok(())
    }
}

/// `ckpt ls` of a cluster's location: every server's checkpoints, then the cuts, each
/// with the number of servers holding a part of it. Only a complete cut (every server's
/// part) can be exported or rolled back to. `--json`: one object, `servers` (each
/// location and its entries) and `cuts` (`step`, `servers`, `complete`). Each location
/// is read once, for its listing and the cuts.
fn list_cluster(servers: &[String], json: bool) -> Result<()> {
    if json {
        let listings: Vec<Listing> = servers
            .iter()
            .map(|l| Listing::read(Path::new(l)))
            .collect::<Result<_>>()?;
        let listed: Vec<serde_json::Value> = servers
            .iter()
            .zip(&listings)
            .map(|(location, l)| json!({"location": location, "checkpoints": l.entries()}))
            .collect();
        let all: Vec<Vec<Manifest>> = listings.iter().map(|l| l.all.clone()).collect();
        let cuts: Vec<serde_json::Value> = ftrec_cluster::resume::cuts_of(&all)
            .iter()
            .map(|c| {
                json!({"step": c.step, "servers": c.servers, "held": c.parts.len(),
                       "complete": c.complete()})
            })
            .collect();
        outln!("{}", json!({"servers": listed, "cuts": cuts}));
        let damaged: usize = listings.iter().map(|l| l.damaged.len()).sum();
        if damaged > 0 {
            bail!("{damaged} manifests are damaged");
        }
        return Ok(());
    }
    // Each server listed under its header, the others still listed when one fails.
    let all = std::cell::RefCell::new(vec![Vec::new(); servers.len()]);
    let index = std::cell::Cell::new(0);
    cluster::each_server(servers, |d| {
        let i = index.replace(index.get() + 1);
        let listing = Listing::read(d)?;
        all.borrow_mut()[i] = listing.all.clone();
        listing.print()?;
        listing.check()
    })?;
    outln!("cuts (parts held / the servers of the job that wrote them):");
    for c in ftrec_cluster::resume::cuts_of(&all.into_inner()) {
        let state = if c.complete() {
            "complete".to_string()
        } else {
            format!("incomplete: servers {:?} hold no part", c.missing())
        };
        outln!(
            "  step {:>8}  {}/{} servers  {state}",
            c.step,
            c.parts.len(),
            c.servers
        );
    }
    Ok(())
}

/// `ckpt ls`: the branches (with where each forked), then every checkpoint by branch;
/// a damaged manifest is reported and the rest still listed.
fn list(dir: &Path, json: bool) -> Result<()> {
    let listing = Listing::read(dir)?;
    if json {
        outln!("{}", serde_json::to_string(&listing.entries())?);
    } else {
        listing.print()?;
    }
    listing.check()
}

/// What a restore of an IncrCP checkpoint reads: its rectangle of the 2-D chunk list.
fn rectangle_summary(ck: &Checkpoints, m: &Manifest) -> Result<serde_json::Value> {
    let (list, column) = ck.incrcp_list(m)?;
    let newest = list.columns.len().saturating_sub(1) as u32;
    let rect = list.rectangle(column);
    let files: std::collections::BTreeSet<&str> = rect.iter().map(|c| c.key.as_str()).collect();
    Ok(json!({
        "list_version": list.version,
        "column": column,
        "width": column + 1,
        "depth": rect.iter().map(|c| c.depth(newest) + 1).max().unwrap_or(0),
        "chunks": rect.len(),
        "files": files.len(),
        "rows": rect.iter().map(|c| c.rows).sum::<u64>(),
        "bytes": rect.iter().map(|c| c.len).sum::<u64>(),
    }))
}

/// `ckpt verify`: everything a restore of `id` (or of every checkpoint) reads.
fn verify(dir: &Path, id: Option<String>, json: bool) -> Result<()> {
    let ck = open(dir)?;
    let results = match id {
        Some(id) => {
            let result = ck.verify(&id).map(|_| ());
            vec![(id, result)]
        }
        None => {
            let results = ck.verify_all()?;
            require_history(dir, results.len(), 0)?;
            results
        }
    };
    let ids: Vec<&String> = results.iter().map(|(id, _)| id).collect();
    let mut failures = Vec::new();
    for (id, result) in &results {
        match result {
            Ok(()) => {
                if !json {
                    outln!("{id}: ok");
                }
            }
            Err(e) => {
                if !json {
                    outln!("{id}: DAMAGED: {e}");
                }
                failures.push(json!({"id": id, "error": e.to_string()}));
            }
        }
    }
    if json {
        outln!("{}", json!({"checked": ids.len(), "damaged": failures}));
    }
    if !failures.is_empty() {
        bail!(
            "{} of {} checkpoints are damaged",
            failures.len(),
            ids.len()
        );
    }
    Ok(())
}

pub fn run(command: CkptCommand) -> Result<()> {
    match command {
        CkptCommand::Ls { dir, json } => match cluster::servers_of(&dir)? {
            Some(servers) => list_cluster(&servers, json)?,
            None => list(&dir, json)?,
        },
        CkptCommand::Show { dir, id } => {
            let ck = open(&dir)?;
            let m = ck.manifest(&id)?;
            let mut shown = serde_json::to_value(&m)?;
            if m.kind == CheckpointKind::Incrcp {
                shown["incrcp_rectangle"] = rectangle_summary(&ck, &m)?;
            }
            outln!("{}", serde_json::to_string_pretty(&shown)?);
        }
        CkptCommand::Verify { dir, id, json } => match cluster::servers_of(&dir)? {
            Some(servers) => cluster::each_server(&servers, |d| verify(d, id.clone(), json))?,
            None => verify(&dir, id, json)?,
        },
        CkptCommand::Export {
            dir,
            id,
            format: ExportFormat::Safetensors,
            out,
            json,
        } => {
            let (id, state, step) = match cluster::servers_of(&dir)? {
                // One global model from the servers' parts of a cut (`--id STEP`, or the
                // newest cut every server holds).
                Some(servers) => cluster::restore_cut(&servers, id.as_deref())?,
                None => {
                    let ck = open(&dir)?;
                    let id = resolve(&ck, &dir, id)?;
                    let (state, manifest) = ck.restore(&id)?;
                    (id, state, manifest.step)
                }
            };
            let tensors = export_safetensors(&state, step, &out)?;
            if json {
                outln!(
                    "{}",
                    json!({"id": id, "out": out, "tensors": tensors.len(),
                           "state_digest": state.digest().to_string()})
                );
            } else {
                outln!(
                    "exported {id} as {} tensors to {}",
                    tensors.len(),
                    out.display()
                );
            }
        }
        CkptCommand::Merge {
            dir,
            stride,
            watch,
            json,
        } => {
            // A cluster location merges each server's history in turn, every round.
            let locations = cluster::servers_of(&dir)?
                .unwrap_or_else(|| vec![dir.to_string_lossy().into_owned()]);
            let cks = locations
                .iter()
                .map(|l| open(Path::new(l)))
                .collect::<Result<Vec<_>>>()?;
            loop {
                for ck in &cks {
                    let report = match merge_all(ck, stride, CHUNK_BYTES) {
                        Ok(r) => r,
                        // Another merger (the trainer's, or gc) is at work: wait for the next
                        // round when watching, else say who holds the location.
                        Err(ftrec_ckpt::CkptError::Busy(why)) if watch.is_some() => {
                            tracing::info!("merge skipped: {why}");
                            ftrec_ckpt::merge::MergeReport::default()
                        }
                        Err(e) => return Err(e.into()),
                    };
                    if json {
                        outln!(
                            "{}",
                            json!({"merged": report.merged, "deleted": report.deleted,
                               "bytes_in": report.bytes_in, "bytes_out": report.bytes_out,
                               "seconds": report.seconds,
                               "bytes_per_second": report.bytes_per_second()})
                        );
                    } else if !report.merged.is_empty() || watch.is_none() {
                        outln!(
                            "merged {} checkpoints into {} ({} MB read at {:.0} MB/s)",
                            report.deleted.len(),
                            report.merged.len(),
                            report.bytes_in / 1_000_000,
                            report.bytes_per_second() / 1e6
                        );
                    }
                }
                match watch {
                    Some(seconds) => {
                        std::thread::sleep(std::time::Duration::from_secs_f64(seconds.max(0.01)))
                    }
                    None => break,
                }
            }
        }
        CkptCommand::Gc {
            dir,
            keep,
            drop_branch,
            abandoned_after,
            wait,
            json,
        } => {
            let ck = open(&dir)?;
            let (all, damaged) = ck.list_lenient()?;
            require_history(&dir, all.len(), damaged.len())?;
            for (id, e) in &damaged {
                eprintln!("{id}: damaged manifest, its data is kept: {e}");
            }
            let options = GcOptions {
                keep,
                drop_branches: drop_branch,
                abandoned_after: std::time::Duration::from_secs_f64(abandoned_after.max(0.0)),
                keep_ids: None,
            };
            let deadline =
                std::time::Instant::now() + std::time::Duration::from_secs_f64(wait.max(0.0));
            let report = loop {
                match ck.gc_with(&options) {
                    Err(ftrec_ckpt::CkptError::Busy(why))
                        if std::time::Instant::now() < deadline =>
                    {
                        tracing::debug!("gc waits: {why}");
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                    other => break other?,
                }
            };
            if json {
                outln!("{}", serde_json::to_string(&report)?);
            } else {
                outln!(
                    "removed {} checkpoints ({}) and {} files; kept {} files of writes in progress",
                    report.checkpoints.len(),
                    report.checkpoints.join(", "),
                    report.files,
                    report.kept_in_flight
                );
            }
        }
        CkptCommand::Restore { dir, id, out, json } => {
            let ck = open(&dir)?;
            let id = resolve(&ck, &dir, id)?;
            let started = std::time::Instant::now();
            let (state, manifest) = ck.restore(&id)?;
            let seconds = started.elapsed().as_secs_f64();
            let chain = ck.lineage(&id)?.len();
            let digest = state.digest().to_string();
            if let Some(out) = &out {
                let progress: Progress =
                    serde_json::from_value(manifest.trainer.clone()).unwrap_or_default();
                snapshot::save(out, &state, progress)?;
            }
            if json {
                outln!(
                    "{}",
                    json!({"id": id, "step": manifest.step, "state_digest": digest,
                           "restore_seconds": seconds, "checkpoints_read": chain, "out": out})
                );
            } else {
                outln!(
                    "restored {id} (step {}, {chain} checkpoints read) in {seconds:.2}s: state digest {digest}",
                    manifest.step
                );
            }
        }
    }
    Ok(())
}
