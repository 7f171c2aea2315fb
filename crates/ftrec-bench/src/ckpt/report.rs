//! What `bench ckpt` writes: its CSV files, plots and `summary.json`.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::json;

use super::CkptBenchReport;
use crate::error::{BenchError, Result};

/// Writes the CSV files, the plots and `summary.json` into `out` (created); the summary.
pub fn write(report: &CkptBenchReport, out: &Path) -> Result<serde_json::Value> {
    std::fs::create_dir_all(out).map_err(BenchError::file(out))?;
    write_csv(report, out)?;
    super::plot::plot(report, out)?;
    let summary = summary(report);
    let path = out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .map_err(BenchError::file(&path))?;
    Ok(summary)
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

/// `summary.json`: the strategies' summaries, the ratios BENCHMARKS.md quotes, the disk
/// baseline and DECK's runs.
pub(crate) fn summary(report: &CkptBenchReport) -> serde_json::Value {
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

/// `incrcp.csv` (a row per checkpoint) and `deck.csv` (DECK's blocking over the steps).
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
    let path = out.join("incrcp.csv");
    std::fs::write(&path, csv).map_err(BenchError::file(&path))?;
    let mut deck = String::from("run,step,cumulative_blocking_seconds\n");
    for run in &report.deck {
        for (step, b) in &run.blocking_timeline {
            writeln!(deck, "{},{step},{b:.6}", run.name)?;
        }
    }
    let path = out.join("deck.csv");
    std::fs::write(&path, deck).map_err(BenchError::file(&path))?;
    Ok(())
}
