use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, generate, read_meta};
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE, convert, criteo, schema::Schema, stats};
use ftrec_train::{Trainer, bench, snapshot};
use serde_json::json;

use crate::cli::*;
use crate::progress::bar;

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train(a),
        Command::Eval(a) => eval(a),
        Command::Data(DataCommand::Gen(a)) => data_gen(a),
        Command::Data(DataCommand::Convert(a)) => data_convert(a),
        Command::Data(DataCommand::Stats(a)) => data_stats(a),
        Command::Bench(BenchCommand::Train(a)) => bench_train(a),
        Command::Bench(BenchCommand::Ckpt(a)) => crate::bench_ckpt::run(a),
        Command::Bench(BenchCommand::Cluster(a)) => crate::bench_cluster::run(a),
        Command::Bench(BenchCommand::Ec(a)) => crate::bench_ec::run(a),
        Command::Bench(BenchCommand::Cpr(a)) => crate::bench_cpr::run(a),
        Command::Demo(a) => crate::demo::run(a),
        Command::Ckpt(c) => crate::ckpt::run(c),
        Command::Cluster(ClusterCommand::Run(a)) => crate::cluster::run(*a),
        Command::Cluster(ClusterCommand::Kill {
            coordinator,
            job,
            member,
        }) => crate::cluster::kill(&coordinator, job.as_deref(), &member),
        Command::Server(a) => crate::cluster::server(a),
        Command::Worker(a) => crate::cluster::worker(a),
        Command::Coordinator(a) => crate::cluster::coordinator(a),
        Command::Plot(PlotCommand::Timeline { input, out, title }) => {
            crate::cluster::plot_timeline(&input, &out, &title)
        }
    }
}

pub(crate) fn load_config(args: &ConfigArgs, extra: Vec<String>) -> Result<JobConfig> {
    let mut overrides = args.overrides.clone();
    if let Some(s) = args.seed {
        overrides.push(format!("seed={s}"));
    }
    if let Some(t) = args.threads {
        overrides.push(format!("threads={t}"));
    }
    overrides.extend(extra);
    let preset = match (&args.preset, &args.config) {
        (Some(p), _) => Some(p.as_str()),
        (None, None) => Some("tiny"),
        (None, Some(_)) => None,
    };
    let config = JobConfig::load(preset, args.config.as_deref(), &overrides)?;
    // Before anything is allocated: a model too large for this host would abort.
    config.fits_in_memory(0)?;
    Ok(config)
}

pub(crate) fn print_json(value: serde_json::Value) -> Result<()> {
    writeln!(stdout(), "{}", serde_json::to_string(&value)?)?;
    Ok(())
}

/// Standard output for results. Written with `writeln!` so a closed pipe is an error
/// (mapped to a quiet exit in `main`), where `println!` would panic.
pub(crate) fn stdout() -> std::io::StdoutLock<'static> {
    std::io::stdout().lock()
}

fn open_split(dir: &Path, file: &str) -> Result<Dataset> {
    // DataError already names the file.
    Ok(Dataset::open_split(dir, file)?)
}

struct TrainOutcome {
    resumed_from: Option<String>,
    writer: Option<ftrec_ckpt::WriterStart>,
    report: ftrec_train::TrainReport,
    metrics: ftrec_model::metrics::Metrics,
    digest: String,
}

fn train_and_eval(
    config: &JobConfig,
    dir: &Path,
    save: Option<&Path>,
    resume: Option<&str>,
    fallback: bool,
    quiet: bool,
) -> Result<TrainOutcome> {
    let train_ds = open_split(dir, TRAIN_FILE)?;
    let test_ds = open_split(dir, TEST_FILE)?;
    let mut trainer = match resume {
        Some(spec) => {
            let (ck_dir, id) = crate::ckpt::parse_location(spec);
            Trainer::resume(config, &ck_dir, id.as_deref(), fallback)?
        }
        None => Trainer::new(config)?,
    };
    let total = trainer.planned_steps(&train_ds);
    // Before checkpointing starts (a resume may fork a branch): nothing to undo.
    trainer.check_total_steps(total)?;
    trainer.enable_checkpoints()?;
    for w in &trainer.resume_warnings {
        eprintln!("warning: {w}");
    }
    if let Some(id) = &trainer.resumed_from
        && trainer.progress.step == total
    {
        eprintln!("warning: checkpoint {id} is already at step {total}: nothing left to train");
    }
    let pb = bar(total, "train");
    if quiet {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = trainer.train(&train_ds, total, |s| {
        pb.set_position(s.step);
        if s.step % 5 == 0 || s.step == s.total_steps {
            pb.set_message(format!(
                "{:.0} samples/s loss {:.4}",
                s.samples as f64 / s.elapsed_secs.max(1e-9),
                s.loss
            ));
        }
    })?;
    pb.finish_and_clear();
    let metrics = trainer.evaluate(&test_ds, config.train.eval_samples)?;
    if let Some(path) = save {
        snapshot::save(path, &trainer.state, trainer.progress)?;
    }
    Ok(TrainOutcome {
        resumed_from: trainer.resumed_from.clone(),
        writer: trainer.writer_start.clone(),
        report,
        metrics,
        digest: trainer.digest().to_string(),
    })
}

/// The `--set` overrides behind the run flags shared by `train` and `cluster run`.
pub(crate) fn run_overrides(
    steps: Option<u64>,
    data: Option<&Path>,
    checkpoint_dir: Option<&Path>,
) -> Vec<String> {
    let mut extra = Vec::new();
    if let Some(s) = steps {
        extra.push(format!("train.steps={s}"));
    }
    if let Some(d) = data {
        extra.push(format!(
            "data.dir={}",
            toml_string(&d.display().to_string())
        ));
    }
    if let Some(d) = checkpoint_dir {
        extra.push(format!(
            "checkpoint.dir={}",
            toml_string(&d.display().to_string())
        ));
    }
    extra
}

fn train(a: TrainArgs) -> Result<()> {
    let mut extra = run_overrides(a.steps, a.data.as_deref(), a.checkpoint_dir.as_deref());
    if a.new_branch {
        extra.push("checkpoint.new_branch=true".into());
    }
    let config = load_config(&a.config, extra)?;
    config.require_checkpoint_dir()?;
    let Some(dir) = config.data.dir.clone() else {
        bail!("no dataset: pass --data DIR or set data.dir");
    };
    let out = train_and_eval(
        &config,
        &dir,
        a.save.as_deref(),
        a.resume.as_deref(),
        a.fallback,
        false,
    )?;
    let teacher_auc = read_meta(&dir).map(|m| m.teacher_auc);
    if a.json {
        return print_json(json!({
            "auc": out.metrics.auc,
            "logloss": out.metrics.logloss,
            "accuracy": out.metrics.accuracy,
            "eval_samples": out.metrics.samples,
            "samples": out.report.samples,
            "steps": out.report.steps,
            "seconds": out.report.seconds,
            "samples_per_sec": out.report.samples_per_sec,
            "train_logloss": out.report.train_logloss,
            "state_digest": out.digest,
            "teacher_auc": teacher_auc,
            "checkpoints": out.report.checkpoints,
            "resumed_from": out.resumed_from,
            "checkpoint_branch": out.writer.as_ref().map(|w| w.branch),
            "forked_from": out.writer.as_ref().and_then(|w| w.forked_from.clone()),
        }));
    }
    outln!(
        "trained {} steps ({} samples) in {:.1}s: {:.0} samples/s, train logloss {:.4}",
        out.report.steps,
        out.report.samples,
        out.report.seconds,
        out.report.samples_per_sec,
        out.report.train_logloss
    );
    outln!(
        "held-out ({} samples): AUC {:.4}, logloss {:.4}, accuracy {:.4}{}",
        out.metrics.samples,
        out.metrics.auc,
        out.metrics.logloss,
        out.metrics.accuracy,
        teacher_auc.map_or(String::new(), |t| format!(" (teacher AUC {t:.4})"))
    );
    outln!("state digest {}", out.digest);
    Ok(())
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

fn eval(a: EvalArgs) -> Result<()> {
    let (state, progress) = snapshot::load(&a.model)?;
    let config = JobConfig::for_model(state.config(), a.batch_size, a.threads);
    config.fits_in_memory(state.bytes() as u64)?;
    let mut trainer = Trainer::with_state(&config, state, progress)?;
    let ds = open_split(&a.data, TEST_FILE)?;
    let m = trainer.evaluate(&ds, a.limit)?;
    if a.json {
        return print_json(json!({
            "auc": m.auc, "logloss": m.logloss, "accuracy": m.accuracy,
            "samples": m.samples, "model_step": progress.step,
            "state_digest": trainer.digest().to_string(),
        }));
    }
    outln!(
        "{} samples: AUC {:.4}, logloss {:.4}, accuracy {:.4} (model at step {})",
        m.samples,
        m.auc,
        m.logloss,
        m.accuracy,
        progress.step
    );
    Ok(())
}

fn gen_config(a: &GenArgs) -> Result<GenConfig> {
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

fn data_gen(a: GenArgs) -> Result<()> {
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

fn data_convert(a: ConvertArgs) -> Result<()> {
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

fn data_stats(a: StatsArgs) -> Result<()> {
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

fn bench_train(a: BenchTrainArgs) -> Result<()> {
    let config = load_config(&a.config, Vec::new())?;
    let pb = bar((a.warmup + a.steps) as u64, "bench");
    if a.json {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let r = bench::bench_train(&config, a.warmup, a.steps, |i| pb.set_position(i as u64))?;
    pb.finish_and_clear();
    if a.json {
        return print_json(serde_json::to_value(&r)?);
    }
    outln!(
        "batch {} on {} threads: median step {:.2} ms (p10 {:.2}, p90 {:.2}) = {:.0} samples/s; model {:.0} MiB, peak RSS {}",
        r.batch_size,
        r.threads,
        r.step_ms_median,
        r.step_ms_p10,
        r.step_ms_p90,
        r.samples_per_sec,
        r.model_bytes as f64 / (1 << 20) as f64,
        r.peak_rss_bytes.map_or("n/a".into(), |b| format!(
            "{:.0} MiB",
            b as f64 / (1 << 20) as f64
        ))
    );
    Ok(())
}
