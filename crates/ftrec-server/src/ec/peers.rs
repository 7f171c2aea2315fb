//! Clients for the other servers of an erasure-coded job: parity differences go to their
//! holders through these, and degraded reads and rebuilds ask survivors through them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ftrec_rpc::PsError;
use ftrec_rpc::client::{Connector, ServerClient};
use ftrec_rpc::hedge::{Hedge, Hedger};
use ftrec_rpc::leader::CoordinatorLink;
use ftrec_rpc::metrics::Metrics;

/// A peer's address, its client, and a client on a second connection of its own for the
/// copy of a slow call ([`ftrec_rpc::hedge`]).
type Peer = (String, ServerClient, ServerClient);

/// Clients for the other servers, from the coordinator's placement map, refreshed when a
/// slot changes hands.
pub(crate) struct Peers {
    coordinator: CoordinatorLink,
    connector: Connector,
    /// The placement map, and the epoch this server was in when it was fetched.
    map: tokio::sync::Mutex<(u64, Vec<Peer>)>,
    /// When a slow call to a peer is sent again, per kind and peer.
    hedger: Mutex<Hedger>,
    /// Counts the calls sent again (`ftrec_hedged_calls_total`).
    metrics: Arc<Metrics>,
}

impl Peers {
    pub(crate) fn new(
        coordinator: CoordinatorLink,
        connector: Connector,
        hedge: Option<Hedge>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            coordinator,
            connector,
            map: tokio::sync::Mutex::new((0, Vec::new())),
            hedger: Mutex::new(Hedger::new(hedge)),
            metrics,
        }
    }

    /// When a call of `kind` to peer `server` at `address` is sent again: before its
    /// deadline, or never (never while its link shows no loss: [`ftrec_rpc::loss_watch`]).
    pub(crate) fn hedge_after(
        &self,
        kind: &'static str,
        server: usize,
        address: &str,
    ) -> Option<Duration> {
        let lost = self.connector.lost_lately(address);
        self.hedger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .after_seen(kind, server, self.connector.timeout(), lost)
    }

    /// A call of `kind` to peer `server` at `address` ended, answered in `took`; `hedged`:
    /// its copy was sent.
    pub(crate) fn called(
        &self,
        kind: &'static str,
        server: usize,
        address: &str,
        took: Option<Duration>,
        hedged: bool,
    ) {
        let lost = self.connector.lost_lately(address);
        self.hedger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record_seen(kind, server, took, hedged, lost);
        if hedged {
            self.metrics.add("ftrec_hedged_calls_total", 1);
        }
    }

    /// A client for `server`, fetching the placement map when it is unknown, `fresh`, or
    /// older than `epoch`. A new epoch may have replaced a peer, and the old address can
    /// be silent rather than refusing (a frozen host, a link down): a call there would
    /// wait out its whole deadline before any retry learned the new address.
    pub(crate) async fn client(
        &self,
        server: usize,
        fresh: bool,
        epoch: u64,
    ) -> Result<ServerClient, PsError> {
        self.clients(server, fresh, epoch).await.map(|(_, c, _)| c)
    }

    /// [`Peers::client`], with its address and the client on the second connection.
    pub(crate) async fn clients(
        &self,
        server: usize,
        fresh: bool,
        epoch: u64,
    ) -> Result<Peer, PsError> {
        let mut guard = self.map.lock().await;
        let (fetched_in, map) = &mut *guard;
        if fresh || *fetched_in < epoch || map.get(server).is_none_or(|(a, _, _)| a.is_empty()) {
            let placement = self.coordinator.placement().await?;
            // Only a map that arrived counts as fetched in this epoch.
            *fetched_in = epoch;
            *map = placement
                .servers
                .into_iter()
                .map(|a| {
                    let address = if a.is_empty() { "0.0.0.0:0" } else { &a };
                    let client = self.connector.server(address)?;
                    let second = self.connector.server(address)?;
                    Ok((a, client, second))
                })
                .collect::<Result<_, PsError>>()?;
        }
        map.get(server)
            .filter(|(a, _, _)| !a.is_empty())
            .cloned()
            .ok_or_else(|| PsError::Unavailable(format!("server {server} has no address yet")))
    }
}
