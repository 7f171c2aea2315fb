//! Shared views of the model's distribution: where rows live, which steps a server has
//! applied, how shards add up to the global model, and what a shard checkpoint says of
//! itself. Gathering the shards from live servers is the runtime's (`ftrec_rpc::gather`).

pub mod applied;
pub mod assemble;
pub mod identity;
pub mod placement;
