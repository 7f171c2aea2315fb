//! The shard's checkpoints: the writer lease, writing a cut, restoring one, and deleting
//! the cuts the coordinator no longer keeps.

use ftrec_ckpt::lease::LeaseOptions;
use ftrec_ckpt::{BranchStart, CheckpointKind, Checkpoints, GcOptions};

use super::Core;
use crate::PsError;

impl Core {
    /// A lease key shared by every process that holds this job's slot, so a replacement
    /// takes the lease over from its predecessor, which the coordinator declared dead and
    /// fenced off by epoch.
    pub(super) fn lease_options(&self) -> LeaseOptions {
        LeaseOptions {
            owner_key: Some(format!(
                "job {:016x} server {}",
                self.job.fingerprint(),
                self.id
            )),
            ..LeaseOptions::new(format!("ftrec server {}", self.id))
        }
    }

    /// The writing handle, started as a fresh run's when no restore started one.
    pub(super) fn writer(&self, checkpoints: &Checkpoints) -> Result<Checkpoints, PsError> {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = writer.as_ref() {
            return Ok(w.clone());
        }
        let start = BranchStart::Fresh {
            new_branch: self.job.config.checkpoint.new_branch,
        };
        let (w, _) = checkpoints.start_writing(start, &self.lease_options())?;
        *writer = Some(w.clone());
        Ok(w)
    }

    /// Restores the shard checkpoint of cut `step`, then writes on from there.
    pub(super) fn restore_cut(
        &self,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<(ftrec_model::ModelState, String), PsError> {
        // The cut's checkpoint at this step written last: an older one at the same step
        // belongs to a cut that failed part-way and was rolled back below it.
        let id = checkpoints
            .list_readable()?
            .into_iter()
            .filter(|m| m.step == step && m.kind == CheckpointKind::Full)
            .max_by_key(|m| m.created_unix_ms)
            .map(|m| m.id)
            .ok_or_else(|| {
                PsError::Config(format!(
                    "server {}: no checkpoint of step {step} in {}",
                    self.id,
                    checkpoints.store().describe("")
                ))
            })?;
        let (state, manifest) = checkpoints.restore(&id)?;
        check_owner(
            &manifest.trainer,
            self.id,
            &checkpoints.store().describe(&id),
        )?;
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // Let go of the old lease first; the same owner key could take it over anyway.
        *writer = None;
        let (w, started) = checkpoints.start_writing(
            BranchStart::Resume { from: id.clone() },
            &self.lease_options(),
        )?;
        if let Some(fork) = &started.forked_from {
            tracing::info!(
                "server {}: restored {fork}, newer checkpoints exist: writing branch {}",
                self.id,
                started.branch
            );
        }
        *writer = Some(w);
        Ok((state, id))
    }

    /// Deletes every checkpoint of this shard except the `keep` ids (the coordinator's kept
    /// cuts) and what their restores read, plus abandoned uncommitted data. Returns how many
    /// checkpoints went.
    pub(super) fn prune(&self, keep: Vec<String>) -> Result<u64, PsError> {
        let Some(checkpoints) = &self.checkpoints else {
            return Ok(0);
        };
        let writer = self.writer(checkpoints)?;
        let report = writer.gc_with(&GcOptions {
            keep_ids: Some(keep),
            ..GcOptions::default()
        })?;
        Ok(report.checkpoints.len() as u64)
    }
}

/// Refuses a shard checkpoint written by another server (a swapped or copied directory):
/// restoring it would silently put another shard's rows in this server's slots.
pub(super) fn check_owner(
    identity: &serde_json::Value,
    server: usize,
    what: &str,
) -> Result<(), PsError> {
    match identity.get("server").and_then(|v| v.as_u64()) {
        Some(owner) if owner == server as u64 => Ok(()),
        Some(owner) => Err(PsError::Refused(format!(
            "{what} is server {owner}'s shard; server {server} refuses to restore it"
        ))),
        None => Err(PsError::Refused(format!(
            "{what} carries no server identity; it is not a cluster shard checkpoint"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::check_owner;

    #[test]
    fn a_shard_checkpoint_of_another_server_is_refused() {
        let identity = serde_json::json!({"server": 1, "servers": 2, "step": 40});
        assert!(check_owner(&identity, 1, "ck").is_ok());
        let e = check_owner(&identity, 0, "ck").unwrap_err().to_string();
        assert!(
            e.contains("server 1's shard") && e.contains("server 0 refuses"),
            "{e}"
        );
        let e = check_owner(&serde_json::json!({"step": 3}), 0, "ck").unwrap_err();
        assert!(e.to_string().contains("no server identity"));
    }
}
