//! The model crate's integration tests, one binary; each module is a former test file.
//! Each test builds its own rayon pool, so sharing the process changes no thread count.

mod gradients;
mod steps;
