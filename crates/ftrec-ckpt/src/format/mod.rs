//! The files a checkpoint is made of: chunks, chunk lists, the dense file, manifests,
//! and the checksummed envelope around each.

pub mod chunk;
pub mod chunklist;
pub mod dense;
pub(crate) mod envelope;
pub mod manifest;
pub(crate) mod parts;
pub mod quant;
