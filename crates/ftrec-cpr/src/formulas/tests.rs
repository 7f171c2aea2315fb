use proptest::prelude::*;

use super::*;

fn inputs() -> CostInputs {
    CostInputs {
        o_save: 2.0,
        o_load: 3.0,
        o_res: 1.0,
        t_fail: 100.0,
        t_total: 1000.0,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn hand_computed_overheads_and_intervals() {
    let c = inputs();
    // sqrt(2 * 2 * 100) = 20.
    assert!(close(c.full_optimal_interval().unwrap(), 20.0));
    // 2 * 1000/20 + (3 + 20/2 + 1) * 1000/100 = 100 + 140.
    assert!(close(c.full_overhead(20.0).unwrap(), 240.0));
    // 2 * 0.1 * 8 * 100 = 160; one server per failure.
    let t = partial_interval(0.1, 8, 1, 100.0).unwrap();
    assert!(close(t, 160.0));
    // 2 * 1000/160 + (3 + 1) * 1000/100 = 12.5 + 40.
    assert!(close(c.partial_overhead(t).unwrap(), 52.5));
    // Four of eight servers per failure: a quarter of the interval.
    assert!(close(partial_interval(0.1, 8, 4, 100.0).unwrap(), 40.0));
    assert!(close(expected_pls(160.0, 100.0, 8, 1).unwrap(), 0.1));
    assert!(close(expected_pls(40.0, 100.0, 8, 4).unwrap(), 0.1));
}

#[test]
fn pls_accumulates_eq3_per_failed_server() {
    let mut p = Pls::new(1000, 8).unwrap();
    // (500 - 300) / (1000 * 8).
    assert!(close(p.on_server_failure(500, 300).unwrap(), 0.025));
    assert!(close(p.on_server_failure(500, 300).unwrap(), 0.025));
    assert!(close(p.value, 0.05));
    assert_eq!(p.on_server_failure(700, 700).unwrap(), 0.0);
    assert!(p.on_server_failure(10, 20).is_err());
    assert!(Pls::new(0, 8).is_err());
}

#[test]
fn decide_picks_partial_when_it_pays_and_falls_back_otherwise() {
    let d = decide(inputs(), 0.1, 8, 1, 0.1).unwrap();
    assert_eq!(d.recovery, Recovery::Partial);
    assert!(close(d.overhead_full, 240.0) && close(d.overhead_partial, 52.5));
    assert!(close(d.benefit(), 1.0 - 52.5 / 240.0));
    assert_eq!(d.inputs, inputs(), "every input is kept for the log");
    assert!(d.to_string().contains("T_fail 100.00s"), "{d}");
    // Cheap saves, expensive reloads: partial saves ~1.4% of the overhead, below 10%.
    let c = CostInputs {
        o_save: 0.01,
        o_load: 50.0,
        o_res: 50.0,
        ..inputs()
    };
    let d = decide(c, 0.1, 8, 1, 0.1).unwrap();
    assert_eq!(d.recovery, Recovery::Full);
    assert!(d.benefit() > 0.0 && d.benefit() < 0.1, "{}", d.benefit());
    assert_eq!(
        decide(c, 0.1, 8, 1, 0.0).unwrap().recovery,
        Recovery::Partial
    );
}

#[test]
fn bad_inputs_are_named() {
    let e = decide(
        CostInputs {
            t_fail: 0.0,
            ..inputs()
        },
        0.1,
        8,
        1,
        0.1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("T_fail"), "{e}");
    assert!(partial_interval(0.1, 8, 9, 1.0).is_err());
    assert!(partial_interval(0.0, 8, 1, 1.0).is_err());
    assert!(decide(inputs(), 0.1, 8, 1, 1.0).is_err());
}

proptest! {
    #[test]
    fn optimal_full_interval_minimises_eq1(
        o_save in 1e-3f64..1e3,
        o_load in 0.0f64..1e3,
        o_res in 0.0f64..1e3,
        t_fail in 1.0f64..1e6,
        eps in 1e-3f64..0.5,
    ) {
        let c = CostInputs { o_save, o_load, o_res, t_fail, t_total: 1e7 };
        let t = c.full_optimal_interval().unwrap();
        let best = c.full_overhead(t).unwrap();
        for n in [t * (1.0 - eps), t * (1.0 + eps)] {
            prop_assert!(c.full_overhead(n).unwrap() >= best * (1.0 - 1e-12));
        }
    }

    #[test]
    fn partial_interval_meets_its_target_and_never_loses_computation(
        pls in 1e-4f64..1.0,
        n in 1usize..64,
        k_frac in 0.0f64..1.0,
        t_fail in 1.0f64..1e6,
    ) {
        let k = 1 + ((n - 1) as f64 * k_frac) as usize;
        let t = partial_interval(pls, n, k, t_fail).unwrap();
        prop_assert!((expected_pls(t, t_fail, n, k).unwrap() - pls).abs() <= 1e-9 * pls);
        // At the same interval Eq. 2 is Eq. 1 less the lost computation.
        let c = CostInputs { o_save: 1.0, o_load: 2.0, o_res: 3.0, t_fail, t_total: 1e6 };
        let gap = c.full_overhead(t).unwrap() - c.partial_overhead(t).unwrap();
        prop_assert!((gap - t / 2.0 * 1e6 / t_fail).abs() <= 1e-6 * gap.max(1.0));
    }

    #[test]
    fn pls_only_grows_and_sums_its_increments(
        events in proptest::collection::vec((0u64..1000, 0u64..1000), 0..20),
    ) {
        let mut p = Pls::new(1000, 4).unwrap();
        let mut sum = 0.0;
        for (a, b) in events {
            let (s_i, last) = (a.max(b), a.min(b));
            let before = p.value;
            sum += p.on_server_failure(s_i, last).unwrap();
            prop_assert!(p.value >= before);
        }
        prop_assert!((p.value - sum).abs() < 1e-12);
    }
}

// Eq. 2 priced with prioritised saves (`prioritized.rs`).
#[test]
fn hand_computed_prioritized_overhead() {
    let p = PrioritizedCosts {
        r: 0.125,
        o_save: 0.1,
        tracking_share: 0.01,
        min_save_interval: 0.0,
    };
    // 0.1 * 1000 / (0.125 * 160) + 0.01 * 1000 + (3 + 1) * 1000 / 100 = 5 + 10 + 40.
    let o = inputs().prioritized_overhead(160.0, &p).unwrap();
    assert!((o - 55.0).abs() < 1e-9, "{o}");
    // Saves no closer than 40 s: 0.1 * 1000 / 40 + 10 + 40.
    let spaced = PrioritizedCosts {
        min_save_interval: 40.0,
        ..p
    };
    let o = inputs().prioritized_overhead(160.0, &spaced).unwrap();
    assert!((o - 52.5).abs() < 1e-9, "{o}");
}

#[test]
fn whole_table_saves_give_eq2_back() {
    // r = 1 and a save as dear as Eq. 2's, nothing tracked: the same as `decide`.
    let p = PrioritizedCosts {
        r: 1.0,
        o_save: 2.0,
        tracking_share: 0.0,
        min_save_interval: 0.0,
    };
    let plain = decide(inputs(), 0.02, 8, 1, 0.1).unwrap();
    let prio = decide_prioritized(inputs(), 0.02, 8, 1, 0.1, p).unwrap();
    assert_eq!(plain.overhead_partial, prio.overhead_partial);
    assert_eq!(plain.recovery, prio.recovery);
}

#[test]
fn cheap_prioritized_saves_turn_the_decision() {
    // At a low target PLS Eq. 2's interval is short and whole-table saves cost more
    // than full recovery; saves of a few touched rows do not.
    let plain = decide(inputs(), 0.002, 8, 1, 0.1).unwrap();
    assert_eq!(plain.recovery, Recovery::Full, "{plain}");
    let p = PrioritizedCosts {
        r: 0.125,
        o_save: 0.01,
        tracking_share: 0.005,
        min_save_interval: 0.0,
    };
    let prio = decide_prioritized(inputs(), 0.002, 8, 1, 0.1, p).unwrap();
    assert_eq!(prio.recovery, Recovery::Partial, "{prio}");
    assert!(prio.to_string().contains("prioritised saves"));
    // Tracking that costs as much as full recovery turns it back.
    let dear = PrioritizedCosts {
        tracking_share: 0.5,
        ..p
    };
    let prio = decide_prioritized(inputs(), 0.002, 8, 1, 0.1, dear).unwrap();
    assert_eq!(prio.recovery, Recovery::Full, "{prio}");
}

#[test]
fn bad_costs_are_named() {
    let p = PrioritizedCosts {
        r: 0.0,
        o_save: 0.1,
        tracking_share: 0.0,
        min_save_interval: 0.0,
    };
    let e = decide_prioritized(inputs(), 0.1, 8, 1, 0.1, p).unwrap_err();
    assert!(e.to_string().contains("r = 0"), "{e}");
}
