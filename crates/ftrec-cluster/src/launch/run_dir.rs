//! The private run directory of a cluster the user gave no `--run-dir`.

use std::path::{Path, PathBuf};

use ftrec_rpc::PsError;

use super::io;

/// A fresh run directory for a cluster the user gave no `--run-dir`: `parent/prefix-<128
/// random bits>`, created by this call (never an existing path) and private (0700).
///
/// It holds the job secret and job file. A predictable name under a shared `/tmp` could be
/// created first by another user, who would then own the directory, read the secret and
/// join the cluster; so the name is unguessable and an existing path is never reused, even
/// our own (a clash means the name is not random enough to trust, or someone guessed it).
pub fn private_run_dir(parent: &Path, prefix: &str) -> Result<PathBuf, PsError> {
    use rand::RngCore;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    const TRIES: usize = 4;
    for _ in 0..TRIES {
        let mut bytes = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        let suffix: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let dir = parent.join(format!("{prefix}-{suffix}"));
        // create_dir (not _all) fails on any existing path, a symlink included: the
        // directory is ours because this call made it. The umask can only remove bits.
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = std::fs::symlink_metadata(&dir).map(|m| m.uid()).ok();
                tracing::warn!(
                    "{} already exists (owner uid {owner:?}): not reusing it",
                    dir.display()
                );
                continue;
            }
            Err(e) => return Err(io(&dir)(e)),
        }
        // Exactly 0700 whatever the umask left (a umask of 0277 would make it unwritable).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(io(&dir))?;
        let meta = std::fs::symlink_metadata(&dir).map_err(io(&dir))?;
        if !meta.is_dir() || meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(PsError::Config(format!(
                "{}: the run directory just created is not a directory owned by this user",
                dir.display()
            )));
        }
        return Ok(dir);
    }
    Err(PsError::Config(format!(
        "{}: {TRIES} random run-directory names under it already existed; pass --run-dir DIR",
        parent.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn default_run_directories_are_fresh_unguessable_and_private() {
        let parent = tempfile::tempdir().unwrap();
        let a = private_run_dir(parent.path(), "ftrec-cluster").unwrap();
        let b = private_run_dir(parent.path(), "ftrec-cluster").unwrap();
        assert_ne!(a, b);
        for dir in [&a, &b] {
            assert_eq!(dir.parent(), Some(parent.path()));
            let name = dir.file_name().unwrap().to_str().unwrap();
            let suffix = name.strip_prefix("ftrec-cluster-").unwrap();
            // 128 random bits, not a pid and a clock.
            assert_eq!(suffix.len(), 32, "{name}");
            assert!(suffix.bytes().all(|c| c.is_ascii_hexdigit()), "{name}");
            let meta = std::fs::symlink_metadata(dir).unwrap();
            assert!(meta.is_dir());
            assert_eq!(meta.permissions().mode() & 0o777, 0o700, "{name}");
        }
        // A parent that cannot hold it is an error naming the path, not a panic.
        let file = parent.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = private_run_dir(&file, "ftrec-cluster")
            .unwrap_err()
            .to_string();
        assert!(e.contains("file/ftrec-cluster-"), "{e}");
    }
}
