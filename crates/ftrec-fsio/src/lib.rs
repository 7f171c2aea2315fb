//! Crash-safe file publication, shared by every crate that writes files: write under a
//! temporary name, fsync, rename over the final name, fsync the directory. A crash leaves
//! the old file or the new one, never a torn one.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use thiserror::Error;

mod direct;
pub use direct::{DIRECT_ALIGN, DIRECT_PIECE, write_unbuffered};

/// An I/O error and the file it happened on.
#[derive(Debug, Error)]
#[error("{path}: {error}")]
pub struct IoAt {
    pub path: PathBuf,
    pub error: std::io::Error,
}

impl IoAt {
    pub fn new(path: &Path, error: std::io::Error) -> Self {
        Self {
            path: path.to_path_buf(),
            error,
        }
    }
}

/// The temporary name a file is written under before it is published: `<name>.tmp`.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".tmp");
    PathBuf::from(name)
}

/// Makes a finished temporary file the file at `path`: fsyncs `file` (the open `tmp`),
/// renames it over `path`, and fsyncs the directory so the rename survives a crash.
pub fn publish(file: File, tmp: &Path, path: &Path) -> Result<(), IoAt> {
    file.sync_all().map_err(|e| IoAt::new(tmp, e))?;
    drop(file);
    std::fs::rename(tmp, path).map_err(|e| IoAt::new(path, e))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IoAt::new(dir, e))
}

/// Writes `bytes` as the file at `path`, atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), IoAt> {
    let tmp = temp_path(path);
    let mut file = File::create(&tmp).map_err(|e| IoAt::new(&tmp, e))?;
    file.write_all(bytes).map_err(|e| IoAt::new(&tmp, e))?;
    publish(file, &tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.bin");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(!temp_path(&path).exists());
        assert_eq!(temp_path(&path), dir.path().join("a.bin.tmp"));
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("a.bin");
        let e = write_atomic(&path, b"x").unwrap_err();
        assert!(e.to_string().contains("a.bin.tmp"), "{e}");
    }
}
