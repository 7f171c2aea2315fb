//! Replays every input the fuzzers kept (`fuzz/corpus/<target>/`, crashes they found
//! included once fixed) through its target on stable: an input that panics again fails
//! here, in CI, without a nightly toolchain.

use std::path::Path;

#[test]
fn every_kept_input_is_handled_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut replayed = 0;
    for (name, target) in ftrec_fuzz_targets::TARGETS {
        let dir = root.join(name);
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (every target keeps a corpus)", dir.display()));
        let mut inputs = 0;
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            target(&data);
            inputs += 1;
        }
        assert!(inputs > 0, "{}: an empty corpus", dir.display());
        replayed += inputs;
    }
    eprintln!("replayed {replayed} inputs");
}
