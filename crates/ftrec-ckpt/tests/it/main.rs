//! The checkpoint engine's integration tests, one binary; each module is a former test
//! file, so a test's path names it (`deck::...`, `s3::...`). DECK's allocator-measured
//! memory bound stays a binary of its own (`deck_memory.rs`): it counts every allocation
//! of the process, so no other test may run beside it.

mod azure;
mod deck;
mod failures;
mod fencing;
mod full;
mod hooked;
mod incrcp_reset;
mod object_suite;
mod s3;
mod strategies;
