//! Clients for the other servers of an erasure-coded job: parity differences go to their
//! holders through these, and degraded reads and rebuilds ask survivors through them.

use ftrec_rpc::PsError;
use ftrec_rpc::client::{Connector, ServerClient};
use ftrec_rpc::leader::CoordinatorLink;

/// Clients for the other servers, from the coordinator's placement map, refreshed when a
/// slot changes hands.
pub(crate) struct Peers {
    coordinator: CoordinatorLink,
    connector: Connector,
    /// The placement map, and the epoch this server was in when it was fetched.
    map: tokio::sync::Mutex<(u64, Vec<(String, ServerClient)>)>,
}

impl Peers {
    pub(crate) fn new(coordinator: CoordinatorLink, connector: Connector) -> Self {
        Self {
            coordinator,
            connector,
            map: tokio::sync::Mutex::new((0, Vec::new())),
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
        let mut guard = self.map.lock().await;
        let (fetched_in, map) = &mut *guard;
        if fresh || *fetched_in < epoch || map.get(server).is_none_or(|(a, _)| a.is_empty()) {
            let placement = self.coordinator.placement().await?;
            // Only a map that arrived counts as fetched in this epoch.
            *fetched_in = epoch;
            *map = placement
                .servers
                .into_iter()
                .map(|a| {
                    let client =
                        self.connector
                            .server(if a.is_empty() { "0.0.0.0:0" } else { &a })?;
                    Ok((a, client))
                })
                .collect::<Result<_, PsError>>()?;
        }
        map.get(server)
            .filter(|(a, _)| !a.is_empty())
            .map(|(_, c)| c.clone())
            .ok_or_else(|| PsError::Unavailable(format!("server {server} has no address yet")))
    }
}
