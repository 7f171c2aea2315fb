//! `ftrec bench cpr`: the CPR emulation study (cpr.txt §5.1, §6) on generated
//! Criteo-shaped data; summary JSON and plots.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use ftrec_bench::cpr_study::many_failures::ManyFailures;
use ftrec_bench::cpr_study::sensitivity::{PlsPoint, Sensitivity};
use ftrec_bench::cpr_study::{
    CorrelationConfig, CostOverrides, Strategy, StudyConfig, StudyReport, run_study,
};
use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, read_meta};
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE};
use plotters::prelude::*;

use crate::commands::data::run_gen;
use crate::output::print_json;

#[derive(Args, Debug)]
pub struct BenchCprArgs {
    /// Dataset directory; generated (Criteo Kaggle shape at 1% of its cardinalities, with
    /// a planted teacher) when it does not hold the `--rows` dataset.
    #[arg(long, default_value = "bench-cpr-data")]
    pub data: PathBuf,
    /// Samples to generate (train + test; 10% are held out).
    #[arg(long, default_value_t = 600_000)]
    pub rows: u64,
    #[arg(long, default_value = "demo")]
    pub preset: String,
    /// Override a configuration key (repeatable), e.g. `--set cpr.r=0.25`. The study's
    /// defaults (dim 16, MLPs 64-16 and 64-1, batch 1024, one table per generated
    /// feature) come first.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Steps per run (default: one epoch).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long, default_value_t = 2)]
    pub failures: usize,
    /// Shares of the embedding servers each failure loses.
    #[arg(long, value_delimiter = ',', default_value = "0.125,0.25,0.5")]
    pub fractions: Vec<f64>,
    /// Emulated embedding servers (N_emb); row `r` of table `t` lives on server
    /// `(r + t) % servers`, the cluster's placement.
    #[arg(long, default_value_t = 8)]
    pub servers: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,partial,cpr_vanilla,cpr_uncoordinated,cpr_scar,cpr_mfu,cpr_ssu"
    )]
    pub strategies: Vec<Strategy>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Target PLS (sets `cpr.target_pls`).
    #[arg(long)]
    pub target_pls: Option<f64>,
    /// Seconds to save the whole model, in the job frame (default: a real full checkpoint
    /// written to `--storage-dir`, measured and scaled to the frame).
    #[arg(long)]
    pub o_save: Option<f64>,
    /// Seconds to load the whole model (default: the real checkpoint's cold restore,
    /// measured).
    #[arg(long)]
    pub o_load: Option<f64>,
    /// Seconds to reschedule a failed node.
    #[arg(long, default_value_t = 0.0)]
    pub o_res: f64,
    /// Length of the emulated job in seconds (default: the measured failure-free epoch);
    /// measured costs are scaled to it (§5.1). T_fail is `cpr.mtbf_seconds`, else this
    /// over `--failures`.
    #[arg(long)]
    pub job_seconds: Option<f64>,
    /// Partial recovery must save this share of Eq. 1's overhead to be chosen.
    #[arg(long, default_value_t = 0.1)]
    pub min_benefit: f64,
    /// Extra CPR-vanilla runs at these target PLS values (each fraction), so the AUC–PLS
    /// correlation spans a PLS range like the paper's §6.5; empty (`--pls-sweep ''`)
    /// skips them.
    #[arg(long, value_delimiter = ',', default_value = "0.2,0.4,0.8")]
    pub pls_sweep: Vec<f64>,
    /// Independent runs for the AUC-PLS correlation: this many model seeds ...
    /// (0 skips them: the correlation then rests on the one schedule's runs).
    #[arg(long, default_value_t = 5)]
    pub correlation_seeds: u64,
    /// ... times this many Poisson failure schedules (mean `--failures` per epoch), each
    /// run CPR-vanilla at the largest fraction, at the next of `--correlation-targets`.
    #[arg(long, default_value_t = 3)]
    pub correlation_schedules: u64,
    #[arg(long, value_delimiter = ',', default_value = "0.02,0.1,0.2,0.4,0.8")]
    pub correlation_targets: Vec<f64>,
    /// Also run the sensitivity studies: target PLS 0.02/0.1/0.2 (CPR-vanilla, CPR-SSU)
    /// and 2/20/40 failures at every fraction (full against CPR-SSU, with CPR's decision
    /// checked against the runs), all in the main study's cost frame.
    #[arg(long)]
    pub sensitivity: bool,
    /// §6.5's many-failure runs: this many CPR-vanilla runs, each with 1-32 failures of
    /// 6.25-50% of 16 emulated servers and a random target PLS in 0.01-1; 0 skips them.
    #[arg(long, default_value_t = 16)]
    pub many_failures: usize,
    #[arg(long, default_value = "bench-results/cpr")]
    pub out: PathBuf,
    /// Where the checkpoints that time `O_save` and `O_load` are written (removed after):
    /// the local disk a server would checkpoint to. Default: `--out`. `--memory-costs`
    /// times an in-memory copy instead (no disk: the cheapest save there is).
    #[arg(long)]
    pub storage_dir: Option<PathBuf>,
    #[arg(long)]
    pub memory_costs: bool,
    #[arg(long)]
    pub json: bool,
}

fn study_config(a: &BenchCprArgs) -> Result<JobConfig> {
    let mut overrides: Vec<String> = vec![
        "model.dim=16".into(),
        "model.bottom=[64, 16]".into(),
        "model.top=[64, 1]".into(),
        "train.batch_size=1024".into(),
        format!("seed={}", a.seed),
    ];
    if let Some(meta) = read_meta(&a.data) {
        let rows: Vec<String> = meta
            .config
            .cardinalities
            .iter()
            .map(|c| c.max(&2).to_string())
            .collect();
        overrides.push(format!("model.table_rows=[{}]", rows.join(", ")));
    }
    if let Some(p) = a.target_pls {
        overrides.push(format!("cpr.target_pls={p}"));
    }
    if let Some(s) = a.steps {
        overrides.push(format!("train.steps={s}"));
    }
    overrides.extend(a.set.iter().cloned());
    let config = JobConfig::load(Some(&a.preset), None, &overrides)?;
    config.fits_in_memory(0)?;
    Ok(config)
}

pub fn run(a: BenchCprArgs) -> Result<()> {
    let gen_config = GenConfig::criteo(a.rows, 1, 0.01);
    let fresh = read_meta(&a.data).is_some_and(|m| m.config == gen_config)
        && a.data.join(TRAIN_FILE).exists();
    if !fresh {
        run_gen(&gen_config, &a.data, OutputFormat::Binary, a.json)?;
    }
    let job = study_config(&a)?;
    let train = Dataset::open_split(&a.data, TRAIN_FILE)?;
    let test = Dataset::open_split(&a.data, TEST_FILE)?;
    let config = StudyConfig {
        job,
        fractions: a.fractions.clone(),
        failures: a.failures,
        servers: a.servers,
        strategies: a.strategies.clone(),
        costs: CostOverrides {
            o_save: a.o_save,
            o_load: a.o_load,
            o_res: a.o_res,
            job_seconds: a.job_seconds,
            storage_dir: (!a.memory_costs)
                .then(|| a.storage_dir.clone().unwrap_or_else(|| a.out.clone())),
        },
        min_benefit: a.min_benefit,
        pls_sweep: a.pls_sweep.clone(),
        correlation: (a.correlation_seeds > 0 && a.correlation_schedules > 0).then(|| {
            CorrelationConfig {
                seeds: a.correlation_seeds,
                schedules: a.correlation_schedules,
                targets: a.correlation_targets.clone(),
            }
        }),
        sensitivity: a.sensitivity,
        many_failures: a.many_failures,
    };
    let bar = indicatif::ProgressBar::new_spinner();
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = run_study(&config, &train, &test, &mut |m| {
        bar.set_message(m.to_string());
        tracing::info!("bench cpr: {m}");
    })?;
    bar.finish_and_clear();
    std::fs::create_dir_all(&a.out).with_context(|| a.out.display().to_string())?;
    let value = serde_json::to_value(&report)?;
    let path = a.out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&value)?)
        .with_context(|| path.display().to_string())?;
    plot_auc_pls(&report, &a.out.join("auc_vs_pls.png"))?;
    plot_overhead(&report, &a.out.join("overhead.png"))?;
    if let Some(sensitivity) = &report.sensitivity {
        plot_sensitivity(sensitivity, &a.out.join("sensitivity.png"))?;
    }
    if let Some(many) = &report.many_failures {
        plot_many_failures(many, &a.out.join("many_failures.png"))?;
    }
    if a.json {
        return print_json(value);
    }
    outln!("{}", serde_json::to_string_pretty(&value["by_fraction"])?);
    outln!(
        "auc_pls_correlation {:.4} over {} runs (95% interval {:.3}..{:.3}); targets {}",
        report.auc_pls_correlation,
        report.correlation_runs,
        report.auc_pls_correlation_interval[0],
        report.auc_pls_correlation_interval[1],
        serde_json::to_string(&report.targets)?
    );
    outln!("wrote {}", a.out.display());
    Ok(())
}

fn strategy_color(name: &str) -> RGBAColor {
    let i = Strategy::ALL
        .iter()
        .position(|s| s.name() == name)
        .unwrap_or(Strategy::ALL.len());
    Palette99::pick(i).to_rgba()
}

/// The label of bar group `i` at the group's centre (`i + 0.5`), none elsewhere: the axis
/// asks for ticks at every half unit.
fn group_label(labels: &[String], x: f64) -> String {
    let i = x.floor() as usize;
    if (x - i as f64 - 0.5).abs() < 1e-6 {
        labels.get(i).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

fn plot_auc_pls(report: &StudyReport, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let runs = &report.runs;
    let sweep = &report.pls_sweep;
    let x_max = runs
        .iter()
        .map(|r| r.pls)
        .chain(sweep.iter().map(|r| r.pls))
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.1;
    let (lo, hi) = runs
        .iter()
        .map(|r| r.auc)
        .chain(sweep.iter().map(|r| r.auc))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), a| {
            (l.min(a), h.max(a))
        });
    let pad = ((hi - lo) * 0.15).max(1e-4);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Final AUC against PLS (r = {:.3}, {} failures)",
                report.auc_pls_correlation, report.failures
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("final PLS")
        .y_desc("test AUC")
        .draw()?;
    let fit = &report.auc_pls_fit;
    chart
        .draw_series(LineSeries::new(
            [0.0, x_max].map(|x| (x, fit.slope * x + fit.intercept)),
            BLACK.stroke_width(1),
        ))?
        .label(format!(
            "fit: AUC = {:.4} {:+.4}·PLS",
            fit.intercept, fit.slope
        ))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
    for s in Strategy::ALL {
        let color = strategy_color(s.name());
        let pts: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.strategy == s.name())
            .map(|r| (r.pls, r.auc))
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, color.filled())))?
            .label(s.name())
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
    }
    if !sweep.is_empty() {
        let color = strategy_color(Strategy::CprVanilla.name());
        chart
            .draw_series(
                sweep
                    .iter()
                    .map(|r| Circle::new((r.pls, r.auc), 5, color.stroke_width(2))),
            )?
            .label("cpr_vanilla, PLS sweep")
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.stroke_width(2)));
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn plot_overhead(report: &StudyReport, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let fractions: Vec<&String> = report.by_fraction.keys().collect();
    let strategies: Vec<&str> = Strategy::ALL
        .iter()
        .map(|s| s.name())
        .filter(|n| report.runs.iter().any(|r| r.strategy == *n))
        .collect();
    let y_max = report
        .runs
        .iter()
        .map(|r| 100.0 * r.overhead_fraction_all_costs)
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.15;
    let groups = fractions.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Overhead, every cost included (% of the job), by failure fraction",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..groups, 0f64..y_max)?;
    let labels: Vec<String> = fractions.iter().map(|f| format!("{f} lost")).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(fractions.len() * 2 + 1)
        .x_label_formatter(&|x| group_label(&labels, *x))
        .y_desc("overhead %")
        .draw()?;
    let width = 0.8 / strategies.len().max(1) as f64;
    for (si, name) in strategies.iter().enumerate() {
        let color = strategy_color(name);
        let bars: Vec<Rectangle<(f64, f64)>> = fractions
            .iter()
            .enumerate()
            .filter_map(|(fi, f)| {
                let run = report.by_fraction.get(*f)?.get(*name)?;
                let x0 = fi as f64 + 0.1 + si as f64 * width;
                Some(Rectangle::new(
                    [
                        (x0, 0.0),
                        (x0 + width * 0.9, 100.0 * run.overhead_fraction_all_costs),
                    ],
                    color.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The sensitivity studies (`--sensitivity`), as the paper draws them: §6.3, the PLS
/// reached and the overhead paid at each target PLS; §6.4, CPR-SSU's overhead over full
/// recovery's at each failure count and fraction, each bar marked with Eq. 1-2's decision.
fn plot_sensitivity(s: &Sensitivity, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1300, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(620);
    let strategies: Vec<&str> = {
        let mut v: Vec<&str> = s.pls.iter().map(|p| p.strategy.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let top = s
        .pls
        .iter()
        .map(|p| p.pls.max(p.target_pls).max(p.overhead_fraction_all_costs))
        .fold(0.0, f64::max)
        * 1.15;
    let right_x = s.pls.iter().map(|p| p.target_pls).fold(0.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "§6.3: PLS reached (solid) and overhead (dashed) by target",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..right_x.max(1e-3), 0f64..top.max(1e-3))?;
    chart
        .configure_mesh()
        .x_desc("target PLS")
        .y_desc("fraction")
        .draw()?;
    for name in &strategies {
        let color = strategy_color(name);
        let points: Vec<&PlsPoint> = s.pls.iter().filter(|p| p.strategy == *name).collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.target_pls, p.pls)),
                color.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(DashedLineSeries::new(
            points
                .iter()
                .map(|p| (p.target_pls, p.overhead_fraction_all_costs)),
            6,
            4,
            color.stroke_width(1),
        ))?;
    }
    chart.draw_series(LineSeries::new(
        [(0.0, 0.0), (right_x, right_x)],
        BLACK.mix(0.3),
    ))?;
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;

    let bars = s.failures.len().max(1);
    let highest = s.failures.iter().map(|f| f.normalized).fold(1.0, f64::max) * 1.15;
    let labels: Vec<String> = s
        .failures
        .iter()
        .map(|f| format!("{}x{:.0}%", f.failures, 100.0 * f.fraction))
        .collect();
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "§6.4: CPR-SSU overhead / full (green: its decision, Eq. 2 priced by probed saves, was right)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..bars as f64, 0f64..highest)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars * 2 + 1)
        .x_label_formatter(&|x| group_label(&labels, *x))
        .x_desc("failures x fraction lost")
        .y_desc("normalized overhead")
        .draw()?;
    chart.draw_series(s.failures.iter().enumerate().map(|(i, f)| {
        let color = if f.decision_right_for_ssu { GREEN } else { RED };
        Rectangle::new(
            [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, f.normalized)],
            color.mix(0.7).filled(),
        )
    }))?;
    chart.draw_series(LineSeries::new(
        [(0.0, 1.0), (bars as f64, 1.0)],
        BLACK.stroke_width(1),
    ))?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// §6.5's Figure 11: AUC loss against PLS over the many-failure runs, coloured by the
/// number of failures, with the fit on PLS.
fn plot_many_failures(m: &ManyFailures, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let x_max = m.runs.iter().map(|r| r.pls).fold(1e-6, f64::max) * 1.1;
    let (lo, hi) = m
        .runs
        .iter()
        .map(|r| r.auc_loss)
        .fold((0.0f64, 0.0f64), |(l, h), a| (l.min(a), h.max(a)));
    let pad = ((hi - lo) * 0.15).max(1e-4);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "§6.5: AUC loss against PLS, {} runs of 1-32 failures (r = {:.3})",
                m.runs.len(),
                m.r
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))?;
    chart
        .configure_mesh()
        .x_desc("final PLS")
        .y_desc("AUC - failure-free AUC")
        .draw()?;
    chart.draw_series(LineSeries::new(
        [0.0, x_max].map(|x| (x, m.slope * x + m.intercept)),
        BLACK.stroke_width(1),
    ))?;
    for (label, range, color) in [
        ("1-4 failures", 1..=4, BLUE),
        ("5-16 failures", 5..=16, GREEN),
        ("17-32 failures", 17..=32, RED),
    ] {
        let pts: Vec<(f64, f64)> = m
            .runs
            .iter()
            .filter(|r| range.contains(&r.failures))
            .map(|r| (r.pls, r.auc_loss))
            .collect();
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, color.filled())))?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The legend of a chart's labelled series, boxed on white, at `position`.
fn draw_legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
