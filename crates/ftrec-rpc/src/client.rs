//! gRPC channels with bounded waits: every call carries the job's RPC timeout and secret
//! (TLS too, when configured), and connecting to an address that does not answer fails
//! with the address in the message.

use std::time::Duration;

use tokio::time::Instant;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Uri};

use crate::network::{Network, Transport};

use crate::PsError;
use crate::auth::{AttachSecret, JobSecret, TlsMaterial};
use ftrec_proto::proto::parameter_server_client;
use ftrec_proto::proto::{HeartbeatRequest, coordinator_client};

pub type AuthChannel = InterceptedService<Channel, AttachSecret>;
pub type CoordinatorClient = coordinator_client::CoordinatorClient<AuthChannel>;
pub type ServerClient = parameter_server_client::ParameterServerClient<AuthChannel>;

/// HTTP/2 flow control sized for the rebuild's multi-MiB replies: with hyper's defaults
/// (64 KiB windows, 16 KiB frames) a survivor stalls for a window update every 64 KiB and
/// the replacement handles a frame every 16 KiB (issue 23: the rebuild moved 137 MB/s).
/// Small calls are unaffected: a window is a limit, not an allocation.
pub const HTTP2_STREAM_WINDOW: u32 = 8 << 20;
pub const HTTP2_CONNECTION_WINDOW: u32 = 32 << 20;
pub const HTTP2_MAX_FRAME: u32 = 1 << 20;

/// How a member calls the others. Cheap to clone.
#[derive(Clone)]
pub struct Connector {
    timeout: Duration,
    secret: AttachSecret,
    tls: Option<ClientTlsConfig>,
    network: Network,
}

impl Connector {
    pub fn new(
        timeout: Duration,
        secret: &JobSecret,
        tls: Option<&TlsMaterial>,
        network: Network,
    ) -> Result<Self, PsError> {
        Ok(Self {
            timeout,
            secret: secret.attacher()?,
            tls: tls.map(TlsMaterial::client),
            network,
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The same, with another bound on each call.
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        Self {
            timeout,
            ..self.clone()
        }
    }

    fn endpoint(&self, address: &str) -> Result<Endpoint, PsError> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| PsError::Config(format!("bad address {address:?}: {e}")))?
            .timeout(self.timeout)
            .connect_timeout(self.timeout.min(Duration::from_secs(5)))
            .tcp_nodelay(true)
            .initial_stream_window_size(HTTP2_STREAM_WINDOW)
            .initial_connection_window_size(HTTP2_CONNECTION_WINDOW)
            .max_frame_size(HTTP2_MAX_FRAME);
        match &self.tls {
            Some(tls) => endpoint
                .tls_config(tls.clone())
                .map_err(|e| PsError::Config(format!("TLS settings for {address}: {e}"))),
            None => Ok(endpoint),
        }
    }

    /// Dials through the member's network: the host's TCP stack, or a simulated one.
    fn channel(&self, endpoint: &Endpoint) -> Channel {
        match self.network.transport() {
            None => endpoint.connect_lazy(),
            Some(transport) => endpoint.connect_with_connector_lazy(dialer(transport.clone())),
        }
    }

    /// Connects at once (an error if no one listens there).
    async fn connect(&self, endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
        match self.network.transport() {
            None => endpoint.connect().await,
            Some(transport) => {
                endpoint
                    .connect_with_connector(dialer(transport.clone()))
                    .await
            }
        }
    }

    /// A server client whose channel connects on first use (and reconnects after a
    /// failure).
    pub fn server(&self, address: &str) -> Result<ServerClient, PsError> {
        let channel = self.channel(&self.endpoint(address)?);
        Ok(
            ServerClient::new(InterceptedService::new(channel, self.secret.clone()))
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
        )
    }

    /// A coordinator client that connects on first use (a new leader, found in etcd).
    pub fn coordinator_lazy(&self, address: &str) -> Result<CoordinatorClient, PsError> {
        let channel = self.channel(&self.endpoint(address)?);
        Ok(CoordinatorClient::new(InterceptedService::new(
            channel,
            self.secret.clone(),
        )))
    }

    /// Connects to the coordinator, retrying for up to the timeout (at most 10 s: it may
    /// still be starting).
    pub async fn coordinator(&self, address: &str) -> Result<CoordinatorClient, PsError> {
        let ep = self.endpoint(address)?;
        let started = Instant::now();
        loop {
            match self.connect(&ep).await {
                Ok(channel) => {
                    return Ok(CoordinatorClient::new(InterceptedService::new(
                        channel,
                        self.secret.clone(),
                    )));
                }
                Err(e) if started.elapsed() >= self.timeout.min(Duration::from_secs(10)) => {
                    return Err(PsError::Rpc {
                        what: format!("cannot reach the coordinator at {address}"),
                        message: format!(
                            "{} (after {:.1}s)",
                            with_causes(&e),
                            started.elapsed().as_secs_f64()
                        ),
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// hyper's connector over a [`Transport`]: dials the URI's authority.
pub(crate) fn dialer(
    transport: std::sync::Arc<dyn Transport>,
) -> impl tower::Service<
    Uri,
    Response = hyper_util::rt::TokioIo<crate::network::Conn>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<hyper_util::rt::TokioIo<crate::network::Conn>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: Uri| {
        let address = uri.authority().map(|a| a.to_string()).unwrap_or_default();
        let dialing = transport.dial(address);
        async move { dialing.await.map(hyper_util::rt::TokioIo::new) }
    })
}

/// An error with its chain of causes: tonic's transport errors say only "transport
/// error" at the top, and the cause (a refused certificate, say) is what a person needs.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Heartbeats over two connections of their own, each beat sent on both: a member is
/// alive if either delivers. A lost TCP segment stalls its connection for a retransmission
/// timeout (200 ms, doubling with each further loss of it), and everything behind it
/// waits: on a link with 5% loss one connection now and then goes quiet for longer than
/// the failure timeout, and the member would be declared dead while it works. Both
/// connections stall together about as often as the square of that.
#[derive(Clone)]
pub struct HeartbeatClient {
    links: [crate::leader::CoordinatorLink; 2],
}

impl HeartbeatClient {
    pub fn new(
        first: crate::leader::CoordinatorLink,
        second: crate::leader::CoordinatorLink,
    ) -> Self {
        Self {
            links: [first, second],
        }
    }

    /// One beat: the first answer that is not a failure, else the last failure.
    pub async fn beat(
        &self,
        request: HeartbeatRequest,
    ) -> Result<tonic::Response<ftrec_proto::proto::HeartbeatReply>, tonic::Status> {
        let client = |l: &crate::leader::CoordinatorLink| {
            l.client()
                .map_err(|e| tonic::Status::unavailable(e.to_string()))
        };
        let (mut a, mut b) = (client(&self.links[0])?, client(&self.links[1])?);
        let first = a.heartbeat(request);
        let second = b.heartbeat(request);
        tokio::pin!(first, second);
        // Biased toward the first link: tokio picks among ready branches at random
        // otherwise, and the simulated cluster's seeds would not replay.
        tokio::select! {
            biased;
            r = &mut first => match r {
                Ok(reply) => Ok(reply),
                Err(_) => second.await,
            },
            r = &mut second => match r {
                Ok(reply) => Ok(reply),
                Err(_) => first.await,
            },
        }
    }
}

/// Sends `request` every `period`, ignoring failures, until the task is aborted: keeps a
/// member alive at the coordinator while its main loop is busy (a worker computing, a
/// server building its shard). Losing the coordinator is the main loop's to notice.
pub async fn keep_alive(beats: HeartbeatClient, request: HeartbeatRequest, period: Duration) {
    loop {
        let _ = beats.beat(request).await;
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
