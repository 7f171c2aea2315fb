//! The launcher (`ftrec cluster run`) and the harness around it: it starts the coordinator
//! in process, servers and workers as child processes, injects faults, and checks what a
//! run ends with (parity, digests); and scrubs a running cluster's parity (`scrub`).

pub mod auto;
pub mod failure_schedule;
pub mod launch;
pub mod parity_check;
pub mod resume;
pub mod scrub;
