//! Leases: at most one live writer (and one merger) per checkpoint location.
//!
//! A lease is one small object (`locks/<name>.lease`) holding who has it and until when.
//! It is taken and renewed only by compare-and-swap ([`Store::put_versioned`]: a
//! conditional PUT on S3 and Azure, a `flock`-guarded replace locally), so two processes
//! can never both believe they hold it: the loser of a race gets a conflict. A holder
//! renews it from a background thread every third of its time to live; a holder that finds
//! it taken over (it was too slow, or its host stalled) marks it lost. A crashed holder's
//! lease expires; on the same host a holder whose process is gone is dead at once, so a
//! restart after a SIGKILL does not wait.
//!
//! **Fencing.** Every acquisition, takeovers included, raises the lease's `generation`.
//! The renewer notices a takeover only at its next round (10 s by default), while a
//! cluster server's replacement takes the lease at once, so a cached "lost" flag cannot
//! stop a frozen holder that thaws. Each commit therefore re-validates the lease at the
//! store itself ([`Lease::fence_commit`]): a compare-and-swap of the lease object from the
//! version this holder last wrote. It succeeds only if no one took the lease since, and it
//! hands out the commit's [`FenceToken`] (generation, and this holder's commit count). A
//! manifest PUT can still land after a takeover that came between its CAS and its PUT; the
//! successor's fence record (`fence.rs`) lists the commits it found, so such a late
//! manifest is never listed or restored.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::now_unix_ms;
use crate::{CkptError, FenceToken, Store};

/// The lease of the process that writes checkpoints (a trainer, a cluster server).
pub const WRITER: &str = "writer";
/// The lease of whoever merges or garbage-collects (DECK's merger, `ckpt merge`, `ckpt gc`).
pub const MERGER: &str = "merger";

/// How long a lease lives without renewal, unless configured.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// Who asks for a lease, and for how long.
#[derive(Clone, Debug)]
pub struct LeaseOptions {
    /// Shown to a process that finds the lease taken, e.g. "ftrec train".
    pub purpose: String,
    pub ttl: Duration,
    /// A holder with the same key may take the lease over while it is live: a cluster
    /// server's replacement (`job <fingerprint> server <id>`), whose predecessor the
    /// coordinator has declared dead and fenced off by epoch.
    pub owner_key: Option<String>,
}

impl LeaseOptions {
    pub fn new(purpose: impl Into<String>) -> Self {
        Self {
            purpose: purpose.into(),
            ttl: DEFAULT_TTL,
            owner_key: None,
        }
    }
}

/// The stored lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub purpose: String,
    pub host: String,
    pub pid: u32,
    /// Distinguishes two holders in one process (and a reused pid).
    pub nonce: u64,
    #[serde(default)]
    pub owner_key: Option<String>,
    pub acquired_unix_ms: u64,
    pub expires_unix_ms: u64,
    /// Set when the holder let go; the lease is then free.
    #[serde(default)]
    pub released: bool,
    /// One more than the previous holder's: the fencing generation (module docs). 0 in
    /// leases written before generations existed.
    #[serde(default)]
    pub generation: u64,
    /// The branch this holder writes, once it started writing: the only branch its
    /// successor may continue, and only once it let go.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<u32>,
}

impl LeaseRecord {
    /// Whether the holder may still be writing.
    pub fn is_live(&self) -> bool {
        if self.released || self.expires_unix_ms <= now_unix_ms() {
            return false;
        }
        // On this host a vanished process holds nothing, whatever its expiry says.
        self.host != host_name() || process_exists(self.pid)
    }

    /// Whether the holder may still be writing, as far as a process taking the lease over
    /// can tell: it did not let go, and it is not a vanished process on this host. A frozen
    /// process, or one on another host, may thaw and write on after it lost the lease.
    fn may_still_write(&self) -> bool {
        !self.released && (self.host != host_name() || process_exists(self.pid))
    }

    pub fn describe(&self) -> String {
        let left = self.expires_unix_ms.saturating_sub(now_unix_ms()) as f64 / 1e3;
        format!(
            "{} (pid {} on {}, lease expires in {left:.0} s)",
            self.purpose, self.pid, self.host
        )
    }
}

fn key_for(name: &str) -> String {
    format!("locks/{name}.lease")
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into())
}

/// Whether `pid` is a running process on this host. A zombie (killed, not yet reaped by
/// its parent) holds nothing: a SIGKILLed server stays one until its launcher waits for it.
fn process_exists(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) state ...`: the command may hold spaces and parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Tells two holders apart (std's randomly keyed hasher over the clock); not a secret.
fn fresh_nonce() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(now_unix_ms())
}

fn encode(record: &LeaseRecord) -> Result<Vec<u8>, CkptError> {
    serde_json::to_vec_pretty(record).map_err(|e| CkptError::Invalid(e.to_string()))
}

fn decode(store: &dyn Store, key: &str, bytes: &[u8]) -> Result<LeaseRecord, CkptError> {
    serde_json::from_slice(bytes)
        .map_err(|e| CkptError::corrupt(&store.describe(key), format!("unreadable lease: {e}")))
}

/// The current holder of lease `name`, if it is live.
pub fn live_holder(store: &dyn Store, name: &str) -> Result<Option<LeaseRecord>, CkptError> {
    let key = key_for(name);
    match store.get_versioned(&key)? {
        Some((bytes, _)) => Ok(Some(decode(store, &key, &bytes)?).filter(LeaseRecord::is_live)),
        None => Ok(None),
    }
}

/// What the holder last wrote, and the commits it has fenced.
struct HeldState {
    record: LeaseRecord,
    /// The stored version of `record`: every compare-and-swap starts from it.
    version: String,
    /// Commits fenced so far ([`Lease::fence_commit`]).
    commits: u64,
}

struct Held {
    store: Arc<dyn Store>,
    key: String,
    ttl: Duration,
    state: Mutex<HeldState>,
    lost: AtomicBool,
}

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Extends the lease by one time to live; a conflict means it was taken over.
    fn renew(&self) -> Result<(), CkptError> {
        let mut state = self.lock();
        let mut record = state.record.clone();
        record.expires_unix_ms = now_unix_ms() + self.ttl.as_millis() as u64;
        self.swap(&mut state, record)
    }

    /// Replaces the stored record by `record`, if it is still the one this holder wrote
    /// last. A conflict means someone took the lease over: it is lost, [`CkptError::Fenced`].
    fn swap(&self, state: &mut HeldState, record: LeaseRecord) -> Result<(), CkptError> {
        match self
            .store
            .put_versioned(&self.key, &encode(&record)?, Some(&state.version))
        {
            Ok(version) => {
                state.record = record;
                state.version = version;
                Ok(())
            }
            Err(CkptError::Conflict(m)) => {
                self.lost.store(true, Ordering::SeqCst);
                Err(self.fenced(&m))
            }
            Err(e) => {
                if state.record.expires_unix_ms <= now_unix_ms() {
                    self.lost.store(true, Ordering::SeqCst);
                }
                Err(e)
            }
        }
    }

    /// The error of a holder that lost the lease, naming who holds it now where that can
    /// be read.
    fn fenced(&self, why: &str) -> CkptError {
        let successor = self
            .store
            .get_versioned(&self.key)
            .ok()
            .flatten()
            .and_then(|(bytes, _)| decode(&*self.store, &self.key, &bytes).ok())
            .map_or_else(
                || "someone else".to_string(),
                |r| format!("{} (generation {})", r.describe(), r.generation),
            );
        CkptError::Fenced(format!(
            "{}: this process lost its lease (now held by {successor}; {why}), so it commits \
             no more checkpoints there",
            self.store.describe(&self.key)
        ))
    }
}

/// A held lease. Renewed in the background until dropped; dropping releases it.
pub struct Lease {
    held: Arc<Held>,
    stop: Option<Sender<()>>,
    renewer: Option<JoinHandle<()>>,
    /// The record of the holder this one took the lease from, if any.
    predecessor: Option<LeaseRecord>,
}

impl Lease {
    /// Takes lease `name`: free, expired, released, held by a dead process on this host,
    /// or held under the same `owner_key`. A live holder makes it [`CkptError::Busy`],
    /// naming the holder.
    pub fn acquire(
        store: Arc<dyn Store>,
        name: &str,
        options: &LeaseOptions,
    ) -> Result<Self, CkptError> {
        let key = key_for(name);
        // A conflict means another process moved between our read and our write: look
        // again, a few times, then report whoever holds it.
        for _ in 0..5 {
            let (expected, predecessor) = match store.get_versioned(&key)? {
                None => (None, None),
                Some((current, version)) => {
                    let holder = decode(&*store, &key, &current)?;
                    let same_owner =
                        options.owner_key.is_some() && holder.owner_key == options.owner_key;
                    if holder.is_live() && !same_owner {
                        return Err(CkptError::Busy(format!(
                            "{} is in use: its {name} lease is held by {}",
                            store.describe(""),
                            holder.describe()
                        )));
                    }
                    (Some(version), Some(holder))
                }
            };
            let now = now_unix_ms();
            let record = LeaseRecord {
                purpose: options.purpose.clone(),
                host: host_name(),
                pid: std::process::id(),
                nonce: fresh_nonce(),
                owner_key: options.owner_key.clone(),
                acquired_unix_ms: now,
                expires_unix_ms: now + options.ttl.as_millis() as u64,
                released: false,
                generation: predecessor.as_ref().map_or(0, |p| p.generation) + 1,
                branch: None,
            };
            match store.put_versioned(&key, &encode(&record)?, expected.as_deref()) {
                Ok(version) => {
                    let mut lease = Self::hold(store, key, options.ttl, record, version);
                    lease.predecessor = predecessor;
                    return Ok(lease);
                }
                Err(CkptError::Conflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(CkptError::Busy(format!(
            "{}: the {name} lease keeps changing hands; another process is taking it",
            store.describe("")
        )))
    }

    fn hold(
        store: Arc<dyn Store>,
        key: String,
        ttl: Duration,
        record: LeaseRecord,
        version: String,
    ) -> Self {
        let held = Arc::new(Held {
            store,
            key,
            ttl,
            state: Mutex::new(HeldState {
                record,
                version,
                commits: 0,
            }),
            lost: AtomicBool::new(false),
        });
        let (stop, stopped) = channel();
        let renewing = Arc::clone(&held);
        let renewer = std::thread::Builder::new()
            .name("ckpt-lease".into())
            .spawn(move || renew_until_stopped(&renewing, &stopped))
            .map_err(|e| tracing::warn!("no lease renewer thread ({e}); the lease will expire"))
            .ok();
        Self {
            held,
            stop: Some(stop),
            renewer,
            predecessor: None,
        }
    }

    /// Fails once the lease is known lost: the caller must not commit anything more. Only
    /// as fresh as the renewer's last round; a commit asks the store ([`Lease::fence_commit`]).
    pub fn check(&self) -> Result<(), CkptError> {
        if self.held.lost.load(Ordering::SeqCst) {
            return Err(self.held.fenced("found at an earlier renewal or commit"));
        }
        Ok(())
    }

    /// Proves, at the store, that this process still holds the lease, and returns the
    /// token of the commit it is about to make: a compare-and-swap of the lease object
    /// from the version this holder wrote last (extending it by one time to live). A
    /// takeover since, however recent, fails it with [`CkptError::Fenced`], and the lease
    /// is lost. Tokens are handed out under the same lock as the swap, so their order is
    /// the order of the swaps.
    pub fn fence_commit(&self) -> Result<FenceToken, CkptError> {
        self.check()?;
        let mut state = self.held.lock();
        let mut record = state.record.clone();
        record.expires_unix_ms = now_unix_ms() + self.held.ttl.as_millis() as u64;
        self.held.swap(&mut state, record)?;
        state.commits += 1;
        Ok(FenceToken {
            generation: state.record.generation,
            seq: state.commits,
        })
    }

    /// Records, by compare-and-swap, that this holder writes `branch`, with its generation
    /// raised above `floor`: a location whose lease object was deleted starts counting
    /// again, and its new tokens must still order after every token already in its
    /// manifests and fence records.
    pub fn start_session(&self, floor: u64, branch: u32) -> Result<(), CkptError> {
        let mut state = self.held.lock();
        let mut record = state.record.clone();
        record.generation = record.generation.max(floor + 1);
        record.branch = Some(branch);
        self.held.swap(&mut state, record)
    }

    /// The fencing generation this holder commits under.
    pub fn generation(&self) -> u64 {
        self.held.lock().record.generation
    }

    /// Whether the holder this one took the lease from may still be writing: it did not
    /// let go, and it is not a vanished process on this host.
    pub fn predecessor_may_write(&self) -> bool {
        self.predecessor
            .as_ref()
            .is_some_and(|p| p.may_still_write())
    }

    /// Whether this holder may continue writing `branch`: only the branch of the holder it
    /// took the lease from, once that one cannot write any more (or in a location no one
    /// held). Any other branch may belong to a holder further back that never let go (a
    /// frozen process taken over once) and may still write its data files there, so a new
    /// writer forks instead: its names never collide with a late writer's.
    pub fn may_continue(&self, branch: u32) -> bool {
        match &self.predecessor {
            None => true,
            Some(p) => !p.may_still_write() && p.branch == Some(branch),
        }
    }

    pub fn record(&self) -> LeaseRecord {
        self.held.lock().record.clone()
    }
}

fn renew_until_stopped(held: &Held, stopped: &Receiver<()>) {
    let period = (held.ttl / 3).max(Duration::from_millis(10));
    loop {
        match stopped.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        if let Err(e) = held.renew() {
            tracing::warn!("checkpoint lease renewal failed: {e}");
            if held.lost.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(r) = self.renewer.take() {
            let _ = r.join();
        }
        if self.held.lost.load(Ordering::SeqCst) {
            return;
        }
        let state = self.held.lock();
        let mut record = state.record.clone();
        record.released = true;
        let released = encode(&record).and_then(|bytes| {
            self.held
                .store
                .put_versioned(&self.held.key, &bytes, Some(&state.version))
        });
        if let Err(e) = released {
            tracing::debug!("releasing the checkpoint lease: {e} (it expires by itself)");
        }
    }
}

#[cfg(test)]
mod process_tests {
    use super::process_exists;

    #[test]
    fn a_zombie_holds_nothing() {
        assert!(process_exists(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        // Not waited for: it exits and stays a zombie until `wait`.
        let pid = child.id();
        let started = std::time::Instant::now();
        while process_exists(pid) {
            assert!(started.elapsed().as_secs() < 10, "pid {pid} still running");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "a zombie"
        );
        child.wait().unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalStore;

    fn store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let s: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path()).unwrap());
        (dir, s)
    }

    #[test]
    fn a_live_lease_excludes_a_second_holder_until_released() {
        let (_dir, s) = store();
        let first = Lease::acquire(s.clone(), WRITER, &LeaseOptions::new("trainer A")).unwrap();
        let e = Lease::acquire(s.clone(), WRITER, &LeaseOptions::new("trainer B"))
            .err()
            .unwrap();
        assert!(matches!(e, CkptError::Busy(_)), "{e}");
        assert!(e.to_string().contains("trainer A"), "{e}");
        assert!(
            e.to_string().contains(&std::process::id().to_string()),
            "{e}"
        );
        assert_eq!(
            live_holder(&*s, WRITER).unwrap().unwrap().purpose,
            "trainer A"
        );
        drop(first);
        assert!(live_holder(&*s, WRITER).unwrap().is_none());
        Lease::acquire(s, WRITER, &LeaseOptions::new("trainer B")).unwrap();
    }

    #[test]
    fn an_expired_lease_is_taken_over_and_its_holder_learns_it_lost() {
        let (_dir, s) = store();
        let short = LeaseOptions {
            ttl: Duration::from_millis(300),
            ..LeaseOptions::new("slow")
        };
        let slow = Lease::acquire(s.clone(), WRITER, &short).unwrap();
        // Stop the renewer, as a stalled host would.
        let mut slow = slow;
        drop(slow.stop.take());
        slow.renewer.take().unwrap().join().unwrap();
        std::thread::sleep(Duration::from_millis(400));
        let _new = Lease::acquire(s.clone(), WRITER, &LeaseOptions::new("new")).unwrap();
        assert!(slow.held.renew().is_err());
        assert!(slow.check().is_err(), "the old holder must stop committing");
    }

    #[test]
    fn the_same_owner_key_takes_a_live_lease_over() {
        let (_dir, s) = store();
        let keyed = LeaseOptions {
            owner_key: Some("job 7 server 1".into()),
            ..LeaseOptions::new("server 1")
        };
        let old = Lease::acquire(s.clone(), WRITER, &keyed).unwrap();
        let new = Lease::acquire(s.clone(), WRITER, &keyed).unwrap();
        assert!(old.held.renew().is_err());
        assert!(new.check().is_ok());
        assert!(Lease::acquire(s, WRITER, &LeaseOptions::new("other")).is_err());
    }

    #[test]
    fn a_takeover_fences_the_old_holders_next_commit_before_its_renewer_notices() {
        let (_dir, s) = store();
        let keyed = LeaseOptions {
            owner_key: Some("job 7 server 1".into()),
            ..LeaseOptions::new("server 1")
        };
        let old = Lease::acquire(s.clone(), WRITER, &keyed).unwrap();
        assert_eq!(old.generation(), 1);
        assert!(!old.predecessor_may_write());
        let token = |generation, seq| FenceToken { generation, seq };
        assert_eq!(old.fence_commit().unwrap(), token(1, 1));
        assert_eq!(old.fence_commit().unwrap(), token(1, 2));
        let new = Lease::acquire(s.clone(), WRITER, &keyed).unwrap();
        assert_eq!(new.generation(), 2);
        assert!(new.predecessor_may_write(), "the old holder never let go");
        assert!(old.check().is_ok(), "its renewer has not run yet");
        let e = old.fence_commit().unwrap_err();
        assert!(matches!(e, CkptError::Fenced(_)), "{e}");
        assert!(e.to_string().contains("generation 2"), "{e}");
        assert!(matches!(old.check(), Err(CkptError::Fenced(_))));
        assert_eq!(new.fence_commit().unwrap(), token(2, 1));
        drop(old);
        drop(new);
        let next = Lease::acquire(s.clone(), WRITER, &keyed).unwrap();
        assert_eq!(next.generation(), 3);
        assert!(!next.predecessor_may_write(), "released");
        assert!(
            !next.may_continue(0),
            "its predecessor never said what it wrote"
        );
        next.start_session(9, 4).unwrap();
        assert_eq!(next.generation(), 10);
        assert_eq!(next.fence_commit().unwrap(), token(10, 1));
        drop(next);
        let after = Lease::acquire(s, WRITER, &keyed).unwrap();
        assert!(after.may_continue(4) && !after.may_continue(0));
    }

    #[test]
    fn renewal_keeps_a_short_lease_alive() {
        let (_dir, s) = store();
        let short = LeaseOptions {
            ttl: Duration::from_millis(300),
            ..LeaseOptions::new("renewing")
        };
        let held = Lease::acquire(s.clone(), WRITER, &short).unwrap();
        std::thread::sleep(Duration::from_millis(900));
        assert!(held.check().is_ok());
        assert!(Lease::acquire(s, WRITER, &LeaseOptions::new("other")).is_err());
    }
}
