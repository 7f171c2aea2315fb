//! The one `cluster run` command line the multi-process tests build ([`ClusterRun`]), and
//! what they read back from a run: its event log and its announced coordinator.

use std::fmt::Display;
use std::path::Path;

use serde_json::Value;

use ftrec_proto::timeline::{EventKind, TimelineData};

use crate::Ftrec;
use crate::cli::model;

/// A `cluster run` command line, built flag by flag: `ClusterRun::new(&data)
/// .run_dir(&run).steps(60).servers(3).workers(2).ft("ec").kill("server:1@step:8")
/// .args()`.
///
/// [`new`](Self::new) starts from what every cluster test shares (a 240 s time limit,
/// the JSON report, the small model with seed 4); the other flags follow in the order
/// they were added, so repeated flags (`--kill`, `--fault`, `--set`) keep their order.
#[derive(Clone, Debug)]
pub struct ClusterRun {
    data: String,
    steps: Option<String>,
    run_dir: Option<String>,
    time_limit: Option<String>,
    json: bool,
    model: bool,
    extra: Vec<String>,
}

impl ClusterRun {
    /// `cluster run` of `data` with a 240 s time limit, `--json` and the small model.
    pub fn new(data: &str) -> Self {
        ClusterRun {
            time_limit: Some("240".into()),
            json: true,
            model: true,
            ..ClusterRun::bare(data)
        }
    }

    /// Only `cluster run --data DATA`: for command lines refused before anything runs.
    pub fn bare(data: &str) -> Self {
        ClusterRun {
            data: data.to_string(),
            steps: None,
            run_dir: None,
            time_limit: None,
            json: false,
            model: false,
            extra: Vec::new(),
        }
    }

    pub fn steps(mut self, steps: impl Display) -> Self {
        self.steps = Some(steps.to_string());
        self
    }

    pub fn run_dir(mut self, dir: &Path) -> Self {
        self.run_dir = Some(dir.to_str().expect("a UTF-8 run directory").to_string());
        self
    }

    /// No `--time-limit`: the launcher's own default.
    pub fn no_time_limit(mut self) -> Self {
        self.time_limit = None;
        self
    }

    pub fn servers(self, n: impl Display) -> Self {
        self.arg("--servers", n)
    }

    pub fn workers(self, n: impl Display) -> Self {
        self.arg("--workers", n)
    }

    /// `--ft MODE`: `checkpoint`, `ec`, `partial`, `auto`, ...
    pub fn ft(self, mode: &str) -> Self {
        self.arg("--ft", mode)
    }

    pub fn deterministic(self) -> Self {
        self.flag("--deterministic")
    }

    pub fn no_eval(self) -> Self {
        self.flag("--no-eval")
    }

    /// `--set KEY=VALUE`.
    pub fn set(self, setting: impl Display) -> Self {
        self.arg("--set", setting)
    }

    /// `--kill ROLE:N@WHEN`.
    pub fn kill(self, spec: impl Display) -> Self {
        self.arg("--kill", spec)
    }

    /// `--fault ROLE:N@POINT:STEP[=ACTION]`.
    pub fn fault(self, spec: impl Display) -> Self {
        self.arg("--fault", spec)
    }

    /// `--json`, where [`bare`](Self::bare) left it out.
    pub fn json(mut self) -> Self {
        self.json = true;
        self
    }

    /// No `--json`: the text report.
    pub fn no_json(mut self) -> Self {
        self.json = false;
        self
    }

    /// Any other flag with its value.
    pub fn arg(mut self, flag: &str, value: impl Display) -> Self {
        self.extra.push(flag.to_string());
        self.extra.push(value.to_string());
        self
    }

    /// Any other flag without a value.
    pub fn flag(mut self, flag: &str) -> Self {
        self.extra.push(flag.to_string());
        self
    }

    /// Words appended as they are: a test's own extra flags.
    pub fn extend<S: AsRef<str>>(mut self, words: impl IntoIterator<Item = S>) -> Self {
        self.extra
            .extend(words.into_iter().map(|w| w.as_ref().to_string()));
        self
    }

    /// The command line, `cluster run ...`, for `Ftrec::run` or a spawned `Command`.
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec!["cluster".into(), "run".into(), "--data".into()];
        args.push(self.data.clone());
        for (flag, value) in [
            ("--steps", &self.steps),
            ("--run-dir", &self.run_dir),
            ("--time-limit", &self.time_limit),
        ] {
            if let Some(value) = value {
                args.push(flag.into());
                args.push(value.clone());
            }
        }
        if self.json {
            args.push("--json".into());
        }
        if self.model {
            args.extend(model().into_iter().map(String::from));
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

impl ClusterRun {
    /// Runs the command line to completion, which must succeed: its JSON report.
    pub fn report(&self, ftrec: Ftrec) -> Value {
        ftrec.json(&self.args())
    }
}

/// The run's event log (`timeline.json` in its run directory), typed: a test compares
/// `EventKind`s, so a renamed or misspelt kind fails to compile instead of never matching.
pub fn timeline(run_dir: &Path) -> TimelineData {
    let path = run_dir.join("timeline.json");
    TimelineData::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The run's events: time, kind, detail.
pub fn timed_events(run_dir: &Path) -> Vec<(f64, EventKind, String)> {
    timeline(run_dir)
        .events
        .into_iter()
        .map(|e| (e.t, e.kind, e.detail))
        .collect()
}

/// The run's events: kind, detail.
pub fn events(run_dir: &Path) -> Vec<(EventKind, String)> {
    timed_events(run_dir)
        .into_iter()
        .map(|(_, k, d)| (k, d))
        .collect()
}

/// The kinds of the run's events, in order.
pub fn event_kinds(run_dir: &Path) -> Vec<EventKind> {
    timed_events(run_dir)
        .into_iter()
        .map(|(_, k, _)| k)
        .collect()
}

/// Reads a `cluster run`'s stderr until it announces its coordinator: returns the
/// coordinator's address and its metrics address. The rest of stderr stays readable.
pub fn announced(
    child: &mut std::process::Child,
) -> (
    String,
    String,
    std::io::BufReader<std::process::ChildStderr>,
) {
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0,
            "the cluster exited without announcing its coordinator"
        );
        if let Some(rest) = line.trim().strip_prefix("coordinator at ") {
            let address = rest.split_whitespace().next().unwrap().to_string();
            let metrics = rest
                .split("http://")
                .nth(1)
                .and_then(|m| m.split('/').next())
                .expect("a metrics address")
                .to_string();
            return (address, metrics, stderr);
        }
    }
}

/// `ftrec args` (a `cluster run`) started in the background with `stdout`, once it
/// announced its coordinator, the rest of its stderr drained: the process and the
/// coordinator's address.
pub fn launch_announced(
    ftrec: crate::Ftrec,
    args: &[String],
    stdout: std::process::Stdio,
) -> (std::process::Child, String) {
    let mut child = ftrec
        .command()
        .args(args)
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (coordinator, _, mut stderr) = announced(&mut child);
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    });
    (child, coordinator)
}
