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
/// A failed fsync or rename removes `tmp`: a full disk must not leave it behind.
pub fn publish(file: File, tmp: &Path, path: &Path) -> Result<(), IoAt> {
    let guard = RemoveOnDrop::new(tmp);
    file.sync_all().map_err(|e| IoAt::new(tmp, e))?;
    drop(file);
    std::fs::rename(tmp, path).map_err(|e| IoAt::new(path, e))?;
    guard.disarm();
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
    let guard = RemoveOnDrop::new(&tmp);
    let mut file = File::create(&tmp).map_err(|e| IoAt::new(&tmp, e))?;
    file.write_all(bytes).map_err(|e| IoAt::new(&tmp, e))?;
    guard.disarm();
    publish(file, &tmp, path)
}

/// Removes a temporary file when dropped, unless disarmed once the file was published:
/// every early return (`?`) of a writer that fails halfway (a full disk, a bad input
/// line) then cleans up after itself instead of leaving `*.tmp` files behind.
#[derive(Debug)]
pub struct RemoveOnDrop {
    path: Option<PathBuf>,
}

impl RemoveOnDrop {
    pub fn new(path: &Path) -> Self {
        Self {
            path: Some(path.to_path_buf()),
        }
    }

    /// The file is published (or handed to an owner that cleans up): leave it.
    pub fn disarm(mut self) {
        self.path = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            // Best effort: the error being reported matters more than this one.
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes `bytes` as the file at `path`, atomically and durably, only if no file is there:
/// a name clash is an error of kind `AlreadyExists` and leaves the existing file untouched.
/// The data goes to a temporary name unique to this call, is fsynced, then hard-linked to
/// `path` (`link` fails on an existing name, where `rename` would replace it), and the
/// directory is fsynced.
pub fn write_atomic_new(path: &Path, bytes: &[u8]) -> Result<(), IoAt> {
    let mut name = OsString::from(path.as_os_str());
    name.push(format!(".{}-{}.tmp", std::process::id(), unique_suffix()));
    let tmp = PathBuf::from(name);
    let written = File::create_new(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .map_err(|e| IoAt::new(&tmp, e))
        .and_then(|()| std::fs::hard_link(&tmp, path).map_err(|e| IoAt::new(path, e)));
    // The temporary name is ours alone; whatever happened, it goes.
    let _ = std::fs::remove_file(&tmp);
    written?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// A value no other call in this process has had, so temporary names never collide.
fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    (NEXT.fetch_add(1, Ordering::Relaxed) << 32) ^ nanos
}

/// Fsyncs a directory, so the names created or removed in it survive a power loss.
pub fn sync_dir(dir: &Path) -> Result<(), IoAt> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IoAt::new(dir, e))
}

/// Creates `dir` and any missing parents below `root` (which must exist), fsyncing the
/// parent of every directory it creates: a new directory's name is only durable once its
/// parent is synced, and a checkpoint's files are lost with it.
pub fn create_dir_durable(root: &Path, dir: &Path) -> Result<(), IoAt> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.is_dir() && at != root {
        missing.push(at);
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    for d in missing.into_iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => sync_dir(d.parent().unwrap_or(root))?,
            // Another writer made it first; its creator syncs the parent.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(IoAt::new(d, e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_onto_a_full_disk_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.bin");
        let tmp = temp_path(&path);
        // /dev/full fails every write with ENOSPC, as a full disk does.
        std::os::unix::fs::symlink("/dev/full", &tmp).unwrap();
        let e = write_atomic(&path, &[7u8; 1 << 16]).unwrap_err();
        assert_eq!(e.error.raw_os_error(), Some(28), "{e}");
        assert!(
            std::fs::symlink_metadata(&tmp).is_err(),
            "{} left",
            tmp.display()
        );
        assert!(!path.exists());
    }

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
    fn exclusive_publish_refuses_an_existing_name_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.man");
        write_atomic_new(&path, b"one").unwrap();
        let e = write_atomic_new(&path, b"two").unwrap_err();
        assert_eq!(e.error.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "a temporary was left behind");
    }

    #[test]
    fn durable_directories_are_created_with_their_parents() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        create_dir_durable(dir.path(), &deep).unwrap();
        assert!(deep.is_dir());
        create_dir_durable(dir.path(), &deep).unwrap();
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("a.bin");
        let e = write_atomic(&path, b"x").unwrap_err();
        assert!(e.to_string().contains("a.bin.tmp"), "{e}");
    }
}
