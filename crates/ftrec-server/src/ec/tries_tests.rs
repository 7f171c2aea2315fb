//! 2PC tries: an abort drops only the parts of the try of a step it names, so one that
//! lands late, once the step was granted again in the same epoch, leaves the new try's
//! prepared update and staged parity differences alone.

use ftrec_proto::proto::ParityUpdateRequest;

use crate::pipeline::{CommitMode, Pushed};
use crate::test_core::{core, ec_job, update};

const EPOCH: u64 = 5;
const STEP: u64 = 7;
const FIRST: u64 = 0x11;
const SECOND: u64 = 0x22;

#[tokio::test]
async fn a_late_abort_of_the_first_try_leaves_the_step_granted_again_prepared() {
    let job = ec_job();
    let core = core(&job, 0, EPOCH);
    let first = crate::shard::Update {
        attempt: FIRST,
        ..update(&core, STEP)
    };
    let prepared = core.run_update(EPOCH, first, CommitMode::TwoPhase).await;
    assert!(matches!(prepared, Ok(Pushed::Prepared { .. })));
    // The step granted again in the same epoch finds its first try prepared and adopts it.
    let second = crate::shard::Update {
        attempt: SECOND,
        ..update(&core, STEP)
    };
    let adopted = core.run_update(EPOCH, second, CommitMode::TwoPhase).await;
    assert!(matches!(adopted, Ok(Pushed::Prepared { rows: 0 })));
    let ec = core.pipeline.ec().unwrap();
    // The first try's abort lands now: it no longer matches.
    core.abort_step(EPOCH, STEP, FIRST).unwrap();
    assert!(
        ec.adopt_prepared(STEP, EPOCH, 0).is_some(),
        "a late abort of the first try dropped the second's prepared update"
    );
    assert_eq!(core.commit_step(EPOCH, STEP).await.unwrap(), 1);

    // An abort of the try it is prepared for (or of every try) still drops it.
    for (step, abort) in [(STEP + 1, SECOND), (STEP + 2, 0)] {
        let u = crate::shard::Update {
            attempt: SECOND,
            ..update(&core, step)
        };
        core.run_update(EPOCH, u, CommitMode::TwoPhase)
            .await
            .unwrap();
        core.abort_step(EPOCH, step, abort).unwrap();
        assert!(ec.adopt_prepared(step, EPOCH, 0).is_none(), "try {abort:x}");
    }
}

#[tokio::test]
async fn a_late_abort_of_the_first_try_leaves_the_second_try_s_staged_parity() {
    let job = ec_job();
    // Server 2 holds parity for servers 0 and 1 in some stripes (k = 2, r = 1, rotated).
    let holder = core(&job, 2, EPOCH);
    let staged = |source: u32, attempt: u64| ParityUpdateRequest {
        epoch: EPOCH,
        step: STEP,
        source,
        staged: true,
        tables: Vec::new(),
        attempt,
    };
    // Server 0's first try staged a difference, its second try replaced it; server 1's
    // only difference came with the second try.
    holder.parity_update(staged(0, FIRST)).unwrap();
    holder.parity_update(staged(0, SECOND)).unwrap();
    holder.parity_update(staged(1, SECOND)).unwrap();
    holder.abort_step(EPOCH, STEP, FIRST).unwrap();
    let ec = holder.pipeline.ec().unwrap();
    let kept = ec.take_staged_parity(STEP, EPOCH);
    let mut sources: Vec<(u32, u64)> = kept.iter().map(|r| (r.source, r.attempt)).collect();
    sources.sort_unstable();
    assert_eq!(sources, vec![(0, SECOND), (1, SECOND)]);

    // The second try's own abort drops them; one for every try drops the rest.
    holder.parity_update(staged(0, SECOND)).unwrap();
    holder.parity_update(staged(1, FIRST)).unwrap();
    holder.abort_step(EPOCH, STEP, SECOND).unwrap();
    let left: Vec<u32> = ec
        .take_staged_parity(STEP, EPOCH)
        .iter()
        .map(|r| r.source)
        .collect();
    assert_eq!(left, vec![1]);
    holder.parity_update(staged(1, FIRST)).unwrap();
    holder.abort_step(EPOCH, STEP, 0).unwrap();
    assert!(ec.take_staged_parity(STEP, EPOCH).is_empty());
}

/// Counts the differences a server sends, by the try they are tagged with.
#[derive(Default)]
struct Sent(std::sync::Mutex<Vec<u64>>);

#[tonic::async_trait]
impl crate::shard::PreCommit for Sent {
    async fn pre_commit(
        &self,
        staged: &crate::shard::StagedUpdate,
    ) -> Result<(), ftrec_rpc::PsError> {
        self.0.lock().unwrap().push(staged.attempt());
        Ok(())
    }
}

/// A copy of a prepare (hedged on a lossy link, or retried) for the try that prepared
/// the step answers without sending its differences again: they are at the holders
/// already, and sending cost the copy another crossing of that link. A new try of the
/// step still sends them again under its own tag, and so does the first try once the
/// second retagged the update.
#[tokio::test]
async fn a_copy_of_the_prepared_try_sends_no_difference_again_and_a_new_try_does() {
    let job = ec_job();
    let mut core = core(&job, 0, EPOCH);
    let sent = std::sync::Arc::new(Sent::default());
    core.pipeline.add_pre_commit(sent.clone());
    let attempt = |attempt| crate::shard::Update {
        attempt,
        ..update(&core, STEP)
    };
    for (try_, expected) in [
        (FIRST, vec![FIRST]),
        // A copy of the first try.
        (FIRST, vec![FIRST]),
        // The step granted again: sent again under the new tag.
        (SECOND, vec![FIRST, SECOND]),
        (SECOND, vec![FIRST, SECOND]),
        // A late copy of the first try retags the update: its tag's differences were
        // replaced at the holders, so they go out again.
        (FIRST, vec![FIRST, SECOND, FIRST]),
        (FIRST, vec![FIRST, SECOND, FIRST]),
        // A try that names none is never taken for sent.
        (0, vec![FIRST, SECOND, FIRST, FIRST]),
    ] {
        let prepared = core
            .run_update(EPOCH, attempt(try_), CommitMode::TwoPhase)
            .await;
        assert!(
            matches!(prepared, Ok(Pushed::Prepared { .. })),
            "try {try_:x}"
        );
        assert_eq!(*sent.0.lock().unwrap(), expected, "after try {try_:x}");
    }
    assert_eq!(core.commit_step(EPOCH, STEP).await.unwrap(), 1);
}
