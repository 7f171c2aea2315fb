//! Where checkpoint objects live. Keys are `/`-separated relative paths.
//!
//! History is append-only: every write creates a new object and a name clash is an error
//! ([`CkptError::AlreadyExists`]), never an overwrite (`O_EXCL` and `link` locally,
//! `PutMode::Create` on object stores). The one object that changes in place is a lease,
//! and only by compare-and-swap ([`Store::put_versioned`]).

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::CkptError;

/// Object storage as the checkpoint engine needs it.
pub trait Store: Send + Sync {
    /// Creates `key` with `bytes`, atomically and durably; an existing `key` is
    /// [`CkptError::AlreadyExists`] and stays as it was.
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError>;
    /// Creates a part of something a later record commits (a manifest or chunk list that
    /// names it with its length and checksum): durable once [`Store::sync_parts`] returns
    /// for its directory, but not atomic by itself, as the record's checksum catches a torn
    /// part. Exclusive like [`Store::put`]. Stores where every put is atomic anyway just put.
    fn put_part(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        self.put(key, bytes)
    }
    /// Makes the names of the parts written under `prefix` (a directory-like prefix
    /// ending in `/`) durable.
    fn sync_parts(&self, _prefix: &str) -> Result<(), CkptError> {
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, CkptError>;
    /// Like [`Store::get`], into `buf` (replacing its contents), so a caller reading many
    /// objects can reuse one allocation.
    fn get_into(&self, key: &str, buf: &mut Vec<u8>) -> Result<(), CkptError> {
        *buf = self.get(key)?;
        Ok(())
    }
    /// A sequential reader over an object and its length, where the backend has a cheap
    /// one (local files), so a large object can be decoded into its destination without an
    /// intermediate copy. `None`: use [`Store::get_into`].
    fn open_reader(&self, _key: &str) -> Result<Option<ObjectReader>, CkptError> {
        Ok(None)
    }
    /// `len` bytes from `offset`.
    fn get_range(&self, key: &str, offset: u64, len: usize) -> Result<Vec<u8>, CkptError>;
    /// [`Store::get_range`], appended to `buf`, so a reader of many ranges can reuse one
    /// allocation.
    fn get_range_into(
        &self,
        key: &str,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CkptError> {
        buf.extend_from_slice(&self.get_range(key, offset, len)?);
        Ok(())
    }
    /// The object at `key` and its version (`None`: no object), for compare-and-swap.
    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, String)>, CkptError>;
    /// Writes `key` only if its version is still `expected` (`None`: only if it does not
    /// exist); otherwise [`CkptError::Conflict`]. Returns the new version. Used for leases
    /// alone: nothing else in a checkpoint location is ever replaced.
    fn put_versioned(
        &self,
        key: &str,
        bytes: &[u8],
        expected: Option<&str>,
    ) -> Result<String, CkptError>;
    /// When `key` was last written, in ms since the Unix epoch (`None`: no object), so
    /// abandoned uncommitted data can be told by its age.
    fn modified_unix_ms(&self, key: &str) -> Result<Option<u64>, CkptError>;
    /// Free bytes where new objects go, where the backend can tell (a local file system).
    fn free_bytes(&self) -> Option<u64> {
        None
    }
    /// Keys under `prefix` (a directory-like prefix ending in `/`, or empty), sorted.
    fn list(&self, prefix: &str) -> Result<Vec<String>, CkptError>;
    fn delete(&self, key: &str) -> Result<(), CkptError>;
    /// A human-readable location, for messages.
    fn describe(&self, key: &str) -> String;
}

/// A sequential reader over a stored object, and the object's length.
pub type ObjectReader = (Box<dyn Read + Send>, u64);

/// A directory on a local (or mounted) file system.
#[derive(Clone, Debug)]
pub struct LocalStore {
    root: PathBuf,
    /// Aligned staging buffers for unbuffered part writes, one per concurrent writer,
    /// reused so no part write faults in fresh pages.
    scratch: std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

/// `ftrec_fsio::write_atomic_new`'s temporary names; listings skip them.
const TMP_SUFFIX: &str = ".tmp";
/// The lock file beside a versioned object that serialises its compare-and-swap.
const GUARD_SUFFIX: &str = ".guard";

impl LocalStore {
    pub fn open(root: &Path) -> Result<Self, CkptError> {
        // The location itself is a new directory too: its name must survive a power loss.
        let absolute = std::path::absolute(root).map_err(|e| io(root, e))?;
        ftrec_fsio::create_dir_durable(Path::new("/"), &absolute)?;
        Ok(Self {
            root: root.to_path_buf(),
            scratch: Default::default(),
        })
    }

    fn take_scratch(&self) -> Vec<u8> {
        // A poisoned pool only means a writer panicked; its buffers are still buffers.
        let mut pool = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        pool.pop().unwrap_or_default()
    }

    fn return_scratch(&self, buffer: Vec<u8>) {
        let mut pool = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        pool.push(buffer);
    }

    fn path(&self, key: &str) -> Result<PathBuf, CkptError> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    /// The directory `path` goes in, created (durably) when missing.
    fn make_parent(&self, path: &Path) -> Result<(), CkptError> {
        let dir = path.parent().unwrap_or(&self.root);
        Ok(ftrec_fsio::create_dir_durable(&self.root, dir)?)
    }
}

/// A local object's version: the CRC32C of its bytes and their length. Every lease write
/// carries a fresh nonce and expiry, so two writes never share a version.
fn local_version(bytes: &[u8]) -> String {
    format!("{:08x}-{}", crc32c::crc32c(bytes), bytes.len())
}

/// Maps "the name is taken" to [`CkptError::AlreadyExists`].
fn exclusive(e: ftrec_fsio::IoAt) -> CkptError {
    if e.error.kind() == std::io::ErrorKind::AlreadyExists {
        CkptError::AlreadyExists {
            key: e.path.display().to_string(),
        }
    } else {
        e.into()
    }
}

/// Keys are relative `/`-separated paths without empty, `.` or `..` parts, so no backend
/// can be made to write outside its root.
pub(crate) fn check_key(key: &str) -> Result<(), CkptError> {
    if key.is_empty()
        || key
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
    {
        return Err(CkptError::Invalid(format!("invalid object key {key:?}")));
    }
    Ok(())
}

fn io(path: &Path, error: std::io::Error) -> CkptError {
    CkptError::Io {
        path: path.to_path_buf(),
        error,
    }
}

impl Store for LocalStore {
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        let path = self.path(key)?;
        self.make_parent(&path)?;
        ftrec_fsio::write_atomic_new(&path, bytes).map_err(exclusive)
    }

    /// No temporary name, rename or directory sync per part: on this VM they cost a full
    /// checkpoint about half its write bandwidth (the numbers are in bench-results/HISTORY.md). Parts
    /// bypass the page cache (`ftrec_fsio::write_unbuffered`): a checkpoint is read back
    /// only after a failure, and filling fresh page-cache pages was a full checkpoint's
    /// largest CPU cost.
    fn put_part(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        let path = self.path(key)?;
        self.make_parent(&path)?;
        let mut scratch = self.take_scratch();
        let written = ftrec_fsio::write_unbuffered(&path, bytes, &mut scratch);
        self.return_scratch(scratch);
        written.map_err(exclusive)
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, String)>, CkptError> {
        match self.get(key) {
            Ok(bytes) => {
                let version = local_version(&bytes);
                Ok(Some((bytes, version)))
            }
            Err(CkptError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Serialised by an exclusive `flock` on a guard file beside the object, so the
    /// compare and the swap are one step for every process on this host (and on file
    /// systems whose `flock` is coherent across hosts).
    fn put_versioned(
        &self,
        key: &str,
        bytes: &[u8],
        expected: Option<&str>,
    ) -> Result<String, CkptError> {
        let path = self.path(key)?;
        self.make_parent(&path)?;
        let guard_path = PathBuf::from(format!("{}{GUARD_SUFFIX}", path.display()));
        let guard = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&guard_path)
            .map_err(|e| io(&guard_path, e))?;
        rustix::fs::flock(&guard, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io(&guard_path, e.into()))?;
        let current = self.get_versioned(key)?.map(|(_, v)| v);
        if current.as_deref() != expected {
            return Err(CkptError::Conflict(format!(
                "{} changed under us (expected version {expected:?}, found {current:?})",
                path.display()
            )));
        }
        // The guard makes this replace safe: no other writer is between our compare and
        // this write.
        ftrec_fsio::write_atomic(&path, bytes)?;
        Ok(local_version(bytes))
    }

    fn modified_unix_ms(&self, key: &str) -> Result<Option<u64>, CkptError> {
        let path = self.path(key)?;
        match fs::metadata(&path).and_then(|m| m.modified()) {
            Ok(t) => Ok(Some(
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path, e)),
        }
    }

    fn free_bytes(&self) -> Option<u64> {
        let st = rustix::fs::statvfs(&self.root).ok()?;
        Some(st.f_bavail.saturating_mul(st.f_frsize))
    }

    fn sync_parts(&self, prefix: &str) -> Result<(), CkptError> {
        let dir = self.root.join(prefix.trim_end_matches('/'));
        match File::open(&dir).and_then(|d| d.sync_all()) {
            // Nothing was written there, so nothing needs syncing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other.map_err(|e| io(&dir, e)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, CkptError> {
        let path = self.path(key)?;
        fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CkptError::NotFound(format!("{} does not exist", path.display()))
            }
            _ => io(&path, e),
        })
    }

    fn open_reader(&self, key: &str) -> Result<Option<ObjectReader>, CkptError> {
        let path = self.path(key)?;
        let file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CkptError::NotFound(format!("{} does not exist", path.display()))
            }
            _ => io(&path, e),
        })?;
        let len = file.metadata().map_err(|e| io(&path, e))?.len();
        Ok(Some((Box::new(file), len)))
    }

    /// A fresh 4 MiB buffer per chunk costs a page fault per 4 KiB page: in `perf` on a
    /// cold 678 MB restore, faulting in fresh pages was about a fifth of the CPU profile.
    fn get_into(&self, key: &str, buf: &mut Vec<u8>) -> Result<(), CkptError> {
        let path = self.path(key)?;
        let mut file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CkptError::NotFound(format!("{} does not exist", path.display()))
            }
            _ => io(&path, e),
        })?;
        buf.clear();
        file.read_to_end(buf).map_err(|e| io(&path, e))?;
        Ok(())
    }

    fn get_range(&self, key: &str, offset: u64, len: usize) -> Result<Vec<u8>, CkptError> {
        let mut buf = Vec::new();
        self.get_range_into(key, offset, len, &mut buf)?;
        Ok(buf)
    }

    fn get_range_into(
        &self,
        key: &str,
        offset: u64,
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CkptError> {
        let path = self.path(key)?;
        let mut f = File::open(&path).map_err(|e| io(&path, e))?;
        f.seek(SeekFrom::Start(offset)).map_err(|e| io(&path, e))?;
        let before = buf.len();
        // One read of the whole range (`read_to_end` through `take` would start at 8 KiB
        // requests); zeroing reused memory first costs far less than the read.
        buf.resize(before + len, 0);
        f.read_exact(&mut buf[before..]).map_err(|_| {
            buf.truncate(before);
            CkptError::corrupt(
                &path.display().to_string(),
                format!("truncated: cannot read {len} bytes at offset {offset}"),
            )
        })
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>, CkptError> {
        let dir = if prefix.is_empty() {
            self.root.clone()
        } else {
            self.path(prefix.trim_end_matches('/'))?
        };
        let mut out = Vec::new();
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            let entries = match fs::read_dir(&d) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&d, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io(&d, e))?;
                let p = entry.path();
                if p.is_dir() {
                    stack.push(p);
                } else if let Ok(rel) = p.strip_prefix(&self.root) {
                    let key = rel.to_string_lossy().replace('\\', "/");
                    if !key.ends_with(TMP_SUFFIX) && !key.ends_with(GUARD_SUFFIX) {
                        out.push(key);
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<(), CkptError> {
        let path = self.path(key)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path, e)),
        }
    }

    fn describe(&self, key: &str) -> String {
        self.root.join(key).display().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_created_once_and_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.put("m/a.man", b"one").unwrap();
        s.put_part("d/x/a.chunk", b"part").unwrap();
        assert!(matches!(
            s.put("m/a.man", b"two"),
            Err(CkptError::AlreadyExists { .. })
        ));
        assert!(matches!(
            s.put_part("d/x/a.chunk", b"other"),
            Err(CkptError::AlreadyExists { .. })
        ));
        assert_eq!(s.get("m/a.man").unwrap(), b"one");
        assert_eq!(s.get("d/x/a.chunk").unwrap(), b"part");
    }

    #[test]
    fn versioned_puts_are_compare_and_swap() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        assert!(s.get_versioned("locks/w").unwrap().is_none());
        let v1 = s.put_versioned("locks/w", b"a", None).unwrap();
        assert!(matches!(
            s.put_versioned("locks/w", b"b", None),
            Err(CkptError::Conflict(_))
        ));
        let v2 = s.put_versioned("locks/w", b"bb", Some(&v1)).unwrap();
        assert!(matches!(
            s.put_versioned("locks/w", b"c", Some(&v1)),
            Err(CkptError::Conflict(_))
        ));
        assert_eq!(
            s.get_versioned("locks/w").unwrap().unwrap(),
            (b"bb".to_vec(), v2)
        );
        assert_eq!(
            s.list("locks/").unwrap(),
            vec!["locks/w"],
            "guards are not objects"
        );
        assert!(s.modified_unix_ms("locks/w").unwrap().is_some());
        assert!(s.modified_unix_ms("locks/none").unwrap().is_none());
    }

    #[test]
    fn put_get_list_delete_and_key_validation() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path()).unwrap();
        s.put("a/b/c.chunk", b"hello").unwrap();
        s.put("a/d", b"x").unwrap();
        std::fs::write(dir.path().join("a/e.tmp"), b"torn").unwrap();
        assert_eq!(s.get("a/b/c.chunk").unwrap(), b"hello");
        assert_eq!(s.get_range("a/b/c.chunk", 1, 3).unwrap(), b"ell");
        assert!(s.get_range("a/b/c.chunk", 3, 5).is_err());
        assert_eq!(
            s.list("a/").unwrap(),
            vec!["a/b/c.chunk", "a/d"],
            "temporaries are not objects"
        );
        s.delete("a/d").unwrap();
        assert!(matches!(s.get("a/d"), Err(CkptError::NotFound(_))));
        assert!(s.put("../escape", b"").is_err());
        assert!(s.put("a//b", b"").is_err());
    }
}
