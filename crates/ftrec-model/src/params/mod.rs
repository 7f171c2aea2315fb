//! What a model holds: embedding tables, the dense state, the optimizers that update
//! them, and memory estimates.

pub(crate) mod memory;
pub(crate) mod optim;
pub(crate) mod pages;
pub(crate) mod state;
pub(crate) mod table;
