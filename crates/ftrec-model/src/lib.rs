//! The DLRM model state and math: embedding tables whose rows carry their optimizer state,
//! dense MLP parameters, forward/backward, optimizers and metrics.
//!
//! Everything here is deterministic for a fixed thread count: later crates compare model
//! states bit for bit after recovery, so no reduction in this crate depends on scheduling.

#[cfg(not(target_endian = "little"))]
compile_error!("ftrec's row byte view is defined as the in-memory little-endian f32 layout");

mod awake;
pub(crate) use awake::with_pool_awake;
mod batch;
mod config;
mod dlrm;
mod error;
pub mod layers;
pub mod metrics;
pub mod params;
pub mod prefetch;
#[cfg(test)]
mod testing;

// Modules keep their root paths (`ftrec_model::matmul`, `crate::optim`).
pub use layers::matmul;
pub(crate) use layers::{lanes, mlp, sparse};
pub(crate) use params::{memory, optim, pages, state, table};

pub use batch::{Bags, Batch};
pub use config::{ModelConfig, interaction_width};
pub use dlrm::{Dlrm, Gradients, PhaseTimes};
pub use error::ModelError;
pub use matmul::{GemmMatMul, MatMul, NaiveMatMul};
pub use memory::{MemoryEstimate, human_bytes};
pub use mlp::{LayerSpec, MlpSpec, MlpWorkspace};
pub use optim::Optimizer;
pub use pages::TablePages;
pub use state::{DenseState, ModelState, StateDigest};
pub use table::EmbeddingTable;
