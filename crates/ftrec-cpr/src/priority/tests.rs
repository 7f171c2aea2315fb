use crate::CprPriority;
use ftrec_model::{EmbeddingTable, Optimizer};
use proptest::prelude::*;

use super::*;

fn table(rows: usize, dim: usize) -> EmbeddingTable {
    EmbeddingTable::new_initialized(rows, dim, &Optimizer::Sgd { lr: 0.1 }, 1, 0)
}

#[test]
fn budget_is_a_rounded_up_share() {
    assert_eq!(budget(1000, 0.125), 125);
    assert_eq!(budget(10, 0.125), 2);
    assert_eq!(budget(3, 1e-9), 1);
    assert_eq!(budget(8, 1.0), 8);
}

#[test]
fn mfu_saves_the_most_used_rows_and_clears_their_counters() {
    let t = table(10, 4);
    let mut m = Mfu::new(10, 2);
    // Row 3 five times, row 7 three times, rows 1 and 9 once.
    m.record(&[3, 7, 3, 1, 3, 7, 3, 9, 3, 7]);
    assert_eq!(m.select(&t), vec![3, 7]);
    assert_eq!((m.count(3), m.count(7), m.count(1)), (0, 0, 1));
    // Ties go to the lower row; rows never accessed since their save are not chosen.
    assert_eq!(m.select(&t), vec![1, 9]);
    assert_eq!(m.select(&t), Vec::<u32>::new());
    m.record(&[4, 4, 5]);
    m.forget(&t, &[4]);
    assert_eq!(m.select(&t), vec![5]);
    assert_eq!(m.memory_bytes(), 40);
}

#[test]
fn ssu_records_every_period_th_access_into_a_distinct_list() {
    let t = table(16, 4);
    let mut s = Ssu::new(16, 4, 2, 7);
    // Accesses 0, 2, 4, 6 are sampled: rows 1, 3, 1, 5.
    s.record(&[1, 2, 3, 4, 1, 6, 5, 8]);
    assert_eq!(s.select(&t), vec![1, 3, 5]);
    assert_eq!(
        s.select(&t),
        Vec::<u32>::new(),
        "a selection empties the list"
    );
    // The sampling phase carries across steps: access 8 is sampled, 9 is not.
    s.record(&[10, 11]);
    s.forget(&t, &[12]);
    assert_eq!(s.select(&t), vec![10]);
    s.record(&[2, 0, 3]);
    s.forget(&t, &[2]);
    assert_eq!(s.select(&t), vec![3]);
    // 4 list entries + a 16-bit bitmap in one word.
    assert_eq!(s.memory_bytes(), 4 * 4 + 8);
}

/// A rollback past a prioritised save: the rows that save chose are restored to the
/// older checkpoint, so SCAR's copy (their values at that save) no longer matches them.
/// Before `forget` re-based restored rows, SCAR ranked them by their distance from values
/// that no longer exist and spent its budget on rows unchanged since the restore.
#[test]
fn scar_after_a_restore_ranks_only_changes_since_the_restored_values() {
    let mut t = table(8, 2);
    let cut = t.clone();
    let mut s = Scar::new(&t, 2);
    t.row_mut(2)[0] += 3.0;
    t.row_mut(6)[0] += 2.0;
    assert_eq!(s.select(&t), vec![2, 6], "a prioritised save after the cut");
    t = cut.clone();
    s.forget(&t, &[2, 6]);
    assert_eq!(
        s.select(&t),
        Vec::<u32>::new(),
        "nothing changed since the restore"
    );
    t.row_mut(5)[1] += 1.0;
    assert_eq!(s.select(&t), vec![5]);
    // The same through a whole-table reset.
    t.row_mut(1)[0] += 1.0;
    t = cut.clone();
    s.reset(&t);
    assert_eq!(s.select(&t), Vec::<u32>::new());
}

/// `choose` marks nothing saved: a save whose write fails chooses the same rows again,
/// and only `forget` (the write durable) or `select` clears them.
#[test]
fn choosing_marks_nothing_saved_until_forget() {
    let t = table(16, 2);
    let mut moved = t.clone();
    moved.row_mut(4)[0] += 1.0;
    moved.row_mut(9)[1] -= 2.0;
    for kind in [CprPriority::Mfu, CprPriority::Ssu, CprPriority::Scar] {
        let mut p = build_prioritizer(kind, &t, 0.5, 1, 7);
        p.record(&[4, 9, 9]);
        let first = p.choose(&moved);
        assert!(!first.is_empty(), "{kind:?}");
        assert_eq!(
            p.choose(&moved),
            first,
            "{kind:?}: a failed save changes nothing"
        );
        p.forget(&moved, &first);
        assert_eq!(p.choose(&moved), Vec::<u32>::new(), "{kind:?}");
    }
}

/// After a whole-table restore no tracker keeps anything of the steps before it.
#[test]
fn every_tracker_resets_to_nothing_unsaved() {
    let t = table(16, 2);
    for kind in [CprPriority::Mfu, CprPriority::Ssu, CprPriority::Scar] {
        let mut p = build_prioritizer(kind, &t, 0.5, 1, 7);
        p.record(&[3, 3, 7, 9, 11]);
        let mut moved = t.clone();
        moved.row_mut(4)[0] += 1.0;
        // A selection with nothing pending would come back empty; check there is some.
        let mut probe = build_prioritizer(kind, &t, 0.5, 1, 7);
        probe.record(&[3, 3, 7, 9, 11]);
        assert!(!probe.select(&moved).is_empty(), "{kind:?}");
        p.reset(&t);
        assert_eq!(p.select(&t), Vec::<u32>::new(), "{kind:?}");
    }
}

#[test]
fn ssu_overflow_discards_at_random_and_keeps_hot_rows() {
    let t = table(1000, 4);
    let mut kept = 0;
    for seed in 0..100 {
        let mut s = Ssu::new(1000, 4, 1, seed);
        // Row 0 every other access, among 500 distinct cold rows.
        let stream: Vec<u32> = (1..=500).flat_map(|c| [0, c]).collect();
        s.record(&stream);
        let rows = s.select(&t);
        assert_eq!(rows.len(), 4, "the list stays full once it overflowed");
        kept += rows.contains(&0) as usize;
    }
    // A cold row survives to the end with probability ~4/5 per later insertion at best;
    // the hot one is re-inserted every other access.
    assert!(kept >= 60, "hot row kept in {kept} of 100 runs");
    let a = {
        let mut s = Ssu::new(1000, 4, 1, 3);
        s.record(&(1..500).collect::<Vec<u32>>());
        s.select(&t)
    };
    let b = {
        let mut s = Ssu::new(1000, 4, 1, 3);
        s.record(&(1..500).collect::<Vec<u32>>());
        s.select(&t)
    };
    assert_eq!(a, b, "deterministic for a seed");
}

#[test]
fn scar_saves_the_largest_changes_since_the_last_save() {
    let mut t = table(8, 2);
    let mut s = Scar::new(&t, 2);
    assert_eq!(s.select(&t), Vec::<u32>::new(), "nothing changed yet");
    t.row_mut(2)[0] += 3.0; // |change| = 3
    t.row_mut(5)[1] -= 1.0; // 1
    t.row_mut(6)[0] += 2.0; // 2
    assert_eq!(s.select(&t), vec![2, 6]);
    // Saved rows start again from zero change; row 5 still carries its change.
    assert_eq!(s.select(&t), vec![5]);
    t.row_mut(2)[1] += 0.5;
    assert_eq!(s.select(&t), vec![2]);
    // The optimizer-state words do not rank a row; only its embedding does.
    assert_eq!(s.memory_bytes(), 8 * 2 * 4);
}

#[test]
fn no_priority_saves_every_row_and_every_kind_builds() {
    let t = table(5, 2);
    let mut n = NoPriority;
    n.record(&[1]);
    assert_eq!(n.select(&t), vec![0, 1, 2, 3, 4]);
    for kind in CprPriority::ALL {
        let p = build_prioritizer(kind, &t, 0.4, 2, 1);
        assert_eq!(p.kind(), kind);
    }
    assert_eq!(
        build_prioritizer(CprPriority::Mfu, &t, 0.4, 2, 1).memory_bytes(),
        20
    );
}

proptest! {
    #[test]
    fn mfu_matches_a_brute_force_ranking(
        accesses in proptest::collection::vec(0u32..50, 0..400),
        budget in 1usize..20,
    ) {
        let t = table(50, 2);
        let mut m = Mfu::new(50, budget);
        m.record(&accesses);
        let mut counts = [0u32; 50];
        for &a in &accesses {
            counts[a as usize] += 1;
        }
        let mut ranked: Vec<(u32, u32)> = counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(r, &c)| (c, r as u32))
            .collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut want: Vec<u32> = ranked.iter().take(budget).map(|x| x.1).collect();
        want.sort_unstable();
        prop_assert_eq!(m.select(&t), want);
    }

    #[test]
    fn ssu_list_is_bounded_distinct_and_sampled(
        accesses in proptest::collection::vec(0u32..64, 0..300),
        budget in 1usize..16,
        period in 1u32..4,
        seed in 0u64..1000,
    ) {
        let t = table(64, 2);
        let mut s = Ssu::new(64, budget, period, seed);
        s.record(&accesses);
        let rows = s.select(&t);
        prop_assert!(rows.len() <= budget);
        prop_assert!(rows.windows(2).all(|w| w[0] < w[1]));
        let sampled: Vec<u32> = accesses.iter().step_by(period as usize).copied().collect();
        prop_assert!(rows.iter().all(|r| sampled.contains(r)));
        let distinct = {
            let mut d = sampled.clone();
            d.sort_unstable();
            d.dedup();
            d.len()
        };
        prop_assert_eq!(rows.len(), distinct.min(budget));
    }
}
