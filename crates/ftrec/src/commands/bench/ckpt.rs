//! `ftrec bench ckpt`: runs the checkpoint benchmark (`ftrec_bench::ckpt`), which writes
//! its CSV files, plots and summary.

use clap::Args;
use std::path::PathBuf;

use anyhow::Result;
use ftrec_bench::ckpt::{CkptBenchConfig, bench_ckpt};

#[derive(Args, Debug)]
pub struct BenchCkptArgs {
    /// Scratch directory for checkpoints (emptied per strategy).
    #[arg(long, default_value = "bench-ckpt-scratch")]
    pub dir: PathBuf,
    /// Where the CSV files, plots and summary go.
    #[arg(long, default_value = "bench-ckpt")]
    pub out: PathBuf,
    /// Scale of the Criteo Kaggle table sizes (1.0: 33.8M rows, ~2.3 GB).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    #[arg(long, default_value_t = 150)]
    pub checkpoints: usize,
    /// Training steps between checkpoints.
    #[arg(long, default_value_t = 10)]
    pub interval: u64,
    /// Time the restore of every N-th checkpoint (and the last).
    #[arg(long, default_value_t = 5)]
    pub restore_every: usize,
    /// Full checkpoints actually written by the full strategy (the rest extrapolated).
    #[arg(long, default_value_t = 3)]
    pub full_samples: usize,
    /// Differential (Check-N-Run) baseline reset: a full checkpoint every N.
    #[arg(long, default_value_t = 50)]
    pub differential_full_every: u64,
    #[arg(long, default_value_t = 0.02)]
    pub incrcp_threshold: f64,
    /// DECK: a full checkpoint when live deltas exceed this many times one delta.
    #[arg(long, default_value_t = 64.0)]
    pub deck_live_factor: f64,
    #[arg(long, default_value_t = 2048)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub skip_deck: bool,
    /// Strategies of the IncrCP experiment, comma-separated (full must be among them for
    /// the disk comparison).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_experiment_strategy,
        default_value = "full,differential,naive-incremental,incrcp"
    )]
    pub strategies: Vec<ftrec_ckpt::Strategy>,
    /// Instead of the strategies' experiment: quantized checkpoints against f32, over
    /// `--cycles` save/restore cycles of a `--preset` job (bytes per checkpoint, held-out
    /// AUC after the restores). int8 or int4.
    #[arg(long, value_parser = parse_quantize)]
    pub quantize: Option<ftrec_ckpt::QuantKind>,
    /// With --quantize: the optimizer state is quantized too.
    #[arg(long, requires = "quantize")]
    pub quantize_optimizer: bool,
    /// With --quantize: the job's preset.
    #[arg(long, default_value = "demo", requires = "quantize")]
    pub preset: String,
    /// With --quantize: save/restore cycles, and training steps in each.
    #[arg(long, default_value_t = 10, requires = "quantize")]
    pub cycles: u64,
    #[arg(long, default_value_t = 50, requires = "quantize")]
    pub steps_per_cycle: u64,
    /// With --quantize: the dataset (generated there, Criteo-shaped, when absent;
    /// default OUT/data).
    #[arg(long, requires = "quantize")]
    pub data: Option<PathBuf>,
    /// With --quantize: samples to generate.
    #[arg(long, default_value_t = 400_000, requires = "quantize")]
    pub rows: u64,
    #[arg(long)]
    pub json: bool,
}

fn parse_quantize(s: &str) -> Result<ftrec_ckpt::QuantKind, String> {
    match s {
        "int8" => Ok(ftrec_ckpt::QuantKind::Int8),
        "int4" => Ok(ftrec_ckpt::QuantKind::Int4),
        _ => Err(format!("--quantize {s:?}: expected int8 or int4")),
    }
}

/// `--quantize`: the quantization study (`ftrec_bench::ckpt::quantize`).
fn quantize_study(a: &BenchCkptArgs, quantize: ftrec_ckpt::QuantKind) -> Result<()> {
    let config = ftrec_bench::ckpt::quantize::QuantStudyConfig {
        preset: a.preset.clone(),
        data: a.data.clone().unwrap_or_else(|| a.out.join("data")),
        rows: a.rows,
        dir: a.dir.clone(),
        quantize,
        quantize_optimizer: a.quantize_optimizer,
        cycles: a.cycles,
        steps_per_cycle: a.steps_per_cycle,
        seed: a.seed,
        threads: a.threads,
    };
    let report = ftrec_bench::ckpt::quantize::study(&config)?;
    let _ = std::fs::remove_dir_all(&a.dir);
    std::fs::create_dir_all(&a.out)?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(a.out.join("quantize.json"), &json)?;
    if a.json {
        outln!("{}", serde_json::to_string(&report)?);
    } else {
        outln!("{json}");
        outln!("wrote {}", a.out.join("quantize.json").display());
    }
    Ok(())
}

fn parse_experiment_strategy(s: &str) -> Result<ftrec_ckpt::Strategy, String> {
    use ftrec_ckpt::Strategy;
    match serde_json::from_value(serde_json::Value::String(s.into())) {
        Ok(Strategy::Deck) => Err("deck has its own experiment (see --skip-deck)".into()),
        Ok(strategy) => Ok(strategy),
        Err(_) => Err(format!(
            "unknown strategy {s:?}: expected full, differential, naive-incremental or incrcp"
        )),
    }
}

pub fn run(a: BenchCkptArgs) -> Result<()> {
    if let Some(quantize) = a.quantize {
        return quantize_study(&a, quantize);
    }
    let config = CkptBenchConfig {
        dir: a.dir.clone(),
        scale: a.scale,
        checkpoints: a.checkpoints,
        interval: a.interval,
        restore_every: a.restore_every,
        full_samples: a.full_samples,
        differential_full_every: a.differential_full_every,
        incrcp_threshold: a.incrcp_threshold,
        deck_live_factor: a.deck_live_factor,
        batch_size: a.batch_size,
        threads: a.threads,
        seed: a.seed,
        skip_deck: a.skip_deck,
        strategies: a.strategies.clone(),
    };
    let bar = indicatif::ProgressBar::new_spinner();
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = bench_ckpt(&config, &mut |m| bar.set_message(m.to_string()))?;
    bar.finish_and_clear();
    let summary = ftrec_bench::ckpt::report::write(&report, &a.out)?;
    let _ = std::fs::remove_dir_all(&a.dir);
    if a.json {
        outln!("{}", serde_json::to_string(&summary)?);
    } else {
        outln!("{}", serde_json::to_string_pretty(&summary)?);
        outln!("wrote {}", a.out.display());
    }
    Ok(())
}
