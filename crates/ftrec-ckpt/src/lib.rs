//! The checkpoint engine: delta tracking, checkpoint files and manifests in a store, and
//! exact restore. Strategies beyond `full` (differential, naive incremental, IncrCP, DECK)
//! build on the same chunk format and manifests.

// Chunks and dense files are written with `bytemuck` casts of f32 slices: the format is
// little-endian, so a big-endian build would write the wrong bytes.
#[cfg(target_endian = "big")]
compile_error!("ftrec-ckpt writes native f32 bytes and supports only little-endian targets");

mod engine;
mod error;
mod export;
pub mod format;
pub mod history;
pub mod storage;
pub mod strategies;

// Every module keeps its path at the crate root (`ftrec_ckpt::chunk`, `crate::store`):
// the folders group files by role without changing what users and siblings name.
pub use format::quant::{Quant, QuantKind};
pub use format::{chunk, chunklist, dense, manifest};
pub(crate) use format::{envelope, parts};
pub use history::{branch, fence, lease};
pub(crate) use history::{retention, session};
pub(crate) use storage::{object, store};
pub use strategies::{deck, incrcp, merge, tracker};
pub(crate) use strategies::{incrcp_worker, policy};

pub use engine::timing;
pub use engine::{CHUNK_BYTES, Checkpoints};
pub use error::CkptError;
pub use export::export_safetensors;
pub use incrcp_worker::CommitReport;
pub use manifest::{CheckpointKind, DeckRef, FenceToken, IncrcpRef, Manifest};
pub use object::{ObjectStoreBackend, open_store};
pub use policy::{Checkpointer, DeckStats};
pub use retention::{GcOptions, GcReport};
pub use session::{BranchStart, WriterStart};
pub use store::{LocalStore, ObjectReader, Store};
pub use strategies::config::{IncrcpThreshold, Strategy, StrategyConfig};
pub use tracker::{DeltaTracker, TenantId};
