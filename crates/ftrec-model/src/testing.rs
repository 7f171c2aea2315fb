//! Helpers shared by the crate's unit tests.

/// Runs `f` in a fresh rayon pool of `threads` threads.
pub(crate) fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}
