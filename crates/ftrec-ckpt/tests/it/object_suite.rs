//! The checkpoint engine's contract with an object store, run against each real server the
//! tests start (moto for S3, Azurite for Azure): store operations,
//! conditional writes and the fencing built on them, every strategy restoring every
//! checkpoint exactly, and damage found and named by URL.

use ftrec_ckpt::{Checkpointer, Checkpoints, ObjectStoreBackend, Store, Strategy};
use ftrec_model::{ModelConfig, ModelState, Optimizer};

fn state(seed: u64) -> ModelState {
    let config = ModelConfig {
        num_dense: 2,
        table_rows: vec![30_000, 9],
        dim: 8,
        bottom: vec![8],
        top: vec![4, 1],
        sparse_optimizer: Optimizer::RowwiseAdagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.0,
        },
        dense_optimizer: Optimizer::Sgd { lr: 0.1 },
    };
    ModelState::new(&config, seed).unwrap()
}

/// Runs the suite on the bucket (or container) `root`, e.g. `s3://ckpt`; `open` opens a
/// URL under it against the test's server.
pub fn run(root: &str, open: impl Fn(&str) -> ObjectStoreBackend) {
    let store = open(&format!("{root}/run-1"));
    store.put("a/b", b"hello").unwrap();
    assert_eq!(store.get("a/b").unwrap(), b"hello");
    assert_eq!(store.get_range("a/b", 1, 3).unwrap(), b"ell");
    assert_eq!(store.list("a/").unwrap(), vec!["a/b"]);
    store.delete("a/b").unwrap();
    assert!(matches!(
        store.get("a/b"),
        Err(ftrec_ckpt::CkptError::NotFound(_))
    ));
    lease_contract(open(&format!("{root}/leases")));
    // Commits fenced by the lease's compare-and-swap on this backend.
    crate::fencing::a_thawed_writers_commit_is_refused(std::sync::Arc::new(open(&format!(
        "{root}/fencing-refused"
    ))));
    crate::fencing::a_manifest_that_slipped_past_a_takeover_is_never_restored(std::sync::Arc::new(
        open(&format!("{root}/fencing-late")),
    ));
    a_crash_between_upload_and_manifest_loses_nothing(std::sync::Arc::new(open(&format!(
        "{root}/crash"
    ))));

    for (i, strategy) in [
        Strategy::Full,
        Strategy::Differential,
        Strategy::NaiveIncremental,
        Strategy::Incrcp,
    ]
    .into_iter()
    .enumerate()
    {
        let url = format!("{root}/strategy-{i}");
        let mut ck =
            Checkpointer::new(Checkpoints::new(Box::new(open(&url))), strategy, 3, 2).unwrap();
        let mut s = state(i as u64);
        let mut expected = Vec::new();
        for step in 1..=5u64 {
            let rows: Vec<u32> = (0..200)
                .map(|k| (k * 7919 + step as u32 * 31) % 30_000)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            for &r in &rows {
                let stride = s.tables()[0].stride();
                s.set_row(0, r as u64, &vec![step as f32 + r as f32; stride])
                    .unwrap();
            }
            s.dense.step = step;
            ck.track(0, &rows);
            let m = ck
                .checkpoint(&s, step, serde_json::json!({"step": step}))
                .unwrap();
            expected.push((m.id, s.clone()));
        }
        ck.flush().unwrap();
        let reader = Checkpoints::new(Box::new(open(&url)));
        assert_eq!(reader.list().unwrap().len(), 5);
        for (id, want) in &expected {
            let (got, _) = reader.restore(id).unwrap();
            assert!(
                &got == want,
                "{strategy:?}: {id} restored a different state"
            );
            reader.verify(id).unwrap();
        }
    }

    // Damage over S3 is found and named by URL.
    let ck = Checkpoints::new(Box::new(open(&format!("{root}/damage"))));
    let m = ck
        .write_full(&state(9), 1, serde_json::Value::Null)
        .unwrap();
    let store = open(&format!("{root}/damage"));
    let mut bytes = store.get(&m.chunks[0].key).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    // The store refuses to replace a committed object; damage comes from outside.
    assert!(matches!(
        store.put(&m.chunks[0].key, &bytes),
        Err(ftrec_ckpt::CkptError::AlreadyExists { .. })
    ));
    store.delete(&m.chunks[0].key).unwrap();
    store.put(&m.chunks[0].key, &bytes).unwrap();
    let e = ck.restore(&m.id).map(|_| ()).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{root}/damage/")) && e.contains(&m.chunks[0].key),
        "{e}"
    );
}

/// A writer that dies between uploading a checkpoint's data and its manifest (its
/// manifest PUT never lands): the checkpoint before stays the newest and restores, and `gc`
/// with no writer left deletes what the dead write uploaded.
fn a_crash_between_upload_and_manifest_loses_nothing(store: std::sync::Arc<dyn Store>) {
    let frozen = std::sync::Arc::new(crate::fencing::Frozen::new(store.clone()));
    let writer = Checkpoints::from_arc(frozen.clone());
    let kept = state(1);
    let first = writer
        .write_full(&kept, 1, serde_json::Value::Null)
        .unwrap();
    frozen.hold_next_manifest();
    let lost = writer
        .write_full(&state(2), 2, serde_json::Value::Null)
        .unwrap();
    drop(writer);
    let uploaded = &lost.chunks[0].key;
    assert!(store.get(uploaded).is_ok(), "the data was uploaded");
    let reader = Checkpoints::from_arc(store.clone());
    let ids: Vec<String> = reader.list().unwrap().into_iter().map(|m| m.id).collect();
    assert_eq!(ids, std::slice::from_ref(&first.id));
    let (restored, _) = reader.restore(&first.id).unwrap();
    assert!(
        restored == kept,
        "the committed checkpoint restores exactly"
    );
    let report = reader.gc(None).unwrap();
    assert!(report.files > 0, "{report:?}");
    assert!(matches!(
        store.get(uploaded),
        Err(ftrec_ckpt::CkptError::NotFound(_))
    ));
    let (restored, _) = reader.restore(&first.id).unwrap();
    assert!(restored == kept, "gc kept the committed checkpoint");
}

/// Conditional writes on the real server: a create never replaces, a compare-and-swap
/// with a stale version fails, and so a live lease excludes a second holder.
fn lease_contract(store: ObjectStoreBackend) {
    use ftrec_ckpt::CkptError;
    use ftrec_ckpt::lease::{Lease, LeaseOptions, WRITER};
    store.put("once", b"first").unwrap();
    assert!(matches!(
        store.put("once", b"second"),
        Err(CkptError::AlreadyExists { .. })
    ));
    assert_eq!(store.get("once").unwrap(), b"first");
    let v1 = store.put_versioned("cas", b"a", None).unwrap();
    assert!(matches!(
        store.put_versioned("cas", b"b", None),
        Err(CkptError::Conflict(_))
    ));
    let v2 = store.put_versioned("cas", b"bb", Some(&v1)).unwrap();
    assert!(matches!(
        store.put_versioned("cas", b"c", Some(&v1)),
        Err(CkptError::Conflict(_))
    ));
    assert_eq!(store.get_versioned("cas").unwrap().unwrap().1, v2);
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(store);
    let held = Lease::acquire(store.clone(), WRITER, &LeaseOptions::new("first")).unwrap();
    let e = Lease::acquire(store.clone(), WRITER, &LeaseOptions::new("second"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("first"), "{e}");
    drop(held);
    Lease::acquire(store, WRITER, &LeaseOptions::new("second")).unwrap();
}
