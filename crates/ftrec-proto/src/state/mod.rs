//! Shared views of the model's distribution: where rows live, which steps a server has
//! applied, and how shards add up to the global model.

pub mod applied;
pub mod assemble;
pub mod gather;
pub mod placement;
