use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

#[test]
fn specs_round_trip_and_nonsense_is_refused_by_name() {
    for text in [
        "prepare:3",
        "commit:40",
        "rebuild",
        "fold-parity:7=skip",
        "prepare:9=delay-2500",
        "fold-parity:12=flip",
        "install:30=flip",
        "install:30=delay-400",
        "send-rows=delay-50",
        "takeover",
    ] {
        let spec = FaultSpec::parse(text).unwrap();
        assert_eq!(spec.to_string(), text);
    }
    assert_eq!(
        FaultSpec::parse("prepare:3=kill").unwrap(),
        FaultSpec::new(points::PREPARE, Some(3), FaultAction::Kill)
    );
    for (bad, says) in [
        ("", "unknown point"),
        ("phase:3", "unknown point \"phase\""),
        ("prepare:x", "step \"x\""),
        ("commit:-1", "step \"-1\""),
        ("rebuild=explode", "unknown action \"explode\""),
        ("install:3=flop", "unknown action \"flop\""),
        ("installs:3=flip", "unknown point \"installs\""),
        ("prepare=delay-", "unknown action \"delay-\""),
        ("prepare=delay-x", "unknown action \"delay-x\""),
        // Points that never take the action: refused, not armed to fire never.
        (
            "rebuild=skip",
            "\"rebuild\" never does \"skip\" (it does: kill)",
        ),
        ("install", "never does \"kill\" (it does: flip, delay-MS)"),
        ("push:3=delay-10", "\"push\" never does \"delay-MS\""),
        ("takeover=delay-100", "\"takeover\" never does \"delay-MS\""),
        ("send-rows", "never does \"kill\""),
    ] {
        let e = FaultSpec::parse(bad).unwrap_err().to_string();
        assert!(
            e.contains(says) && e.contains(&format!("{bad:?}")),
            "{bad}: {e}"
        );
    }
}

fn counting() -> (Faults, Arc<AtomicUsize>) {
    let kills = Arc::new(AtomicUsize::new(0));
    let seen = kills.clone();
    let faults = Faults::with_kill_hook(Arc::new(move |_: &FaultSpec| {
        seen.fetch_add(1, Ordering::SeqCst);
    }));
    (faults, kills)
}

#[test]
fn a_point_fires_once_at_its_step_only() {
    let (faults, kills) = counting();
    faults.arm(FaultSpec::parse("commit:5").unwrap());
    faults.kill_at(points::COMMIT, Some(4));
    faults.kill_at(points::PREPARE, Some(5));
    assert_eq!(kills.load(Ordering::SeqCst), 0);
    faults.kill_at(points::COMMIT, Some(5));
    faults.kill_at(points::COMMIT, Some(5));
    assert_eq!(kills.load(Ordering::SeqCst), 1);
    assert!(faults.armed().is_empty());
    assert_eq!(faults.fired(), vec![FaultSpec::parse("commit:5").unwrap()]);
}

#[test]
fn a_stepless_spec_fires_at_any_step_and_actions_do_not_cross() {
    let (faults, kills) = counting();
    faults.arm(FaultSpec::parse("fold-parity=skip").unwrap());
    faults.kill_at(points::FOLD_PARITY, Some(9));
    assert_eq!(kills.load(Ordering::SeqCst), 0, "a skip is not a kill");
    assert!(faults.skip_at(points::FOLD_PARITY, Some(9)));
    assert!(!faults.skip_at(points::FOLD_PARITY, Some(10)));
}

#[test]
fn a_delay_fires_once_with_its_length_and_is_no_kill() {
    let (faults, kills) = counting();
    faults.arm(FaultSpec::parse("prepare:4=delay-1500").unwrap());
    assert_eq!(faults.delay_at(points::PREPARE, Some(3)), None);
    faults.kill_at(points::PREPARE, Some(4));
    assert_eq!(kills.load(Ordering::SeqCst), 0, "a delay is not a kill");
    assert_eq!(
        faults.delay_at(points::PREPARE, Some(4)),
        Some(std::time::Duration::from_millis(1500))
    );
    assert_eq!(faults.delay_at(points::PREPARE, Some(4)), None);
}

#[test]
fn a_flip_fires_once_at_its_step_and_is_neither_a_skip_nor_a_kill() {
    let (faults, kills) = counting();
    faults.arm(FaultSpec::parse("install:6=flip").unwrap());
    assert_eq!(
        faults.armed(),
        vec![FaultSpec::new(points::INSTALL, Some(6), FaultAction::Flip)]
    );
    assert!(!faults.flip_at(points::INSTALL, Some(5)));
    assert!(!faults.flip_at(points::FOLD_PARITY, Some(6)));
    assert!(
        !faults.skip_at(points::INSTALL, Some(6)),
        "a flip is not a skip"
    );
    faults.kill_at(points::INSTALL, Some(6));
    assert_eq!(kills.load(Ordering::SeqCst), 0, "a flip is not a kill");
    assert!(faults.flip_at(points::INSTALL, Some(6)));
    assert!(!faults.flip_at(points::INSTALL, Some(6)), "fires once");
    assert_eq!(
        faults.fired(),
        vec![FaultSpec::parse("install:6=flip").unwrap()]
    );
}

#[test]
fn registries_are_independent_but_clones_share() {
    let (a, _) = counting();
    let (b, _) = counting();
    a.arm(FaultSpec::parse("fold-parity=skip").unwrap());
    assert!(!b.skip_at(points::FOLD_PARITY, None));
    let a2 = a.clone();
    assert!(a2.skip_at(points::FOLD_PARITY, None));
    assert!(!a.skip_at(points::FOLD_PARITY, None));
}
