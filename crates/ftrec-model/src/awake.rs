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

/// How long a polling thread goes without work before it stops polling and returns to
/// rayon's own sleep. Longer than any serial stretch of a step (the dense update, about
/// 0.2 ms on `tiny`). It also bounds the one case where polling would block the step: a
/// thread that stole part of a fork, and then, waiting inside it for a piece taken back
/// by the step's thread, picked up its polling job. That job sits on top of work the step
/// waits for, so it must not wait for the step to end.
const GIVE_UP_AFTER: Duration = Duration::from_millis(1);

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
/// do not change; only when the second thread starts does. A poller that finds no work
/// for a millisecond goes back to rayon's ordinary sleep ([`GIVE_UP_AFTER`]). Meanwhile
/// the pollers keep their cores busy, yielding to any other runnable thread: what a host
/// dedicated to training wants, and why this wraps a single-process step
/// (`Dlrm::train_step`) and never the time between steps. A parameter-server worker's `forward_backward` does not use it:
/// its cluster may share cores with servers whose heartbeats must not wait.
///
/// At most one call at a time per pool, and nothing else queued on the pool meanwhile:
/// the broadcast returns only once every thread has run its part, and two overlapping
/// calls could each poll on top of the other's unfinished work. `Dlrm::train_step` runs
/// alone under its caller's `pool.install`, which is why this is not public.
pub(crate) fn with_pool_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
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
                    continue;
                }
                let idle = idle_since.elapsed();
                if idle < SPIN_BEFORE_YIELDING {
                    std::hint::spin_loop();
                } else if idle < GIVE_UP_AFTER {
                    // A longer gap: hand the core to any other runnable thread (tests run
                    // several pools at once); with none, this returns within a
                    // microsecond.
                    std::thread::yield_now();
                } else {
                    break;
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
    use crate::testing::in_pool;
    use rayon::prelude::*;

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

    /// Forks inside forks, many times over, finish with the right sums; a watchdog fails
    /// the test instead of hanging it. (The race that hung a two-trainer test, a poller
    /// picked up inside a stolen fork, is too rare to force here; `GIVE_UP_AFTER` bounds
    /// it, and `two_concurrent_trainers_are_excluded_by_the_writer_lease` ran into it.)
    #[test]
    fn nested_forks_finish() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let sums = in_pool(2, || {
                (0..300)
                    .map(|round: u64| {
                        with_pool_awake(|| {
                            (0..26u64)
                                .into_par_iter()
                                .map(|t| {
                                    (0..64u64)
                                        .into_par_iter()
                                        .map(|i| i * t + round)
                                        .sum::<u64>()
                                })
                                .sum::<u64>()
                        })
                    })
                    .collect::<Vec<_>>()
            });
            let _ = tx.send(sums);
        });
        let sums = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("300 nested steps finish within a minute");
        let want: Vec<u64> = (0..300u64)
            .map(|round| {
                (0..26u64)
                    .map(|t| (0..64u64).map(|i| i * t + round).sum::<u64>())
                    .sum()
            })
            .collect();
        assert_eq!(sums, want);
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
