//! Writes that fail: a full disk halfway through a data file, a commit whose outcome is
//! unclear, a damaged ancestor, one damaged manifest among good ones. Nothing committed is
//! lost, and nothing a failed write made is left behind.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ftrec_testkit::model::state;

use ftrec_ckpt::{CheckpointKind, Checkpoints, CkptError, LocalStore, Store};

use crate::hooked::{Hooked, WriteHook};

/// A local store that fails on command, the way a full disk or a lost reply would.
type Faulty = Hooked<Failures>;

struct Failures {
    /// The n-th data file written from now on (1-based) gets half its bytes, then ENOSPC.
    fail_part: AtomicUsize,
    /// Manifests are written, then the call reports an error anyway.
    fail_after_manifest: std::sync::atomic::AtomicBool,
}

impl WriteHook for Failures {
    fn put(&self, inner: &dyn Store, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        inner.put(key, bytes)?;
        if key.starts_with("manifests/") && self.fail_after_manifest.load(Ordering::SeqCst) {
            return Err(CkptError::Io {
                path: key.into(),
                error: std::io::Error::other("fsync of the directory failed"),
            });
        }
        Ok(())
    }
    fn put_part(&self, inner: &dyn Store, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        if self.fail_part.fetch_sub(1, Ordering::SeqCst) == 1 {
            inner.put_part(key, &bytes[..bytes.len() / 2])?;
            return Err(CkptError::Io {
                path: key.into(),
                error: std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left"),
            });
        }
        inner.put_part(key, bytes)
    }
}

fn faulty(dir: &Path) -> (Checkpoints, Arc<Faulty>) {
    let store = Arc::new(Faulty {
        inner: Arc::new(LocalStore::open(dir).unwrap()),
        hook: Failures {
            fail_part: AtomicUsize::new(0),
            fail_after_manifest: false.into(),
        },
    });
    (Checkpoints::from_arc(store.clone()), store)
}

fn data_dirs(ck: &Checkpoints) -> Vec<String> {
    let mut ids: Vec<String> = ck
        .store()
        .list("data/")
        .unwrap()
        .iter()
        .filter_map(|k| k.split('/').nth(1).map(str::to_string))
        .collect();
    ids.dedup();
    ids
}

#[test]
fn a_write_that_runs_out_of_space_removes_every_file_it_made() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, store) = faulty(dir.path());
    let a = state(1);
    let first = ck.write_full(&a, 10, serde_json::json!({})).unwrap();
    // The second data file of the next checkpoint gets half written, then ENOSPC.
    store.hook.fail_part.store(2, Ordering::SeqCst);
    let e = ck
        .write_full(&state(2), 20, serde_json::json!({}))
        .unwrap_err();
    assert!(e.to_string().contains("no space left"), "{e}");
    assert_eq!(
        data_dirs(&ck),
        vec![first.id.clone()],
        "the half file is gone too"
    );
    assert_eq!(ck.list().unwrap().len(), 1);
    ck.verify(&first.id).unwrap();
    assert_eq!(ck.restore(&first.id).unwrap().0, a);
}

#[test]
fn a_commit_whose_outcome_is_unclear_keeps_its_files_when_the_manifest_landed() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, store) = faulty(dir.path());
    let a = state(3);
    store.hook.fail_after_manifest.store(true, Ordering::SeqCst);
    let e = ck.write_full(&a, 10, serde_json::json!({})).unwrap_err();
    assert!(e.to_string().contains("fsync"), "{e}");
    // The manifest is there, so the checkpoint is committed: its data must be too.
    let listed = ck.list().unwrap();
    assert_eq!(listed.len(), 1);
    ck.verify(&listed[0].id).unwrap();
    assert_eq!(ck.restore(&listed[0].id).unwrap().0, a);
}

#[test]
fn verify_of_a_delta_reports_its_damaged_ancestor() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, _) = faulty(dir.path());
    let mut s = state(4);
    let base = ck.write_full(&s, 10, serde_json::json!({})).unwrap();
    s.dense.step += 1;
    let rows = vec![vec![3, 9], vec![1], vec![]];
    let delta = ck
        .write(
            &s,
            20,
            CheckpointKind::Differential,
            Some(&rows),
            vec![base.id.clone()],
            serde_json::json!({}),
        )
        .unwrap();
    ck.verify(&delta.id).unwrap();
    // Flip one byte in the middle of the base's first chunk.
    let key = &base.chunks[0].key;
    let path = dir.path().join(key);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let e = ck.verify(&delta.id).unwrap_err().to_string();
    assert!(
        e.contains(&format!("ancestor {} is damaged", base.id)),
        "{e}"
    );
}

#[test]
fn one_damaged_manifest_is_reported_and_the_rest_still_list_and_collect() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, _) = faulty(dir.path());
    let mut ids = Vec::new();
    for step in [10, 20, 30] {
        ids.push(
            ck.write_full(&state(step), step, serde_json::json!({}))
                .unwrap()
                .id,
        );
    }
    let damaged = dir.path().join(format!("manifests/{}.man", ids[0]));
    std::fs::write(&damaged, b"garbage").unwrap();
    let (good, bad) = ck.list_lenient().unwrap();
    assert_eq!(good.len(), 2);
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].0, ids[0]);
    assert_eq!(ck.list_readable().unwrap().len(), 2);
    // gc keeps the damaged one's data (it may be repaired) and thins the rest.
    let report = ck.gc(Some(1)).unwrap();
    assert_eq!(report.checkpoints, vec![ids[1].clone()]);
    assert!(data_dirs(&ck).contains(&ids[0]));
    assert!(!data_dirs(&ck).contains(&ids[1]));
}
