//! The checkpoint context's invariants: a cut asked for again at the same step is not
//! rewritten, a cut is only taken where the shard stands at a step boundary, and a new
//! history writes on a branch of its own.

use std::sync::Arc;

use ftrec_ckpt::{Checkpoints, open_store};
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
    let ckpt = CheckpointContext::new(job, 0, layout, Some(location.clone()), None);
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
