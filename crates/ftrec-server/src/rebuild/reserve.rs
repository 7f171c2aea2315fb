//! A spare's memory for the shard it will rebuild, allocated and written while it waits
//! (`ec.spare_reserve`). Zeroed memory from the allocator is mapped lazily, so a table
//! allocated at promotion faults in every page while the rebuild writes it: about a fifth
//! of the replacement's CPU in a rebuild (`perf`, issue 23, 4x rows), on the two cores
//! that training shares. A standby that owns its memory before it is needed also cannot
//! fail for the lack of it at the moment it is needed.
//!
//! The spare does not know which slot it will take, so each table's reserve is the largest
//! any slot needs; a smaller slot truncates it (no copy, no write). The reserve is built on
//! a thread of its own, a table at a time, and cut short at promotion if not finished: a
//! promotion never waits for it, and the tables built by then still serve.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ftrec_model::ModelConfig;
use ftrec_proto::placement::Layout;
use ftrec_rpc::PsError;

use crate::shard::Shard;

/// Zeroed table rows and parity rows, every page written.
#[derive(Debug, Default)]
pub(crate) struct Reserve {
    tables: Vec<Option<Vec<f32>>>,
    parity: Vec<Option<Vec<u8>>>,
}

/// The largest table (floats) and parity (bytes) each table's slot may need, over every
/// slot of `layout`.
fn largest_needs(global: &ModelConfig, layout: Layout) -> Result<Vec<(usize, usize)>, PsError> {
    let stride = global.row_stride();
    let mut needs = vec![(0usize, 0usize); global.tables()];
    for server in 0..layout.servers() {
        let config = Shard::shard_config(global, layout, server)?;
        for (t, need) in needs.iter_mut().enumerate() {
            let table = config.table_rows[t] * stride;
            let parity = layout.parity_rows(server, global.table_rows[t]) * stride * 4;
            *need = (need.0.max(table), need.1.max(parity));
        }
    }
    Ok(needs)
}

/// `len` zeroes with every page written (`resize` writes each element; `vec![0; n]` maps
/// zero pages lazily), or `None` once `cancel` is set: checked every 64 MiB, so a
/// promotion's rebuild shares the cores with at most that much more writing.
fn resident<T: Clone + Default>(len: usize, cancel: &AtomicBool) -> Option<Vec<T>> {
    let chunk = (64 << 20) / std::mem::size_of::<T>().max(1);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        if cancel.load(Ordering::Relaxed) {
            return None;
        }
        v.resize((v.len() + chunk).min(len), T::default());
    }
    Some(v)
}

impl Reserve {
    /// The reserve for any slot of `layout`, built here (tests; spares build it on a
    /// thread of their own, [`SpareReserve::start`]).
    #[cfg(test)]
    fn build(global: &ModelConfig, layout: Layout, cancel: &AtomicBool) -> Result<Self, PsError> {
        let into = Mutex::new(Self::default());
        fill(&largest_needs(global, layout)?, &into, cancel);
        Ok(into.into_inner().unwrap_or_else(|p| p.into_inner()))
    }

    /// Table `t`'s `len` zeroed floats: the reserve's if built and large enough, or a
    /// lazily mapped allocation.
    pub(crate) fn table(&mut self, t: usize, len: usize) -> Vec<f32> {
        take_or_allocate(self.tables.get_mut(t), len)
    }

    /// Table `t`'s `len` zeroed parity bytes, as [`Reserve::table`].
    pub(crate) fn parity(&mut self, t: usize, len: usize) -> Vec<u8> {
        take_or_allocate(self.parity.get_mut(t), len)
    }
}

fn take_or_allocate<T: Clone + Default>(slot: Option<&mut Option<Vec<T>>>, len: usize) -> Vec<T> {
    match slot.and_then(Option::take) {
        // Zero throughout, and written: truncating keeps the pages, writes nothing.
        Some(mut v) if v.len() >= len => {
            v.truncate(len);
            v
        }
        _ => vec![T::default(); len],
    }
}

/// Writes each table's reserve into `into` as it is built, until `cancel` is set. The
/// cancel is checked under `into`'s lock, which [`SpareReserve::take`] sets it under: a
/// table finished after the take is dropped, never added to what was taken.
fn fill(needs: &[(usize, usize)], into: &Mutex<Reserve>, cancel: &AtomicBool) {
    {
        let mut reserve = into.lock().unwrap_or_else(|p| p.into_inner());
        reserve.tables.resize_with(needs.len(), || None);
        reserve.parity.resize_with(needs.len(), || None);
    }
    // Writes `len` zeroes and stores them where `slot` says; false once cancelled.
    fn deliver<T: Clone + Default>(
        len: usize,
        into: &Mutex<Reserve>,
        cancel: &AtomicBool,
        slot: impl FnOnce(&mut Reserve) -> &mut Option<Vec<T>>,
    ) -> bool {
        let Some(written) = resident(len, cancel) else {
            return false;
        };
        let mut reserve = into.lock().unwrap_or_else(|p| p.into_inner());
        if cancel.load(Ordering::Relaxed) {
            return false;
        }
        *slot(&mut reserve) = Some(written);
        true
    }
    for (t, &(table, parity)) in needs.iter().enumerate() {
        if !deliver(table, into, cancel, |r| &mut r.tables[t])
            || !deliver(parity, into, cancel, |r| &mut r.parity[t])
        {
            return;
        }
    }
}

/// A reserve being built, or built, for a spare.
#[derive(Default)]
pub(crate) struct SpareReserve {
    built: Arc<Mutex<Reserve>>,
    cancel: Arc<AtomicBool>,
}

impl SpareReserve {
    /// Starts building the reserve for any slot of `layout` on a thread of its own.
    pub(crate) fn start(global: ModelConfig, layout: Layout) -> Self {
        let reserve = Self::default();
        let (built, cancel) = (reserve.built.clone(), reserve.cancel.clone());
        let spawned = std::thread::Builder::new()
            .name("spare-reserve".into())
            .spawn(move || match largest_needs(&global, layout) {
                Ok(needs) => {
                    let started = std::time::Instant::now();
                    fill(&needs, &built, &cancel);
                    tracing::info!(
                        "spare's memory reserve written in {:.3} s{}",
                        started.elapsed().as_secs_f64(),
                        if cancel.load(Ordering::Relaxed) {
                            " (cut short by a promotion)"
                        } else {
                            ""
                        }
                    );
                }
                Err(e) => tracing::warn!("a spare's memory reserve was not built: {e}"),
            });
        if let Err(e) = spawned {
            tracing::warn!("a spare's memory reserve was not started: {e}");
        }
        reserve
    }

    /// Stops the build (a promotion does not wait for it) and takes what is built.
    pub(crate) fn take(&self) -> Reserve {
        let mut built = self.built.lock().unwrap_or_else(|p| p.into_inner());
        self.cancel.store(true, Ordering::Relaxed);
        std::mem::take(&mut *built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_proto::placement::Layout;

    fn coded() -> (ModelConfig, Layout) {
        let global = ModelConfig {
            table_rows: vec![1000, 37],
            ..crate::shard::tests::model()
        };
        let params = ftrec_ec::EcParams {
            k: 2,
            r: 1,
            groups: 1,
        };
        let layout = Layout::striped(ftrec_ec::StripeLayout::new(params, 3).unwrap());
        (global, layout)
    }

    #[test]
    fn a_reserve_fits_every_slot_and_is_zero() {
        let (global, layout) = coded();
        let mut reserve = Reserve::build(&global, layout, &AtomicBool::new(false)).unwrap();
        let stride = global.row_stride();
        let needs = largest_needs(&global, layout).unwrap();
        for server in 0..layout.servers() {
            let config = Shard::shard_config(&global, layout, server).unwrap();
            for (t, &(table, parity)) in needs.iter().enumerate() {
                let len = config.table_rows[t] * stride;
                assert!(len <= table, "server {server} table {t}");
                let bytes = layout.parity_rows(server, global.table_rows[t]) * stride * 4;
                assert!(bytes <= parity, "server {server} table {t} parity");
            }
        }
        // Some slot needs the whole of each reserve: it is no larger than it must be.
        for (t, &(table, parity)) in needs.iter().enumerate() {
            let slots = 0..layout.servers();
            let configs: Vec<_> = slots
                .clone()
                .map(|s| Shard::shard_config(&global, layout, s).unwrap())
                .collect();
            assert!(configs.iter().any(|c| c.table_rows[t] * stride == table));
            assert!(
                slots
                    .map(|s| layout.parity_rows(s, global.table_rows[t]) * stride * 4)
                    .any(|b| b == parity)
            );
        }
        let t0 = reserve.table(0, needs[0].0 - 5);
        assert_eq!(t0.len(), needs[0].0 - 5);
        assert!(t0.iter().all(|&x| x == 0.0));
        let p1 = reserve.parity(1, needs[1].1);
        assert!(p1.iter().all(|&x| x == 0));
        // Taken: the next asks allocate, still zero and of the asked length.
        assert_eq!(reserve.table(0, 7), vec![0.0; 7]);
        // Larger than reserved: allocated, not a short buffer.
        let big = reserve.parity(0, needs[0].1 + 1);
        assert_eq!(big.len(), needs[0].1 + 1);
    }

    #[test]
    fn a_cancelled_build_keeps_nothing_unfinished_and_serves_allocations() {
        let (global, layout) = coded();
        let mut reserve = Reserve::build(&global, layout, &AtomicBool::new(true)).unwrap();
        assert_eq!(reserve.table(0, 10), vec![0.0; 10]);
        assert_eq!(reserve.parity(1, 3), vec![0u8; 3]);
        // A spare promoted before its build began: nothing reserved, allocations served.
        let mut taken = SpareReserve::default().take();
        assert_eq!(taken.table(0, 4), vec![0.0; 4]);
    }
}
