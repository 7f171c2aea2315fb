//! The etcd client against a real etcd server, one binary: the client and elections
//! (`etcd.rs`), fenced writes (`fenced.rs`).

mod etcd;
mod fenced;

use std::time::Duration;

use ftrec_etcd::EtcdOptions;

/// A client's options for one etcd endpoint under `prefix`.
fn options(endpoint: &str, prefix: &str) -> EtcdOptions {
    EtcdOptions {
        endpoints: vec![endpoint.to_string()],
        prefix: prefix.to_string(),
        request_timeout: Duration::from_secs(2),
    }
}
