//! `ftrec cluster run|kill|scale`, `ftrec server|worker|coordinator` and `ftrec plot timeline`.

use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ftrec_cluster::launch::{self, KillSpec, LaunchOptions, LaunchReport};
use ftrec_proto::proto::KillRequest;
use ftrec_proto::timeline::TimelineData;
use ftrec_rpc::leader::CoordinatorSource;
use ftrec_rpc::{Job, client};
use ftrec_server::ServerOptions;
use ftrec_worker::WorkerOptions;

pub mod auto;
mod coordinator;
mod resume;
mod scale;
mod survivor_spare;
mod verify;

pub use auto::FtArg;
use auto::choose_ft;
pub use coordinator::{CoordinatorArgs, coordinator};
use verify::print_mismatches;
pub use verify::verify_parity;

use crate::commands::config::{ConfigArgs, load_config, run_overrides};
use crate::output::print_json;
use crate::progress::bar;

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Launch servers and workers as separate processes on loopback and train.
    Run(Box<ClusterRunArgs>),
    /// SIGKILL a member of a running cluster, e.g. `server:1`.
    Kill {
        /// The coordinator's address (printed by `cluster run`).
        #[arg(long)]
        coordinator: String,
        /// The job file (`RUN_DIR/job.toml`, printed by `cluster run`): its secret admits
        /// the call. Not needed when `FTREC_JOB_SECRET` is set.
        #[arg(long)]
        job: Option<PathBuf>,
        /// `server:ID` or `worker:ID`.
        member: String,
    },
    /// Move a running job to another number of servers, at its next step boundary and
    /// through a consistent cut; training goes on where it stopped (`--ft checkpoint`,
    /// `partial` or `ec+checkpoint`).
    Scale(scale::ScaleArgs),
    /// Scrub a running erasure-coded cluster without stopping it: every stripe's parity
    /// re-encoded from its data rows and compared, every dense replica with its primary,
    /// each range read at equal applied steps on every server. Exits non-zero when a
    /// mismatch is found (each is named) or a range never settled.
    VerifyParity(VerifyParityArgs),
}

#[derive(Args, Debug)]
pub struct VerifyParityArgs {
    /// The coordinator's address (printed by `cluster run`).
    #[arg(long)]
    pub coordinator: String,
    /// The job file (`RUN_DIR/job.toml`): the layout to check, and the secret that
    /// admits the calls.
    #[arg(long)]
    pub job: PathBuf,
    /// Stripes of one group read at once.
    #[arg(long, default_value_t = 256)]
    pub range: usize,
    /// Reads of a range before it is reported unsettled (its servers never answered at
    /// the same applied steps).
    #[arg(long, default_value_t = 200)]
    pub attempts: u32,
    /// Print the report as JSON: stripes, parity_mismatches, replica_mismatches,
    /// parity_mismatch_details, unsettled, unsettled_details, epoch, ranges, rereads,
    /// unconfirmed, first_applied, last_applied, seconds.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ClusterRunArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Dataset directory (overrides data.dir).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Total steps over all workers (overrides train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Parameter servers (overrides cluster.servers).
    #[arg(long)]
    pub servers: Option<usize>,
    /// Workers (overrides cluster.workers).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Fault tolerance: none, checkpoint, ec, ec+checkpoint, partial (overrides cluster.ft),
    /// or auto: chosen with its interval from costs measured before the start and --mtbf.
    #[arg(long, value_parser = str::parse::<FtArg>)]
    pub ft: Option<FtArg>,
    /// With --ft auto: the cluster's mean time between failures, seconds (default: one
    /// failure per server per week).
    #[arg(long, requires = "ft")]
    pub mtbf: Option<f64>,
    /// With --ft auto: where calibrations are kept per job fingerprint (default:
    /// $FTREC_CACHE_DIR, else $XDG_CACHE_HOME/ftrec, else ~/.cache/ftrec; `none`: keep
    /// none).
    #[arg(long, value_name = "DIR", requires = "ft")]
    pub calibration_cache: Option<PathBuf>,
    /// With --ft auto: calibrate again even where this job's calibration is cached.
    #[arg(long, requires = "ft")]
    pub recalibrate: bool,
    /// With --ft auto: steps of each of the calibration's runs (default: an eighth of the
    /// job's, between 20 and 60).
    #[arg(long, value_name = "N", requires = "ft")]
    pub calibration_steps: Option<u64>,
    /// Steps in strict order: bit-reproducible (overrides cluster.deterministic).
    #[arg(long)]
    pub deterministic: bool,
    /// SIGKILL `ROLE:ID` this long after training starts, e.g. `server:1@10s` (repeatable).
    /// With --etcd, `coordinator@T` SIGKILLs whichever coordinator leads at T, and
    /// `coordinator@rebuild` the leader as soon as a server rebuilds in the background.
    #[arg(long = "kill", value_name = "ROLE:ID@SECONDS")]
    pub kills: Vec<String>,
    /// Move the job to SERVERS servers once step STEP is reached, as `ftrec cluster scale`
    /// would (repeatable), e.g. `80:5`: the move's cut is at step 80 when a cut may start
    /// there.
    #[arg(long = "scale-at", value_name = "STEP:SERVERS", value_parser = scale::parse_scale_at)]
    pub scale_at: Vec<(u64, usize)>,
    /// Arm a fault point in a server, `server:J@POINT[:STEP][=ACTION]` (repeatable):
    /// prepare and commit (kill, delay-MS), rebuild, cut, restore and load (kill),
    /// fold-parity (skip, flip), install (flip, delay-MS) or send-rows (delay-MS); another
    /// action is refused. `server:1@fold-parity:20=skip` drops one parity difference,
    /// `=flip` folds it with a bit flipped; `server:2@install:20=flip` flips a bit of a row
    /// step 20 installs: planted bugs the parity checks must report; `install:20=delay-MS`
    /// holds the job at step 20.
    #[arg(long = "fault", value_name = "server:J@SPEC")]
    pub faults: Vec<String>,
    /// Spare servers to start; a failed server's slot goes to a spare before a new process.
    #[arg(long, default_value_t = 0)]
    pub spares: usize,
    /// Keep the job's membership, epoch and cuts in etcd at these endpoints
    /// (`host:port[,host:port...]`), with the coordinators as processes of their own.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// With --etcd: coordinator processes (one leads, the rest stand by).
    #[arg(long, default_value_t = 2, requires = "etcd")]
    pub coordinators: usize,
    /// Checkpoint directory for `--ft checkpoint` (default: RUN_DIR/checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Job file, process logs, timeline CSV/JSON (default: a new temporary directory).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3600.0)]
    pub time_limit: f64,
    /// Skip the final evaluation on the test split.
    #[arg(long)]
    pub no_eval: bool,
    /// Write the final model to this snapshot file (`.ftm`, as `train --save`) once the
    /// last step has committed, under every `--ft`; `ftrec eval --model FILE` reads it.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Start from a cut of an earlier job, `CKDIR` (its newest cut that every server
    /// committed) or `CKDIR@STEP`, where `CKDIR` is that job's checkpoint directory or
    /// object-store location. `--servers` and `--workers` may differ from that job's: the
    /// rows are re-placed. Training goes on at the cut's step up to `--steps`; new cuts go
    /// to CKDIR unless `--checkpoint-dir` says otherwise (on a branch of their own, so
    /// nothing there is overwritten). Sets cluster.resume_from.
    #[arg(long, value_name = "CKDIR[@STEP]")]
    pub resume: Option<String>,
    /// With --resume: a damaged cut is passed over for the newest older one that is whole.
    #[arg(long, requires = "resume")]
    pub fallback: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ServerArgs {
    /// The job file `cluster run` writes (a TOML training configuration).
    #[arg(long)]
    pub job: PathBuf,
    #[command(flatten)]
    pub coordinator: CoordinatorArg,
    /// Server slot; omit with `--spare`.
    #[arg(long, required_unless_present = "spare")]
    pub id: Option<usize>,
    /// Join as a standby that takes over a failed server's slot.
    #[arg(long, conflicts_with = "id")]
    pub spare: bool,
    /// Interface to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// A spare that live server ID started on its host because a lost slot waited with no
    /// replacement (the coordinator asks for it; see cluster.survivor_spare_after_s). The
    /// slot it takes moves to a spare from elsewhere once one joins (`ec` jobs).
    #[arg(long, requires = "spare", value_name = "ID")]
    pub hosted_by: Option<usize>,
    /// Arm a fault point in this server, NAME[:STEP][=ACTION] (the points and actions of
    /// `cluster run --fault`); it fires once. `cluster run --kill server:J@commit:N` passes
    /// these.
    #[arg(long = "fault", value_name = "SPEC")]
    pub faults: Vec<String>,
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    pub job: PathBuf,
    #[command(flatten)]
    pub coordinator: CoordinatorArg,
    #[arg(long)]
    pub id: usize,
    /// Arm a fault point in this worker, NAME[:STEP][=kill] (push: before it
    /// sends step N; prepared: once every server prepared step N, before any commit); it
    /// fires once.
    #[arg(long = "fault", value_name = "SPEC")]
    pub faults: Vec<String>,
}

/// How a server or worker finds its coordinator: one address, or the job's leader in etcd.
#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct CoordinatorArg {
    /// The coordinator's address (embedded membership).
    #[arg(long)]
    pub coordinator: Option<String>,
    /// etcd endpoints, `host:port[,host:port...]`: follow whichever coordinator leads the
    /// job (sets cluster.membership = "etcd").
    #[arg(long, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
}

impl CoordinatorArg {
    /// The job as this process sees it (with `--etcd`, its endpoints), and where its
    /// coordinator is.
    fn resolve(self, job: Job) -> (Job, CoordinatorSource) {
        match (self.coordinator, self.etcd) {
            (Some(address), _) => (job, CoordinatorSource::Address(address)),
            (None, Some(endpoints)) => (job.with_etcd(endpoints), CoordinatorSource::Etcd),
            (None, None) => (job, CoordinatorSource::Etcd),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum PlotCommand {
    /// Throughput against time with failure, detection and recovery marked (PNG).
    Timeline {
        /// `timeline.json` from a cluster run (or its run directory).
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "ftrec cluster throughput")]
        title: String,
    },
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p)
        .with_context(|| format!("{}: cannot make the path absolute", p.display()))
}

pub fn run(a: ClusterRunArgs) -> Result<()> {
    // A run directory of our own choosing is scratch: removed after a successful run.
    let temporary_run_dir = a.run_dir.is_none();
    let run_dir = match &a.run_dir {
        Some(d) => absolute(d)?,
        // It will hold the job secret: an unguessable name, made private, never reused.
        None => launch::private_run_dir(&absolute(&std::env::temp_dir())?, "ftrec-cluster")?,
    };
    let result = run_in(a, run_dir.clone(), temporary_run_dir);
    if result.is_err() && temporary_run_dir {
        // Refused before the launch wrote anything (a bad --kill, a missing dataset): leave
        // no empty directory behind. A failed launch's logs stay (remove_dir only takes an
        // empty one), so the failure can be read.
        let _ = std::fs::remove_dir(&run_dir);
    }
    result
}

fn run_in(a: ClusterRunArgs, run_dir: PathBuf, temporary_run_dir: bool) -> Result<()> {
    let data = a.data.as_deref().map(absolute).transpose()?;
    // An object-store location (`s3://...`) is kept as it is; a local one made absolute,
    // as every member reads it from its own working directory.
    let checkpoint_dir = a
        .checkpoint_dir
        .as_deref()
        .map(|d| match d.to_str() {
            Some(url) if url.contains("://") => Ok(d.to_path_buf()),
            _ => absolute(d),
        })
        .transpose()?;
    // Checked before the run whose end it keeps; absolute, as coordinators are processes
    // of their own under etcd.
    let save = a.save.as_deref().map(absolute).transpose()?;
    if let Some(save) = &save {
        launch::check_save_path(save)?;
    }
    let mut extra = run_overrides(a.steps, data.as_deref(), checkpoint_dir.as_deref());
    if let Some(n) = a.servers {
        extra.push(format!("cluster.servers={n}"));
    }
    if let Some(n) = a.workers {
        extra.push(format!("cluster.workers={n}"));
    }
    if let Some(FtArg::Fixed(ft)) = a.ft {
        extra.push(format!("cluster.ft=\"{}\"", ft.name()));
    }
    if a.ft != Some(FtArg::Auto)
        && (a.mtbf.is_some() || a.calibration_cache.is_some() || a.recalibrate)
    {
        bail!("--mtbf, --calibration-cache and --recalibrate are the inputs of --ft auto");
    }
    if a.deterministic {
        extra.push("cluster.deterministic=true".into());
    }
    let mut config = load_config(&a.config, extra)?;
    if let Some(data) = config.data.dir.clone() {
        config.data.dir = Some(absolute(&data)?);
    }
    let resume = resume::resume_point(&mut config, a.resume.as_deref(), a.fallback)?;
    let probe_steps = a
        .calibration_steps
        .unwrap_or_else(|| ftrec_cluster::auto::calibrate::default_probe_steps(config.train.steps));
    let auto = match a.ft {
        Some(FtArg::Auto) => Some(choose_ft(
            &mut config,
            &run_dir,
            &auto::AutoArgs {
                mtbf: a.mtbf,
                spares: a.spares,
                cache: auto::cache_dir(a.calibration_cache.as_deref()),
                recalibrate: a.recalibrate,
                probe_steps,
            },
            a.json,
        )?),
        _ => None,
    };
    // A temporary run directory is scratch, unless the job's cuts went into it: a
    // committed checkpoint is deleted only by an explicit policy, never by the way out.
    let mut temporary_run_dir = temporary_run_dir;
    if config.cluster.ft.checkpoints() {
        if config.checkpoint.dir.is_none() {
            config.checkpoint.dir = Some(run_dir.join("checkpoints"));
            if temporary_run_dir {
                temporary_run_dir = false;
                eprintln!(
                    "checkpoints go to {}; the run directory is kept (--checkpoint-dir puts \
                     them elsewhere)",
                    run_dir.join("checkpoints").display()
                );
            }
        }
        if config.checkpoint.every_steps == 0 {
            config.checkpoint.every_steps = 10;
        }
    }
    if config.threads == 0 {
        // Every process shares this host's cores; one compute thread per worker.
        config.threads = 1;
    }
    let Some(data) = config.data.dir.clone() else {
        bail!("no dataset: pass --data DIR or set data.dir");
    };
    config.data.dir = Some(absolute(&data)?);
    let mut coordinator_kills = Vec::new();
    let mut kills = Vec::new();
    for k in &a.kills {
        match launch::coordinator_kill(k) {
            Some(at) => coordinator_kills.push(at.map_err(anyhow::Error::msg)?),
            None => kills.push(k.parse::<KillSpec>().map_err(anyhow::Error::msg)?),
        }
    }
    if !coordinator_kills.is_empty() && a.etcd.is_none() {
        bail!("--kill coordinator@T needs --etcd: an embedded coordinator has no standby");
    }
    for fault in &a.faults {
        kills.push(KillSpec::fault(fault).map_err(anyhow::Error::msg)?);
    }
    let job = Job::new(config)?;
    if let Some(endpoints) = a.etcd.clone() {
        let report = run_with_etcd(
            launch::etcd::EtcdRunOptions {
                job,
                run_dir,
                kills,
                exe: std::env::current_exe().context("locating the ftrec binary")?,
                time_limit: Duration::from_secs_f64(a.time_limit),
                etcd: launch::etcd::EtcdLaunch {
                    endpoints,
                    coordinators: a.coordinators,
                    coordinator_kills,
                    save,
                },
            },
            a.json,
        )?;
        return report_run(report, a.json, temporary_run_dir, auto.as_ref());
    }
    let total = job.config.train.steps;
    let pb = bar(total, "cluster");
    if a.json {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let announced = std::cell::Cell::new(false);
    let job_file = run_dir.join("job.toml");
    let report = launch::run(
        LaunchOptions {
            job: job.clone(),
            run_dir,
            kills,
            spares: a.spares,
            exe: std::env::current_exe().context("locating the ftrec binary")?,
            time_limit: Duration::from_secs_f64(a.time_limit),
            evaluate: (!a.no_eval).then(evaluator),
            save,
            resume,
            scale_at: a.scale_at.clone(),
        },
        |p| {
            if !announced.replace(true) {
                pb.suspend(|| {
                    eprintln!(
                        "coordinator at {} (metrics http://{}/metrics; job {})",
                        p.coordinator,
                        p.coordinator_metrics.as_deref().unwrap_or("-"),
                        job_file.display()
                    )
                });
            }
            pb.set_position(p.steps);
            pb.set_message(format!("{} samples, epoch {}", p.samples, p.epoch));
        },
    );
    pb.finish_and_clear();
    report_run(report?, a.json, temporary_run_dir, auto.as_ref())
}

/// Says what a run did (`--json`: the report), and fails it when its redundancy is
/// wrong at the end.
fn report_run(
    mut report: LaunchReport,
    json: bool,
    temporary_run_dir: bool,
    auto: Option<&ftrec_cluster::auto::Choice>,
) -> Result<()> {
    if temporary_run_dir {
        std::fs::remove_dir_all(&report.run_dir)
            .with_context(|| format!("removing the run directory {}", report.run_dir.display()))?;
        report.run_dir_removed = true;
    }
    // A run whose redundancy is wrong failed, whatever the rest says: a later failure
    // would rebuild from the wrong bytes.
    let damaged = redundancy_damage(&report);
    if json {
        let mut value = serde_json::to_value(&report)?;
        if let Some(choice) = auto {
            value["auto"] = serde_json::to_value(choice)?;
        }
        print_json(value)?;
        if let Some(why) = damaged {
            bail!("{why}");
        }
        return Ok(());
    }
    let s = &report.summary;
    outln!(
        "{} servers, {} workers: {} steps, {} samples in {:.1}s = {:.0} samples/s ({:.0} RPC bytes/sample)",
        report.servers,
        report.workers,
        s.steps,
        s.samples,
        s.train_seconds,
        s.samples_per_sec,
        s.rpc_bytes_per_sample
    );
    for c in &s.checkpoints {
        outln!(
            "checkpoint at step {}: {:.1} MB, training paused {:.3}s",
            c.step,
            c.bytes as f64 / 1e6,
            c.pause_seconds
        );
    }
    for r in &s.recoveries {
        outln!(
            "server {} failure detected at {:.2}s, training resumed at {:.2}s from step {} ({} steps rolled back)",
            r.server,
            r.detected_at,
            r.resumed_at,
            r.resumed_step,
            r.steps_rolled_back
        );
    }
    for k in &report.kill_to_resume_seconds {
        outln!("SIGKILL to training resumed: {k:.2}s");
    }
    for f in s.coordinator_failovers.iter().flatten() {
        outln!(
            "coordinator {} took over from {} in {:.2}s",
            f.to,
            f.from,
            f.failover_seconds
        );
    }
    if let (Some(auc), Some(ll)) = (report.auc, report.logloss) {
        outln!(
            "held-out ({} samples): AUC {auc:.4}, logloss {ll:.4}",
            report.eval_samples.unwrap_or(0)
        );
    }
    outln!("state digest {}", report.state_digest);
    if let (Some(parity), Some(replicas)) = (report.parity_mismatches, report.replica_mismatches) {
        outln!("parity check: {parity} stripe mismatches, {replicas} dense replica mismatches");
        print_mismatches(
            report
                .parity_mismatch_details
                .as_deref()
                .unwrap_or_default(),
            parity + replicas,
        )?;
    }
    if report.run_dir_removed {
        outln!(
            "run directory removed; pass --run-dir DIR to keep the timeline, logs and checkpoints"
        );
    } else {
        outln!(
            "timeline: {}/timeline.json (plot: ftrec plot timeline {0} --out timeline.png)",
            report.run_dir.display()
        );
    }
    if let Some(why) = damaged {
        bail!("{why}");
    }
    Ok(())
}

/// `cluster run --etcd`: coordinators as processes of their own; the report is the
/// finishing coordinator's. No evaluation: the model stays with the servers it was
/// gathered from.
fn run_with_etcd(opts: launch::etcd::EtcdRunOptions, json: bool) -> Result<LaunchReport> {
    let total = opts.job.config.train.steps;
    let pb = bar(total, "cluster");
    if json {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = launch::etcd::run(opts, |p| {
        pb.set_position(p.steps);
        pb.set_message(format!(
            "{} samples, epoch {}, leader {}",
            p.samples, p.epoch, p.coordinator
        ));
    });
    pb.finish_and_clear();
    Ok(report?)
}

/// Why the end-of-run parity check fails the run, if it does.
fn redundancy_damage(report: &LaunchReport) -> Option<String> {
    let parity = report.parity_mismatches.unwrap_or(0);
    let replicas = report.replica_mismatches.unwrap_or(0);
    (parity + replicas > 0).then(|| {
        format!(
            "the parity check failed: {parity} stripes with a wrong parity row and {replicas} \
             dense replicas that differ from their primary"
        )
    })
}

pub use scale::scale;

/// A connector for an operator's call to a running job's coordinator: the job file's
/// secret and TLS settings, or `FTREC_JOB_SECRET` without one.
fn admin_connector(job: Option<&Path>) -> Result<client::Connector> {
    Ok(match job {
        // The job's own secret and TLS settings.
        Some(path) => Job::load(path)?
            .connector()?
            .with_timeout(Duration::from_secs(10)),
        // Without a job file there are no TLS settings: a TLS cluster needs --job.
        None => {
            let secret = ftrec_rpc::auth::JobSecret::from_env()?.ok_or_else(|| {
                anyhow::anyhow!(
                    "the cluster admits only its job's processes: pass --job RUN_DIR/job.toml \
                     or set {}",
                    ftrec_config::SECRET_ENV
                )
            })?;
            client::Connector::new(Duration::from_secs(10), &secret, None, Default::default())?
        }
    })
}

pub fn kill(coordinator: &str, job: Option<&Path>, member: &str) -> Result<()> {
    let (role, id) = launch::parse_member(member).map_err(anyhow::Error::msg)?;
    let connector = admin_connector(job)?;
    let rt = runtime()?;
    let pid = rt.block_on(async {
        let mut c = connector.coordinator(coordinator).await?;
        let reply = c
            .kill(KillRequest {
                role: role as i32,
                id: id as u32,
            })
            .await
            .map_err(|s| ftrec_rpc::PsError::rpc(format!("kill {member}"), &s))?;
        Ok::<_, ftrec_rpc::PsError>(reply.into_inner().pid)
    })?;
    outln!("killed {member} (pid {pid})");
    Ok(())
}

pub fn server(a: ServerArgs) -> Result<()> {
    launch::die_with_launcher()?;
    let start_spare = survivor_spare::starter(&absolute(&a.job)?, &a.coordinator, &a.host);
    let (job, coordinator) = a.coordinator.resolve(Job::load(&a.job)?);
    // The job file may come from a larger host: refuse before allocating (an allocation
    // failure aborts without saying which key to change) and before joining.
    job.check_server_memory(if a.spare { None } else { a.id })?;
    runtime()?.block_on(ftrec_server::run(ServerOptions {
        job,
        id: if a.spare { None } else { a.id },
        coordinator,
        host: a.host,
        faults: ftrec_faults::Faults::parse_all(a.faults.iter().map(String::as_str))?,
        hosted_by: a.hosted_by,
        start_spare: Some(start_spare),
    }))?;
    Ok(())
}

pub fn worker(a: WorkerArgs) -> Result<()> {
    launch::die_with_launcher()?;
    let (job, coordinator) = a.coordinator.resolve(Job::load(&a.job)?);
    job.check_worker_memory()?;
    ftrec_worker::run(WorkerOptions {
        job,
        id: a.id,
        coordinator,
        faults: ftrec_faults::Faults::parse_all(a.faults.iter().map(String::as_str))?,
    })?;
    Ok(())
}

pub fn plot_timeline(input: &Path, out: &Path, title: &str) -> Result<()> {
    let path = if input.is_dir() {
        input.join("timeline.json")
    } else {
        input.to_path_buf()
    };
    let data = TimelineData::read(&path)?;
    ftrec_bench::timeline_plot::plot_timeline(&data, out, title)?;
    outln!("wrote {}", out.display());
    Ok(())
}

/// The single-process trainer's evaluation on the job's test split, for the cluster's
/// final model.
pub fn evaluator() -> ftrec_cluster::launch::Evaluator {
    Box::new(|job, state| {
        let run = || -> anyhow::Result<ftrec_model::metrics::Metrics> {
            let dir = job
                .config
                .data
                .dir
                .clone()
                .context("data.dir is not set: nothing to evaluate on")?;
            let test = ftrec_data::Dataset::open_split(&dir, ftrec_data::TEST_FILE)?;
            let mut trainer = ftrec_train::Trainer::with_state(
                &job.config,
                state,
                ftrec_train::Progress::default(),
            )?;
            Ok(trainer.evaluate(&test, job.config.train.eval_samples)?)
        };
        run().map_err(|e| format!("evaluating the final model: {e:#}"))
    })
}
