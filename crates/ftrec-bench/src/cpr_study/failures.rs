//! Failure injection: when failures happen, which emulated servers they take, and what
//! losing a server does to the model under partial recovery.

use ftrec_model::ModelState;
use rand::Rng;
use rand::SeedableRng;
use rand::seq::index::sample;
use rand_xoshiro::Xoshiro256PlusPlus;

use ftrec_train::TrainError;

/// Servers of `servers` a failure of `fraction` loses (0 when the fraction is not a whole
/// number of servers, which the study refuses).
pub fn servers_lost(fraction: f64, servers: usize) -> usize {
    let k = fraction * servers as f64;
    if (k - k.round()).abs() > 1e-9 || k.round() > servers as f64 {
        return 0;
    }
    k.round() as usize
}

/// The emulated server that holds row `row` of table `table`: the cluster's
/// `row-modulo-v1` placement, `(row + table) mod servers`, so the hot low rows of every
/// table do not all land on server 0.
pub fn server_of(table: usize, row: u32, servers: usize) -> usize {
    (row as usize + table) % servers
}

#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// The failure strikes after this many executed steps (counting re-executed ones).
    pub at_step: u64,
    /// Lost servers, ascending, one list per failure fraction of the study.
    pub lost: Vec<Vec<usize>>,
}

/// The failures of every run, drawn once so all strategies face the same ones.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub failures: Vec<Failure>,
}

impl Schedule {
    /// `count` failures at uniformly random steps of `1..=total_steps` (failures are
    /// near-uniform in time in production, cpr.txt §3.1), each losing a uniformly random
    /// set of servers per fraction. Deterministic in `seed`.
    pub fn draw(
        seed: u64,
        total_steps: u64,
        count: usize,
        servers: usize,
        fractions: &[f64],
    ) -> Result<Self, TrainError> {
        if total_steps == 0 {
            return Err(TrainError::Config(
                "the study needs at least one step".into(),
            ));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xC0FF_EE00_F417_0001);
        let mut failures: Vec<Failure> = (0..count)
            .map(|_| {
                let at_step = rng.gen_range(1..=total_steps);
                let lost = lose_servers(&mut rng, servers, fractions);
                Failure { at_step, lost }
            })
            .collect();
        failures.sort_by_key(|f| f.at_step);
        Ok(Self { failures })
    }
}

impl Schedule {
    /// Failures of a Poisson process with `mean` failures over `total_steps` (exponential
    /// gaps, so the count itself varies from schedule to schedule, as in production),
    /// each losing a uniformly random set of servers per fraction. Deterministic in `seed`.
    pub fn poisson(
        seed: u64,
        total_steps: u64,
        mean: f64,
        servers: usize,
        fractions: &[f64],
    ) -> Result<Self, TrainError> {
        if total_steps == 0 || !(mean > 0.0 && mean.is_finite()) {
            return Err(TrainError::Config(format!(
                "a Poisson failure schedule needs steps and a positive mean, got {total_steps} steps and {mean}"
            )));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x9015_5011_F417_0002);
        let rate = mean / total_steps as f64;
        let mut at = 0.0f64;
        let mut failures = Vec::new();
        loop {
            // Inverse-CDF exponential gap; `1 - u` keeps the logarithm finite.
            let u: f64 = rng.r#gen();
            at += -(1.0 - u).ln() / rate;
            if at >= total_steps as f64 {
                break;
            }
            let lost = lose_servers(&mut rng, servers, fractions);
            failures.push(Failure {
                at_step: (at as u64).max(1),
                lost,
            });
        }
        Ok(Self { failures })
    }
}

/// One failure's lost servers for each fraction: a uniformly random set, ascending.
fn lose_servers(
    rng: &mut Xoshiro256PlusPlus,
    servers: usize,
    fractions: &[f64],
) -> Vec<Vec<usize>> {
    fractions
        .iter()
        .map(|&f| {
            let mut s = sample(rng, servers, servers_lost(f, servers)).into_vec();
            s.sort_unstable();
            s
        })
        .collect()
}

/// Partial recovery of the `lost` servers: their rows of every table go back to the
/// values in `saved`; nothing else changes. Returns the reset rows per table, ascending.
pub fn reset_servers(
    state: &mut ModelState,
    saved: &ModelState,
    servers: usize,
    lost: &[usize],
) -> Vec<Vec<u32>> {
    let mut reset = Vec::with_capacity(state.tables().len());
    for (t, (table, from)) in state
        .tables_mut()
        .iter_mut()
        .zip(saved.tables())
        .enumerate()
    {
        let mut rows: Vec<u32> = lost
            .iter()
            .flat_map(|&s| {
                let first = (s + servers - t % servers) % servers;
                (first..table.rows()).step_by(servers).map(|r| r as u32)
            })
            .collect();
        rows.sort_unstable();
        for &r in &rows {
            table
                .row_mut(r as usize)
                .copy_from_slice(from.row(r as usize));
        }
        reset.push(rows);
    }
    reset
}

#[cfg(test)]
mod tests {
    use ftrec_model::{ModelConfig, Optimizer};

    use super::*;

    fn config() -> ModelConfig {
        ModelConfig {
            num_dense: 3,
            table_rows: vec![20, 7],
            dim: 2,
            bottom: vec![4, 2],
            top: vec![4, 1],
            sparse_optimizer: Optimizer::RowwiseAdagrad {
                lr: 0.1,
                eps: 1e-8,
                initial_accumulator: 0.0,
            },
            dense_optimizer: Optimizer::Sgd { lr: 0.1 },
        }
    }

    #[test]
    fn a_reset_touches_exactly_the_lost_servers_rows() {
        let saved = ModelState::new(&config(), 1).unwrap();
        let mut state = ModelState::new(&config(), 2).unwrap();
        let before = state.clone();
        let reset = reset_servers(&mut state, &saved, 4, &[1, 3]);
        assert_eq!(reset[0], vec![1, 3, 5, 7, 9, 11, 13, 15, 17, 19]);
        // Table 1 is shifted by one server: (r + 1) mod 4 in {1, 3}.
        assert_eq!(reset[1], vec![0, 2, 4, 6]);
        for (t, rows) in [20u32, 7].iter().enumerate() {
            for r in 0..*rows {
                let lost = [1, 3].contains(&server_of(t, r, 4));
                let want = if lost { &saved } else { &before };
                assert_eq!(
                    state.row(t, r as u64).unwrap(),
                    want.row(t, r as u64).unwrap()
                );
            }
        }
        assert_eq!(state.dense, before.dense, "dense parameters survive");
    }

    #[test]
    fn schedule_is_seeded_sorted_and_loses_the_right_number_of_servers() {
        let a = Schedule::draw(7, 100, 3, 8, &[0.125, 0.25, 0.5]).unwrap();
        assert_eq!(
            a,
            Schedule::draw(7, 100, 3, 8, &[0.125, 0.25, 0.5]).unwrap()
        );
        assert_ne!(
            a,
            Schedule::draw(8, 100, 3, 8, &[0.125, 0.25, 0.5]).unwrap()
        );
        assert!(a.failures.windows(2).all(|w| w[0].at_step <= w[1].at_step));
        for f in &a.failures {
            assert!((1..=100).contains(&f.at_step));
            let sizes: Vec<usize> = f.lost.iter().map(Vec::len).collect();
            assert_eq!(sizes, vec![1, 2, 4]);
            assert!(f.lost.iter().flatten().all(|&s| s < 8));
        }
        // A Poisson schedule: seeded, inside the job, and its count varies around the
        // mean over many draws.
        let counts: Vec<usize> = (0..400)
            .map(|s| {
                let p = Schedule::poisson(s, 1000, 3.0, 8, &[0.5]).unwrap();
                assert!(p.failures.windows(2).all(|w| w[0].at_step <= w[1].at_step));
                assert!(p.failures.iter().all(|f| (1..1000).contains(&f.at_step)));
                p.failures.len()
            })
            .collect();
        let mean = counts.iter().sum::<usize>() as f64 / counts.len() as f64;
        assert!((2.7..3.3).contains(&mean), "{mean}");
        assert!(counts.iter().any(|&c| c != 3));
        assert_eq!(
            Schedule::poisson(5, 1000, 3.0, 8, &[0.5]).unwrap(),
            Schedule::poisson(5, 1000, 3.0, 8, &[0.5]).unwrap()
        );
        assert_eq!(servers_lost(0.3, 8), 0);
        assert_eq!(servers_lost(0.5, 8), 4);
    }
}
