//! Cache prefetch hints for rows read in an order the hardware prefetcher cannot guess:
//! embedding rows by id, parity slots by stripe. A row is a few cache lines at a random
//! place in a table of hundreds of MB, so each one read cold waits out a memory latency
//! (about 100 ns); asking for the rows a few ahead overlaps those waits.

/// Bytes the CPU fetches at once.
const CACHE_LINE: usize = 64;

/// Asks the CPU to bring every cache line of `slice` into cache for reading; does nothing
/// off x86-64.
#[inline]
pub fn prefetch_read<T>(slice: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = slice.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(slice);
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: `offset < bytes`, so the address is inside `slice` (`wrapping_add`
            // never dereferences it anyway), and a prefetch is a hint: it never faults,
            // reads nothing into the program and writes no memory.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    start.wrapping_add(offset),
                )
            };
            offset += CACHE_LINE;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slice;
}

#[cfg(test)]
mod tests {
    use super::prefetch_read;

    #[test]
    fn a_prefetch_changes_nothing_whatever_the_slice() {
        // Empty, shorter than a line, unaligned and several lines long: every case must
        // leave the data as it was (a prefetch that wrote or faulted would fail here).
        let data: Vec<u8> = (0..=255).cycle().take(1000).collect();
        let before = data.clone();
        prefetch_read::<u8>(&[]);
        prefetch_read(&data[..1]);
        prefetch_read(&data[3..67]);
        prefetch_read(&data);
        let floats = vec![1.5f32; 130];
        prefetch_read(&floats[1..]);
        assert_eq!(data, before);
        assert!(floats.iter().all(|&v| v == 1.5));
    }
}
