//! A real etcd on loopback (`ftrec_etcd::local`, which `ftrec bench coordinator` uses
//! too), started for tests: a missing etcd fails the test naming it and
//! `./scripts/test-deps`.

use std::path::Path;

pub use ftrec_etcd::local::LocalEtcd;

use crate::deps;

/// `ftrec_etcd::local` starts `$FTREC_ETCD_BIN`, or `etcd` from `PATH`.
#[track_caller]
fn require_etcd() {
    let binary = std::env::var("FTREC_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    deps::program(&binary, "etcd (Debian's etcd-server)");
}

/// One single-member etcd with its data under `dir`, serving; killed when dropped.
#[track_caller]
pub fn start(dir: &Path) -> LocalEtcd {
    require_etcd();
    ftrec_etcd::local::start(dir).unwrap_or_else(|e| panic!("etcd: {e}"))
}

/// An etcd cluster of `members` processes under `dir`, every member serving.
#[track_caller]
pub fn start_cluster(dir: &Path, members: usize) -> Vec<LocalEtcd> {
    require_etcd();
    ftrec_etcd::local::start_cluster(dir, members).unwrap_or_else(|e| panic!("etcd: {e}"))
}

/// A client of the etcd at `endpoint` under the job prefix `prefix`, as a test reads a
/// job's record and leader with it.
#[track_caller]
pub fn client(rt: &tokio::runtime::Runtime, endpoint: &str, prefix: &str) -> ftrec_etcd::Etcd {
    rt.block_on(ftrec_etcd::Etcd::connect(&ftrec_etcd::EtcdOptions {
        endpoints: vec![endpoint.to_string()],
        prefix: prefix.into(),
        request_timeout: std::time::Duration::from_secs(3),
    }))
    .unwrap_or_else(|e| panic!("etcd at {endpoint}: {e}"))
}

/// A job's keys in etcd as a test reads them (its record, its leader), through a client
/// of its own; a read that fails (etcd frozen, say) reads as nothing.
pub struct JobKeys {
    rt: tokio::runtime::Runtime,
    client: ftrec_etcd::Etcd,
}

impl JobKeys {
    #[track_caller]
    pub fn new(endpoint: &str, prefix: &str) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("a runtime: {e}"));
        let client = client(&rt, endpoint, prefix);
        Self { rt, client }
    }

    /// The job's durable record.
    pub fn record(&self) -> Option<serde_json::Value> {
        self.get("state")
    }

    /// The job's key `key` (under its prefix), as JSON.
    pub fn get(&self, key: &str) -> Option<serde_json::Value> {
        self.rt
            .block_on(self.client.get_json::<serde_json::Value>(key))
            .ok()
            .flatten()
            .map(|(v, _)| v)
    }

    /// The id of the coordinator that leads.
    pub fn leader(&self) -> Option<String> {
        self.rt
            .block_on(self.client.leader())
            .ok()
            .flatten()
            .map(|(l, _)| l.id)
    }
}
