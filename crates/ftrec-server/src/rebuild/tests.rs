//! A rebuild's ordering against the steps an older epoch left prepared here.

use std::sync::Arc;
use std::time::Duration;

use ftrec_proto::proto::RebuildRequest;
use ftrec_rpc::PsError;

use crate::pipeline::{CommitMode, Pushed};
use crate::test_core::{core, ec_job, update};

/// Issue 42, hole 1: a slot rebuilding in the background when its leader died holds a
/// step of the old epoch in phase 1 (with the commit turn), and its worker dropped it on
/// seeing the new epoch. The new leader fences the other servers only, then asks this
/// slot to rebuild in its epoch. The rebuild took the commit turn first and waited on the
/// prepared step forever (and the leader on the rebuild's stream). Now the older epoch's
/// prepared steps are dropped before the turn is taken: the rebuild goes on (here it
/// stops at once, at the survivors' addresses, which this test leaves out).
#[tokio::test]
async fn a_rebuild_in_a_newer_epoch_is_not_held_up_by_a_step_prepared_in_an_older_one() {
    let job = ec_job();
    let core = Arc::new(core(&job, 0, 5));
    let step = update(&core, 7);
    let prepared = core
        .run_update(5, step, CommitMode::TwoPhase)
        .await
        .unwrap();
    assert!(matches!(prepared, Pushed::Prepared { .. }));
    let ec = core.pipeline.ec().unwrap();
    assert!(ec.adopt_prepared(7, 5, 0).is_some());

    let (progress, _replies) = tokio::sync::mpsc::channel(8);
    let request = RebuildRequest {
        epoch: 6,
        servers: vec![String::new(); 3],
        lost: vec![0],
        parity_only: false,
        background: true,
        failure_free_steps_per_sec: 0.0,
    };
    let rebuilt = tokio::time::timeout(Duration::from_secs(20), core.rebuild(request, progress))
        .await
        .expect("the rebuild waited on a step the old epoch prepared here");
    let e = rebuilt.unwrap_err();
    assert!(
        matches!(&e, PsError::BadRequest(why) if why.contains("no address")),
        "past the turn, the rebuild needs its survivors: {e}"
    );
    assert!(
        ec.adopt_prepared(7, 5, 0).is_none(),
        "the old epoch's step is dropped"
    );
    // The fence is up: the old epoch prepares nothing more here.
    let late = core
        .run_update(5, update(&core, 8), CommitMode::TwoPhase)
        .await;
    assert!(late.is_err(), "a prepare of the fenced epoch went through");
}
