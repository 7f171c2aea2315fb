//! Where checkpoint files live: a local directory or an object store, behind one trait.

pub(crate) mod object;
pub(crate) mod store;
