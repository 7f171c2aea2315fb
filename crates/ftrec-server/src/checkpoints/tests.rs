//! The checkpoint context's invariants: a cut asked for again at the same step is not
//! rewritten, a cut is only taken where the shard stands at a step boundary, a new
//! history writes on a branch of its own, a server whose replacement took its slot over
//! commits nothing more, and the part a rollback restores is the one committed last by
//! fencing token, whatever the servers' clocks say.

use std::sync::Arc;

use ftrec_ckpt::{Checkpoints, CkptError, Manifest, open_store};
use ftrec_proto::placement::Layout;

use super::CheckpointContext;
use crate::pipeline::UpdatePipeline;
use crate::shard::Shard;
use crate::shard::tests::model;
use ftrec_rpc::PsError;

fn parts(dir: &std::path::Path) -> (CheckpointContext, UpdatePipeline, Checkpoints) {
    // A cluster job names a dataset; checkpoints never read it.
    let data = format!("data.dir={:?}", dir.join("data").to_string_lossy());
    // A checkpoint directory makes the strategy `full`, the default.
    let ckpt_dir = format!("checkpoint.dir={:?}", dir.to_string_lossy());
    let config = ftrec_config::JobConfig::load(Some("micro"), None, &[data, ckpt_dir]).unwrap();
    let job = ftrec_rpc::Job::new(config).unwrap();
    let layout = Layout::new(1).unwrap();
    let location = Checkpoints::new(open_store(&dir.join("server-0").to_string_lossy()).unwrap());
    let shard = Shard::initial(&model(), 7, layout, 0).unwrap();
    let pipeline = UpdatePipeline::new(
        shard,
        1,
        false,
        Arc::new(crate::server_metrics("0")),
        ftrec_faults::Faults::default(),
    );
    let ckpt = CheckpointContext::new(job, 0, layout, Some(location.clone()), None, None);
    (ckpt, pipeline, location)
}

#[test]
fn a_cut_asked_again_at_the_same_step_returns_the_committed_part() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, pipeline, location) = parts(dir.path());
    let (first, committed) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    assert!(committed);
    assert!(ckpt.cut_committed(&location, 0).unwrap());
    let (again, committed) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    assert!(committed);
    assert_eq!(again.id, first.id);
    assert_eq!(location.list_readable().unwrap().len(), 1);
}

#[test]
fn a_cut_off_the_shards_step_boundary_is_refused_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, pipeline, location) = parts(dir.path());
    assert!(matches!(
        ckpt.write_cut(&pipeline, &location, 3),
        Err(PsError::BadRequest(_))
    ));
    assert!(location.list_readable().unwrap().is_empty());
    assert!(!ckpt.cut_committed(&location, 3).unwrap());
}

#[test]
fn a_restarted_history_writes_on_a_branch_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, pipeline, location) = parts(dir.path());
    let (first, _) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    ckpt.restart_history().unwrap();
    // The cut of the history left behind is not this history's part.
    assert!(!ckpt.cut_committed(&location, 0).unwrap());
    let (second, committed) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    assert!(committed);
    assert_ne!(second.id, first.id);
    assert_ne!(second.branch, first.branch);
    // A restore finds the newest checkpoint of the cut.
    let (_, id, ahead) = ckpt.restore_cut(&location, 0).unwrap();
    assert_eq!(id, second.id);
    assert!(ahead.is_empty());
}

/// A server froze; the coordinator declared it dead and its replacement took the slot's
/// checkpoint lease over. The old server thaws before its lease renewer runs and writes the
/// cut it was asked for: the store refuses the commit, typed, and the rollback restores
/// the replacement's part.
#[test]
fn a_thawed_servers_cut_after_its_replacement_took_over_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (zombie, zombie_pipeline, location) = parts(dir.path());
    // It holds the slot's lease, as a server that has written before.
    zombie.writer(&location).unwrap();
    let (replacement, pipeline, _) = parts(dir.path());
    replacement.continue_history().unwrap();
    let e = zombie
        .write_cut(&zombie_pipeline, &location, 0)
        .map(|(m, _)| m.id)
        .unwrap_err();
    assert!(
        matches!(e, PsError::Checkpoint(CkptError::Fenced(_))),
        "{e}"
    );
    assert!(location.list_readable().unwrap().is_empty());
    let (part, committed) = replacement.write_cut(&pipeline, &location, 0).unwrap();
    assert!(committed);
    let (_, id, _) = replacement.restore_cut(&location, 0).unwrap();
    assert_eq!(id, part.id);
}

/// The cut at step 0 is taken, the shard goes back to its initial state (a rollback to
/// before any cut) and the cut is retaken on a new branch. The abandoned part claims to be
/// a day newer (its host's clock ran ahead): the rollback still restores the live part.
#[test]
fn a_rollback_restores_the_live_part_though_an_abandoned_one_claims_to_be_newer() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, pipeline, location) = parts(dir.path());
    let (abandoned, _) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    let store = location.store();
    let key = Manifest::key_for(&abandoned.id);
    let mut ahead = Manifest::decode(&key, &store.get(&key).unwrap()).unwrap();
    ahead.created_unix_ms += 86_400_000;
    store.delete(&key).unwrap();
    store.put(&key, &ahead.encode().unwrap()).unwrap();
    ckpt.restart_history().unwrap();
    let (live, _) = ckpt.write_cut(&pipeline, &location, 0).unwrap();
    assert!(live.created_unix_ms < ahead.created_unix_ms);
    let (_, id, _) = ckpt.restore_cut(&location, 0).unwrap();
    assert_eq!(id, live.id);
}
