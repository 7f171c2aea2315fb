//! The launcher (`ftrec cluster run`) and the harness around it: it starts the coordinator
//! in process, servers and workers as child processes, injects faults, and checks what a
//! run ends with (parity, digests).

pub mod launch;
pub mod parity_check;
