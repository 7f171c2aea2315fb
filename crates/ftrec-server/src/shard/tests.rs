//! Shard tests: the initial shards against the single-process model, the pipeline's
//! stage / commit seams, and the striped (erasure-coded) layout's shards.

use super::*;
use ftrec_model::Optimizer;
use ftrec_proto::placement::LocalRow;

/// A small model with Adam rows and Adam dense state (other tests of the crate use it).
pub(crate) fn model() -> ModelConfig {
    ModelConfig {
        num_dense: 3,
        table_rows: vec![23, 40, 9],
        dim: 4,
        bottom: vec![8, 4],
        top: vec![6, 1],
        sparse_optimizer: Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
        dense_optimizer: Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    }
}

fn shards(servers: usize) -> Vec<Shard> {
    let layout = Layout::new(servers).unwrap();
    (0..servers)
        .map(|s| Shard::initial(&model(), 7, layout, s).unwrap())
        .collect()
}

#[test]
fn initial_shards_hold_exactly_the_single_process_rows_and_dense_ranges() {
    let global = ModelState::new(&model(), 7).unwrap();
    for servers in 1..4 {
        let layout = Layout::new(servers).unwrap();
        let mut dense_seen = Vec::new();
        for shard in shards(servers) {
            for (t, table) in shard.state().tables().iter().enumerate() {
                for local in 0..table.rows() {
                    let rows = global.config().table_rows[t];
                    let g = layout
                        .global_row(t, shard.server(), LocalRow(local as u32), rows)
                        .unwrap();
                    assert_eq!(table.row(local), global.row(t, g.0 as u64).unwrap());
                }
            }
            dense_seen.extend_from_slice(shard.dense_params());
        }
        assert_eq!(dense_seen, global.dense.params);
    }
}

fn update(shard: &Shard, rows: Vec<u32>, seed: f32) -> Update {
    let dim = model().dim;
    Update {
        step: 0,
        sparse: vec![(
            1,
            rows.clone(),
            (0..rows.len() * dim)
                .map(|i| seed + i as f32 * 0.01)
                .collect(),
        )],
        dense: vec![0.5; shard.dense_params().len()],
        replica_dense: Vec::new(),
        attempt: 0,
    }
}

/// Striped shards hold the single-process rows at their slots, padding zero, and
/// parity rows equal to the stripes' encoding; each dense replica equals its primary.
#[test]
fn striped_initial_shards_hold_rows_parity_and_replicas() {
    let config = model();
    let global = ModelState::new(&config, 7).unwrap();
    for (k, r, servers) in [(2, 1, 3), (3, 1, 4), (2, 2, 4)] {
        let params = ftrec_ec::EcParams { k, r, groups: 1 };
        let stripes = ftrec_ec::StripeLayout::new(params, servers).unwrap();
        let layout = Layout::striped(stripes);
        let codec = ftrec_ec::Codec::new(k, r).unwrap();
        let shards: Vec<Shard> = (0..servers)
            .map(|s| Shard::initial(&config, 7, layout, s).unwrap())
            .collect();
        let row_bytes = config.row_stride() * 4;
        for (t, &rows) in config.table_rows.iter().enumerate() {
            let zero = vec![0u8; row_bytes];
            let row_of = |g: usize| -> Vec<u8> {
                if g < rows {
                    bytemuck::cast_slice(global.row(t, g as u64).unwrap()).to_vec()
                } else {
                    zero.clone()
                }
            };
            for j in 0..stripes.stripes(rows) {
                let data: Vec<Vec<u8>> = (0..k).map(|i| row_of(j * k + i)).collect();
                for (i, d) in data.iter().enumerate() {
                    let slot = stripes.data_slot(t, j, i);
                    let stored = shards[slot.server].state().tables()[t].row(slot.local);
                    assert_eq!(bytemuck::cast_slice::<f32, u8>(stored), &d[..]);
                }
                let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                for p in 0..r {
                    let mut expected = vec![0u8; row_bytes];
                    codec.encode_parity(p, &refs, &mut expected).unwrap();
                    let slot = stripes.parity_slot(t, j, p);
                    let red = shards[slot.server].redundancy().unwrap();
                    let held = &red.parity[t][slot.local * row_bytes..(slot.local + 1) * row_bytes];
                    assert_eq!(
                        held,
                        &expected[..],
                        "k={k} r={r} table {t} stripe {j} parity {p}"
                    );
                }
            }
        }
        for shard in &shards {
            let replica = shard.redundancy().unwrap().replica.as_ref().unwrap();
            assert_eq!(replica.params, shards[replica.of].dense_params());
            assert_eq!(replica.state, shards[replica.of].dense_optimizer_state());
        }
    }
}

#[test]
fn stage_changes_nothing_and_keeps_the_new_rows_then_commit_installs_them() {
    let mut shard = shards(2).remove(0);
    let rows: Vec<u32> = (0..40u32).filter(|r| (r + 1) % 2 == 0).take(3).collect();
    let before = shard.state().clone();
    let u = update(&shard, rows.clone(), 0.3);
    let staged = shard.stage(&u).unwrap();
    assert_eq!(shard.state(), &before, "staging is invisible");
    drop(staged); // abort
    assert_eq!(shard.state(), &before);
    let staged = shard.stage(&u).unwrap();
    shard.commit(&staged);
    let changed = &staged.rows()[0];
    assert_eq!((changed.table, &changed.globals), (1, &rows));
    let stride = shard.state().tables()[1].stride();
    for (i, &r) in rows.iter().enumerate() {
        let local = r as usize / 2;
        assert_eq!(changed.locals[i] as usize, local);
        let new = &changed.new[i * stride..(i + 1) * stride];
        assert_eq!(new, shard.state().tables()[1].row(local));
        assert_ne!(new, before.tables()[1].row(local));
    }
    assert_eq!(shard.dense_step(), 1);
}

/// An erasure-coded shard stages each row's `old XOR new` (what its parity holders fold)
/// beside the new row; an uncoded one keeps no differences.
#[test]
fn a_coded_shard_stages_each_rows_difference_and_an_uncoded_one_none() {
    let params = ftrec_ec::EcParams {
        k: 2,
        r: 1,
        groups: 1,
    };
    let layout = Layout::striped(ftrec_ec::StripeLayout::new(params, 3).unwrap());
    // SGD rows, so that a row with a zero gradient stays as it was (Adam's rows count
    // their own steps, so every row they touch changes).
    let config = ModelConfig {
        sparse_optimizer: Optimizer::Sgd { lr: 0.1 },
        ..model()
    };
    let shard = Shard::initial(&config, 7, layout, 0).unwrap();
    let rows: Vec<u32> = (0..40u32)
        .filter(|&g| shard.locals_of(1, &[g]).is_ok())
        .take(4)
        .collect();
    assert_eq!(rows.len(), 4, "server 0 holds rows of table 1");
    let mut u = update(&shard, rows.clone(), 0.3);
    // The first row's gradient zero: it stays as it was, and a row whose difference is
    // all zero sends nothing.
    u.sparse[0].2[..model().dim].fill(0.0);
    u.replica_dense = vec![
        0.5;
        shard
            .redundancy()
            .unwrap()
            .replica
            .as_ref()
            .unwrap()
            .range
            .len()
    ];
    let staged = shard.stage(&u).unwrap();
    let changed = &staged.rows()[0];
    let stride = shard.state().tables()[1].stride();
    assert_eq!(changed.delta.len(), rows.len() * stride);
    for (n, &local) in changed.locals.iter().enumerate() {
        let old = shard.state().tables()[1].row(local as usize);
        let new = &changed.new[n * stride..(n + 1) * stride];
        let expected: Vec<u32> = old
            .iter()
            .zip(new)
            .map(|(a, b)| a.to_bits() ^ b.to_bits())
            .collect();
        assert_eq!(&changed.delta[n * stride..(n + 1) * stride], &expected[..]);
        assert_eq!(
            changed.changed_delta(n, stride).is_some(),
            n != 0,
            "row {n}"
        );
    }
    let plain = shards(2).remove(0);
    let plain_rows: Vec<u32> = (0..40u32).filter(|r| (r + 1) % 2 == 0).take(3).collect();
    let staged = plain.stage(&update(&plain, plain_rows, 0.3)).unwrap();
    assert!(staged.rows()[0].delta.is_empty());
}

#[test]
fn misdirected_rows_and_bad_lengths_are_refused() {
    let shard = shards(2).remove(0);
    let mut u = update(&shard, vec![0], 0.1); // row 0 of table 1 lives on server 1
    assert!(
        shard
            .stage(&u)
            .unwrap_err()
            .to_string()
            .contains("belongs to server 1")
    );
    u.sparse[0].1 = vec![1];
    u.sparse[0].2.pop();
    assert!(shard.stage(&u).is_err());
    let mut u = update(&shard, vec![1], 0.1);
    u.dense.pop();
    assert!(
        shard
            .stage(&u)
            .unwrap_err()
            .to_string()
            .contains("dense gradient")
    );
}

/// `gather` hands back each asked row's embedding in the order asked, past the distance
/// it prefetches ahead, and refuses a table or row it does not hold with an error, also
/// when no row is asked (it must not index a table that is not there).
#[test]
fn gather_returns_the_asked_rows_in_order_and_refuses_what_is_not_here() {
    let shard = shards(2).remove(0);
    let dim = model().dim;
    // Table 1 has 40 rows; server 0 of 2 holds the odd ones (the test above).
    let rows: Vec<u32> = (1..40).step_by(2).rev().collect();
    assert!(rows.len() > PREFETCH_AHEAD);
    let mut out = Vec::new();
    shard.gather(1, &rows, &mut out).unwrap();
    assert_eq!(out.len(), rows.len() * dim * 4);
    let table = &shard.state().tables()[1];
    for (n, &row) in rows.iter().enumerate() {
        let local = shard.local(1, row).unwrap();
        let expected: &[u8] = bytemuck::cast_slice(table.embedding(local));
        assert_eq!(&out[n * dim * 4..(n + 1) * dim * 4], expected, "row {row}");
    }
    let mut out = Vec::new();
    assert!(
        shard.gather(1, &[0], &mut out).is_err(),
        "row 0 is server 1's"
    );
    assert!(
        shard.gather(9, &[], &mut out).is_err(),
        "there is no table 9"
    );
    assert!(
        shard.gather(1, &[41], &mut out).is_err(),
        "table 1 has 40 rows"
    );
}

#[test]
fn shards_reassemble_into_the_global_model_bit_for_bit() {
    let config = model();
    let global = ModelState::new(&config, 7).unwrap();
    for servers in 1..4 {
        let layout = ftrec_proto::placement::Layout::new(servers).unwrap();
        let shards: Vec<ModelState> = (0..servers)
            .map(|s| {
                Shard::initial(&config, 7, layout, s)
                    .unwrap()
                    .state()
                    .clone()
            })
            .collect();
        let back = ftrec_proto::assemble::assemble(&shards).unwrap();
        assert_eq!(back.digest(), global.digest(), "{servers} servers");
    }
}

/// A new leader keeps a slot's rows when its process says it holds them all: a
/// replacement's zeros must never say so, nor a shard with a background rebuild's slots
/// left; a restore's or a finished rebuild's must.
#[test]
fn only_a_shard_whose_rebuild_ended_or_that_was_restored_holds_its_rows() {
    let config = model();
    let params = ftrec_ec::EcParams {
        k: 2,
        r: 1,
        groups: 1,
    };
    let layout = Layout::striped(ftrec_ec::StripeLayout::new(params, 3).unwrap());
    assert!(
        Shard::initial(&config, 7, layout, 1)
            .unwrap()
            .holds_its_rows()
    );
    let mut replacement = Shard::awaiting_rebuild(&config, 7, layout, 1).unwrap();
    assert!(!replacement.holds_its_rows());
    let state = Shard::initial(&config, 7, layout, 1)
        .unwrap()
        .state()
        .clone();
    replacement.replace_state(state).unwrap();
    assert!(replacement.holds_its_rows());
    let slots = Shard::shard_config(&config, layout, 1).unwrap().table_rows;
    let mut pending = Pending::new(&slots, &vec![0; slots.len()]);
    pending.mark_data(0, 0);
    replacement.begin_background_rebuild(pending);
    assert!(!replacement.holds_its_rows());
    let row = vec![0u8; config.row_stride() * 4];
    replacement.install_decoded(0, &[(0, &row)]).unwrap();
    assert!(replacement.holds_its_rows());
}
