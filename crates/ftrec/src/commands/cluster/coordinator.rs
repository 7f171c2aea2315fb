//! `ftrec coordinator`: a coordinator as a process of its own (multi-host, or under etcd
//! membership, where one leads and the rest stand by).

use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use ftrec_cluster::launch;
use ftrec_coordinator::CoordinatorOptions;
use ftrec_rpc::Job;
use serde_json::json;

use super::runtime;
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct CoordinatorArgs {
    #[arg(long)]
    pub job: PathBuf,
    /// etcd endpoints, `host:port[,host:port...]`: keep the job's membership, epoch and
    /// cuts in etcd, and lead only while elected (sets cluster.membership = "etcd").
    #[arg(long, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// Wait while another coordinator leads, and take over when its lease expires.
    #[arg(long, requires = "etcd")]
    pub standby: bool,
    /// Start replacement servers and workers on this host when members die (their logs
    /// go beside `--out`).
    #[arg(long)]
    pub spawn: bool,
    /// This coordinator's name in etcd and in the reports (default: host and pid).
    #[arg(long)]
    pub id: Option<String>,
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 7070)]
    pub port: u16,
    /// Where the timeline goes.
    #[arg(long, default_value = ".")]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
    /// Arm a fault point in this coordinator, NAME[:STEP][=kill] (recovery: with a
    /// recovery decided, before it calls any server; switch: with a move's cut committed
    /// and the move recorded, before it switches layout; takeover: just elected, before it
    /// fences any server); it fires once.
    #[arg(long = "fault", value_name = "SPEC")]
    pub faults: Vec<String>,
    /// Write the final model to this snapshot file (`.ftm`, as `train --save`) once the
    /// last step has committed; whichever coordinator leads at the end writes it.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
}

pub fn coordinator(a: CoordinatorArgs) -> Result<()> {
    launch::die_with_launcher()?;
    let mut job = Job::load(&a.job)?;
    if let Some(endpoints) = a.etcd.clone() {
        job = job.with_etcd(endpoints);
    }
    if let Some(save) = &a.save {
        launch::check_save_path(save)?;
    }
    let faults = ftrec_faults::Faults::parse_all(a.faults.iter().map(String::as_str))?;
    // A resumed job names its cut in the job file (`cluster.resume_from`), which every
    // member reads, so all of them are of one job; the coordinator checks the cut and
    // tells the servers which one it is.
    let resume = ftrec_cluster::resume::resolve(&job.config, false)?;
    let rt = runtime()?;
    let report = rt.block_on(async {
        if a.standby {
            eprintln!("standby coordinator: waiting to lead the job");
        }
        let mut handle = ftrec_coordinator::start(CoordinatorOptions {
            job: job.clone(),
            host: a.host.clone(),
            port: a.port,
            spawner: a
                .spawn
                .then(|| {
                    launch::replacement_spawner(
                        std::env::current_exe().unwrap_or_else(|_| "ftrec".into()),
                        a.job.clone(),
                        a.out.join("logs"),
                        &job.config.cluster.etcd_endpoints,
                    )
                })
                .transpose()?,
            standby: a.standby,
            id: a.id.clone(),
            faults,
            resume,
        })
        .await?;
        eprintln!("coordinator listening on {}", handle.shared.address());
        let waited = handle.wait_done(Duration::from_secs(30 * 24 * 3600)).await;
        let shared = handle.shared.clone();
        // Written on every way out: most wanted when the run did not finish.
        shared.timeline().write(&a.out)?;
        if let Err(e) = waited {
            // etcd: the job's failure is recorded (a standby ends with it rather than try
            // again); a deposed coordinator's write is refused, as it should be.
            let _ = handle.finish().await;
            return Err(e);
        }
        if handle.inherited_done {
            return Ok((shared.summary(), None));
        }
        // Gathered, and the parity checked, while the servers still serve.
        let report =
            launch::final_report(&job, &shared, Vec::new(), None, &a.out, a.save.as_deref())
                .await?;
        shared.timeline().write(&a.out)?;
        handle.record_end().await?;
        shared.stop();
        // Let the heartbeats carry `stop` to every server before exiting.
        tokio::time::sleep(Duration::from_millis(job.config.cluster.heartbeat_ms * 5)).await;
        handle.finish().await?;
        Ok::<_, ftrec_rpc::PsError>((shared.summary(), Some(report)))
    })?;
    let (summary, report) = report;
    let Some(report) = report else {
        // A standby that took over a finished job: the leader before it reported.
        if a.json {
            let mut v = serde_json::to_value(&summary)?;
            v["already_done"] = json!(true);
            return print_json(v);
        }
        outln!("the job had finished under an earlier coordinator; nothing to do");
        return Ok(());
    };
    if a.json {
        return print_json(serde_json::to_value(&report)?);
    }
    outln!(
        "{} samples at {:.0} samples/s; state digest {}",
        summary.samples,
        summary.samples_per_sec,
        report.state_digest
    );
    Ok(())
}
