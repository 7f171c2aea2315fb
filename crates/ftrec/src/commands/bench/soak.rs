//! `ftrec bench soak`: rolling faults of every kind across network namespaces, against
//! the same job without faults (`ftrec_bench::soak`).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use ftrec_bench::soak::SoakOptions;
use ftrec_bench::soak::schedule::FaultKind;

use crate::output::print_json;

#[derive(Args, Debug)]
pub struct BenchSoakArgs {
    /// How long faults keep coming, in minutes of training.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seconds between faults.
    #[arg(long, default_value_t = 20.0)]
    pub every: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, default_value_t = 4)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub spares: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// The mix (comma separated): server-kill, server-freeze, server-zombie, link-down,
    /// partition, loss, leader-kill, leader-etcd-cut, etcd-restart, etcd-quorum-loss, rack.
    #[arg(long, value_delimiter = ',')]
    pub faults: Vec<String>,
    /// Asynchronous workers in both runs (judged by lost samples, not the digest).
    #[arg(long = "async")]
    pub asynchronous: bool,
    /// Steps per run (default: the failure-free rate, measured past its start-up, times
    /// --minutes plus one --every, so that the last fault lands inside the job).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Failure-free and soak runs, alternating, this many times each.
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// Only the soak, and its goals asserted (survival, exactness, no mismatch): what
    /// `.ci/run` runs. Prints one SKIPPED line where namespaces need root.
    #[arg(long)]
    pub ci: bool,
    /// `KEY=VALUE` overrides of the job.
    #[arg(long = "set")]
    pub sets: Vec<String>,
    #[arg(long, default_value = "bench-soak")]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
}

pub fn bench_soak(a: BenchSoakArgs) -> Result<()> {
    if let Some(why) = ftrec_bench::soak::unusable() {
        if a.ci {
            outln!("SKIPPED: bench soak needs network namespaces ({why})");
            return Ok(());
        }
        bail!("bench soak needs network namespaces: {why}");
    }
    let kinds = if a.faults.is_empty() {
        FaultKind::ALL.to_vec()
    } else {
        a.faults
            .iter()
            .map(|n| {
                FaultKind::parse(n).ok_or_else(|| {
                    anyhow::anyhow!("--faults: unknown fault {n} (see --help for the kinds)")
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let report = ftrec_bench::soak::run(
        &super::Cli,
        &SoakOptions {
            minutes: a.minutes,
            every: a.every,
            seed: a.seed,
            servers: a.servers,
            spares: a.spares,
            workers: a.workers,
            kinds,
            asynchronous: a.asynchronous,
            steps: a.steps,
            rounds: a.rounds,
            no_baseline: a.ci,
            out: a.out.clone(),
            sets: a.sets,
        },
    )?;
    if a.json {
        print_json(serde_json::to_value(&report)?)?;
    } else {
        for line in report.table() {
            outln!("{line}");
        }
        outln!("report: {}", a.out.join("soak.json").display());
    }
    if a.ci {
        let failures = report.failures();
        for f in &failures {
            outln!("FAIL: {f}");
        }
        if !failures.is_empty() {
            bail!(
                "bench soak: {} goal(s) failed (runs under {})",
                failures.len(),
                a.out.display()
            );
        }
        outln!("PASS: every fault survived, exact, no mismatch");
    }
    Ok(())
}
