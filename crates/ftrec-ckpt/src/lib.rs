//! The checkpoint engine: delta tracking, checkpoint files and manifests in a store, and
//! exact restore. Strategies beyond `full` (differential, naive incremental, IncrCP, DECK)
//! build on the same chunk format and manifests.

// Chunks and dense files are written with `bytemuck` casts of f32 slices: the format is
// little-endian, so a big-endian build would write the wrong bytes.
#[cfg(target_endian = "big")]
compile_error!("ftrec-ckpt writes native f32 bytes and supports only little-endian targets");

pub mod branch;
pub mod chunk;
pub mod chunklist;
pub mod deck;
pub mod dense;
mod engine;
mod envelope;
mod error;
mod export;
pub mod incrcp;
mod incrcp_worker;
pub mod lease;
pub mod manifest;
pub mod merge;
mod object;
mod partial;
mod parts;
mod policy;
mod retention;
mod session;
mod store;
pub mod tracker;

pub use engine::{CHUNK_BYTES, Checkpoints};
pub use error::CkptError;
pub use export::export_safetensors;
pub use incrcp_worker::CommitReport;
pub use manifest::{CheckpointKind, DeckRef, IncrcpRef, Manifest};
pub use object::{ObjectStoreBackend, open_store};
pub use policy::{Checkpointer, DeckStats, Strategy};
pub use retention::{GcOptions, GcReport};
pub use session::{BranchStart, WriterStart};
pub use store::{LocalStore, ObjectReader, Store};
pub use tracker::{DeltaTracker, TenantId};
