//! `data convert` on the inputs people have: compressed day files, small files, files
//! that are mostly wrong, and output directories that already hold a dataset.

use std::io::Write;
use std::path::{Path, PathBuf};

use ftrec_data::convert::{ConvertOptions, ConvertReport, convert, expand_inputs, is_test_sample};
use ftrec_data::{Dataset, META_FILE, TEST_FILE, TRAIN_FILE, criteo};

fn criteo_lines(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{}{}{}\n",
                i % 2,
                format!("\t{i}").repeat(13),
                format!("\t{:08x}", i * 7919).repeat(26)
            )
        })
        .collect()
}

fn options(inputs: Vec<PathBuf>, out: &Path, fraction: f64, skip: bool) -> ConvertOptions {
    ConvertOptions {
        inputs,
        schema: criteo::schema(),
        out_dir: out.to_path_buf(),
        test_fraction: fraction,
        skip_bad_lines: skip,
    }
}

fn run(input: &Path, out: &Path, fraction: f64, skip: bool) -> Result<ConvertReport, String> {
    convert(
        &options(vec![input.to_path_buf()], out, fraction, skip),
        |_| {},
    )
    .map_err(|e| e.to_string())
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect()
}

#[test]
fn the_split_is_exact_for_any_size() {
    for fraction in [0.0, 0.1, 0.25, 0.5, 0.333, 0.9] {
        let mut test = 0u64;
        for n in 1..=3000u64 {
            test += is_test_sample(n - 1, fraction) as u64;
            assert_eq!(
                test,
                (n as f64 * fraction).floor() as u64,
                "{n} at {fraction}"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("small");
    for (lines, fraction, train, test) in [(100, 0.1, 90, 10), (500, 0.5, 250, 250)] {
        std::fs::write(&input, criteo_lines(lines)).unwrap();
        let r = run(&input, &dir.path().join("out"), fraction, false).unwrap();
        assert_eq!((r.train_samples, r.test_samples), (train, test), "{lines}");
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    }
    // Too few lines for a test sample: converted, and said loudly.
    std::fs::write(&input, criteo_lines(5)).unwrap();
    let r = run(&input, &dir.path().join("out"), 0.1, false).unwrap();
    assert_eq!((r.train_samples, r.test_samples), (5, 0));
    assert!(
        r.warnings.iter().any(|w| w.contains("test.ftrd is empty")),
        "{:?}",
        r.warnings
    );
}

#[test]
fn gzip_and_zstd_inputs_convert_like_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let text = criteo_lines(300);
    let plain = dir.path().join("day_0");
    std::fs::write(&plain, &text).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(text.as_bytes()).unwrap();
    // Named without .gz: detected by its magic bytes.
    let gzipped = dir.path().join("day_1");
    std::fs::write(&gzipped, gz.finish().unwrap()).unwrap();
    let zstd = dir.path().join("day_2.zst");
    std::fs::write(
        &zstd,
        ruzstd::encoding::compress_to_vec(
            text.as_bytes(),
            ruzstd::encoding::CompressionLevel::Fastest,
        ),
    )
    .unwrap();
    let mut digests = Vec::new();
    for (name, input) in [("plain", &plain), ("gzip", &gzipped), ("zstd", &zstd)] {
        let out = dir.path().join(format!("out-{name}"));
        let r = run(input, &out, 0.1, false).unwrap();
        assert_eq!(
            (r.lines, r.bad_lines, r.train_samples),
            (300, 0, 270),
            "{name}"
        );
        digests.push(std::fs::read(out.join(TRAIN_FILE)).unwrap());
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn all_lines_skipped_is_an_error_and_most_is_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("day_0");
    let out = dir.path().join("out");
    std::fs::write(&input, "1\tbroken\n".repeat(20)).unwrap();
    let e = run(&input, &out, 0.1, true).unwrap_err();
    assert!(e.contains("all 20 lines") && e.contains("day_0:1"), "{e}");
    assert!(!out.join(TRAIN_FILE).exists(), "nothing published");
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));

    std::fs::write(&input, format!("{}{}", criteo_lines(4), "x\n".repeat(6))).unwrap();
    let r = run(&input, &out, 0.0, true).unwrap();
    assert_eq!((r.train_samples, r.bad_lines), (4, 6));
    assert!(
        r.warnings.iter().any(|w| w.contains("6 of 10 lines (60%)")),
        "{:?}",
        r.warnings
    );
    // An empty file converts nothing: an error, not two empty files.
    std::fs::write(&input, "").unwrap();
    assert!(run(&input, &out, 0.1, true).unwrap_err().contains("empty"));
}

#[test]
fn a_convert_replaces_an_old_dataset_and_a_failed_one_leaves_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data");
    std::fs::create_dir(&out).unwrap();
    // What `data gen` leaves: its meta.json describes the generated data only.
    std::fs::write(out.join(META_FILE), "{\"teacher_auc\": 0.8}").unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let input = dir.path().join("day_0");
    std::fs::write(&input, criteo_lines(50)).unwrap();
    run(&input, &out, 0.1, false).unwrap();
    assert!(!out.join(META_FILE).exists(), "stale meta.json kept");
    assert!(
        out.join("notes.txt").exists(),
        "a file convert does not own was removed"
    );
    assert_eq!(Dataset::open(&out.join(TRAIN_FILE)).unwrap().len(), 45);

    // A failing convert (a bad line, not skipped) publishes nothing and leaves no
    // temporary file or staging directory behind.
    std::fs::write(&input, format!("{}1\tbroken\n", criteo_lines(70))).unwrap();
    let e = run(&input, &out, 0.1, false).unwrap_err();
    assert!(e.contains("day_0:71"), "{e}");
    assert_eq!(Dataset::open(&out.join(TRAIN_FILE)).unwrap().len(), 45);
    assert_eq!(Dataset::open(&out.join(TEST_FILE)).unwrap().len(), 5);
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    let mut names: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["notes.txt", TEST_FILE, TRAIN_FILE]);
}

#[test]
fn an_empty_input_directory_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = expand_inputs(&[dir.path().to_path_buf()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no files"), "{e}");
    let e = convert(
        &options(Vec::new(), &dir.path().join("o"), 0.1, false),
        |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no input"), "{e}");
}
