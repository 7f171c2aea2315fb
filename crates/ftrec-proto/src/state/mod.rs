//! Shared views of the model's distribution: where rows live, which steps a server has
//! applied, how shards add up to the global model, and what a shard checkpoint says of
//! itself.

pub mod applied;
pub mod assemble;
pub mod gather;
pub mod identity;
pub mod placement;
