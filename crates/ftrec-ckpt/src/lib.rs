//! The checkpoint engine: delta tracking, checkpoint files and manifests in a store, and
//! exact restore. Strategies beyond `full` (differential, naive incremental, IncrCP, DECK)
//! build on the same chunk format and manifests.

pub mod chunk;
pub mod dense;
mod engine;
mod error;
mod export;
pub mod manifest;
mod object;
mod policy;
mod store;
pub mod tracker;

pub use engine::{CHUNK_BYTES, Checkpoints, GcReport};
pub use error::CkptError;
pub use export::export_safetensors;
pub use manifest::{CheckpointKind, Manifest};
pub use object::{ObjectStoreBackend, open_store};
pub use policy::{Checkpointer, Strategy};
pub use store::{LocalStore, Store};
pub use tracker::{DeltaTracker, TenantId};
