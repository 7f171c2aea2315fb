//! The data files one checkpoint write creates, so that a write that fails (ENOSPC, a lost
//! lease, a crash of the store) removes exactly its own files and nothing else: they were
//! created exclusively, so every name recorded here is this writer's.

use std::sync::Mutex;

use crate::{Checkpoints, CkptError, Manifest};

pub(crate) struct Parts<'a> {
    ck: &'a Checkpoints,
    /// The checkpoint these files belong to: if its manifest exists after a failure, the
    /// commit went through (an fsync that failed after the rename, a retried PUT answered
    /// "already exists") and the files are kept.
    manifest_id: String,
    created: Mutex<Vec<String>>,
}

impl<'a> Parts<'a> {
    pub(crate) fn new(ck: &'a Checkpoints, manifest_id: &str) -> Self {
        Self {
            ck,
            manifest_id: manifest_id.to_string(),
            created: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn checkpoints(&self) -> &'a Checkpoints {
        self.ck
    }

    /// Creates one data file ([`crate::Store::put_part`]) and remembers it, also when the
    /// write fails halfway (ENOSPC leaves a partial file). A name that already existed is
    /// someone else's and is not remembered.
    pub(crate) fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        let result = self.ck.store().put_part(key, bytes);
        if !matches!(result, Err(CkptError::AlreadyExists { .. })) {
            self.created
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(key.to_string());
        }
        result
    }

    /// Passes `result` through; on failure first deletes every file this write created,
    /// unless the checkpoint's manifest exists (then it is committed and its files stay).
    pub(crate) fn finish<T>(self, result: Result<T, CkptError>) -> Result<T, CkptError> {
        if result.is_err() {
            let manifest = Manifest::key_for(&self.manifest_id);
            if self.ck.store().get(&manifest).is_ok() {
                tracing::warn!(
                    "checkpoint {} reported an error after its manifest was written; its files \
                     are kept",
                    self.manifest_id
                );
                return result;
            }
            let created = self.created.into_inner().unwrap_or_else(|p| p.into_inner());
            for key in created {
                match self.ck.store().delete(&key) {
                    Ok(()) | Err(CkptError::NotFound(_)) => {}
                    Err(e) => {
                        tracing::warn!("could not remove {key} of a failed checkpoint write: {e}")
                    }
                }
            }
        }
        result
    }
}
