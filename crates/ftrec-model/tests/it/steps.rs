//! A training step pools and interacts sixteen samples at a time (the AVX-512 lanes
//! path, where the CPU has it) and the portable kernel on the rest of each thread's
//! chunk. Whatever the thread count, and whether the step runs as `train_step` or as a
//! parameter-server worker's phases (`forward_backward`, gradients out, then `apply`),
//! the state must come out with the same bits, or a cluster run would not match a
//! single-process one.

use ftrec_model::{Batch, Dlrm, GemmMatMul, ModelConfig, ModelState, Optimizer};

fn config(sparse: Optimizer, dense: Optimizer) -> ModelConfig {
    ModelConfig {
        num_dense: 5,
        table_rows: vec![11, 7, 40, 3],
        dim: 16,
        bottom: vec![16, 16],
        top: vec![32, 8, 1],
        sparse_optimizer: sparse,
        dense_optimizer: dense,
    }
}

/// `samples` samples with repeated ids, multi-hot and empty bags, varying with `seed`.
fn batch(c: &ModelConfig, samples: usize, seed: usize) -> Batch {
    let mut b = Batch::with_tables(c.table_rows.len());
    for s in 0..samples {
        let k = s * 7 + seed * 13;
        b.labels.push(k.is_multiple_of(3) as u8 as f32);
        for f in 0..c.num_dense {
            b.dense.push(((k * 5 + f) as f32 * 0.37).sin());
        }
        for (t, &rows) in c.table_rows.iter().enumerate() {
            let len = match t {
                0 => 1,
                1 => k % 4,     // empty bags too
                2 => 1 + k % 3, // multi-hot
                _ => 2,         // always a repeated id in a tiny table
            };
            b.sparse[t].push_bag((0..len).map(|i| ((k * 31 + i * 17 + t) % rows) as u32));
        }
    }
    b.size = samples;
    b
}

fn run(c: &ModelConfig, threads: usize, whole_step: bool) -> String {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut state = ModelState::new(c, 3).unwrap();
    let mut model = Dlrm::new(c, 64, threads, Box::new(GemmMatMul)).unwrap();
    for step in 0..4 {
        // 64 samples make whole blocks of 16 on one and two threads; 45 leave a remainder.
        let b = batch(c, if step % 2 == 0 { 64 } else { 45 }, step);
        pool.install(|| {
            if whole_step {
                model.train_step(&mut state, &b).unwrap();
            } else {
                model.prepare(&b).unwrap();
                model.gather_from(&state);
                model.forward_backward(&state.dense.params, &b);
                model.apply(&mut state);
            }
        });
    }
    state.digest().to_string()
}

#[test]
fn steps_give_the_same_bits_on_any_threads_and_as_worker_phases() {
    let optimizers = [
        (Optimizer::Sgd { lr: 0.05 }, Optimizer::Sgd { lr: 0.05 }),
        (
            Optimizer::Adagrad {
                lr: 0.05,
                eps: 1e-10,
                initial_accumulator: 0.0,
            },
            Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        ),
    ];
    for (sparse, dense) in optimizers {
        let c = config(sparse, dense);
        let reference = run(&c, 1, false);
        for threads in [1, 2] {
            assert_eq!(
                run(&c, threads, true),
                reference,
                "{} / {}, {threads} threads",
                sparse.name(),
                dense.name()
            );
        }
        assert_eq!(run(&c, 2, false), reference);
    }
}
