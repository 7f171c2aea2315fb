//! The decoders that read bytes ftrec did not write itself (files from disk or object
//! storage, lines of input data, RPC payloads), one function per fuzz target. Each must
//! return for every input: an `Err` is fine, a panic or an abort is the bug the fuzzer
//! hunts. `fuzz/` drives them with libFuzzer on nightly; `tests/corpora.rs` replays the
//! kept corpora on stable so CI keeps every fixed crash fixed.

use std::sync::OnceLock;

use ftrec_data::Record;
use ftrec_model::{ModelConfig, Optimizer};
use ftrec_server::shard::{Shard, Update};

/// A target: takes any bytes, returns for all of them.
pub type Target = fn(&[u8]);

/// The targets by name, as `fuzz/fuzz_targets/<name>.rs` and `fuzz/corpus/<name>/` call
/// them.
pub const TARGETS: [(&str, Target); 8] = [
    ("chunk", chunk),
    ("dense", dense),
    ("manifest", manifest),
    ("chunk_list", chunk_list),
    ("ftrd", ftrd),
    ("criteo_line", criteo_line),
    ("schema", schema),
    ("push", push),
];

/// A checkpoint's row chunk.
pub fn chunk(data: &[u8]) {
    let _ = ftrec_ckpt::chunk::decode("fuzz", data, |_, _| Ok(()));
}

/// A checkpoint's dense file, read into buffers of the size the first byte picks (the
/// manifest gives the real size; the decoder must refuse a file that disagrees).
pub fn dense(data: &[u8]) {
    let n = data.first().copied().unwrap_or(0) as usize;
    let (mut params, mut state) = (vec![0f32; n], vec![0f32; 2 * n]);
    let _ = ftrec_ckpt::dense::decode("fuzz", data, &mut params, &mut state);
}

/// A checkpoint manifest (its envelope and JSON).
pub fn manifest(data: &[u8]) {
    let _ = ftrec_ckpt::Manifest::decode("fuzz", data);
}

/// An IncrCP chunk list (its envelope and JSON).
pub fn chunk_list(data: &[u8]) {
    let _ = ftrec_ckpt::chunklist::ChunkList::decode("fuzz", data);
}

/// A `.ftrd` dataset file: opened, then every sample read (at most 4096).
pub fn ftrd(data: &[u8]) {
    let path = std::env::temp_dir().join(format!("ftrec-fuzz-{}.ftrd", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(set) = ftrec_data::Dataset::open(&path) {
        let mut rec = Record::default();
        for i in 0..set.len().min(4096) {
            set.record(i, &mut rec);
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// One line of Criteo TSV.
pub fn criteo_line(data: &[u8]) {
    let schema = ftrec_data::criteo::schema();
    let mut rec = Record::default();
    let _ = schema.parse_line(data, &mut rec);
}

/// A schema TOML; when it parses, its first line of input data goes through it too.
pub fn schema(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (toml, line) = text.split_once("\n---\n").unwrap_or((text, ""));
    if let Ok(schema) = ftrec_data::schema::Schema::parse(toml)
        && schema.validate().is_ok()
    {
        let _ = schema.check_header(line.as_bytes());
        let mut rec = Record::default();
        let _ = schema.parse_line(line.as_bytes(), &mut rec);
    }
}

/// A server of a small model, built once per process.
fn small_shard() -> &'static Option<Shard> {
    static SHARD: OnceLock<Option<Shard>> = OnceLock::new();
    SHARD.get_or_init(|| {
        let config = ModelConfig {
            num_dense: 2,
            table_rows: vec![50, 7],
            dim: 4,
            bottom: vec![8, 4],
            top: vec![8, 1],
            sparse_optimizer: Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            dense_optimizer: Optimizer::Adagrad {
                lr: 0.01,
                eps: 1e-8,
                initial_accumulator: 0.0,
            },
        };
        let layout = ftrec_proto::placement::Layout::new(2).ok()?;
        Shard::initial(&config, 1, layout, 0).ok()
    })
}

/// A push as a server receives it: the protobuf message, its payloads, then staged
/// against a shard (tables, rows, shapes checked there).
pub fn push(data: &[u8]) {
    use prost::Message;
    let Ok(req) = ftrec_proto::proto::PushRequest::decode(data) else {
        return;
    };
    let Ok((update, _)) = Update::from_push(&req) else {
        return;
    };
    if let Some(shard) = small_shard() {
        let _ = shard.stage(&update);
    }
}
