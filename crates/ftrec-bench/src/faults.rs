//! `ftrec bench faults`: every kind of silent failure (a host's link down, a partition
//! between the worker and one server, 5% loss, a frozen server, a frozen server resumed as
//! a zombie) at random moments under each `--ft`, across Linux network namespaces, each
//! faulted run right after the same run without the fault. The runs themselves are
//! `tools/netns-harness.sh sweep` (processes started by hand in their own namespaces, as on
//! separate hosts); this bench drives it with the binary and reduces its trials to the
//! table BENCHMARKS.md quotes: per fault and mode, the medians of time to detect, time to
//! resume and slowdown, and how many runs ended exact, finished, or recovered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_json::{Value, json};

use crate::error::{BenchError, Result};
use crate::host::Host;

/// `ftrec bench faults`'s flags.
#[derive(Clone, Debug)]
pub struct FaultsOptions {
    /// The namespace harness that runs each trial.
    pub harness: PathBuf,
    pub rounds: u32,
    pub faults: Vec<String>,
    pub fts: Vec<String>,
    /// The range of seconds after training starts the fault's moment is drawn from.
    pub at: String,
    pub seed: u64,
    pub steps: u64,
    /// Reduce an earlier sweep's trials instead of running one.
    pub from_trials: Option<PathBuf>,
    pub out: PathBuf,
}

/// Runs the sweep (or reads an earlier one) and reduces it; the summary (the caller
/// writes `summary.json`), its rows under `by_fault`.
pub fn run(host: &dyn Host, a: &FaultsOptions) -> Result<Value> {
    std::fs::create_dir_all(&a.out).map_err(BenchError::file(&a.out))?;
    let trials_path = match &a.from_trials {
        Some(path) => path.clone(),
        None => run_sweep(host, a)?,
    };
    let text = std::fs::read_to_string(&trials_path).map_err(BenchError::file(&trials_path))?;
    let trials: Value = serde_json::from_str(&text).map_err(|source| BenchError::Json {
        what: format!("{}: not JSON", trials_path.display()),
        source,
    })?;
    let list = trials["trials"].as_array().map_or(&[][..], Vec::as_slice);
    let rows = summarize(list);
    let rounds = list.iter().filter_map(|t| t["round"].as_u64()).max();
    Ok(json!({
        "rounds": rounds,
        "trials": trials_path,
        "pairs": list.len(),
        "by_fault": rows,
    }))
}

/// Runs the harness's sweep with the binary; returns where it wrote its trials.
fn run_sweep(host: &dyn Host, a: &FaultsOptions) -> Result<PathBuf> {
    if !a.harness.is_file() {
        return Err(BenchError::Usage(format!(
            "{}: the namespace harness is not there (run from the repository root, or pass --harness)",
            a.harness.display()
        )));
    }
    let trials_path = std::path::absolute(a.out.join("trials.json"))?;
    let exe = host.exe()?;
    let status = Command::new(&a.harness)
        .arg("sweep")
        .arg("--json")
        .arg(&trials_path)
        .args(["--rounds", &a.rounds.to_string()])
        .args(["--faults", &a.faults.join(",")])
        .args(["--fts", &a.fts.join(",")])
        .args(["--at", &a.at])
        .args(["--seed", &a.seed.to_string()])
        .args(["--steps", &a.steps.to_string()])
        .env("BIN", &exe)
        .status()
        .map_err(|source| BenchError::IoDuring {
            what: format!("running {}", a.harness.display()),
            source,
        })?;
    if !status.success() {
        return Err(BenchError::Failed(format!(
            "{} sweep failed ({status}); it needs root for network namespaces",
            a.harness.display()
        )));
    }
    Ok(trials_path)
}

/// One row per (fault, ft): medians over the rounds, and counts of what every run kept.
pub(crate) fn summarize(trials: &[Value]) -> Vec<Value> {
    let mut groups: BTreeMap<(String, String), Vec<&Value>> = BTreeMap::new();
    for t in trials {
        let f = &t["faulted"];
        let key = (
            f["fault"].as_str().unwrap_or("?").to_string(),
            f["ft"].as_str().unwrap_or("?").to_string(),
        );
        groups.entry(key).or_default().push(t);
    }
    groups
        .into_iter()
        .map(|((fault, ft), runs)| {
            let faulted = |key: &str| -> Vec<f64> {
                runs.iter()
                    .filter_map(|t| t["faulted"][key].as_f64())
                    .collect()
            };
            let baseline: Vec<f64> = runs
                .iter()
                .filter_map(|t| t["baseline"]["seconds"].as_f64())
                .collect();
            let slowdown: Vec<f64> = runs
                .iter()
                .filter_map(|t| t["slowdown_seconds"].as_f64())
                .collect();
            let count = |test: &dyn Fn(&Value) -> bool| runs.iter().filter(|t| test(t)).count();
            json!({
                "fault": fault,
                "ft": ft,
                "runs": runs.len(),
                "finished": count(&|t| t["faulted"]["result"] == "ok"),
                "exact": count(&|t| t["faulted"]["exact"] == true),
                "baselines_exact": count(&|t| t["baseline"]["exact"] == true),
                "mismatches": runs.iter().map(|t| {
                    t["faulted"]["parity_mismatches"].as_u64().unwrap_or(0)
                        + t["faulted"]["replica_mismatches"].as_u64().unwrap_or(0)
                }).sum::<u64>(),
                "with_recovery": count(&|t| t["faulted"]["recoveries"].as_u64().unwrap_or(0) > 0),
                "zombies_refused": runs.iter().map(|t| t["faulted"]["zombies_refused"].as_u64().unwrap_or(0)).sum::<u64>(),
                "detect_seconds": spread(faulted("detect_seconds")),
                "resume_seconds": spread(faulted("resume_seconds")),
                "seconds": spread(faulted("seconds")),
                "baseline_seconds": spread(baseline),
                "slowdown_seconds": spread(slowdown),
            })
        })
        .collect()
}

/// Median (the mean of the middle two for an even count), min and max; null where no
/// run had the figure.
fn spread(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    json!({ "median": median, "min": v[0], "max": v[n - 1], "n": n })
}

/// The table BENCHMARKS.md quotes, one line each, of the summary's `by_fault` rows.
pub fn table(rows: &[Value]) -> Vec<String> {
    let median = |v: &Value| {
        v["median"]
            .as_f64()
            .map_or("-".to_string(), |m| format!("{m:.2}"))
    };
    let mut lines = vec![
        "| fault | ft | runs | finished | exact | recovered | detect s | resume s | slowdown s |"
            .to_string(),
        "|---|---|---|---|---|---|---|---|---|".to_string(),
    ];
    for r in rows {
        lines.push(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r["fault"].as_str().unwrap_or("?"),
            r["ft"].as_str().unwrap_or("?"),
            r["runs"],
            r["finished"],
            r["exact"],
            r["with_recovery"],
            median(&r["detect_seconds"]),
            median(&r["resume_seconds"]),
            median(&r["slowdown_seconds"]),
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial(fault: &str, ft: &str, seconds: f64, base: f64, exact: bool) -> Value {
        json!({
            "round": 1,
            "baseline": { "seconds": base, "exact": true, "result": "ok" },
            "faulted": {
                "fault": fault, "ft": ft, "seconds": seconds, "exact": exact,
                "result": if exact { "ok" } else { "timed out after 300 s" },
                "recoveries": 1, "parity_mismatches": 0, "replica_mismatches": 0,
                "detect_seconds": 1.1, "resume_seconds": 1.4,
            },
            "slowdown_seconds": seconds - base,
        })
    }

    #[test]
    fn trials_reduce_to_one_row_per_fault_and_mode_with_medians_and_counts() {
        let trials = vec![
            trial("link-down", "ec", 12.0, 10.0, true),
            trial("link-down", "ec", 14.0, 10.0, true),
            trial("link-down", "ec", 30.0, 10.0, false),
            trial("partition", "ec", 20.0, 10.0, true),
        ];
        let rows = summarize(&trials);
        assert_eq!(rows.len(), 2);
        let link = &rows[0];
        assert_eq!(link["fault"], "link-down");
        assert_eq!(link["runs"], 3);
        assert_eq!(link["finished"], 2);
        assert_eq!(link["exact"], 2);
        assert_eq!(link["slowdown_seconds"]["median"], 4.0);
        assert_eq!(link["slowdown_seconds"]["max"], 20.0);
        assert_eq!(rows[1]["slowdown_seconds"]["n"], 1);
        assert_eq!(spread(vec![4.0, 1.0])["median"], 2.5);
    }

    #[test]
    fn the_table_has_a_line_per_row_and_dashes_for_figures_no_run_had() {
        let rows = summarize(&[trial("loss", "partial", 12.0, 10.0, true)]);
        let mut no_detect = rows[0].clone();
        no_detect["detect_seconds"] = Value::Null;
        let lines = table(&[rows[0].clone(), no_detect]);
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[2],
            "| loss | partial | 1 | 1 | 1 | 1 | 1.10 | 1.40 | 2.00 |"
        );
        assert_eq!(
            lines[3],
            "| loss | partial | 1 | 1 | 1 | 1 | - | 1.40 | 2.00 |"
        );
        assert_eq!(table(&[]).len(), 2);
    }

    #[test]
    fn no_trials_reduce_to_no_rows() {
        assert!(summarize(&[]).is_empty());
        assert_eq!(spread(Vec::new()), Value::Null);
    }
}
