//! The network's compute: matrix products over `gemm`, MLP layers, the dot interaction
//! and sum-pooled embedding bags.

pub(crate) mod interaction;
pub(crate) mod lanes;
pub mod matmul;
pub(crate) mod mlp;
pub(crate) mod sparse;
