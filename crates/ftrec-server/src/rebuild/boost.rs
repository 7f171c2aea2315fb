//! Rebuild first: while an uncapped rebuild runs, the processes that move its bytes (the
//! replacement, and each survivor while a bulk connection to it is open) raise the
//! scheduling priority of all their threads to `ec.rebuild_nice`, and put it back after.
//!
//! Why this costs training nothing in total: a rebuild costs a fixed number of
//! core-seconds per GB (about 0.9 here, nearly all of it the kernel's loopback copies,
//! `perf`, issue 23), and on a host that also trains, every one of them comes out of
//! training whenever it is spent. Spending them first ends the window in which a second
//! loss in the group is fatal sooner, for the same training lost. A capped rebuild
//! (`ec.rebuild_bytes_per_sec > 0`) is one the user wants spread out, so it is left at
//! the normal priority.
//!
//! A negative nice needs `CAP_SYS_NICE` (or a raised `RLIMIT_NICE`); without it the raise
//! fails, is logged once, and the rebuild runs at the normal priority.

use std::sync::{Arc, Mutex};

use rustix::process::{Pid, getpriority_process, setpriority_process};

/// One process's raise: counted, so that overlapping holders (a survivor serving two
/// connections, or both roles at once) raise once and restore once.
pub(crate) struct RebuildBoost {
    nice: i32,
    state: Mutex<BoostState>,
}

#[derive(Default)]
struct BoostState {
    holders: usize,
    /// The nice value to restore, read when the first holder came.
    before: Option<i32>,
    refused_logged: bool,
}

/// Holds the raise until dropped.
pub(crate) struct BoostGuard(Arc<RebuildBoost>);

impl RebuildBoost {
    /// `None` when `nice` is 0: nothing to raise.
    pub(crate) fn new(nice: i32) -> Option<Arc<Self>> {
        (nice != 0).then(|| {
            Arc::new(Self {
                nice,
                state: Mutex::new(BoostState::default()),
            })
        })
    }

    /// Raises every thread of the process to this boost's nice, unless a holder did.
    pub(crate) fn hold(self: &Arc<Self>) -> BoostGuard {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.holders += 1;
        if state.holders == 1 {
            let before = getpriority_process(None).unwrap_or(0);
            match set_every_thread(self.nice) {
                Ok(threads) => {
                    state.before = Some(before);
                    tracing::debug!("rebuild first: {threads} threads at nice {}", self.nice);
                }
                Err(e) => {
                    // Some threads may have moved before the refusal: put them back.
                    let _ = set_every_thread(before);
                    state.before = None;
                    if !state.refused_logged {
                        state.refused_logged = true;
                        tracing::warn!(
                            "ec.rebuild_nice = {}: cannot raise this process's priority ({e}); the rebuild shares the CPU with training at the normal priority",
                            self.nice
                        );
                    }
                }
            }
        }
        BoostGuard(self.clone())
    }

    fn release(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.holders = state.holders.saturating_sub(1);
        if state.holders == 0
            && let Some(before) = state.before.take()
            && let Err(e) = set_every_thread(before)
        {
            tracing::warn!("cannot put this process's priority back to nice {before}: {e}");
        }
    }
}

impl Drop for BoostGuard {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Sets every thread of this process to `nice` (on Linux a nice value is a thread's, so
/// the process's is set thread by thread). Threads started meanwhile take their
/// creator's. Returns how many were set.
fn set_every_thread(nice: i32) -> std::io::Result<usize> {
    let mut threads = 0;
    for entry in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
            .and_then(Pid::from_raw)
        else {
            continue;
        };
        match setpriority_process(Some(tid), nice) {
            Ok(()) => threads += 1,
            // The thread ended since the directory was read.
            Err(rustix::io::Errno::SRCH) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(threads)
}

/// Tests that change this process's nice values take this, so that none sees another's.
#[cfg(test)]
pub(crate) static NICE_TESTS: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// On Linux, `PRIO_PROCESS` of 0 is the calling thread.
    fn nice_of_this_thread() -> i32 {
        getpriority_process(None).unwrap_or(i32::MIN)
    }

    /// Holders nest: the raise stays until the last guard goes, and then the old value is
    /// back on every thread, one started meanwhile included. As root (CI) it raises
    /// priority, as a rebuild does; otherwise it lowers it, which needs no privilege, and
    /// only checks the restore where the host allows going back.
    #[test]
    fn holders_nest_and_the_last_restores_every_thread() {
        let _serial = NICE_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let before = nice_of_this_thread();
        let root = rustix::process::geteuid().is_root();
        let target = if root { before - 5 } else { before + 3 }.clamp(-20, 19);
        if target == before {
            return;
        }
        let boost = RebuildBoost::new(target).unwrap_or_else(|| unreachable!());
        let first = boost.hold();
        assert_eq!(nice_of_this_thread(), target);
        let second = boost.hold();
        drop(first);
        assert_eq!(nice_of_this_thread(), target, "a holder is left");
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let _ = tx.send(nice_of_this_thread());
            let _ = done_rx.recv();
            nice_of_this_thread()
        });
        assert_eq!(
            rx.recv().ok(),
            Some(target),
            "a new thread takes its creator's"
        );
        drop(second);
        let restored = nice_of_this_thread();
        let _ = done_tx.send(());
        let other_after = other.join().unwrap_or(i32::MIN);
        if root {
            assert_eq!(restored, before);
        }
        assert_eq!(
            other_after, restored,
            "every thread gets the same value back"
        );
    }

    #[test]
    fn zero_raises_nothing() {
        assert!(RebuildBoost::new(0).is_none());
    }
}
