//! How a round of calls to the survivors is sorted (`Sorted::of`).

use ftrec_rpc::PsError;

use super::Sorted;

/// A recovery's new epoch reaches the servers one by one, so a survivor an epoch apart
/// (ahead or behind) is asked again, not taken for a refusal for good: that failed a
/// background rebuild whose slot a second failure's recovery had just moved, and ended
/// the job (`tools/netns-control.sh survivor-link-down-rebuild`: "server 1's background
/// rebuild failed: ... stale epoch 3145731: the cluster is in epoch 3145730").
#[test]
fn a_survivor_an_epoch_apart_is_asked_again() {
    for (got, current) in [(3, 2), (2, 3)] {
        let results: Vec<Result<u32, PsError>> =
            vec![Ok(1), Err(PsError::StaleEpoch { got, current })];
        let sorted = Sorted::of(results, || "server 1: rebuild of table 4".to_string())
            .unwrap_or_else(|e| panic!("epoch {got} against {current}: {e}"));
        assert_eq!(sorted.ok, vec![1]);
        assert!(sorted.unreachable.is_none());
    }
    // A refusal for good still ends the read at once.
    let refused: Vec<Result<u32, PsError>> = vec![Err(PsError::BadRequest("no".into()))];
    assert!(matches!(
        Sorted::of(refused, String::new),
        Err(PsError::Degraded(_))
    ));
}
