//! Optimizers for embedding rows (lazy: only rows touched by a batch are updated) and for
//! the flat dense parameter buffer.
//!
//! An embedding row is stored as `[embedding (dim) | optimizer state]`; the state layout is
//! fixed per optimizer (see [`Optimizer::row_state_len`]) so that the row is the unit that
//! later code can checkpoint, erasure-code and restore with its optimizer state.

use serde::{Deserialize, Serialize};

use crate::{EmbeddingTable, ModelError};

/// Which optimizer, with its hyper-parameters. Formulas follow PyTorch (dense) and FBGEMM
/// (row-wise Adagrad) so results can be compared with those systems.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Optimizer {
    /// `p -= lr * g`
    Sgd { lr: f32 },
    /// `v = momentum * v + g; p -= lr * v` (PyTorch, no dampening, no Nesterov)
    Momentum { lr: f32, momentum: f32 },
    /// `a += g^2; p -= lr * g / (sqrt(a) + eps)`, element-wise accumulator
    Adagrad {
        lr: f32,
        #[serde(default = "default_adagrad_eps")]
        eps: f32,
        #[serde(default)]
        initial_accumulator: f32,
    },
    /// `a += mean(g^2); p -= lr * g / (sqrt(a) + eps)`, one accumulator per row
    /// (FBGEMM's row-wise Adagrad). Embedding tables only.
    RowwiseAdagrad {
        lr: f32,
        #[serde(default = "default_adagrad_eps")]
        eps: f32,
        #[serde(default)]
        initial_accumulator: f32,
    },
    /// Adam with bias correction; each embedding row keeps its own step count so a lazily
    /// updated row is corrected by how often *it* was updated.
    Adam {
        lr: f32,
        #[serde(default = "default_beta1")]
        beta1: f32,
        #[serde(default = "default_beta2")]
        beta2: f32,
        #[serde(default = "default_adam_eps")]
        eps: f32,
    },
}

fn default_adagrad_eps() -> f32 {
    1e-10
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_adam_eps() -> f32 {
    1e-8
}

impl Optimizer {
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Momentum { .. } => "momentum",
            Optimizer::Adagrad { .. } => "adagrad",
            Optimizer::RowwiseAdagrad { .. } => "rowwise_adagrad",
            Optimizer::Adam { .. } => "adam",
        }
    }

    /// Checks hyper-parameters; `field` names the config key in the error.
    pub fn validate(&self, field: &str) -> Result<(), ModelError> {
        let bad = |what: &str| {
            Err(ModelError::Config(format!(
                "{field}: {what} (optimizer {})",
                self.name()
            )))
        };
        let lr = match *self {
            Optimizer::Sgd { lr }
            | Optimizer::Momentum { lr, .. }
            | Optimizer::Adagrad { lr, .. }
            | Optimizer::RowwiseAdagrad { lr, .. }
            | Optimizer::Adam { lr, .. } => lr,
        };
        if !(lr.is_finite() && lr > 0.0) {
            return bad(&format!("lr must be a positive finite number, got {lr}"));
        }
        match *self {
            Optimizer::Momentum { momentum, .. } if !(0.0..1.0).contains(&momentum) => {
                bad(&format!("momentum must be in [0, 1), got {momentum}"))
            }
            Optimizer::Adagrad {
                eps,
                initial_accumulator,
                ..
            }
            | Optimizer::RowwiseAdagrad {
                eps,
                initial_accumulator,
                ..
            } if !(eps > 0.0 && initial_accumulator >= 0.0) => bad(&format!(
                "eps must be > 0 and initial_accumulator >= 0, got {eps} and {initial_accumulator}"
            )),
            Optimizer::Adam {
                beta1, beta2, eps, ..
            } if !((0.0..1.0).contains(&beta1) && (0.0..1.0).contains(&beta2) && eps > 0.0) => bad(
                &format!("need 0 <= beta1, beta2 < 1 and eps > 0, got {beta1}, {beta2}, {eps}"),
            ),
            _ => Ok(()),
        }
    }

    /// Number of f32 words of optimizer state stored after a row's `dim` embedding values.
    pub fn row_state_len(&self, dim: usize) -> usize {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::Momentum { .. } | Optimizer::Adagrad { .. } => dim,
            Optimizer::RowwiseAdagrad { .. } => 1,
            // m, v, and the row's step count stored as the bits of a u32
            Optimizer::Adam { .. } => 2 * dim + 1,
        }
    }

    /// Number of f32 words of state per dense parameter.
    pub fn dense_state_len(&self, params: usize) -> Result<usize, ModelError> {
        match self {
            Optimizer::Sgd { .. } => Ok(0),
            Optimizer::Momentum { .. } | Optimizer::Adagrad { .. } => Ok(params),
            Optimizer::Adam { .. } => Ok(2 * params),
            Optimizer::RowwiseAdagrad { .. } => Err(ModelError::Config(
                "optimizer.dense: rowwise_adagrad applies only to embedding rows; use adagrad"
                    .into(),
            )),
        }
    }

    /// Initial value of a fresh row's optimizer state.
    pub fn init_row_state(&self, state: &mut [f32]) {
        match *self {
            Optimizer::Adagrad {
                initial_accumulator,
                ..
            }
            | Optimizer::RowwiseAdagrad {
                initial_accumulator,
                ..
            } => state.fill(initial_accumulator),
            _ => state.fill(0.0),
        }
    }

    /// Applies `grads [rows x dim]` to `rows` of `table`, compiled for the running CPU's
    /// SIMD level (same bits at every level: no fast-math).
    pub fn apply_rows(&self, table: &mut EmbeddingTable, rows: &[u32], grads: &[f32], dim: usize) {
        apply_rows_simd(self, table, rows, grads, dim)
    }

    /// Updates one embedding row in place; `row` is `[embedding | state]`, `grad` has `dim`
    /// values. Called once per unique row per batch with the batch-aggregated gradient.
    #[inline(always)]
    pub fn apply_row(&self, row: &mut [f32], grad: &[f32]) {
        let dim = grad.len();
        let (emb, state) = row.split_at_mut(dim);
        match *self {
            Optimizer::Sgd { lr } => sgd(emb, grad, lr),
            Optimizer::Momentum { lr, momentum } => momentum_step(emb, state, grad, lr, momentum),
            Optimizer::Adagrad { lr, eps, .. } => adagrad(emb, state, grad, lr, eps),
            Optimizer::RowwiseAdagrad { lr, eps, .. } => {
                // Sum in a fixed order so the row's result never depends on threading.
                let mut sq = 0.0f32;
                for g in grad {
                    sq += g * g;
                }
                state[0] += sq / dim as f32;
                let denom = state[0].sqrt() + eps;
                for (p, g) in emb.iter_mut().zip(grad) {
                    *p -= lr * g / denom;
                }
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let (mv, step) = state.split_at_mut(2 * dim);
                let t = step[0].to_bits().saturating_add(1);
                step[0] = f32::from_bits(t);
                let (m, v) = mv.split_at_mut(dim);
                adam(
                    emb,
                    m,
                    v,
                    grad,
                    AdamStep::new(lr, beta1, beta2, eps, t as u64),
                );
            }
        }
    }

    /// Updates the dense parameters; `step` is the number of dense updates so far and is
    /// incremented here (Adam's bias correction uses it).
    pub fn apply_dense(&self, params: &mut [f32], state: &mut [f32], grad: &[f32], step: &mut u64) {
        apply_dense_simd(self, params, state, grad, step);
    }

    #[inline(always)]
    fn apply_dense_scalar(
        &self,
        params: &mut [f32],
        state: &mut [f32],
        grad: &[f32],
        step: &mut u64,
    ) {
        *step += 1;
        match *self {
            Optimizer::Sgd { lr } => sgd(params, grad, lr),
            Optimizer::Momentum { lr, momentum } => {
                momentum_step(params, state, grad, lr, momentum)
            }
            Optimizer::Adagrad { lr, eps, .. } => adagrad(params, state, grad, lr, eps),
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                let n = params.len();
                let (m, v) = state.split_at_mut(n);
                adam(
                    params,
                    m,
                    v,
                    grad,
                    AdamStep::new(lr, beta1, beta2, eps, *step),
                );
            }
            // Rejected by dense_state_len at model construction.
            Optimizer::RowwiseAdagrad { lr, .. } => sgd(params, grad, lr),
        }
    }

    /// Dense initial state (same rule as rows).
    pub fn init_dense_state(&self, state: &mut [f32]) {
        self.init_row_state(state)
    }
}

#[inline(always)]
fn sgd(params: &mut [f32], grad: &[f32], lr: f32) {
    for (p, g) in params.iter_mut().zip(grad) {
        *p -= lr * g;
    }
}

#[inline(always)]
fn momentum_step(params: &mut [f32], vel: &mut [f32], grad: &[f32], lr: f32, momentum: f32) {
    for ((p, v), g) in params.iter_mut().zip(vel.iter_mut()).zip(grad) {
        *v = momentum * *v + g;
        *p -= lr * *v;
    }
}

#[inline(always)]
fn adagrad(params: &mut [f32], acc: &mut [f32], grad: &[f32], lr: f32, eps: f32) {
    for ((p, a), g) in params.iter_mut().zip(acc.iter_mut()).zip(grad) {
        *a += g * g;
        *p -= lr * g / (a.sqrt() + eps);
    }
}

/// Adam's per-step constants; bias corrections are computed in f64 so they do not depend
/// on how `powi` rounds in f32 for large step counts.
struct AdamStep {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    correction1: f32,
    correction2_sqrt: f32,
}

impl AdamStep {
    fn new(lr: f32, beta1: f32, beta2: f32, eps: f32, t: u64) -> Self {
        let t = t.min(i32::MAX as u64) as i32;
        Self {
            lr,
            beta1,
            beta2,
            eps,
            correction1: (1.0 - (beta1 as f64).powi(t)) as f32,
            correction2_sqrt: (1.0 - (beta2 as f64).powi(t)).sqrt() as f32,
        }
    }
}

#[inline(always)]
fn adam(params: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32], s: AdamStep) {
    let step_size = s.lr / s.correction1;
    for (((p, m), v), g) in params
        .iter_mut()
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(grad)
    {
        *m = s.beta1 * *m + (1.0 - s.beta1) * g;
        *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
        let denom = v.sqrt() / s.correction2_sqrt + s.eps;
        *p -= step_size * *m / denom;
    }
}

/// The dense update compiled for each SIMD level and picked at run time: the loops are
/// element by element with no reordering or fused multiply-add, so every level gives the
/// same bits (`every_simd_level_gives_the_dense_update_the_same_bits`), only wider. Adam
/// over a server's dense range took about 100 us a step with SSE2 and 30 with AVX-512
/// (Zen 5, 170,000 parameters, in cache); an `ec` server runs it twice, for its own range
/// and for the replica it keeps.
#[multiversion::multiversion(targets = "simd")]
fn apply_dense_simd(
    opt: &Optimizer,
    params: &mut [f32],
    state: &mut [f32],
    grad: &[f32],
    step: &mut u64,
) {
    opt.apply_dense_scalar(params, state, grad, step);
}

#[multiversion::multiversion(targets = "simd")]
fn apply_rows_simd(
    opt: &Optimizer,
    table: &mut EmbeddingTable,
    rows: &[u32],
    grads: &[f32],
    dim: usize,
) {
    for (&row, g) in rows.iter().zip(grads.chunks_exact(dim)) {
        opt.apply_row(table.row_mut(row as usize), g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G1: [f32; 2] = [0.5, -1.0];
    const G2: [f32; 2] = [0.25, 2.0];

    fn run_row(opt: Optimizer, grads: &[[f32; 2]]) -> Vec<f32> {
        let mut row = vec![0.0f32; 2 + opt.row_state_len(2)];
        row[0] = 1.0;
        row[1] = -2.0;
        opt.init_row_state(&mut row[2..]);
        for g in grads {
            opt.apply_row(&mut row, g);
        }
        row
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "index {i}: got {g}, want {w}"
            );
        }
    }

    #[test]
    fn sgd_by_hand() {
        let row = run_row(Optimizer::Sgd { lr: 0.1 }, &[G1, G2]);
        // 1 - .1*.5 - .1*.25 ; -2 + .1 - .2
        close(&row, &[0.925, -2.1]);
    }

    #[test]
    fn momentum_by_hand() {
        let row = run_row(
            Optimizer::Momentum {
                lr: 0.1,
                momentum: 0.9,
            },
            &[G1, G2],
        );
        // v1 = g1 = (.5,-1); p1 = (.95,-1.9); v2 = .9 v1 + g2 = (.7, 1.1); p2 = (.88, -2.01)
        close(&row, &[0.88, -2.01, 0.7, 1.1]);
    }

    #[test]
    fn adagrad_by_hand() {
        let row = run_row(
            Optimizer::Adagrad {
                lr: 0.1,
                eps: 1e-10,
                initial_accumulator: 0.1,
            },
            &[G1, G2],
        );
        let a1 = [0.1 + 0.25, 0.1 + 1.0];
        let p1 = [
            1.0 - 0.1 * 0.5 / f64::sqrt(a1[0]),
            -2.0 + 0.1 * 1.0 / f64::sqrt(a1[1]),
        ];
        let a2 = [a1[0] + 0.0625, a1[1] + 4.0];
        let p2 = [
            p1[0] - 0.1 * 0.25 / a2[0].sqrt(),
            p1[1] - 0.1 * 2.0 / a2[1].sqrt(),
        ];
        close(&row, &[p2[0], p2[1], a2[0], a2[1]]);
    }

    #[test]
    fn rowwise_adagrad_by_hand() {
        let row = run_row(
            Optimizer::RowwiseAdagrad {
                lr: 0.1,
                eps: 1e-10,
                initial_accumulator: 0.0,
            },
            &[G1, G2],
        );
        let a1 = (0.25 + 1.0) / 2.0;
        let p1 = [1.0 - 0.1 * 0.5 / f64::sqrt(a1), -2.0 + 0.1 / f64::sqrt(a1)];
        let a2 = a1 + (0.0625 + 4.0) / 2.0;
        let p2 = [
            p1[0] - 0.1 * 0.25 / f64::sqrt(a2),
            p1[1] - 0.1 * 2.0 / f64::sqrt(a2),
        ];
        close(&row, &[p2[0], p2[1], a2]);
    }

    #[test]
    fn adam_by_hand_with_row_step_count() {
        let opt = Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        let row = run_row(opt, &[G1, G2]);
        let mut p = [1.0f64, -2.0];
        let (mut m, mut v) = ([0.0f64; 2], [0.0f64; 2]);
        for (t, g) in [G1, G2].iter().enumerate() {
            let t = (t + 1) as i32;
            for i in 0..2 {
                let g = g[i] as f64;
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.999 * v[i] + 0.001 * g * g;
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                p[i] -= 0.01 * mh / (vh.sqrt() + 1e-8);
            }
        }
        close(&row[..6], &[p[0], p[1], m[0], m[1], v[0], v[1]]);
        assert_eq!(row[6].to_bits(), 2, "row step count");
    }

    proptest::proptest! {
        /// The dense update picked for this CPU (AVX-512 or AVX2 where there is one) gives
        /// the bits the baseline build gives, for every optimizer and any length: the
        /// wide loops may not reorder or fuse anything.
        #[test]
        fn every_simd_level_gives_the_dense_update_the_same_bits(
            len in 1usize..300,
            seed in 0u32..1000,
            steps in 1u64..4,
        ) {
            let value = |i: usize, salt: u32| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed ^ salt);
                (x % 20_001) as f32 / 10_000.0 - 1.0
            };
            for opt in [
                Optimizer::Sgd { lr: 0.1 },
                Optimizer::Momentum { lr: 0.05, momentum: 0.9 },
                Optimizer::Adagrad { lr: 0.01, eps: 1e-10, initial_accumulator: 0.1 },
                Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 },
            ] {
                let params: Vec<f32> = (0..len).map(|i| value(i, 1)).collect();
                let mut state = vec![0.0f32; opt.dense_state_len(len).unwrap()];
                opt.init_dense_state(&mut state);
                let (mut wide, mut base) = ((params.clone(), state.clone(), 0u64), (params, state, 0u64));
                for step in 0..steps {
                    let grad: Vec<f32> = (0..len).map(|i| value(i, 7 + step as u32)).collect();
                    opt.apply_dense(&mut wide.0, &mut wide.1, &grad, &mut wide.2);
                    opt.apply_dense_scalar(&mut base.0, &mut base.1, &grad, &mut base.2);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                proptest::prop_assert_eq!(bits(&wide.0), bits(&base.0), "{:?}", opt);
                proptest::prop_assert_eq!(bits(&wide.1), bits(&base.1), "{:?}", opt);
                proptest::prop_assert_eq!(wide.2, base.2);
            }
        }
    }

    #[test]
    fn dense_adam_matches_row_adam() {
        let opt = Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        };
        let row = run_row(opt, &[G1, G2]);
        let mut params = vec![1.0f32, -2.0];
        let mut state = vec![0.0f32; 4];
        let mut step = 0;
        for g in [G1, G2] {
            opt.apply_dense(&mut params, &mut state, &g, &mut step);
        }
        assert_eq!(step, 2);
        assert_eq!(&params[..], &row[..2]);
        assert_eq!(&state[..], &row[2..6]);
    }

    #[test]
    fn invalid_hyperparameters_name_the_field() {
        let err = Optimizer::Sgd { lr: -1.0 }
            .validate("optimizer.sparse")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("optimizer.sparse") && err.contains("lr"),
            "{err}"
        );
        assert!(
            Optimizer::RowwiseAdagrad {
                lr: 0.1,
                eps: 1e-10,
                initial_accumulator: 0.0
            }
            .dense_state_len(3)
            .is_err()
        );
    }
}
