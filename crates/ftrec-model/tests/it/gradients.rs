//! Every gradient of the f32 implementation (dense layers and embedding rows) against
//! central finite differences of an independent float64 forward pass.

use ftrec_model::{
    Batch, Dlrm, GemmMatMul, MatMul, MlpSpec, ModelConfig, ModelState, NaiveMatMul, Optimizer,
};

fn config(dim: usize) -> ModelConfig {
    ModelConfig {
        num_dense: 4,
        table_rows: vec![7, 5, 9],
        dim,
        bottom: vec![8, dim],
        top: vec![8, 6, 1],
        sparse_optimizer: Optimizer::Sgd { lr: 0.1 },
        dense_optimizer: Optimizer::Sgd { lr: 0.1 },
    }
}

#[allow(clippy::needless_range_loop)] // parallel arrays indexed by sample and table
fn batch() -> Batch {
    let mut b = Batch::with_tables(3);
    let bags: [&[&[u32]]; 3] = [
        &[&[1], &[2], &[1], &[6], &[3], &[0]],
        // multi-hot, repeated ids and an empty bag
        &[&[1, 2], &[4], &[], &[2, 2, 3], &[0], &[4, 1]],
        &[&[8], &[8], &[8], &[7], &[5], &[2]],
    ];
    for s in 0..6 {
        b.labels.push((s % 2) as f32);
        for f in 0..4 {
            b.dense.push(((s * 4 + f) as f32 * 0.61).sin());
        }
        for t in 0..3 {
            b.sparse[t].push_bag(bags[t][s].iter().copied());
        }
    }
    b.size = 6;
    b
}

/// The mean log loss in float64, written independently of the crate's kernels.
fn reference_loss(c: &ModelConfig, dense: &[f64], tables: &[Vec<f64>], b: &Batch) -> f64 {
    let (bottom, top) = MlpSpec::dlrm_pair(c);
    let mlp = |spec: &MlpSpec, mut h: Vec<f64>| {
        for l in spec.layers() {
            h = (0..l.outputs)
                .map(|o| {
                    let mut y = dense[l.bias + o];
                    for i in 0..l.inputs {
                        y += dense[l.weight + o * l.inputs + i] * h[i];
                    }
                    if l.relu { y.max(0.0) } else { y }
                })
                .collect();
        }
        h
    };
    let mut loss = 0.0;
    for s in 0..b.size {
        let x: Vec<f64> = b.dense[s * 4..s * 4 + 4]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let mut z = vec![mlp(&bottom, x)];
        for (t, bags) in b.sparse.iter().enumerate() {
            let mut e = vec![0.0; c.dim];
            for &r in bags.bag(s) {
                for d in 0..c.dim {
                    e[d] += tables[t][r as usize * c.dim + d];
                }
            }
            z.push(e);
        }
        let mut inter = z[0].clone();
        for i in 1..z.len() {
            for j in 0..i {
                inter.push((0..c.dim).map(|d| z[i][d] * z[j][d]).sum());
            }
        }
        let logit = mlp(&top, inter)[0];
        let y = b.labels[s] as f64;
        loss += logit.max(0.0) + (-logit.abs()).exp().ln_1p() - y * logit;
    }
    loss / b.size as f64
}

fn check(mm: Box<dyn MatMul>, threads: usize, dim: usize) {
    let c = config(dim);
    let b = batch();
    let state = ModelState::new(&c, 5).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut model = Dlrm::new(&c, 8, threads, mm).unwrap();
    let loss = pool.install(|| {
        model.prepare(&b).unwrap();
        model.gather_from(&state);
        model.forward_backward(&state.dense.params, &b)
    });

    let mut dense: Vec<f64> = state.dense.params.iter().map(|&v| v as f64).collect();
    let mut tables: Vec<Vec<f64>> = state
        .tables()
        .iter()
        .map(|t| {
            (0..t.rows())
                .flat_map(|r| t.embedding(r).iter().map(|&v| v as f64))
                .collect()
        })
        .collect();
    let ref_loss = reference_loss(&c, &dense, &tables, &b);
    assert!(
        (loss / 6.0 - ref_loss).abs() < 1e-5,
        "loss {} vs {ref_loss}",
        loss / 6.0
    );

    let h = 1e-5;
    let close = |got: f32, want: f64, what: &str| {
        assert!(
            (got as f64 - want).abs() <= 1e-4 * want.abs() + 1e-6,
            "{what}: got {got}, float64 reference {want}"
        );
    };
    let grads = model.gradients();
    let mut nonzero = 0;
    for i in 0..dense.len() {
        let orig = dense[i];
        dense[i] = orig + h;
        let up = reference_loss(&c, &dense, &tables, &b);
        dense[i] = orig - h;
        let down = reference_loss(&c, &dense, &tables, &b);
        dense[i] = orig;
        let fd = (up - down) / (2.0 * h);
        nonzero += (fd.abs() > 1e-6) as usize;
        close(grads.dense[i], fd, &format!("dense[{i}]"));
    }
    assert!(
        nonzero > dense.len() / 2,
        "test batch exercises too few parameters: {nonzero} of {}",
        dense.len()
    );
    for t in 0..3 {
        let unique = model.unique_rows(t).to_vec();
        let touched: std::collections::BTreeSet<u32> = b.sparse[t].rows.iter().copied().collect();
        assert_eq!(
            unique,
            touched.into_iter().collect::<Vec<_>>(),
            "table {t} unique rows"
        );
        for (u, &row) in unique.iter().enumerate() {
            for d in 0..c.dim {
                let k = row as usize * c.dim + d;
                let orig = tables[t][k];
                tables[t][k] = orig + h;
                let up = reference_loss(&c, &dense, &tables, &b);
                tables[t][k] = orig - h;
                let down = reference_loss(&c, &dense, &tables, &b);
                tables[t][k] = orig;
                let fd = (up - down) / (2.0 * h);
                close(
                    grads.sparse[t][u * c.dim + d],
                    fd,
                    &format!("table {t} row {row} dim {d}"),
                );
            }
        }
    }
}

#[test]
fn gradients_match_float64_reference_with_naive_matmul() {
    check(Box::new(NaiveMatMul), 1, 4);
}

#[test]
fn gradients_match_float64_reference_with_gemm_two_threads() {
    check(Box::new(GemmMatMul), 2, 4);
}

/// dim 16 takes the 16-lane interaction paths.
#[test]
fn gradients_match_float64_reference_with_simd_width_embeddings() {
    check(Box::new(GemmMatMul), 2, 16);
}
