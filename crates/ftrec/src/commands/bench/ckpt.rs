//! `ftrec bench ckpt`: runs the checkpoint benchmark and writes its CSV files, plots and
//! summary.

use clap::Args;
use std::fmt::Write as _;
use std::path::Path;
use std::path::PathBuf;

use anyhow::{Context, Result};
use ftrec_bench::ckpt::{CkptBenchConfig, CkptBenchReport, bench_ckpt};
use plotters::prelude::*;
use serde_json::json;

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
    #[arg(long)]
    pub json: bool,
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
    std::fs::create_dir_all(&a.out).with_context(|| format!("{}", a.out.display()))?;
    write_csv(&report, &a.out)?;
    plot(&report, &a.out)?;
    let summary = summary(&report);
    std::fs::write(
        a.out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let _ = std::fs::remove_dir_all(&a.dir);
    if a.json {
        outln!("{}", serde_json::to_string(&summary)?);
    } else {
        outln!("{}", serde_json::to_string_pretty(&summary)?);
        outln!("wrote {}", a.out.display());
    }
    Ok(())
}

fn mean_of(report: &CkptBenchReport, strategy: &str) -> Option<(f64, f64, u64)> {
    report
        .summaries
        .iter()
        .find(|s| s.strategy == strategy)
        .map(|s| {
            (
                s.mean_restore_seconds,
                s.mean_blocking_seconds,
                s.final_storage_bytes,
            )
        })
}

/// Bytes naive incremental restores read over those IncrCP's rectangles read, summed over
/// the checkpoints both timed: the ceiling on IncrCP's restore speedup when both restores
/// are bound by what they read.
fn restore_bytes_ratio(report: &CkptBenchReport, over: &str, under: &str) -> f64 {
    let bytes_of = |strategy: &str| -> std::collections::BTreeMap<usize, u64> {
        report
            .rows
            .iter()
            .filter(|r| r.strategy == strategy && r.measured)
            .filter_map(|r| r.restore_bytes.map(|b| (r.index, b)))
            .collect()
    };
    let (a, b) = (bytes_of(over), bytes_of(under));
    let (mut sum_a, mut sum_b) = (0u64, 0u64);
    for (index, bytes) in &a {
        if let Some(other) = b.get(index) {
            sum_a += bytes;
            sum_b += other;
        }
    }
    if sum_b == 0 {
        f64::NAN
    } else {
        sum_a as f64 / sum_b as f64
    }
}

fn summary(report: &CkptBenchReport) -> serde_json::Value {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let incr = mean_of(report, "incrcp");
    let naive = mean_of(report, "naive-incremental");
    let diff = mean_of(report, "differential");
    let d = &report.disk;
    json!({
        "model_bytes": report.model_bytes,
        "table_rows": report.table_rows,
        "strategies": report.summaries,
        "incrcp_restore_speedup_vs_naive": match (incr, naive) {
            (Some(i), Some(n)) => ratio(n.0, i.0), _ => f64::NAN },
        "incrcp_restore_bytes_ratio_vs_naive":
            restore_bytes_ratio(report, "naive-incremental", "incrcp"),
        "incrcp_storage_vs_differential": match (incr, diff) {
            (Some(i), Some(df)) => ratio(i.2 as f64, df.2 as f64), _ => f64::NAN },
        "disk": d,
        "full_write_vs_dd": ratio(d.full_write_bytes_per_second, d.dd_write_bytes_per_second),
        "full_restore_vs_dd": ratio(d.full_restore_bytes_per_second, d.dd_read_bytes_per_second),
        "deck": report.deck.iter().map(|r| json!({
            "name": r.name, "steps": r.steps, "checkpoints": r.checkpoints, "fulls": r.fulls,
            "wall_seconds": r.wall_seconds, "blocking_seconds": r.blocking_seconds,
            "effective_training_time": r.effective_training_time,
            "tracking_ms_per_step": r.tracking_ms_per_step, "step_ms_mean": r.step_ms_mean,
            "tracking_share_of_step": ratio(r.tracking_ms_per_step, r.step_ms_mean),
            "merge_bytes_per_second": r.merge_bytes_per_second,
            "merged_checkpoints": r.merged_checkpoints,
            "peak_resident_chunks": r.peak_resident_chunks,
        })).collect::<Vec<_>>(),
    })
}

fn write_csv(report: &CkptBenchReport, out: &Path) -> Result<()> {
    let mut csv = String::from(
        "strategy,index,step,kind,blocking_seconds,bytes_written,storage_bytes,restore_seconds,restore_bytes,measured\n",
    );
    for r in &report.rows {
        let opt = |v: Option<String>| v.unwrap_or_default();
        writeln!(
            csv,
            "{},{},{},{},{:.6},{},{},{},{},{}",
            r.strategy,
            r.index,
            r.step,
            r.kind,
            r.blocking_seconds,
            r.bytes_written,
            r.storage_bytes,
            opt(r.restore_seconds.map(|s| format!("{s:.6}"))),
            opt(r.restore_bytes.map(|b| b.to_string())),
            r.measured
        )?;
    }
    std::fs::write(out.join("incrcp.csv"), csv)?;
    let mut deck = String::from("run,step,cumulative_blocking_seconds\n");
    for run in &report.deck {
        for (step, b) in &run.blocking_timeline {
            writeln!(deck, "{},{step},{b:.6}", run.name)?;
        }
    }
    std::fs::write(out.join("deck.csv"), deck)?;
    Ok(())
}

type Series = Vec<(String, Vec<(f64, f64)>)>;

fn by_strategy(
    report: &CkptBenchReport,
    value: impl Fn(&ftrec_bench::ckpt::CheckpointRow) -> Option<f64>,
) -> Series {
    report
        .summaries
        .iter()
        .map(|s| {
            let points = report
                .rows
                .iter()
                .filter(|r| r.strategy == s.strategy)
                .filter_map(|r| value(r).map(|v| (r.index as f64 + 1.0, v)))
                .collect();
            (s.strategy.clone(), points)
        })
        .collect()
}

fn plot(report: &CkptBenchReport, out: &Path) -> Result<()> {
    line_chart(
        &out.join("restore.png"),
        "Restore time beyond the baseline (cold cache)",
        "checkpoint",
        "seconds",
        &by_strategy(report, |r| r.restore_seconds),
    )?;
    line_chart(
        &out.join("construction.png"),
        "Blocking construction time",
        "checkpoint",
        "seconds",
        &by_strategy(report, |r| Some(r.blocking_seconds)),
    )?;
    line_chart(
        &out.join("storage.png"),
        "Cumulative storage",
        "checkpoint",
        "GB",
        &by_strategy(report, |r| Some(r.storage_bytes as f64 / 1e9)),
    )?;
    if !report.deck.is_empty() {
        let series: Series = report
            .deck
            .iter()
            .map(|r| {
                (
                    format!("{} ({} checkpoints)", r.name, r.checkpoints),
                    r.blocking_timeline
                        .iter()
                        .map(|&(s, b)| (s as f64, b))
                        .collect(),
                )
            })
            .collect();
        line_chart(
            &out.join("deck.png"),
            "Training time lost to checkpoints",
            "step",
            "cumulative blocking seconds",
            &series,
        )?;
    }
    Ok(())
}

fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &Series,
) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let x_max = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points.map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
