//! `ftrec data gen | convert | stats`: synthetic data, conversion to the binary format,
//! and statistics.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use ftrec_data::generate::{GenConfig, OutputFormat, generate};
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE, convert, criteo, schema::Schema, stats};
use serde_json::json;

use crate::output::{print_json, stdout};
use crate::progress::bar;

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Synthetic Criteo-shaped data with a planted teacher model.
    Gen(GenArgs),
    /// Convert Criteo TSV or schema-described text to the binary format.
    Convert(ConvertArgs),
    /// Statistics of a dataset directory or .ftrd file.
    Stats(StatsArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum GenFormat {
    Binary,
    CriteoTsv,
}

#[derive(Args, Debug)]
pub struct GenArgs {
    /// Preset sizing: `tiny` scales the Criteo Kaggle cardinalities by 0.01.
    #[arg(long)]
    pub preset: Option<String>,
    /// Total samples (train + test).
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Factor applied to the Criteo Kaggle cardinalities (overrides the preset's).
    #[arg(long)]
    pub scale: Option<f64>,
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    #[arg(long, default_value_t = 0.1)]
    pub test_fraction: f64,
    #[arg(long, value_enum, default_value_t = GenFormat::Binary)]
    pub format: GenFormat,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Input text files, or directories of them (read in natural name order); plain,
    /// gzip or zstd, told by their first bytes, not their names.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The dataset directory: its train.ftrd and test.ftrd are replaced only once the
    /// whole input converted, and a stale meta.json is removed.
    #[arg(long)]
    pub out: PathBuf,
    /// Schema file for non-Criteo data; Criteo TSV when absent.
    #[arg(long)]
    pub schema: Option<PathBuf>,
    /// Share of samples held out for test. Exact for any size: sample i (0-based) is a
    /// test sample iff floor((i+1)*f) > floor(i*f), so the first n samples hold
    /// floor(n*f) test samples, evenly interleaved. An empty split is warned about.
    #[arg(long, default_value_t = 0.1)]
    pub test_fraction: f64,
    /// Skip malformed lines (and report how many) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    pub path: PathBuf,
    /// Only the first N samples.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn gen_config(a: &GenArgs) -> Result<GenConfig> {
    let preset_scale = match a.preset.as_deref() {
        Some("tiny") => 0.01,
        Some(other) => bail!("unknown data preset {other:?} (known: tiny)"),
        None => 0.01,
    };
    let mut c = GenConfig::criteo(a.rows, a.seed, a.scale.unwrap_or(preset_scale));
    c.zipf_exponent = a.zipf;
    c.test_fraction = a.test_fraction;
    Ok(c)
}

pub(crate) fn run_gen(
    config: &GenConfig,
    out: &Path,
    format: OutputFormat,
    quiet: bool,
) -> Result<ftrec_data::generate::GenReport> {
    let pb = bar(config.rows, "generate");
    if quiet {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = generate(config, out, format, |n| pb.set_position(n))
        .with_context(|| format!("generating into {}", out.display()))?;
    pb.finish_and_clear();
    Ok(report)
}

pub(crate) fn data_gen(a: GenArgs) -> Result<()> {
    let config = gen_config(&a)?;
    let format = match a.format {
        GenFormat::Binary => OutputFormat::Binary,
        GenFormat::CriteoTsv => OutputFormat::CriteoTsv,
    };
    let r = run_gen(&config, &a.out, format, false)?;
    if a.json {
        return print_json(json!({
            "teacher_auc": r.teacher_auc, "teacher_logloss": r.teacher_logloss,
            "train_samples": r.train_samples, "test_samples": r.test_samples,
            "positive_rate": r.positive_rate, "out": a.out,
        }));
    }
    let mut out = stdout();
    writeln!(
        out,
        "wrote {} train + {} test samples to {} (CTR {:.3}); teacher AUC on test {:.4}",
        r.train_samples,
        r.test_samples,
        a.out.display(),
        r.positive_rate,
        r.teacher_auc
    )?;
    Ok(())
}

pub(crate) fn data_convert(a: ConvertArgs) -> Result<()> {
    let schema = match &a.schema {
        Some(p) => Schema::load(p)?,
        None => criteo::schema(),
    };
    let opts = convert::ConvertOptions {
        inputs: convert::expand_inputs(&a.inputs)?,
        schema,
        out_dir: a.out.clone(),
        test_fraction: a.test_fraction,
        skip_bad_lines: a.skip_bad_lines,
    };
    let pb = indicatif::ProgressBar::new_spinner();
    let r = convert::convert(&opts, |n| pb.set_message(format!("{n} samples")))?;
    pb.finish_and_clear();
    for w in &r.warnings {
        eprintln!("warning: {w}");
    }
    if a.json {
        return print_json(serde_json::to_value(&r)?);
    }
    let mut out = stdout();
    writeln!(
        out,
        "{} lines: {} train + {} test samples, {} bad lines skipped",
        r.lines, r.train_samples, r.test_samples, r.bad_lines
    )?;
    if let Some(first) = r.first_bad {
        writeln!(out, "first bad line: {first}")?;
    }
    Ok(())
}

pub(crate) fn data_stats(a: StatsArgs) -> Result<()> {
    let files: Vec<PathBuf> = if a.path.is_dir() {
        vec![a.path.join(TRAIN_FILE), a.path.join(TEST_FILE)]
    } else {
        vec![a.path.clone()]
    };
    let mut all = serde_json::Map::new();
    let mut out = stdout();
    for f in files {
        let ds = Dataset::open(&f)?;
        let s = stats::compute(&ds, a.limit);
        if !a.json {
            writeln!(
                out,
                "{}: {} samples, CTR {:.4}, {} dense, {} sparse{}",
                f.display(),
                s.samples,
                s.positive_rate,
                s.dense.len(),
                s.sparse.len(),
                if s.multi_hot { " (multi-hot)" } else { "" }
            )?;
            for (i, d) in s.sparse.iter().enumerate() {
                writeln!(
                    out,
                    "  sparse {i:>2}: {:>9} distinct, {:.3} missing, max bag {}",
                    d.distinct, d.missing_fraction, d.max_bag
                )?;
            }
        }
        all.insert(f.display().to_string(), serde_json::to_value(&s)?);
    }
    if a.json {
        print_json(serde_json::Value::Object(all))?;
    }
    Ok(())
}
