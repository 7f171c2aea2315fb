//! The simulation's integration tests, one binary (each link costs CI time and disk):
//! random fault schedules, the control plane under etcd, two-phase commit races and
//! stalled streams.

mod control_plane;
mod schedules;
mod stalled_streams;
mod two_phase;
