//! A superseded writer never adds to the history: a holder whose lease was taken over (a
//! cluster server's replacement takes it at once) has its next commit refused at the
//! store, a manifest that slipped past the takeover is never listed or restored, and the
//! commits at one step are ordered by fencing token, whatever the writers' clocks say.
//! The scenarios run on a local directory here, and on S3 and Azure through
//! `object_suite.rs`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ftrec_ckpt::lease::LeaseOptions;
use ftrec_ckpt::{BranchStart, Checkpoints, CkptError, LocalStore, Manifest, Store};
use ftrec_model::{ModelConfig, ModelState, Optimizer};
use proptest::prelude::*;
use serde_json::json;

use crate::hooked::{Hooked, WriteHook};

fn state(seed: u64) -> ModelState {
    let config = ModelConfig {
        num_dense: 2,
        table_rows: vec![20, 5],
        dim: 2,
        bottom: vec![2],
        top: vec![1],
        sparse_optimizer: Optimizer::Sgd { lr: 0.1 },
        dense_optimizer: Optimizer::Sgd { lr: 0.1 },
    };
    ModelState::new(&config, seed).unwrap()
}

/// The lease options of one cluster server slot: a replacement takes a live lease over.
fn slot() -> LeaseOptions {
    LeaseOptions {
        owner_key: Some("job 1 server 0".into()),
        ..LeaseOptions::new("server 0")
    }
}

/// A store that can hold back manifest PUTs, as a writer frozen between its lease check
/// and its PUT: the writer sees its commit succeed, and the manifest lands when the test
/// says. It can also stamp every manifest with a clock that runs backwards (each commit
/// looks a second older than the one before), so that no pick by wall clock can pass.
pub type Frozen = Hooked<Freezer>;

pub struct Freezer {
    hold_next: AtomicBool,
    held: Mutex<Vec<(String, Vec<u8>)>>,
    /// When nonzero, the `created_unix_ms` of the next manifest (then one second less).
    clock: AtomicU64,
}

impl Frozen {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Hooked {
            inner,
            hook: Freezer {
                hold_next: AtomicBool::new(false),
                held: Mutex::default(),
                clock: AtomicU64::new(0),
            },
        }
    }

    /// The next manifest PUT is held back (until [`Frozen::land`]).
    pub fn hold_next_manifest(&self) {
        self.hook.hold_next.store(true, Ordering::SeqCst);
    }

    /// Ids of the manifests held back, and no more holding.
    fn held_ids(&self) -> Vec<String> {
        self.hook.hold_next.store(false, Ordering::SeqCst);
        self.hook
            .held
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k["manifests/".len()..k.len() - ".man".len()].to_string())
            .collect()
    }

    /// Every held manifest lands now.
    pub fn land(&self) {
        for (key, bytes) in self.hook.held.lock().unwrap().drain(..) {
            self.inner.put(&key, &bytes).unwrap();
        }
    }

    /// Manifests written from now on claim to be created at `start`, then each one second
    /// earlier than the one before.
    pub fn clock_runs_backwards_from(&self, start: u64) {
        self.hook.clock.store(start, Ordering::SeqCst);
    }
}

impl WriteHook for Freezer {
    fn put(&self, inner: &dyn Store, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        if !key.starts_with("manifests/") {
            return inner.put(key, bytes);
        }
        let mut bytes = bytes.to_vec();
        let clock = self.clock.load(Ordering::SeqCst);
        if clock > 0 {
            let mut m = Manifest::decode(key, &bytes)?;
            m.created_unix_ms = self.clock.fetch_sub(1000, Ordering::SeqCst);
            bytes = m.encode()?;
        }
        if self.hold_next.swap(false, Ordering::SeqCst) {
            self.held.lock().unwrap().push((key.to_string(), bytes));
            return Ok(());
        }
        inner.put(key, &bytes)
    }
}

fn ids(ck: &Checkpoints) -> Vec<String> {
    ck.list().unwrap().into_iter().map(|m| m.id).collect()
}

/// Holder A writes; B takes the lease over, as a replacement does; A thaws, still
/// believing it holds the lease (its renewer has not run), and commits. The commit is
/// refused with [`CkptError::Fenced`], and nothing of it stays.
pub fn a_thawed_writers_commit_is_refused(store: Arc<dyn Store>) {
    let ck = Checkpoints::from_arc(store.clone());
    let fresh = BranchStart::Fresh { new_branch: false };
    let (a, _) = ck.start_writing(fresh, &slot()).unwrap();
    let first = a.write_full(&state(1), 1, json!({"by": "A"})).unwrap();
    let (b, started) = ck
        .start_writing(
            BranchStart::Resume {
                from: first.id.clone(),
            },
            &slot(),
        )
        .unwrap();
    let refused = a.write_full(&state(2), 2, json!({"by": "A"}));
    let e = refused.map(|m| m.id).unwrap_err();
    assert!(matches!(e, CkptError::Fenced(_)), "{e}");
    assert!(e.to_string().contains("lost its lease"), "{e}");
    assert_eq!(ids(&ck), vec![first.id.clone()]);
    let left = [
        store.list("data/").unwrap(),
        store.list("manifests/").unwrap(),
    ]
    .concat();
    assert!(
        !left.iter().any(|k| k.contains("000000000002")),
        "a refused commit leaves nothing behind: {left:?}"
    );
    // B keeps off A's branch: a late write of A's can never take one of B's names.
    assert!(
        started.new_branch && b.branch() != a.branch(),
        "{started:?}"
    );
    let second = b.write_full(&state(3), 2, json!({"by": "B"})).unwrap();
    let all = ck.list().unwrap();
    assert_eq!(Manifest::last_at_step(&all, 2).unwrap().id, second.id);
    assert_eq!(ck.restore(&second.id).unwrap().0, state(3));
    // Once refused, A stays refused.
    let again = a.write_full(&state(4), 3, json!({})).map(|m| m.id);
    assert!(matches!(again, Err(CkptError::Fenced(_))), "{again:?}");
}

#[test]
fn a_thawed_writers_late_commit_is_refused_on_a_local_directory() {
    let dir = tempfile::tempdir().unwrap();
    a_thawed_writers_commit_is_refused(Arc::new(LocalStore::open(dir.path()).unwrap()));
}

/// A froze after its lease check and before its PUT; B took over meanwhile and wrote its
/// fence record; A's manifest lands afterwards. It is never listed or restored, the
/// live writer's part wins its step, and `gc` deletes it.
pub fn a_manifest_that_slipped_past_a_takeover_is_never_restored(inner: Arc<dyn Store>) {
    let frozen = Arc::new(Frozen::new(inner));
    let ck = Checkpoints::from_arc(frozen.clone());
    let fresh = BranchStart::Fresh { new_branch: false };
    let (a, _) = ck.start_writing(fresh, &slot()).unwrap();
    let first = a.write_full(&state(1), 1, json!({})).unwrap();
    frozen.hold_next_manifest();
    let late = a.write_full(&state(2), 2, json!({})).unwrap();
    assert_eq!(frozen.held_ids(), vec![late.id.clone()]);
    let from = BranchStart::Resume {
        from: first.id.clone(),
    };
    let (b, _) = ck.start_writing(from, &slot()).unwrap();
    frozen.land();
    assert!(ck.store().get(&Manifest::key_for(&late.id)).is_ok());
    assert_eq!(ids(&ck), vec![first.id.clone()]);
    let e = ck.restore(&late.id).map(|_| ()).unwrap_err();
    assert!(matches!(e, CkptError::Fenced(_)), "{e}");
    let live = b.write_full(&state(3), 2, json!({})).unwrap();
    let all = ck.list().unwrap();
    assert_eq!(Manifest::last_at_step(&all, 2).unwrap().id, live.id);
    // Nor can anyone resume from it.
    let resume = ck.start_writing(
        BranchStart::Resume {
            from: late.id.clone(),
        },
        &slot(),
    );
    assert!(matches!(resume, Err(CkptError::Fenced(_))));
    let report = ck.gc(None).unwrap();
    assert_eq!(report.checkpoints, vec![late.id.clone()]);
    let left = [
        ck.store().list("data/").unwrap(),
        ck.store().list("manifests/").unwrap(),
    ]
    .concat();
    assert!(
        !left
            .iter()
            .any(|k| k.starts_with(&format!("data/{}/", late.id))
                || *k == Manifest::key_for(&late.id)),
        "a late commit's data is garbage at once: {left:?}"
    );
    assert!(ck.verify_all().unwrap().iter().all(|(_, r)| r.is_ok()));
}

#[test]
fn a_manifest_that_slipped_past_a_takeover_is_never_listed_or_restored() {
    let dir = tempfile::tempdir().unwrap();
    a_manifest_that_slipped_past_a_takeover_is_never_restored(Arc::new(
        LocalStore::open(dir.path()).unwrap(),
    ));
}

/// A cut at step 2 rolled back to step 1 and retaken on a new branch: the retaken part is
/// the one restored, though the abandoned one claims to be newer (its host's clock ran
/// ahead).
#[test]
fn a_rollback_restores_the_live_branch_whatever_the_clocks_say() {
    let dir = tempfile::tempdir().unwrap();
    let frozen = Arc::new(Frozen::new(Arc::new(LocalStore::open(dir.path()).unwrap())));
    let ck = Checkpoints::from_arc(frozen.clone());
    frozen.clock_runs_backwards_from(4_000_000_000_000);
    let options = LeaseOptions::new("trainer");
    let (writer, _) = ck
        .start_writing(BranchStart::Fresh { new_branch: false }, &options)
        .unwrap();
    let first = writer.write_full(&state(1), 1, json!({})).unwrap();
    let abandoned = writer.write_full(&state(2), 2, json!({})).unwrap();
    drop(writer);
    let from = BranchStart::Resume {
        from: first.id.clone(),
    };
    let (writer, started) = ck.start_writing(from, &options).unwrap();
    assert_eq!(started.forked_from.as_deref(), Some(first.id.as_str()));
    let live = writer.write_full(&state(3), 2, json!({})).unwrap();
    let all = ck.list().unwrap();
    let at = |id: &str| all.iter().find(|m| m.id == id).unwrap().created_unix_ms;
    assert!(at(&abandoned.id) > at(&live.id), "the clock ran backwards");
    assert_eq!(Manifest::last_at_step(&all, 2).unwrap().id, live.id);
    assert_eq!(all.last().unwrap().id, live.id, "listed as committed");
    assert_eq!(ck.latest().unwrap().unwrap().id, live.id);
    assert_eq!(ck.restore(&live.id).unwrap().0, state(3));
}

/// A flipped byte in a fence record is damage `verify` names, and the commits it judges
/// are neither restored nor listed as good (nor deleted) until it is repaired.
#[test]
fn a_damaged_fence_record_is_named_and_clears_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let options = LeaseOptions::new("trainer");
    let (writer, _) = ck
        .start_writing(BranchStart::Fresh { new_branch: false }, &options)
        .unwrap();
    let judged = writer.write_full(&state(1), 1, json!({})).unwrap();
    drop(writer);
    let from = BranchStart::Resume {
        from: judged.id.clone(),
    };
    let (writer, _) = ck.start_writing(from, &options).unwrap();
    let newer = writer.write_full(&state(2), 2, json!({})).unwrap();
    drop(writer);
    let key = ftrec_ckpt::fence::FenceRecord::key_for(2, 1);
    let good = ck.store().get(&key).unwrap();
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 1;
    ck.store().delete(&key).unwrap();
    ck.store().put(&key, &bad).unwrap();
    let (listed, damaged) = ck.list_lenient().unwrap();
    assert_eq!(
        listed.iter().map(|m| &m.id).collect::<Vec<_>>(),
        [&newer.id]
    );
    assert_eq!(damaged.len(), 1);
    assert_eq!(damaged[0].0, judged.id);
    assert!(damaged[0].1.to_string().contains(&key), "{}", damaged[0].1);
    assert!(ck.restore(&judged.id).is_err());
    let verdicts = ck.verify_all().unwrap();
    assert!(verdicts.iter().any(|(k, r)| *k == key && r.is_err()));
    ck.store().delete(&key).unwrap();
    ck.store().put(&key, &good).unwrap();
    assert_eq!(ids(&ck), vec![judged.id, newer.id]);
}

/// An operator deleted the lease object (counting starts over at generation 1): the next
/// writer's commits still order after every earlier one.
#[test]
fn a_deleted_lease_object_does_not_reorder_the_commits() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let options = LeaseOptions::new("trainer");
    let (writer, _) = ck
        .start_writing(BranchStart::Fresh { new_branch: false }, &options)
        .unwrap();
    let first = writer.write_full(&state(1), 1, json!({})).unwrap();
    writer.write_full(&state(2), 2, json!({})).unwrap();
    writer.write_full(&state(3), 3, json!({})).unwrap();
    drop(writer);
    ck.store().delete("locks/writer.lease").unwrap();
    let from = BranchStart::Resume { from: first.id };
    let (writer, _) = ck.start_writing(from, &options).unwrap();
    let live = writer.write_full(&state(4), 2, json!({})).unwrap();
    let all = ck.list().unwrap();
    assert_eq!(Manifest::last_at_step(&all, 2).unwrap().id, live.id);
}

#[derive(Clone, Debug)]
enum Op {
    /// Holder `h` (re)starts writing, taking the lease: resuming from the newest
    /// checkpoint (0), or from the k-th listed one (a rollback).
    Take(usize, u8),
    /// Holder `h` commits its next step, its manifest PUT held back if `true`.
    Commit(usize, bool),
    /// Every held manifest lands.
    Land,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0usize..2, 0u8..4).prop_map(|(h, k)| Op::Take(h, k)),
        4 => (0usize..2, proptest::bool::weighted(0.3)).prop_map(|(h, held)| Op::Commit(h, held)),
        1 => Just(Op::Land),
    ]
}

struct Commit {
    id: String,
    step: u64,
    seed: u64,
    /// Takes of the lease before this commit's lease check.
    takes_before: u64,
    landed: bool,
    /// Landed before anyone took the lease over.
    live: bool,
}

/// Two holders of one slot, each a process that can freeze with a manifest PUT in flight.
struct Model {
    frozen: Arc<Frozen>,
    ck: Checkpoints,
    handles: [Option<Checkpoints>; 2],
    next_step: [u64; 2],
    pending: [bool; 2],
    current: Option<usize>,
    takes: u64,
    commits: Vec<Commit>,
}

impl Model {
    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            // A frozen process does nothing until it thaws.
            Op::Take(h, _) | Op::Commit(h, _) if self.pending[h] => {}
            Op::Take(h, k) => {
                self.handles[h] = None;
                let listed = self.ck.list().unwrap();
                let from = match k {
                    _ if listed.is_empty() => None,
                    0 => listed
                        .iter()
                        .max_by(|a, b| (a.step, a.commit_order()).cmp(&(b.step, b.commit_order()))),
                    k => listed.get(k as usize % listed.len()),
                };
                let start = match from {
                    Some(m) => BranchStart::Resume { from: m.id.clone() },
                    None => BranchStart::Fresh { new_branch: false },
                };
                let (w, _) = self.ck.start_writing(start, &slot()).unwrap();
                self.handles[h] = Some(w);
                self.next_step[h] = from.map_or(1, |m| m.step + 1);
                self.current = Some(h);
                self.takes += 1;
            }
            Op::Commit(h, held) => {
                let Some(w) = &self.handles[h] else {
                    return Ok(());
                };
                if held {
                    self.frozen.hold_next_manifest();
                }
                let seed = self.commits.len() as u64 + 10;
                let step = self.next_step[h];
                let result = w.write_full(&state(seed), step, json!({}));
                let held_ids = self.frozen.held_ids();
                if self.current != Some(h) {
                    let e = result.map(|m| m.id);
                    prop_assert!(matches!(e, Err(CkptError::Fenced(_))), "{e:?}");
                    return Ok(());
                }
                let m = result.unwrap();
                self.next_step[h] += 1;
                self.pending[h] = held;
                prop_assert_eq!(held_ids.contains(&m.id), held);
                self.commits.push(Commit {
                    id: m.id,
                    step,
                    seed,
                    takes_before: self.takes,
                    landed: !held,
                    live: !held,
                });
            }
            Op::Land => {
                self.frozen.land();
                for c in self.commits.iter_mut().filter(|c| !c.landed) {
                    c.landed = true;
                    c.live = c.takes_before == self.takes;
                }
                self.pending = [false; 2];
            }
        }
        self.check()
    }

    /// Listed: exactly the commits that landed before a takeover. At each step, the one
    /// committed last of those. The others are refused by restore.
    fn check(&self) -> Result<(), TestCaseError> {
        let all = self.ck.list().unwrap();
        let mut listed: Vec<&str> = all.iter().map(|m| m.id.as_str()).collect();
        let mut live: Vec<&Commit> = self.commits.iter().filter(|c| c.live).collect();
        listed.sort_unstable();
        let mut want: Vec<&str> = live.iter().map(|c| c.id.as_str()).collect();
        want.sort_unstable();
        prop_assert_eq!(listed, want);
        // Commits are numbered in the order their lease checks passed.
        live.reverse();
        for c in &live {
            let last = live.iter().find(|o| o.step == c.step).unwrap();
            prop_assert_eq!(&Manifest::last_at_step(&all, c.step).unwrap().id, &last.id);
        }
        for c in self.commits.iter().filter(|c| c.landed && !c.live) {
            let e = self.ck.restore(&c.id).map(|_| ());
            prop_assert!(matches!(e, Err(CkptError::Fenced(_))), "{}: {e:?}", c.id);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// For any interleaving of two holders' takeovers, commits, freezes and thaws (with a
    /// clock that runs backwards), the location lists and restores exactly the commits that
    /// landed before a takeover, and at every step the one committed last.
    #[test]
    fn any_interleaving_of_two_holders_lists_and_restores_only_live_commits(
        ops in proptest::collection::vec(op(), 1..28)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let frozen = Arc::new(Frozen::new(Arc::new(LocalStore::open(dir.path()).unwrap())));
        frozen.clock_runs_backwards_from(4_000_000_000_000);
        let mut model = Model {
            ck: Checkpoints::from_arc(frozen.clone()),
            frozen,
            handles: [None, None],
            next_step: [1, 1],
            pending: [false; 2],
            current: None,
            takes: 0,
            commits: Vec::new(),
        };
        for op in &ops {
            model.apply(op)?;
        }
        model.frozen.land();
        for c in model.commits.iter().filter(|c| c.live) {
            prop_assert_eq!(model.ck.restore(&c.id).unwrap().0, state(c.seed));
        }
    }
}
