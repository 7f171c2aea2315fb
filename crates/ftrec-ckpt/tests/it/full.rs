use ftrec_testkit::model::state;

use ftrec_ckpt::{Checkpoints, CkptError, LocalStore};

fn open(dir: &std::path::Path) -> Checkpoints {
    Checkpoints::new(Box::new(LocalStore::open(dir).unwrap()))
}

#[test]
fn full_checkpoint_restores_bit_identical_state_and_trainer_meta() {
    let dir = tempfile::tempdir().unwrap();
    let ck = open(dir.path());
    let a = state(1);
    let m = ck
        .write_full(&a, 10, serde_json::json!({"position": 123}))
        .unwrap();
    assert!(
        m.chunks.iter().filter(|c| c.table == Some(0)).count() > 1,
        "table 0 spans chunks"
    );
    let b = state(2);
    ck.write_full(&b, 20, serde_json::json!({"position": 456}))
        .unwrap();
    let (ra, ma) = ck.restore(&m.id).unwrap();
    assert_eq!(ra, a);
    assert_eq!(ra.digest(), a.digest());
    assert_eq!(ma.trainer["position"], 123);
    assert_eq!(ck.latest().unwrap().unwrap().step, 20);
    assert_eq!(ck.list().unwrap().len(), 2);
    let (rb, _) = ck.restore(&ck.latest().unwrap().unwrap().id).unwrap();
    assert_eq!(rb, b);
}

#[test]
fn damage_to_any_file_kind_is_reported_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let ck = open(dir.path());
    let m = ck
        .write_full(&state(3), 5, serde_json::Value::Null)
        .unwrap();
    let files: Vec<String> = std::iter::once(format!("manifests/{}.man", m.id))
        .chain(std::iter::once(m.dense.key.clone()))
        .chain(m.chunks.iter().map(|c| c.key.clone()))
        .collect();
    for key in &files {
        let path = dir.path().join(key);
        let good = std::fs::read(&path).unwrap();
        for pos in [0, 39, good.len() / 2, good.len() - 1] {
            let mut bad = good.clone();
            bad[pos] ^= 0x08;
            std::fs::write(&path, &bad).unwrap();
            let e = ck.restore(&m.id).map(|_| ()).unwrap_err().to_string();
            let name = key.rsplit('/').next().unwrap();
            assert!(e.contains(name), "{key} flip at {pos}: {e}");
            assert!(ck.verify(&m.id).is_err());
        }
        std::fs::write(&path, &good[..good.len() - 3]).unwrap();
        assert!(ck.restore(&m.id).is_err(), "{key} truncated");
        std::fs::write(&path, &good).unwrap();
        ck.verify(&m.id).unwrap();
    }
}

#[test]
fn checkpoint_without_manifest_does_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let ck = open(dir.path());
    ck.write_full(&state(4), 1, serde_json::Value::Null)
        .unwrap();
    let m2 = ck
        .write_full(&state(5), 2, serde_json::Value::Null)
        .unwrap();
    // A crash before the commit: data written, manifest not.
    std::fs::remove_file(dir.path().join(format!("manifests/{}.man", m2.id))).unwrap();
    assert_eq!(ck.latest().unwrap().unwrap().step, 1);
    assert!(matches!(ck.restore(&m2.id), Err(CkptError::NotFound(_))));
}

#[test]
fn a_consistent_but_wrong_manifest_cannot_double_cover_rows() {
    let dir = tempfile::tempdir().unwrap();
    let ck = open(dir.path());
    let mut m = ck
        .write_full(&state(6), 3, serde_json::Value::Null)
        .unwrap();
    let good = m.chunks.clone();
    let first = m.chunks.iter().position(|c| c.table == Some(0)).unwrap();
    // Simulated tampering: the store itself never replaces a committed object.
    let rewrite = |m: &ftrec_ckpt::Manifest| {
        let key = ftrec_ckpt::Manifest::key_for(&m.id);
        ck.store().delete(&key).unwrap();
        ck.store().put(&key, &m.encode().unwrap()).unwrap();
    };
    // One chunk listed twice and its neighbour dropped: the row counts no longer add up.
    m.chunks[first + 1] = m.chunks[first].clone();
    rewrite(&m);
    let e = ck.restore(&m.id).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("table 0 has") && e.contains("rows"), "{e}");
    // Every chunk listed once, counts intact, but two swapped: rows land out of order.
    m.chunks = good;
    m.chunks.swap(first, first + 1);
    rewrite(&m);
    let e = ck.restore(&m.id).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("out of order"), "{e}");
}

#[test]
fn gc_keeps_the_lineage_of_retained_checkpoints_and_removes_crash_leftovers() {
    use ftrec_ckpt::{CheckpointKind, Checkpointer, Strategy};
    let dir = tempfile::tempdir().unwrap();
    let mut ck = Checkpointer::new(open(dir.path()), Strategy::NaiveIncremental, 3, 3).unwrap();
    let mut s = state(7);
    let mut ids = Vec::new();
    for step in 1..=5u64 {
        s.set_row(1, step % 17, &vec![step as f32; s.tables()[1].stride()])
            .unwrap();
        ck.track(1, &[(step % 17) as u32]);
        ids.push(
            ck.checkpoint(&s, step * 10, serde_json::Value::Null)
                .unwrap()
                .id,
        );
    }
    // kinds: full, incr, incr, full, incr
    let store = ck.checkpoints();
    // A crashed write before the newest commit, and one that may be in progress.
    store
        .store()
        .put("data/000000000035-incr/t0001-000000.chunk", b"x")
        .unwrap();
    store
        .store()
        .put("data/000000000099-incr/t0001-000000.chunk", b"y")
        .unwrap();
    let before = store.restore(&ids[4]).unwrap().0;
    // While a writer holds the location, fresh uncommitted data may be its write in
    // progress, whatever its step: kept.
    let writer = ftrec_ckpt::lease::Lease::acquire(
        std::sync::Arc::new(ftrec_ckpt::LocalStore::open(dir.path()).unwrap()),
        ftrec_ckpt::lease::WRITER,
        &ftrec_ckpt::lease::LeaseOptions::new("a live trainer"),
    )
    .unwrap();
    let report = store.gc(Some(1)).unwrap();
    assert_eq!(
        report.checkpoints,
        vec![ids[0].clone(), ids[1].clone(), ids[2].clone()]
    );
    assert_eq!(report.kept_in_flight, 2, "{report:?}");
    let keys = store.store().list("data/").unwrap();
    assert!(keys.iter().any(|k| k.contains("000000000035")));
    assert!(keys.iter().any(|k| k.contains("000000000099")));
    // Older than the abandonment age: gone, even below the newest step or above it.
    let aged = ftrec_ckpt::GcOptions {
        keep: Some(1),
        abandoned_after: std::time::Duration::ZERO,
        ..Default::default()
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    let report = store.gc_with(&aged).unwrap();
    assert_eq!(report.files, 2, "{report:?}");
    drop(writer);
    let left: Vec<String> = store.list().unwrap().into_iter().map(|m| m.id).collect();
    assert_eq!(
        left,
        vec![ids[3].clone(), ids[4].clone()],
        "the newest and its full parent"
    );
    assert_eq!(store.manifest(&ids[3]).unwrap().kind, CheckpointKind::Full);
    assert_eq!(store.restore(&ids[4]).unwrap().0, before);
    let keys = store.store().list("data/").unwrap();
    assert!(!keys.iter().any(|k| k.contains("000000000035")));
    assert!(!keys.iter().any(|k| k.contains("000000000099")));
    assert!(!keys.iter().any(|k| k.contains(&ids[0])));
    // With no live writer, uncommitted data is abandoned at once.
    store
        .store()
        .put("data/000000000077-incr/t0001-000000.chunk", b"z")
        .unwrap();
    assert_eq!(store.gc(Some(1)).unwrap().files, 1);
    assert!(store.gc(Some(0)).is_err(), "keep 0 would delete everything");
}

#[test]
fn damage_to_incrcp_lists_chunks_and_bundles_is_reported_with_its_name() {
    use ftrec_ckpt::{Checkpointer, Strategy};
    let dir = tempfile::tempdir().unwrap();
    let mut ck =
        Checkpointer::with_threshold(open(dir.path()), Strategy::Incrcp, 0, 3, 0.0).unwrap();
    let mut s = state(8);
    let mut last = None;
    for step in 1..=4u64 {
        // Rows 0..300 rewritten every time, so every round extracts into bundles.
        let rows: Vec<u32> = (0..300)
            .chain(1000 * step as u32..1000 * step as u32 + 50)
            .collect();
        for &r in &rows {
            s.set_row(0, r as u64, &vec![step as f32; s.tables()[0].stride()])
                .unwrap();
        }
        ck.track(0, &rows);
        last = Some(ck.checkpoint(&s, step, serde_json::Value::Null).unwrap());
    }
    ck.flush().unwrap();
    let m = last.unwrap();
    let checkpoints = ck.checkpoints();
    let (got, _) = checkpoints.restore(&m.id).unwrap();
    assert_eq!(got, s);
    let mut files: Vec<String> = walk(dir.path())
        .into_iter()
        .filter(|k| k.starts_with("incrcp/"))
        .collect();
    files.sort();
    for kind in [".cl", ".chunk", "-row0.bundle", "-row1.bundle"] {
        assert!(
            files.iter().any(|f| f.ends_with(kind)),
            "no {kind} in {files:?}"
        );
    }
    for key in &files {
        let path = dir.path().join(key);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 0x10;
        std::fs::write(&path, &bad).unwrap();
        // A file outside the newest rectangle may be read only by older checkpoints.
        let damaged: Vec<String> = checkpoints
            .list()
            .unwrap()
            .iter()
            .filter_map(|m| checkpoints.restore(&m.id).err().map(|e| e.to_string()))
            .collect();
        let name = key.rsplit('/').next().unwrap();
        assert!(!damaged.is_empty(), "{key}: a flipped byte went unnoticed");
        assert!(
            damaged.iter().all(|e| e.contains(name)),
            "{key}: {damaged:?}"
        );
        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        assert!(
            checkpoints
                .list()
                .unwrap()
                .iter()
                .any(|m| checkpoints.verify(&m.id).is_err()),
            "{key} truncated"
        );
        std::fs::write(&path, &good).unwrap();
    }
    for m in checkpoints.list().unwrap() {
        checkpoints.verify(&m.id).unwrap();
    }
}

fn walk(root: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out
}
