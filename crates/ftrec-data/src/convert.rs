//! Text (Criteo TSV or schema-described) to the binary format, with a deterministic
//! train/test split.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::schema::Schema;
use crate::staging::Staging;
use crate::text::{TextSummary, for_each_record};
use crate::{DataError, DatasetWriter, META_FILE, TEST_FILE, TRAIN_FILE};

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub inputs: Vec<PathBuf>,
    pub schema: Schema,
    pub out_dir: PathBuf,
    /// Sample `i` (0-based, over all inputs) goes to the test split iff
    /// `floor((i + 1) * f) > floor(i * f)`: the first `n` samples hold exactly
    /// `floor(n * f)` test samples for every `n`, spread evenly, deterministic and
    /// streaming. See [`is_test_sample`].
    pub test_fraction: f64,
    pub skip_bad_lines: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ConvertReport {
    pub train_samples: u64,
    pub test_samples: u64,
    pub lines: u64,
    pub bad_lines: u64,
    pub first_bad: Option<String>,
    /// Things the user must see: most lines skipped, an empty split.
    pub warnings: Vec<String>,
}

/// More than this share of lines skipped is reported loudly: the schema or the file is
/// probably wrong, not a few lines.
const MOST_LINES: f64 = 0.5;

/// Whether sample `index` belongs to the test split at `fraction` (see
/// [`ConvertOptions::test_fraction`]).
pub fn is_test_sample(index: u64, fraction: f64) -> bool {
    ((index + 1) as f64 * fraction).floor() > (index as f64 * fraction).floor()
}

/// Converts the inputs into `train.ftrd` and `test.ftrd` in `out_dir`. Both files are
/// written into a staging directory inside `out_dir` and moved into place only when the
/// conversion succeeded, so a failed convert leaves the old dataset as it was and no
/// temporary files; a successful one also removes the old dataset's `meta.json`, which
/// describes a generated dataset and would be wrong for this one.
pub fn convert(
    opts: &ConvertOptions,
    mut progress: impl FnMut(u64),
) -> Result<ConvertReport, DataError> {
    if !(0.0..1.0).contains(&opts.test_fraction) {
        return Err(DataError::Invalid(format!(
            "test fraction must be in [0, 1), got {}",
            opts.test_fraction
        )));
    }
    if opts.inputs.is_empty() {
        return Err(DataError::Invalid("no input files to convert".into()));
    }
    let staging = Staging::create(&opts.out_dir, "convert")?;
    let (nd, ns) = (opts.schema.num_dense(), opts.schema.num_sparse());
    let multi_hot = opts.schema.multi_hot_separator.is_some();
    let mut train = DatasetWriter::create(&staging.path.join(TRAIN_FILE), nd, ns, multi_hot)?;
    let mut test = DatasetWriter::create(&staging.path.join(TEST_FILE), nd, ns, multi_hot)?;
    let mut report = ConvertReport::default();
    let mut index = 0u64;
    for input in &opts.inputs {
        let summary: TextSummary =
            for_each_record(input, &opts.schema, opts.skip_bad_lines, |rec| {
                let sink = if is_test_sample(index, opts.test_fraction) {
                    &mut test
                } else {
                    &mut train
                };
                sink.push(rec)?;
                index += 1;
                if index.is_multiple_of(1 << 16) {
                    progress(index);
                }
                Ok(())
            })?;
        report.lines += summary.lines;
        report.bad_lines += summary.bad_lines;
        if report.first_bad.is_none() {
            report.first_bad = summary.first_bad;
        }
    }
    progress(index);
    let inputs = describe(&opts.inputs);
    if index == 0 {
        // Nothing to train on is never what a convert was for; the old dataset stays.
        return Err(DataError::Invalid(if report.bad_lines > 0 {
            format!(
                "all {} lines of {inputs} were bad and skipped, no samples written                  (first: {}); is the schema right for this file?",
                report.bad_lines,
                report.first_bad.as_deref().unwrap_or("?")
            )
        } else {
            format!("{inputs}: no samples (the input is empty)")
        }));
    }
    let data_lines = index + report.bad_lines;
    if report.bad_lines as f64 > MOST_LINES * data_lines as f64 {
        report.warnings.push(format!(
            "{} of {data_lines} lines ({:.0}%) were bad and skipped; is the schema right              for this file?",
            report.bad_lines,
            100.0 * report.bad_lines as f64 / data_lines as f64
        ));
    }
    report.train_samples = train.finish()?;
    report.test_samples = test.finish()?;
    for (name, n) in [
        (TRAIN_FILE, report.train_samples),
        (TEST_FILE, report.test_samples),
    ] {
        if n == 0 {
            report.warnings.push(format!(
                "{name} is empty: {index} samples at test fraction {} leave none for it",
                opts.test_fraction
            ));
        }
    }
    // The old meta.json describes a generated dataset, not this one.
    staging.publish(&opts.out_dir, &[TRAIN_FILE, TEST_FILE], &[META_FILE])?;
    Ok(report)
}

fn describe(inputs: &[PathBuf]) -> String {
    match inputs {
        [one] => one.display().to_string(),
        [first, ..] => format!("{} input files ({} ...)", inputs.len(), first.display()),
        [] => "no input".into(),
    }
}

/// Input paths as given, or every regular file in a directory (sorted), so a Terabyte
/// `day_0..day_23` directory converts in day order.
pub fn expand_inputs(paths: &[PathBuf]) -> Result<Vec<PathBuf>, DataError> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| DataError::io(p, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            if files.is_empty() {
                return Err(DataError::format(
                    p,
                    "is a directory with no files to convert",
                ));
            }
            files.sort_by_key(|p| natural_key(p));
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Sorts `day_2` before `day_10`.
fn natural_key(p: &Path) -> (String, u64) {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let digits: String = name
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    let num = digits
        .chars()
        .rev()
        .collect::<String>()
        .parse()
        .unwrap_or(0);
    (
        name.trim_end_matches(|c: char| c.is_ascii_digit())
            .to_string(),
        num,
    )
}
