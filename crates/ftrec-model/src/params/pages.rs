//! How a table's memory is backed.
//!
//! A training step reads about 53,000 rows at random from 665 MB of tables (`tiny`). With
//! 4 KiB pages nearly every read also misses the TLB and walks the page table; with 2 MiB
//! pages the whole model fits the second-level TLB. Measured on the Zen 4 host
//! (bench-results/HISTORY.md, "Tables on whole huge pages"), pooling and the sparse update took 0.8-1 ms
//! less a step; full checkpoints written from them blocked about 20% longer, so
//! `train.huge_pages` is opt-in.

use std::alloc::{Layout, alloc, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

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

const HUGE: usize = 2 << 20;

/// `len` zeroed floats on whole 2 MiB pages of their own, advised as huge before the
/// first write.
///
/// A table in a plain `Vec` gets its own mapping from the allocator, but that mapping
/// starts on a 4 KiB boundary, so only the whole 2 MiB pages inside it can be huge: the
/// first and last partial ones stay on small pages, 87 of the 667 MB of `tiny`'s tables.
/// Under Zipf ids the first is the hottest part of a table (its lowest rows). A block
/// aligned to 2 MiB and rounded up to whole 2 MiB pages has no partial page.
pub(crate) struct HugeBlock {
    ptr: NonNull<f32>,
    len: usize,
    layout: Layout,
}

// SAFETY: a `HugeBlock` owns its floats alone, as a `Vec<f32>` does; nothing else points
// into them.
unsafe impl Send for HugeBlock {}
// SAFETY: shared access only reads (through `Deref`); writes need `&mut`.
unsafe impl Sync for HugeBlock {}

impl HugeBlock {
    /// `None` when `len` floats cannot be laid out or allocated; the caller falls back
    /// to ordinary pages.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let bytes = len
            .checked_mul(size_of::<f32>())?
            .checked_next_multiple_of(HUGE)?;
        if bytes == 0 {
            return None;
        }
        let layout = Layout::from_size_align(bytes, HUGE).ok()?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw.cast::<f32>())?;
        advise_huge(raw, bytes);
        // SAFETY: `raw` is valid for `bytes` bytes (just allocated), and zero bytes are
        // the float +0.0, so after this the first `len` floats are initialised.
        unsafe { std::ptr::write_bytes(raw, 0, bytes) };
        Some(Self { ptr, len, layout })
    }
}

impl Deref for HugeBlock {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `ptr` points to at least `len` initialised floats (zeroed at
        // allocation, written only through `deref_mut`), owned by `self` for its lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HugeBlock {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugeBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout, and freed only here.
        unsafe { dealloc(self.ptr.as_ptr().cast(), self.layout) };
    }
}

/// Asks the kernel to back `bytes` at `start`, both on 2 MiB boundaries, with huge
/// pages. A refusal (THP off) changes nothing but speed, and `bench train` reports what
/// was granted (`huge_page_bytes`), so it is not an error.
fn advise_huge(start: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the range is the caller's own allocation. MADV_HUGEPAGE changes how
        // the kernel backs the pages, never their contents or whether they are mapped.
        unsafe { libc::madvise(start.cast::<libc::c_void>(), bytes, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block starts on a 2 MiB boundary, holds `len` zeros, keeps what is written, and
    /// refuses an empty or impossible size.
    #[test]
    fn a_block_is_aligned_zeroed_and_writable() {
        for len in [
            1usize,
            HUGE / 4 - 1,
            HUGE / 4,
            HUGE / 4 + 1,
            3 * HUGE / 4 + 5,
        ] {
            let mut block = HugeBlock::zeroed(len).unwrap();
            assert_eq!(block.as_ptr() as usize % HUGE, 0, "len {len}");
            assert_eq!(block.len(), len);
            assert!(block.iter().all(|v| v.to_bits() == 0), "len {len}");
            for (i, v) in block.iter_mut().enumerate() {
                *v = i as f32;
            }
            assert!(block.iter().enumerate().all(|(i, &v)| v == i as f32));
        }
        assert!(HugeBlock::zeroed(0).is_none());
        assert!(HugeBlock::zeroed(usize::MAX / 2).is_none());
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
