//! gRPC channels with bounded waits: every call carries the job's RPC timeout, and
//! connecting to an address that does not answer fails with the address in the message.

use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

use crate::PsError;
use crate::proto::parameter_server_client;
use crate::proto::{HeartbeatRequest, coordinator_client};

pub type CoordinatorClient = coordinator_client::CoordinatorClient<Channel>;
pub type ServerClient = parameter_server_client::ParameterServerClient<Channel>;

fn endpoint(address: &str, timeout: Duration) -> Result<Endpoint, PsError> {
    Ok(Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| PsError::Config(format!("bad address {address:?}: {e}")))?
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(5)))
        .tcp_nodelay(true))
}

/// A channel that connects on first use (and reconnects after a failure).
pub fn connect_lazy(address: &str, timeout: Duration) -> Result<Channel, PsError> {
    Ok(endpoint(address, timeout)?.connect_lazy())
}

pub fn server_client(address: &str, timeout: Duration) -> Result<ServerClient, PsError> {
    Ok(ServerClient::new(connect_lazy(address, timeout)?)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX))
}

/// Connects to the coordinator, retrying for up to `timeout` (it may still be starting).
pub async fn connect_coordinator(
    address: &str,
    timeout: Duration,
) -> Result<CoordinatorClient, PsError> {
    let ep = endpoint(address, timeout)?;
    let started = Instant::now();
    loop {
        match ep.connect().await {
            Ok(channel) => return Ok(CoordinatorClient::new(channel)),
            Err(e) if started.elapsed() >= timeout.min(Duration::from_secs(10)) => {
                return Err(PsError::Rpc {
                    what: format!("cannot reach the coordinator at {address}"),
                    message: format!("{e} (after {:.1}s)", started.elapsed().as_secs_f64()),
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Sends `request` every `period`, ignoring failures, until the task is aborted: keeps a
/// member alive at the coordinator while its main loop is busy (a worker computing, a
/// server building its shard). Losing the coordinator is the main loop's to notice.
pub async fn keep_alive(
    mut coordinator: CoordinatorClient,
    request: HeartbeatRequest,
    period: Duration,
) {
    loop {
        let _ = coordinator.heartbeat(request).await;
        tokio::time::sleep(period).await;
    }
}

/// Binds a listener on `host:port` (port 0: any) and returns it with the address it got.
pub async fn bind(host: &str, port: u16) -> Result<(tokio::net::TcpListener, String), PsError> {
    let io = |error| PsError::Io {
        path: format!("{host}:{port}"),
        error,
    };
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(io)?;
    let address = listener.local_addr().map_err(io)?.to_string();
    Ok((listener, address))
}
