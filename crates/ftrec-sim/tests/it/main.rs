//! The simulation's integration tests, one binary (each link costs CI time and disk):
//! random fault schedules, the control plane under etcd, two-phase commit races and
//! stalled streams.

mod control_plane;
mod schedules;
mod stalled_streams;
mod two_phase;

use std::sync::OnceLock;

/// The simulation's dataset, generated once for every test of the binary.
fn data_dir() -> &'static std::path::Path {
    static DATA: OnceLock<tempfile::TempDir> = OnceLock::new();
    DATA.get_or_init(|| {
        let data = tempfile::tempdir().unwrap();
        ftrec_sim::generate_dataset(data.path()).unwrap();
        data
    })
    .path()
}
