//! A [`Core`] for unit tests: one server of a `micro` job with its pipeline and an empty
//! rebuild and checkpoint context, no listener, no coordinator and no peers. A test drives
//! its methods directly (phase 1 of a step, a rebuild request) to pin an ordering the
//! multi-process tests reach only by luck of timing.

use std::sync::Arc;

use tokio::sync::Notify;

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_proto::placement::Layout;
use ftrec_rpc::job::Job;

use crate::checkpoints::CheckpointContext;
use crate::pipeline::UpdatePipeline;
use crate::rebuild::RebuildContext;
use crate::shard::{Shard, Update};
use crate::{Core, server_metrics};

/// The `micro` job on 3 servers under `--ft ec` (k = 2, r = 1, two-phase commit).
pub(crate) fn ec_job() -> Job {
    let mut c = JobConfig::preset("micro").unwrap();
    c.cluster.servers = 3;
    c.cluster.ft = FaultTolerance::Ec;
    // The job is never trained here: no dataset is read.
    c.data.dir = Some(std::env::temp_dir());
    c.validate().unwrap();
    Job::new(c).unwrap()
}

/// Server `id` of `job`, in `epoch`, its shard as a fresh start builds it.
pub(crate) fn core(job: &Job, id: usize, epoch: u64) -> Core {
    let layout = job.layout().unwrap();
    let model = job.config.model_config().unwrap();
    let shard = Shard::initial(&model, job.config.seed, layout, id).unwrap();
    let metrics = Arc::new(server_metrics(&id.to_string()));
    let faults = ftrec_faults::Faults::default();
    let pipeline = UpdatePipeline::new(
        shard,
        epoch,
        job.config.cluster.ft.erasure_coded(),
        metrics.clone(),
        faults.clone(),
    );
    Core {
        job: job.clone(),
        layout,
        id,
        incarnation: 1,
        address: format!("127.0.0.1:{}", 7000 + id),
        metrics,
        stop: Arc::new(Notify::new()),
        faults,
        pipeline,
        rebuilding: RebuildContext::new(None, None, None, None, Default::default()),
        ckpt: CheckpointContext::new(job.clone(), id, layout, None, None, None),
    }
}

/// One step's update of `core`'s dense range and of the first row it owns in table 0.
pub(crate) fn update(core: &Core, step: u64) -> Update {
    let layout: Layout = core.layout;
    let dim = core.job.config.model_config().unwrap().dim;
    let row = (0..u32::MAX)
        .find(|&r| layout.server_of(0, ftrec_proto::placement::GlobalRow(r)) == core.id)
        .unwrap();
    let shard = core.pipeline.shard_read().unwrap();
    let replica = shard
        .redundancy()
        .and_then(|r| r.replica.as_ref())
        .map_or(0, |r| r.range.len());
    Update {
        step,
        sparse: vec![(0, vec![row], vec![0.5; dim])],
        dense: vec![0.25; shard.dense_params().len()],
        replica_dense: vec![0.125; replica],
        attempt: 0,
    }
}
