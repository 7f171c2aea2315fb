//! Deleting a checkpoint, and checking everything a restore of one reads.

use super::Checkpoints;
use rayon::prelude::*;

use crate::manifest::CheckpointKind;
use crate::{CkptError, Manifest, chunk};

impl Checkpoints {
    /// Deletes checkpoint `m`: its manifest first (so it disappears at once), then its
    /// data objects. Objects already gone are fine (another merger or gc got there).
    pub fn delete_checkpoint(&self, m: &Manifest) -> Result<(), CkptError> {
        let keys = std::iter::once(Manifest::key_for(&m.id))
            .chain(self.store.list(&format!("data/{}/", m.id))?);
        for key in keys {
            match self.store.delete(&key) {
                Ok(()) | Err(CkptError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Checks everything a restore of checkpoint `id` reads: every object of every
    /// checkpoint in its lineage (lengths, checksums, each chunk's block checksums; for
    /// IncrCP the rectangle of the chunk list), and its dense file, without building a
    /// model. A delta over a damaged baseline is damaged.
    pub fn verify(&self, id: &str) -> Result<Manifest, CkptError> {
        let target = self.manifest(id)?;
        for link in self.lineage(id)? {
            self.verify_own(&link).map_err(|e| {
                if link.id == id {
                    e
                } else {
                    CkptError::Invalid(format!("its ancestor {} is damaged: {e}", link.id))
                }
            })?;
        }
        self.fetch(&target.dense)?;
        Ok(target)
    }

    /// Checks the objects checkpoint `manifest` itself stores.
    pub(crate) fn verify_own(&self, manifest: &Manifest) -> Result<(), CkptError> {
        self.on_io_pool(|| {
            manifest.chunks.par_iter().try_for_each(|entry| {
                let bytes = self.fetch(entry)?;
                chunk::decode(&self.store.describe(&entry.key), &bytes, |_, _| Ok(())).map(|_| ())
            })?;
            if manifest.kind == CheckpointKind::Incrcp {
                let (list, column) = self.incrcp_list(manifest)?;
                list.rectangle(column).par_iter().try_for_each(|c| {
                    let bytes = c.read(&*self.store)?;
                    chunk::decode(&self.store.describe(&c.key), &bytes, |_, _| Ok(())).map(|_| ())
                })?;
            }
            self.fetch(&manifest.dense).map(|_| ())
        })
    }
}
