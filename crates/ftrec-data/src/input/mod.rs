//! Reading delimited CTR data: Criteo TSV, any layout a schema describes, compressed
//! input, and the hashing of categorical values.

pub mod compressed;
pub mod criteo;
pub mod hashing;
pub mod schema;
pub mod text;
