//! Writing a dataset directory as a whole: the new files go to a staging directory inside
//! the output directory and are moved into place only when everything was written, so a
//! failed or interrupted `data convert` or `data gen` leaves the old dataset as it was (and
//! no temporary files), and a successful one leaves no stale file that a reader would pair
//! with the new ones (an old `meta.json` gives `train` a wrong `teacher_auc`).

use std::path::{Path, PathBuf};

use crate::DataError;

/// A directory inside the output directory (same file system, so the final renames are
/// atomic) that the new files are written into; removed with whatever is left in it when
/// dropped, on success or failure alike.
pub(crate) struct Staging {
    pub(crate) path: PathBuf,
}

impl Staging {
    /// `out_dir` (created if missing; an existing non-directory is refused by name) with an
    /// empty staging directory `.{what}-{pid}.tmp` inside it.
    pub(crate) fn create(out_dir: &Path, what: &str) -> Result<Self, DataError> {
        if out_dir.exists() && !out_dir.is_dir() {
            return Err(DataError::format(
                out_dir,
                "exists and is not a directory (--out names the dataset directory)",
            ));
        }
        std::fs::create_dir_all(out_dir).map_err(|e| DataError::io(out_dir, e))?;
        let path = out_dir.join(format!(".{what}-{}.tmp", std::process::id()));
        // A leftover of a killed run with the same pid is ours to replace.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).map_err(|e| DataError::io(&path, e))?;
        Ok(Self { path })
    }

    /// Removes `stale` (and the temporary files of every name involved) from `out_dir`
    /// first, so no reader pairs them with the new files, then moves the staged `files` in,
    /// in the order given (so a description like `meta.json` can come last).
    pub(crate) fn publish(
        &self,
        out_dir: &Path,
        files: &[&str],
        stale: &[&str],
    ) -> Result<(), DataError> {
        let temps = files
            .iter()
            .chain(stale)
            .map(|name| ftrec_fsio::temp_path(&out_dir.join(name)));
        for path in stale.iter().map(|name| out_dir.join(name)).chain(temps) {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(DataError::io(&path, e));
                }
                _ => {}
            }
        }
        for name in files {
            let to = out_dir.join(name);
            std::fs::rename(self.path.join(name), &to).map_err(|e| DataError::io(&to, e))?;
        }
        Ok(ftrec_fsio::sync_dir(out_dir)?)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Best effort: an error being reported matters more than this one.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
