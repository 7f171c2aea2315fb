//! etcd's KV, Lease and Watch gRPC services over the store.
//!
//! A request that reached the server is applied even if its client has given up on it
//! (its attempt timed out, its stream was reset), as a proposal that reached etcd's raft
//! is: each is applied in a task of its own, which the handler only awaits. That is what
//! lets a resent request and its late first attempt both land, as they do on a real etcd.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::proto::{
    PbCompactionRequest, PbCompactionResponse, PbDeleteRequest, PbDeleteResponse, PbKvService,
    PbLeaseGrantRequest, PbLeaseGrantResponse, PbLeaseKeepAliveRequest, PbLeaseKeepAliveResponse,
    PbLeaseLeasesRequest, PbLeaseLeasesResponse, PbLeaseRevokeRequest, PbLeaseRevokeResponse,
    PbLeaseService, PbLeaseStatus, PbLeaseTimeToLiveRequest, PbLeaseTimeToLiveResponse,
    PbPutRequest, PbPutResponse, PbRangeRequest, PbRangeResponse, PbRangeStreamResponse,
    PbTxnRequest, PbTxnResponse, PbWatchRequest, PbWatchRequestUnion, PbWatchResponse,
    PbWatchService,
};
use futures::Stream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

use crate::faults::{Faults, Rpc};
use crate::kv;
use crate::store::Store;
use crate::watch::Create;

/// The store and the knobs, shared by every service and connection.
#[derive(Default)]
pub(crate) struct Shared {
    store: Mutex<Store>,
    pub faults: Faults,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Store> {
        // Every change to the store is made whole under the lock before anything can
        // panic; a poisoned lock still guards a consistent store.
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Revokes the leases past their deadline, every 100 ms while not paused (etcd's
    /// lessor looks every 500 ms). Never returns.
    pub async fn expire_leases(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            self.faults.resumed().await;
            self.lock().expire(Instant::now());
        }
    }
}

pub(crate) type ReplyStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The replies a stream handler queued, each let out only while the server is not
/// paused.
fn gated<T: Send + 'static>(
    shared: Arc<Shared>,
    replies: mpsc::UnboundedReceiver<Result<T, Status>>,
) -> ReplyStream<T> {
    Box::pin(futures::stream::unfold(
        (shared, replies),
        |(shared, mut replies)| async move {
            let reply = replies.recv().await?;
            shared.faults.resumed().await;
            Some((reply, (shared, replies)))
        },
    ))
}

#[derive(Clone)]
pub(crate) struct Service(pub Arc<Shared>);

impl Service {
    /// Applies one request in a task of its own, once the knobs let it.
    async fn apply<T, F>(&self, rpc: Rpc, apply: F) -> Result<Response<T>, Status>
    where
        T: Send + 'static,
        F: FnOnce(&mut Store) -> Result<T, Status> + Send + 'static,
    {
        let shared = self.0.clone();
        let task = tokio::spawn(async move {
            shared.faults.admit(rpc).await;
            let mut store = shared.lock();
            apply(&mut store)
        });
        match task.await {
            Ok(reply) => reply.map(Response::new),
            Err(e) => Err(Status::internal(format!("in-memory etcd: {e}"))),
        }
    }
}

#[tonic::async_trait]
impl PbKvService for Service {
    async fn range(
        &self,
        request: Request<PbRangeRequest>,
    ) -> Result<Response<PbRangeResponse>, Status> {
        let r = request.into_inner();
        self.apply(Rpc::Range, move |s| kv::range(s, &r)).await
    }

    type RangeStreamStream = ReplyStream<PbRangeStreamResponse>;

    /// etcd 3.7's chunked read, in one chunk.
    async fn range_stream(
        &self,
        request: Request<PbRangeRequest>,
    ) -> Result<Response<Self::RangeStreamStream>, Status> {
        let r = request.into_inner();
        let reply = self.apply(Rpc::Range, move |s| kv::range(s, &r)).await?;
        let chunk = PbRangeStreamResponse {
            range_response: Some(reply.into_inner()),
        };
        let stream: Self::RangeStreamStream = Box::pin(futures::stream::iter([Ok(chunk)]));
        Ok(Response::new(stream))
    }

    async fn put(&self, request: Request<PbPutRequest>) -> Result<Response<PbPutResponse>, Status> {
        let p = request.into_inner();
        self.apply(Rpc::Put, move |s| {
            let mut w = s.write();
            let reply = kv::put(&mut w, p)?;
            w.commit();
            Ok(reply)
        })
        .await
    }

    async fn delete_range(
        &self,
        request: Request<PbDeleteRequest>,
    ) -> Result<Response<PbDeleteResponse>, Status> {
        let d = request.into_inner();
        self.apply(Rpc::DeleteRange, move |s| {
            crate::store::key_required(&d.key)?;
            let mut w = s.write();
            let reply = kv::delete(&mut w, &d);
            w.commit();
            Ok(reply)
        })
        .await
    }

    async fn txn(&self, request: Request<PbTxnRequest>) -> Result<Response<PbTxnResponse>, Status> {
        let t = request.into_inner();
        self.apply(Rpc::Txn, move |s| {
            let mut w = s.write();
            let reply = kv::txn(&mut w, t)?;
            w.commit();
            Ok(reply)
        })
        .await
    }

    async fn compact(
        &self,
        request: Request<PbCompactionRequest>,
    ) -> Result<Response<PbCompactionResponse>, Status> {
        let c = request.into_inner();
        self.apply(Rpc::Compact, move |s| kv::compact(s, &c)).await
    }
}

#[tonic::async_trait]
impl PbLeaseService for Service {
    async fn lease_grant(
        &self,
        request: Request<PbLeaseGrantRequest>,
    ) -> Result<Response<PbLeaseGrantResponse>, Status> {
        let g = request.into_inner();
        self.apply(Rpc::LeaseGrant, move |s| {
            let (id, ttl) = s.leases.grant(g.id, g.ttl)?;
            Ok(PbLeaseGrantResponse {
                header: s.header(),
                id,
                ttl,
                error: String::new(),
            })
        })
        .await
    }

    async fn lease_revoke(
        &self,
        request: Request<PbLeaseRevokeRequest>,
    ) -> Result<Response<PbLeaseRevokeResponse>, Status> {
        let id = request.into_inner().id;
        self.apply(Rpc::LeaseRevoke, move |s| {
            if !s.revoke(id) {
                return Err(Status::not_found("etcdserver: requested lease not found"));
            }
            Ok(PbLeaseRevokeResponse { header: s.header() })
        })
        .await
    }

    type LeaseKeepAliveStream = ReplyStream<PbLeaseKeepAliveResponse>;

    async fn lease_keep_alive(
        &self,
        request: Request<Streaming<PbLeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        let mut inbound = request.into_inner();
        let (replies, out) = mpsc::unbounded_channel();
        let shared = self.0.clone();
        tokio::spawn(async move {
            while let Ok(Some(renewal)) = inbound.message().await {
                shared.faults.admit(Rpc::LeaseKeepAlive).await;
                let reply = {
                    let mut s = shared.lock();
                    // etcd answers a lease it does not have with a TTL of 0.
                    let ttl = s.leases.renew(renewal.id).unwrap_or(0);
                    PbLeaseKeepAliveResponse {
                        header: s.header(),
                        id: renewal.id,
                        ttl,
                    }
                };
                if replies.send(Ok(reply)).is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(gated(self.0.clone(), out)))
    }

    async fn lease_time_to_live(
        &self,
        request: Request<PbLeaseTimeToLiveRequest>,
    ) -> Result<Response<PbLeaseTimeToLiveResponse>, Status> {
        let q = request.into_inner();
        self.apply(Rpc::LeaseTimeToLive, move |s| {
            let header = s.header();
            let Some(lease) = s.leases.get(q.id) else {
                return Ok(PbLeaseTimeToLiveResponse {
                    header,
                    id: q.id,
                    ttl: -1,
                    ..Default::default()
                });
            };
            let left = lease.deadline.saturating_duration_since(Instant::now());
            Ok(PbLeaseTimeToLiveResponse {
                header,
                id: q.id,
                ttl: left.as_secs_f64().ceil() as i64,
                granted_ttl: lease.ttl,
                keys: if q.keys {
                    lease.keys.iter().cloned().collect()
                } else {
                    Vec::new()
                },
            })
        })
        .await
    }

    async fn lease_leases(
        &self,
        _request: Request<PbLeaseLeasesRequest>,
    ) -> Result<Response<PbLeaseLeasesResponse>, Status> {
        self.apply(Rpc::LeaseLeases, |s| {
            Ok(PbLeaseLeasesResponse {
                header: s.header(),
                leases: s
                    .leases
                    .ids()
                    .into_iter()
                    .map(|id| PbLeaseStatus { id })
                    .collect(),
            })
        })
        .await
    }
}

#[tonic::async_trait]
impl PbWatchService for Service {
    type WatchStream = ReplyStream<PbWatchResponse>;

    async fn watch(
        &self,
        request: Request<Streaming<PbWatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut inbound = request.into_inner();
        let (replies, out) = mpsc::unbounded_channel();
        let shared = self.0.clone();
        let stream = shared.lock().watchers.new_stream();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    m = inbound.message() => m,
                    () = replies.closed() => break,
                };
                let Ok(Some(request)) = message else { break };
                shared.faults.admit(Rpc::Watch).await;
                watch_request(&shared, stream, request, &replies);
            }
            shared.lock().watchers.end_stream(stream);
        });
        Ok(Response::new(gated(self.0.clone(), out)))
    }
}

fn watch_request(
    shared: &Shared,
    stream: u64,
    request: PbWatchRequest,
    replies: &crate::watch::Replies,
) {
    let mut s = shared.lock();
    match request.request_union {
        Some(PbWatchRequestUnion::CreateRequest(c)) => {
            let create = Create {
                key: c.key,
                range_end: c.range_end,
                start_revision: c.start_revision,
                prev_kv: c.prev_kv,
                filters: c.filters,
                watch_id: c.watch_id,
            };
            s.create_watch(stream, create, replies);
        }
        Some(PbWatchRequestUnion::CancelRequest(c)) if s.watchers.cancel(stream, c.watch_id) => {
            let _ = replies.send(Ok(PbWatchResponse {
                header: s.header(),
                watch_id: c.watch_id,
                canceled: true,
                ..Default::default()
            }));
        }
        // Cancelling a watcher this stream does not have: etcd says nothing either.
        Some(PbWatchRequestUnion::CancelRequest(_)) => {}
        Some(PbWatchRequestUnion::ProgressRequest(_)) => {
            let _ = replies.send(Ok(PbWatchResponse {
                header: s.header(),
                // clientv3's `InvalidWatchID`: a progress report for the whole stream.
                watch_id: -1,
                ..Default::default()
            }));
        }
        None => {}
    }
}
