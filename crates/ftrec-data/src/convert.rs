//! Text (Criteo TSV or schema-described) to the binary format, with a deterministic
//! train/test split.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::schema::Schema;
use crate::text::{TextSummary, for_each_record};
use crate::{DataError, DatasetWriter, TEST_FILE, TRAIN_FILE};

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub inputs: Vec<PathBuf>,
    pub schema: Schema,
    pub out_dir: PathBuf,
    /// Every sample whose index modulo 1000 is below `test_fraction * 1000` goes to the
    /// test split: deterministic, streaming, and spread over the whole input.
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
}

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
    std::fs::create_dir_all(&opts.out_dir).map_err(|e| DataError::io(&opts.out_dir, e))?;
    let (nd, ns) = (opts.schema.num_dense(), opts.schema.num_sparse());
    let multi_hot = opts.schema.multi_hot_separator.is_some();
    let mut train = DatasetWriter::create(&opts.out_dir.join(TRAIN_FILE), nd, ns, multi_hot)?;
    let mut test = DatasetWriter::create(&opts.out_dir.join(TEST_FILE), nd, ns, multi_hot)?;
    let per_mille = (opts.test_fraction * 1000.0).round() as u64;
    let mut report = ConvertReport::default();
    let mut index = 0u64;
    for input in &opts.inputs {
        let summary: TextSummary =
            for_each_record(input, &opts.schema, opts.skip_bad_lines, |rec| {
                let sink = if index % 1000 < per_mille {
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
    report.train_samples = train.finish()?;
    report.test_samples = test.finish()?;
    Ok(report)
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
