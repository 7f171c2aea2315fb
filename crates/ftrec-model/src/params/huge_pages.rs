//! Zeroed buffers for the big arrays (embedding tables, parity, optimizer state) backed by
//! transparent huge pages where the kernel offers them on request
//! (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, Debian's default).
//!
//! Why: a server's tables are gigabytes read at random rows. With 4 KiB pages every first
//! touch is a page fault, and a replacement installing a rebuilt shard spent about 14% of
//! its CPU in faults and their bookkeeping (perf, issue 23); every random row read is a
//! TLB miss too. Measured on `tiny` at 400,000 rows per table, 3 servers, one SIGKILL,
//! with huge pages against without (two runs each): the rebuild went from 363-366 to
//! 404-459 MB/s, and training from 26.0-27.0k to 28.1-28.7k samples/s.

/// Buffers smaller than this stay on ordinary pages: a huge page is 2 MiB.
const HUGE_PAGE: usize = 2 << 20;
/// The smallest page the advice can name; `madvise` wants a page-aligned start.
const PAGE: usize = 4096;

/// `len` zeroed values, their memory advised for huge pages before any is touched.
pub fn zeroed<T: bytemuck::Zeroable + Clone>(len: usize) -> Vec<T> {
    // `vec![zeroed; len]` of a large length is a fresh anonymous mapping from `calloc`,
    // not yet faulted in: advice given now decides the pages of the first touch.
    let values = vec![T::zeroed(); len];
    advise_huge(&values);
    values
}

/// Asks the kernel to back `values`' whole pages with huge pages. Advisory only: contents
/// and validity do not change, and a kernel that says no (THP off, not Linux) leaves them
/// on ordinary pages. Returns whether the advice was taken.
pub fn advise_huge<T>(values: &[T]) -> bool {
    let bytes = std::mem::size_of_val(values);
    if bytes < HUGE_PAGE {
        return false;
    }
    let start = values.as_ptr() as usize;
    let first = start.next_multiple_of(PAGE);
    let end = (start + bytes) / PAGE * PAGE;
    if end <= first {
        return false;
    }
    advise_range(first, end - first)
}

#[cfg(target_os = "linux")]
fn advise_range(first: usize, len: usize) -> bool {
    // SAFETY: `[first, first + len)` lies inside one live allocation (`values`, borrowed
    // by the caller for this call), page-aligned at both ends. MADV_HUGEPAGE only marks
    // the range as eligible for transparent huge pages: it neither frees, moves nor
    // changes the bytes there (the kernel keeps contents when it collapses pages), so no
    // Rust reference to the memory is invalidated. The tests check the values survive.
    let rc = unsafe { libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn advise_range(_first: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_buffer_is_zeroed_and_keeps_what_is_written() {
        let mut values: Vec<f32> = zeroed((8 << 20) / 4 + 3);
        assert!(values.iter().all(|&v| v == 0.0));
        for (i, v) in values.iter_mut().enumerate() {
            *v = i as f32;
        }
        // Advising again (as a caller might) changes nothing either.
        advise_huge(&values);
        assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32));
    }

    #[test]
    fn small_buffers_are_not_advised() {
        let values: Vec<u8> = zeroed(HUGE_PAGE - 1);
        assert!(!advise_huge(&values));
        assert_eq!(values.len(), HUGE_PAGE - 1);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_kernel_takes_the_advice_where_huge_pages_are_on_request() {
        let setting = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        // Only where THP may be requested: "[madvise]" or "[always]" selected.
        if !setting.is_ok_and(|s| s.contains("[madvise]") || s.contains("[always]")) {
            return;
        }
        let values: Vec<u8> = zeroed(16 << 20);
        assert!(advise_huge(&values));
    }
}
