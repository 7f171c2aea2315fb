//! Result output shared by every command: the locked stdout `outln!` writes to, and JSON.

use anyhow::Result;
use std::io::Write;

pub(crate) fn print_json(value: serde_json::Value) -> Result<()> {
    writeln!(stdout(), "{}", serde_json::to_string(&value)?)?;
    Ok(())
}

/// Standard output for results. Written with `writeln!` so a closed pipe is an error
/// (mapped to a quiet exit in `main`), where `println!` would panic.
pub(crate) fn stdout() -> std::io::StdoutLock<'static> {
    std::io::stdout().lock()
}
