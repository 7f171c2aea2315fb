use ftrec_data::generate::{GenConfig, OutputFormat, generate};
use ftrec_data::hashing::row_for;
use ftrec_data::{Dataset, DatasetWriter, Record, convert, criteo};
use ftrec_model::Batch;
use proptest::prelude::*;

fn record_strategy(nd: usize, ns: usize, multi: bool) -> impl Strategy<Value = Record> {
    let max_bag = if multi { 4 } else { 1 };
    let min_bag = if multi { 0 } else { 1 };
    (
        any::<bool>(),
        proptest::collection::vec(-1e6f32..1e6, nd),
        proptest::collection::vec(
            proptest::collection::vec(any::<u32>(), min_bag..=max_bag),
            ns,
        ),
    )
        .prop_map(|(label, dense, bags)| {
            let mut r = Record::default();
            r.clear();
            r.label = label as u8 as f32;
            r.dense = dense;
            for bag in bags {
                r.ids.extend(bag);
                r.end_feature();
            }
            r
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn binary_round_trip(
        multi in any::<bool>(),
        recs in (any::<bool>()).prop_flat_map(|m| proptest::collection::vec(record_strategy(3, 4, m), 1..40).prop_map(move |r| (m, r))),
    ) {
        let (multi_data, recs) = recs;
        let multi = multi || multi_data;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.ftrd");
        let mut w = DatasetWriter::create(&path, 3, 4, multi).unwrap();
        for r in &recs {
            w.push(r).unwrap();
        }
        prop_assert_eq!(w.finish().unwrap(), recs.len() as u64);
        let ds = Dataset::open(&path).unwrap();
        prop_assert_eq!(ds.len(), recs.len());
        let mut got = Record::default();
        for (i, r) in recs.iter().enumerate() {
            ds.record(i, &mut got);
            prop_assert_eq!(&got, r);
        }
        let rows = [7u32, 2, 1000, 5];
        let mut batch = Batch::with_tables(4);
        ds.fill_batch(0, recs.len(), &rows, &mut batch).unwrap();
        for (i, r) in recs.iter().enumerate() {
            prop_assert_eq!(batch.labels[i], r.label);
            for (t, &table_rows) in rows.iter().enumerate() {
                let want: Vec<u32> = r.feature(t).iter().map(|&id| row_for(id, table_rows)).collect();
                prop_assert_eq!(batch.sparse[t].bag(i), &want[..]);
            }
        }
    }
}

fn small_dataset(dir: &std::path::Path, multi: bool) -> std::path::PathBuf {
    let path = dir.join("d.ftrd");
    let mut w = DatasetWriter::create(&path, 2, 2, multi).unwrap();
    let mut r = Record::default();
    for i in 0..50u32 {
        r.clear();
        r.label = (i % 2) as f32;
        r.dense = vec![i as f32, 1.0];
        r.ids.push(i);
        r.end_feature();
        r.ids.push(i * 7);
        r.end_feature();
        w.push(&r).unwrap();
    }
    w.finish().unwrap();
    path
}

#[test]
fn every_flipped_byte_and_truncation_is_detected() {
    for multi in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = small_dataset(dir.path(), multi);
        let good = std::fs::read(&path).unwrap();
        for pos in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[pos] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let err = Dataset::open(&path).expect_err(&format!("flip at {pos} undetected"));
            assert!(err.to_string().contains("d.ftrd"), "{err}");
        }
        for len in [0, 10, 64, good.len() - 1, good.len() / 2] {
            std::fs::write(&path, &good[..len]).unwrap();
            let err = Dataset::open(&path).unwrap_err().to_string();
            assert!(
                err.contains("truncated") || err.contains("length"),
                "len {len}: {err}"
            );
        }
    }
}

#[test]
fn generator_is_deterministic_and_tsv_converts_to_the_same_binary() {
    let cfg = GenConfig {
        rows: 20_000,
        ..GenConfig::criteo(20_000, 3, 0.001)
    };
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let t = tempfile::tempdir().unwrap();
    let ra = generate(&cfg, a.path(), OutputFormat::Binary, |_| {}).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let rb = pool.install(|| generate(&cfg, b.path(), OutputFormat::Binary, |_| {}).unwrap());
    assert_eq!(ra, rb);
    assert!(
        ra.teacher_auc > 0.7 && ra.teacher_auc < 0.95,
        "teacher auc {}",
        ra.teacher_auc
    );
    assert!(
        ra.positive_rate > 0.1 && ra.positive_rate < 0.5,
        "ctr {} auc {}",
        ra.positive_rate,
        ra.teacher_auc
    );
    for f in ["train.ftrd", "test.ftrd"] {
        assert_eq!(
            std::fs::read(a.path().join(f)).unwrap(),
            std::fs::read(b.path().join(f)).unwrap()
        );
    }
    generate(&cfg, t.path(), OutputFormat::CriteoTsv, |_| {}).unwrap();
    let out = tempfile::tempdir().unwrap();
    let train_txt = t.path().join("train.txt");
    let report = convert::convert(
        &convert::ConvertOptions {
            inputs: vec![train_txt],
            schema: criteo::schema(),
            out_dir: out.path().to_path_buf(),
            test_fraction: 0.0,
            skip_bad_lines: false,
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(report.train_samples, ra.train_samples);
    assert_eq!(
        std::fs::read(out.path().join("train.ftrd")).unwrap(),
        std::fs::read(a.path().join("train.ftrd")).unwrap(),
        "Criteo TSV -> binary must reproduce the generator's binary exactly"
    );
}
