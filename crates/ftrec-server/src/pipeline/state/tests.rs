//! The pipeline's invariants: steps and epoch published together, epochs that only move
//! forward where they must, installs checked under the lock they install under.

use super::*;
use crate::shard::Update;
use crate::shard::tests::model;
use ftrec_proto::placement::Layout;

fn pipeline(epoch: u64) -> UpdatePipeline {
    let shard = Shard::initial(&model(), 7, Layout::new(1).unwrap(), 0).unwrap();
    UpdatePipeline::new(
        shard,
        epoch,
        false,
        Arc::new(crate::server_metrics("0")),
        Faults::default(),
    )
}

/// One step's update of row 0 of table 0 and of the dense range.
fn update(p: &UpdatePipeline, step: u64) -> Update {
    let shard = p.shard_read().unwrap();
    Update {
        step,
        sparse: vec![(0, vec![0], vec![0.5; model().dim])],
        dense: vec![0.25; shard.dense_params().len()],
        replica_dense: Vec::new(),
        attempt: 0,
    }
}

#[test]
fn publish_changes_the_steps_and_the_live_floor_together() {
    let p = pipeline(2);
    assert_eq!(
        p.live(),
        Live {
            epoch: 2,
            applied: 0
        }
    );
    let count = p.publish(3, |steps| {
        steps.insert(0);
        steps.insert(1);
        steps.insert(3);
    });
    assert_eq!(count, 3);
    // The floor is the first step not applied; a step ahead of a gap does not move it.
    assert_eq!(
        p.live(),
        Live {
            epoch: 3,
            applied: 2
        }
    );
    let reply = p.applied_of(&[0, 2, 3]);
    assert_eq!(reply.applied, vec![true, false, true]);
    assert_eq!((reply.applied_low, reply.applied_end), (2, 4));
}

#[test]
fn epochs_are_checked_exactly_or_forward() {
    let p = pipeline(5);
    assert!(p.check_epoch(5).is_ok());
    assert!(matches!(
        p.check_epoch(4),
        Err(PsError::StaleEpoch { got: 4, current: 5 })
    ));
    assert!(p.check_epoch(6).is_err());
    assert!(p.check_epoch_forward(6).is_ok());
    assert!(p.check_epoch_forward(5).is_ok());
    assert!(p.check_epoch_forward(4).is_err());
}

#[test]
fn install_records_the_step_and_refuses_another_epoch_without_changing_the_shard() {
    let p = pipeline(1);
    let staged = p.shard_read().unwrap().stage(&update(&p, 0)).unwrap();
    let before = p.shard_read().unwrap().digest();
    assert!(matches!(
        p.install(2, &staged, &[]),
        Err(PsError::StaleEpoch { .. })
    ));
    assert_eq!(p.shard_read().unwrap().digest(), before);
    assert_eq!(p.steps().count(), 0);
    assert_eq!(p.install(1, &staged, &[]).unwrap(), 1);
    assert!(p.steps().contains(0));
    assert_ne!(p.shard_read().unwrap().digest(), before);
    assert_eq!(p.live().applied, 1);
}

#[test]
fn an_update_staged_before_another_installed_is_refused() {
    let p = pipeline(1);
    let first = p.shard_read().unwrap().stage(&update(&p, 0)).unwrap();
    let second = p.shard_read().unwrap().stage(&update(&p, 1)).unwrap();
    p.install(1, &first, &[]).unwrap();
    let after_first = p.shard_read().unwrap().digest();
    // Its dense gradient was staged against values that have moved since.
    assert!(matches!(
        p.install(1, &second, &[]),
        Err(PsError::Internal(_))
    ));
    assert_eq!(p.shard_read().unwrap().digest(), after_first);
    assert!(!p.steps().contains(1));
}

#[tokio::test]
async fn a_wait_for_a_step_ends_when_it_is_applied_or_the_epoch_moves() {
    let p = Arc::new(pipeline(1));
    let waiting = {
        let p = p.clone();
        tokio::spawn(async move { p.wait_applied(1, 2, Duration::from_secs(30), 0).await })
    };
    tokio::task::yield_now().await;
    p.publish(1, |steps| {
        steps.insert(0);
        steps.insert(1);
    });
    assert!(waiting.await.unwrap().is_ok());

    let waiting = {
        let p = p.clone();
        tokio::spawn(async move { p.wait_applied(1, 5, Duration::from_secs(30), 0).await })
    };
    tokio::task::yield_now().await;
    p.publish(2, |_| {});
    assert!(matches!(
        waiting.await.unwrap(),
        Err(PsError::StaleEpoch { got: 1, current: 2 })
    ));

    assert!(matches!(
        p.wait_applied(2, 5, Duration::from_millis(10), 0).await,
        Err(PsError::Timeout(_))
    ));
}
