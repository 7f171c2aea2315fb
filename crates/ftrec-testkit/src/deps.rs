//! The programs and Python modules tests need beyond Rust. A missing one fails the test
//! that needs it, naming it and the script that installs it: a test that skipped itself
//! would pass in CI while testing nothing.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// The script that installs every test dependency (idempotent; `.ci/run` runs it).
pub const INSTALL: &str = "./scripts/test-deps";

/// Fails the calling test: `what` is not installed, for the reason `why`.
#[track_caller]
pub fn missing(what: &str, why: impl std::fmt::Display) -> ! {
    panic!("{what} is missing ({why}): the test needs it; install it with `{INSTALL}`")
}

/// The path of `program` (a name looked up on `PATH`, or a path), failing the test
/// naming `what` where there is none.
#[track_caller]
pub fn program(program: &str, what: &str) -> PathBuf {
    match find_program(program) {
        Some(path) => path,
        None if program.contains('/') => missing(what, format_args!("no executable `{program}`")),
        None => missing(what, format_args!("no executable `{program}` on PATH")),
    }
}

fn find_program(program: &str) -> Option<PathBuf> {
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

/// Fails the test naming `what` unless `python3` imports `module`. Checked once per
/// process: importing moto takes a second or two.
#[track_caller]
pub fn python_module(module: &str, what: &str) {
    static IMPORTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    if IMPORTED
        .lock()
        .unwrap()
        .get_or_insert_default()
        .contains(module)
    {
        return;
    }
    let python = program("python3", "python3");
    let out = Command::new(&python)
        .args([OsStr::new("-c"), OsStr::new(&format!("import {module}"))])
        .output()
        .unwrap_or_else(|e| missing("python3", e));
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or_default().to_string();
        missing(what, format_args!("python3 cannot import {module}: {last}"));
    }
    IMPORTED
        .lock()
        .unwrap()
        .get_or_insert_default()
        .insert(module.to_string());
}
