//! An in-memory etcd that serves etcd's own gRPC API (KV, Lease, Watch), so that the real
//! `etcd-client` and `ftrec_etcd::Etcd` (its resends included) run against it unchanged:
//! the control plane of the simulation (issue 42, §2). A fake below the client would hide
//! the client's own behaviour (a late attempt landing after its resend, hole 5); a server
//! behind the wire does not.
//!
//! Its own crate rather than a feature of `ftrec-etcd`: no production binary depends on
//! it, so none links a server that must never stand in for etcd; its tests need
//! `ftrec-etcd` (to run `Leadership` against it) without a crate depending on itself;
//! and the simulation, its only user, names it as one dependency.
//!
//! What it serves, as etcd 3.5 does:
//! - KV: Range (one key, a range or a prefix, at the current or an older revision, with
//!   count, limit, sort, keys or count only, revision filters), Put (lease, prev_kv,
//!   ignore_value, ignore_lease), DeleteRange, Txn (compares on version, create and mod
//!   revision, value and lease; nested transactions), Compact. One global revision moves
//!   on by one per write transaction that changes something; each key has its create
//!   revision, mod revision and version.
//! - Lease: Grant (a TTL under 2 s is granted as 2 s, as etcd does), Revoke, KeepAlive
//!   (a stream; a lease it does not have is answered with TTL 0), TimeToLive, Leases. A
//!   lease expires by `tokio::time`, so under turmoil by the simulated clock, and its
//!   keys are deleted in one revision.
//! - Watch: any number of watchers per stream, on a key or a range, from a past revision
//!   (replayed) or from now, with prev_kv and the NOPUT/NODELETE filters, cancel, and
//!   progress requests.
//!
//! Not served: auth, cluster and maintenance, elections and locks, progress
//! notifications, fragmented watch replies, and the duplicate-key check of a transaction.
//!
//! Files: `store.rs` keys, revisions and history; `kv.rs` the KV requests; `lease.rs`
//! leases and expiry; `watch.rs` watchers; `faults.rs` the knobs; `service.rs` the gRPC
//! services.

mod faults;
mod kv;
mod lease;
mod service;
mod store;
mod watch;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{PbKeyValue, PbKvServer, PbLeaseServer, PbWatchServer};
use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::transport::server::Connected;

pub use faults::Rpc;
use service::{Service, Shared};

/// A handle on one in-memory etcd: clones share its keys, leases and knobs.
#[derive(Clone, Default)]
pub struct MemoryEtcd {
    shared: Arc<Shared>,
}

impl MemoryEtcd {
    /// An empty etcd at revision 1, answering.
    pub fn new() -> Self {
        Self::default()
    }

    /// The KV, Lease and Watch services, to add to a server of the caller's.
    pub fn routes(&self) -> tonic::service::Routes {
        let service = Service(self.shared.clone());
        tonic::service::Routes::new(PbKvServer::new(service.clone()))
            .add_service(PbLeaseServer::new(service.clone()))
            .add_service(PbWatchServer::new(service))
    }

    /// Serves every connection `incoming` yields (a turmoil listener's, say), and expires
    /// leases, until `incoming` ends or the future is dropped (an etcd host killed: its
    /// data lives on in this handle, as on a disk, for a restart to serve again).
    pub async fn serve_with_incoming<I, IO, IE>(
        self,
        incoming: I,
    ) -> Result<(), tonic::transport::Error>
    where
        I: Stream<Item = Result<IO, IE>>,
        IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
        IO::ConnectInfo: Clone + Send + Sync + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let serve = tonic::transport::Server::builder()
            .add_routes(self.routes())
            .serve_with_incoming(incoming);
        tokio::select! {
            served = serve => served,
            () = self.shared.clone().expire_leases() => Ok(()),
        }
    }

    /// Serves on a TCP port of 127.0.0.1 (for tests outside a simulation), in a task that
    /// ends when the returned handle is dropped.
    pub async fn serve_loopback(&self) -> io::Result<Loopback> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = listener.local_addr()?.to_string();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let served = self.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = served.serve_with_incoming(incoming).await {
                tracing::warn!("in-memory etcd: {e}");
            }
        });
        Ok(Loopback { endpoint, task })
    }

    /// Stops answering, as a SIGSTOPped etcd: every request waits (and is applied once
    /// resumed), keep-alive and watch replies are held, and leases do not expire. The
    /// connections stay open and HTTP/2 pings are still answered: to freeze the host
    /// as a whole, hold its network in the simulation too.
    pub fn pause(&self) {
        self.shared.faults.pause();
    }

    /// Answers again. A lease whose deadline passed while paused expires at once, as on a
    /// single etcd member woken by SIGCONT; see [`renew_all_leases`](Self::renew_all_leases)
    /// for a cluster that elected a new raft leader meanwhile.
    pub fn resume(&self) {
        self.shared.faults.resume();
    }

    pub fn is_paused(&self) -> bool {
        self.shared.faults.paused()
    }

    /// Every request waits `delay` before it is applied (its reply is that late too), or
    /// none with `None`.
    pub fn set_delay(&self, delay: Option<Duration>) {
        self.shared.faults.set_delay(delay);
    }

    /// The next `count` requests of kind `rpc` wait `delay` before they are applied,
    /// instead of the delay of [`set_delay`](Self::set_delay): a request that lands
    /// after its client resent it, or after later requests.
    pub fn delay_next(&self, rpc: Rpc, count: usize, delay: Duration) {
        self.shared.faults.delay_next(rpc, count, delay);
    }

    /// Gives every lease a full TTL from now, as etcd does when a new raft leader is
    /// elected (a member of three frozen and thawed, a quorum regained).
    pub fn renew_all_leases(&self) {
        self.shared.lock().leases.renew_all();
    }

    /// When lease `id` expires unless renewed before (by the clock etcd runs on), or
    /// `None` when there is no such lease. A paused etcd expires nothing until it resumes,
    /// but a lease past this deadline then is gone: nothing after it was covered by it.
    pub fn lease_deadline(&self, id: i64) -> Option<tokio::time::Instant> {
        self.shared.lock().leases.get(id).map(|l| l.deadline)
    }

    /// The revision of the last write.
    pub fn revision(&self) -> i64 {
        self.shared.lock().revision
    }

    /// A key as it is now, with its revisions, version and lease (for a simulation's
    /// invariants; the knobs do not hold it).
    pub fn get(&self, key: &[u8]) -> Option<PbKeyValue> {
        self.shared.lock().get(key).cloned()
    }
}

/// An in-memory etcd served on loopback TCP; serving stops when it is dropped.
pub struct Loopback {
    /// `127.0.0.1:PORT`.
    pub endpoint: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.task.abort();
    }
}
