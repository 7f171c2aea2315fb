//! Keeping the pool's threads awake through a step.
//!
//! A step forks and joins its pool about thirty times (each MLP product, the pooling,
//! the interaction, the aggregation, the updates), with a little serial work between the
//! joins. Left alone, a rayon worker that finds no work goes to sleep within tens of
//! microseconds, and the next fork must wake it: a futex call, and on a virtual machine
//! an interrupt to a halted virtual CPU, before the second half of the product starts.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a polling thread spins without work before it also yields its core to the
/// OS between polls: longer than the serial gaps between a step's forks (a few
/// microseconds), so that on a dedicated host it never makes a system call.
const SPIN_BEFORE_YIELDING: Duration = Duration::from_micros(50);

struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `f` on one thread of the current rayon pool while every other thread of the pool
/// polls for work (`rayon::yield_now`) instead of sleeping, until `f` returns. Outside a
/// pool, or in a pool of one, it just runs `f`.
///
/// The polling threads run the same jobs they would have run after waking, so results
/// do not change; only when the second thread starts does. Meanwhile they keep their
/// cores busy, yielding to any other runnable thread: what a host dedicated to training
/// wants, and why this wraps a single-process step (`Dlrm::train_step`) and never the
/// time between steps. A parameter-server worker's `forward_backward` does not use it:
/// its cluster may share cores with servers whose heartbeats must not wait.
pub fn with_pool_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_num_threads() < 2 || rayon::current_thread_index().is_none() {
        return f();
    }
    let work = Mutex::new(Some(f));
    let claimed = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let results = rayon::broadcast(|_| {
        if claimed.swap(true, Ordering::AcqRel) {
            let mut idle_since = Instant::now();
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle_since = Instant::now();
                } else if idle_since.elapsed() < SPIN_BEFORE_YIELDING {
                    std::hint::spin_loop();
                } else {
                    // A long gap: hand the core to any other runnable thread (tests run
                    // several pools at once); with none, this returns within a
                    // microsecond.
                    std::thread::yield_now();
                }
            }
            return None;
        }
        // Set on the way out, a panic in `f` included, so that the pollers stop and the
        // broadcast can carry the panic to the caller.
        let _done = SetOnDrop(&done);
        // Only this call takes the lock, so it is never poisoned; take the value anyway.
        let f = work.lock().unwrap_or_else(|e| e.into_inner()).take();
        f.map(|f| f())
    });
    let mut results = results.into_iter().flatten();
    match results.next() {
        Some(result) => result,
        // Exactly one broadcast call claims `f` and returns its result.
        None => unreachable!("one thread of the broadcast runs the step"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// The result of `f`, and of the parallel work inside it, in pools of every size and
    /// outside any pool; and twice in a row, so that the pollers of the first call have
    /// let go of the pool.
    #[test]
    fn runs_the_work_once_and_returns_its_result() {
        let work = || {
            let squares: Vec<u64> = (0..10_000u64).into_par_iter().map(|i| i * i).collect();
            squares.iter().sum::<u64>()
        };
        let want: u64 = (0..10_000u64).map(|i| i * i).sum();
        assert_eq!(with_pool_awake(work), want);
        for threads in [1, 2, 3, 4] {
            let runs = std::sync::atomic::AtomicUsize::new(0);
            let got = in_pool(threads, || {
                (0..2)
                    .map(|_| {
                        with_pool_awake(|| {
                            runs.fetch_add(1, Ordering::Relaxed);
                            work()
                        })
                    })
                    .collect::<Vec<_>>()
            });
            assert_eq!(got, vec![want, want], "a pool of {threads}");
            assert_eq!(runs.load(Ordering::Relaxed), 2, "a pool of {threads}");
        }
    }

    /// A panic in `f` reaches the caller, and the pollers stop rather than spin forever.
    #[test]
    fn a_panic_reaches_the_caller() {
        let outcome = in_pool(2, || {
            std::panic::catch_unwind(|| with_pool_awake(|| -> u32 { panic!("in the step") }))
        });
        assert!(outcome.is_err());
        assert_eq!(in_pool(2, || with_pool_awake(|| 7)), 7);
    }
}
