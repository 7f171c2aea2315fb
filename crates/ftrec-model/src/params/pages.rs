//! How a table's memory is backed.
//!
//! A training step reads about 53,000 rows at random from 665 MB of tables (`tiny`). With
//! 4 KiB pages nearly every read also misses the TLB and walks the page table; with 2 MiB
//! pages the whole model fits the second-level TLB. Measured on the Zen 4 host
//! (BENCHMARKS, "Huge pages for the tables"), pooling took 0.35-0.8 ms less a step; a
//! full checkpoint written from them blocked 30% longer, so `train.huge_pages` is opt-in.

/// The pages a table's rows live on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TablePages {
    /// Whatever the allocator and the system give.
    #[default]
    Default,
    /// Transparent huge pages, asked for with `madvise(MADV_HUGEPAGE)` before the first
    /// write, so that the kernel faults the memory in as 2 MiB pages where it can. Needs
    /// `/sys/kernel/mm/transparent_hugepage/enabled` at `madvise` or `always`; elsewhere
    /// the advice is refused and the table stays on small pages (same values either way).
    Huge,
}

/// The 2 MiB-aligned part of `len` bytes at `start`, as `(start, len)`, if any.
fn huge_aligned(start: usize, len: usize) -> Option<(usize, usize)> {
    const HUGE: usize = 2 << 20;
    let first = start.checked_next_multiple_of(HUGE)?;
    let end = (start + len) / HUGE * HUGE;
    (end > first).then(|| (first, end - first))
}

/// Asks the kernel to back the whole 2 MiB pages inside `capacity` floats at `start` with
/// huge pages. A refusal (THP off) changes nothing but speed, and `bench train` reports
/// what was granted (`huge_page_bytes`), so it is not an error.
pub(crate) fn advise_huge(start: *const f32, capacity: usize) {
    let Some((first, len)) = huge_aligned(start as usize, capacity * size_of::<f32>()) else {
        return;
    };
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `[first, first + len)` lies inside the caller's allocation of `capacity`
        // floats (`huge_aligned` only shrinks the range). MADV_HUGEPAGE changes how the
        // kernel backs the pages, never their contents or whether they are mapped, so no
        // reference into the range is affected.
        unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (first, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_huge_pages_inside_the_buffer_are_advised() {
        const HUGE: usize = 2 << 20;
        assert_eq!(huge_aligned(HUGE, 3 * HUGE), Some((HUGE, 3 * HUGE)));
        assert_eq!(huge_aligned(HUGE + 1, 3 * HUGE), Some((2 * HUGE, 2 * HUGE)));
        assert_eq!(huge_aligned(HUGE + 1, HUGE), None);
        assert_eq!(huge_aligned(0, HUGE - 1), None);
    }

    /// Large enough to hold whole huge pages: the advice changes no value.
    #[test]
    fn a_table_on_huge_pages_holds_the_same_rows() {
        let optimizer = crate::Optimizer::Adagrad {
            lr: 0.1,
            initial_accumulator: 0.0,
            eps: 1e-10,
        };
        let on =
            |pages| crate::EmbeddingTable::new_initialized_on(40_000, 16, &optimizer, 9, 3, pages);
        let (small, huge) = (on(TablePages::Default), on(TablePages::Huge));
        assert_eq!(huge.as_slice().len(), 40_000 * huge.stride());
        assert!(
            small
                .as_slice()
                .iter()
                .zip(huge.as_slice())
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
