//! Training data: Criteo TSV and schema-described delimited text, a compact memory-mapped
//! binary format, and a synthetic Criteo-shaped generator with a planted teacher model.
//!
//! Categorical values are kept raw (32-bit) in the binary format and hashed into a
//! table's row range only when a batch is built ([`hashing::row_for`]), so one converted
//! dataset serves models of any table size.

pub mod binfmt;
pub mod convert;
mod error;
pub mod generate;
pub mod input;
mod record;
mod staging;
pub mod stats;

// The readers keep their root paths (`ftrec_data::criteo`).
pub use input::{compressed, criteo, hashing, schema, text};

pub use binfmt::{Dataset, DatasetWriter};
pub use error::DataError;
pub use record::Record;

/// File names inside a dataset directory.
pub const TRAIN_FILE: &str = "train.ftrd";
pub const TEST_FILE: &str = "test.ftrd";
pub const META_FILE: &str = "meta.json";
