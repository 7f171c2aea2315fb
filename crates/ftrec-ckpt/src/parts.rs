//! The data files one checkpoint write creates, so that a write that fails (ENOSPC, a lost
//! lease, a crash of the store) removes exactly its own files and nothing else: they were
//! created exclusively, so every name recorded here is this writer's.

use std::sync::Mutex;

use crate::{Checkpoints, CkptError};

pub(crate) struct Parts<'a> {
    ck: &'a Checkpoints,
    created: Mutex<Vec<String>>,
}

impl<'a> Parts<'a> {
    pub(crate) fn new(ck: &'a Checkpoints) -> Self {
        Self {
            ck,
            created: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn checkpoints(&self) -> &'a Checkpoints {
        self.ck
    }

    /// Creates one data file ([`crate::Store::put_part`]) and remembers it.
    pub(crate) fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        self.ck.store().put_part(key, bytes)?;
        self.created
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key.to_string());
        Ok(())
    }

    /// Passes `result` through; on failure first deletes every file this write created.
    pub(crate) fn finish<T>(self, result: Result<T, CkptError>) -> Result<T, CkptError> {
        if result.is_err() {
            let created = self.created.into_inner().unwrap_or_else(|p| p.into_inner());
            for key in created {
                if let Err(e) = self.ck.store().delete(&key) {
                    tracing::warn!("could not remove {key} of a failed checkpoint write: {e}");
                }
            }
        }
        result
    }
}
