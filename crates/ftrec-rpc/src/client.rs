//! gRPC channels with bounded waits: every call carries the job's RPC timeout and secret
//! (TLS too, when configured), and connecting to an address that does not answer fails
//! with the address in the message.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Uri};

use crate::hedge::first_answer;
use crate::loss_watch::{LOSS_MEMORY, LossWatch};
use crate::network::{Network, Transport};
use crate::tail_probe::{Side, TailProbes};

use crate::PsError;
use crate::auth::{AttachSecret, JobSecret, TlsMaterial};
use ftrec_proto::proto::parameter_server_client;
use ftrec_proto::proto::{AppliedRequest, HeartbeatRequest, coordinator_client};

pub type AuthChannel = InterceptedService<Channel, AttachSecret>;
type TcpIo = hyper_util::rt::TokioIo<TailProbes<tokio::net::TcpStream>>;
pub type CoordinatorClient = coordinator_client::CoordinatorClient<AuthChannel>;
pub type ServerClient = parameter_server_client::ParameterServerClient<AuthChannel>;

/// HTTP/2 flow control sized for the rebuild's multi-MiB replies: with hyper's defaults
/// (64 KiB windows, 16 KiB frames) a survivor stalls for a window update every 64 KiB and
/// the replacement handles a frame every 16 KiB (issue 23: the rebuild moved 137 MB/s).
/// Small calls are unaffected: a window is a limit, not an allocation.
pub const HTTP2_STREAM_WINDOW: u32 = 8 << 20;
pub const HTTP2_CONNECTION_WINDOW: u32 = 32 << 20;
pub const HTTP2_MAX_FRAME: u32 = 1 << 20;

/// When a TCP dial still unanswered is raced by a second ([`Connector`]'s dialer). A
/// handshake on a job's network takes well under a millisecond, a loaded host's included
/// (the kernel answers a SYN itself); a second dial costs one socket.
pub const SECOND_DIAL_AFTER: Duration = Duration::from_millis(30);

/// How a connection notices that its peer went silent (frozen, its link down) when no
/// call is waiting on it to time out: an idle connection, or one a stream holds open.
/// Without it a connection to a vanished peer stays open for TCP's retransmission limit
/// (about 15 minutes), and every call sent on it meanwhile waits out its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// An HTTP/2 PING (and, on TCP, a keepalive probe) after this long with nothing read.
    pub ping_after: Duration,
    /// The connection is closed when a PING goes unanswered this long, or sent data stays
    /// unacknowledged this long (`TCP_USER_TIMEOUT`, where the platform has it).
    pub give_up_after: Duration,
    /// TCP's minimum retransmission timeout and longest delayed ACK on the connection
    /// (`cluster.deadlines.retransmit_min_ms`, Linux 6.15+; see `retransmit.rs`). None:
    /// the kernel's own.
    pub retransmit_min: Option<Duration>,
    /// Tail probes after each burst while the connection loses packets
    /// (`cluster.deadlines.tail_probes`; see `tail_probe.rs`). 0: none, as under TLS.
    pub tail_probes: u32,
}

impl Liveness {
    /// Pings after the failure timeout; gives up after the streams' progress deadline.
    pub fn of(deadlines: &ftrec_config::Deadlines) -> Self {
        Self {
            ping_after: deadlines.heartbeat,
            give_up_after: deadlines.stream_progress,
            retransmit_min: deadlines.retransmit_min,
            tail_probes: deadlines.tail_probes,
        }
    }

    /// Sets `TCP_USER_TIMEOUT` on an accepted socket, where the platform has it:
    /// unacknowledged data then closes the connection after `give_up_after`, rather than
    /// after TCP's own retransmission limit. And [`Liveness::tune_retransmits`].
    pub fn tune(&self, socket: &tokio::net::TcpStream) {
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
        {
            let ms = u32::try_from(self.give_up_after.as_millis()).unwrap_or(u32::MAX);
            if let Err(e) = rustix::net::sockopt::set_tcp_user_timeout(socket, ms) {
                tracing::warn!("TCP_USER_TIMEOUT not set: {e}");
            }
        }
        self.tune_retransmits(socket);
    }

    /// Lowers TCP's retransmission floor on a connected or accepted socket
    /// (`retransmit_min`), where the kernel allows it.
    pub fn tune_retransmits(&self, socket: &tokio::net::TcpStream) {
        #[cfg(target_os = "linux")]
        crate::retransmit::tune(socket, self.retransmit_min);
        #[cfg(not(target_os = "linux"))]
        let _ = socket;
    }
}

impl Default for Liveness {
    fn default() -> Self {
        Self::of(&ftrec_config::ClusterSection::default().deadlines())
    }
}

/// How a member calls the others. Cheap to clone.
#[derive(Clone)]
pub struct Connector {
    timeout: Duration,
    secret: AttachSecret,
    tls: Option<ClientTlsConfig>,
    network: Network,
    liveness: Liveness,
    /// Which peers' connections retransmitted lately (the connections with tail probes).
    loss: LossWatch,
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
            liveness: Liveness::default(),
            loss: LossWatch::default(),
        })
    }

    /// Whether a connection to `address` retransmitted lately; `None` where none reads
    /// its retransmissions (tail probes off, TLS, a simulated network). See
    /// [`crate::loss_watch`].
    pub fn lost_lately(&self, address: &str) -> Option<bool> {
        self.loss.lost_within(address, LOSS_MEMORY)
    }

    /// The same, noticing silent peers as `liveness` says.
    pub fn with_liveness(self, liveness: Liveness) -> Self {
        Self { liveness, ..self }
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
            .max_frame_size(HTTP2_MAX_FRAME)
            .http2_keep_alive_interval(self.liveness.ping_after)
            .keep_alive_timeout(self.liveness.give_up_after)
            // A pooled connection found dead before a call is sent on it costs that call
            // nothing; found dead by the call, it costs the call's deadline.
            .keep_alive_while_idle(true);
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
            None => endpoint.connect_with_connector_lazy(self.tcp()),
            Some(transport) => endpoint.connect_with_connector_lazy(dialer(transport.clone())),
        }
    }

    /// The host's TCP dialer as tonic's own (no Nagle, the endpoint's connect timeout is
    /// applied around it), with keepalive probes, `TCP_USER_TIMEOUT` and the
    /// retransmission floor, which tonic's endpoint does not set. A dial unanswered after
    /// [`SECOND_DIAL_AFTER`] is raced by a second one on a socket of its own (the first
    /// handshake to finish wins; the other is dropped): the kernel resends a lost SYN or
    /// SYN-ACK only after a whole second (`TCP_TIMEOUT_INIT`), which no socket option
    /// lowers, and on a link losing 5% of its packets one dial in ten lost one.
    fn tcp(
        &self,
    ) -> impl tower::Service<
        Uri,
        Response = TcpIo,
        Error = tower::BoxError,
        Future = impl Future<Output = Result<TcpIo, tower::BoxError>> + Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_keepalive(Some(self.liveness.ping_after));
        http.set_keepalive_interval(Some(self.liveness.ping_after));
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
        http.set_tcp_user_timeout(Some(self.liveness.give_up_after));
        let liveness = self.liveness;
        // No byte may be added inside TLS's stream, and tonic puts TLS over this one.
        let probes = if self.tls.is_some() {
            0
        } else {
            liveness.tail_probes
        };
        let loss = self.loss.clone();
        tower::service_fn(move |uri: Uri| {
            // Only a connection with probes reads its retransmissions.
            let link = uri
                .authority()
                .filter(|_| probes > 0)
                .map(|a| loss.link(a.as_str()));
            let first = tower::ServiceExt::oneshot(http.clone(), uri.clone());
            let second = tower::ServiceExt::oneshot(http.clone(), uri);
            async move {
                let io = first_answer(first, Some((SECOND_DIAL_AFTER, second)))
                    .await
                    .result?;
                let stream = io.into_inner();
                liveness.tune_retransmits(&stream);
                let probed = TailProbes::new(stream, Side::Client, probes);
                Ok(TcpIo::new(match link {
                    Some(link) => probed.watched_by(link),
                    None => probed,
                }))
            }
        })
    }

    /// Connects at once (an error if no one listens there).
    async fn connect(&self, endpoint: &Endpoint) -> Result<Channel, tonic::transport::Error> {
        match self.network.transport() {
            None => endpoint.connect_with_connector(self.tcp()).await,
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

    /// Whether the server at `address` answers a call on a connection of its own within
    /// `within`. Any answer counts, a refusal too; silence or a failed transport does not.
    /// It tells a peer that is cut off or frozen from one that is only slow, which a call
    /// waiting on the pooled connection cannot: a fresh connection's packets get through a
    /// slow link, and none gets through a partition.
    pub async fn reaches(&self, address: &str, within: Duration) -> bool {
        let probe = async {
            let endpoint = self.endpoint(address).ok()?.timeout(within);
            let channel = self.connect(&endpoint).await.ok()?;
            let mut client =
                ServerClient::new(InterceptedService::new(channel, self.secret.clone()));
            Some(match client.applied(AppliedRequest::default()).await {
                Ok(_) => true,
                Err(status) => !matches!(PsError::rpc("probe", &status), PsError::Unavailable(_)),
            })
        };
        matches!(tokio::time::timeout(within, probe).await, Ok(Some(true)))
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
        let first = a.heartbeat(request.clone());
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
        let _ = beats.beat(request.clone()).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Accepted sockets carry the give-up time as `TCP_USER_TIMEOUT`: unacknowledged data
    /// closes them after it, not after TCP's own retransmission limit (about 15 minutes).
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_tuned_socket_gives_up_on_unacknowledged_data_after_the_liveness_bound() {
        let (listener, address) = bind("127.0.0.1", 0).await.unwrap();
        let _dialled = tokio::net::TcpStream::connect(&address).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        assert_eq!(
            rustix::net::sockopt::tcp_user_timeout(&accepted).unwrap(),
            0
        );
        let liveness = Liveness {
            ping_after: Duration::from_millis(400),
            give_up_after: Duration::from_millis(2_500),
            retransmit_min: None,
            tail_probes: 0,
        };
        liveness.tune(&accepted);
        assert_eq!(
            rustix::net::sockopt::tcp_user_timeout(&accepted).unwrap(),
            2_500
        );
    }

    /// Both ends of a job's connection lower TCP's retransmission floor: the accepted
    /// socket when the listener tunes it, the dialled one in the connector's dialer.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn both_ends_of_a_connection_lower_the_retransmission_floor() {
        use tower::{Service, ServiceExt};
        let kernel_floor = Duration::from_millis(200);
        let (listener, address) = bind("127.0.0.1", 0).await.unwrap();
        let deadlines = ftrec_config::ClusterSection::default().deadlines();
        let liveness = Liveness::of(&deadlines);
        assert_eq!(liveness.retransmit_min, Some(Duration::from_millis(5)));
        let secret = crate::auth::JobSecret::generate();
        let connector = Connector::new(Duration::from_secs(5), &secret, None, Network::default())
            .unwrap()
            .with_liveness(liveness);
        let mut dialer = connector.tcp();
        let uri: Uri = format!("http://{address}").parse().unwrap();
        let dialled = dialer.ready().await.unwrap().call(uri).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let Ok(before) = crate::retransmit::rto_min(&accepted) else {
            // A kernel before 6.15: tuning must leave the connection as it was.
            liveness.tune(&accepted);
            eprintln!("this kernel has no TCP_RTO_MIN_US: checked only that tuning is harmless");
            return;
        };
        assert_eq!(
            before, kernel_floor,
            "an untuned socket has the kernel's floor"
        );
        liveness.tune(&accepted);
        for (end, socket) in [
            ("accepted", &accepted),
            ("dialled", dialled.inner().get_ref()),
        ] {
            let floor = crate::retransmit::rto_min(socket).unwrap();
            // The kernel rounds up to whole jiffies (8 ms at HZ = 250).
            assert!(
                floor >= Duration::from_millis(5) && floor < Duration::from_millis(20),
                "{end}: {floor:?}"
            );
        }
    }

    /// A dial whose SYN is lost is raced by a second one instead of waiting out the
    /// kernel's one-second SYN timer. The listener's accept queue (backlog 0: room for one)
    /// is full when the first SYN arrives, so the kernel drops it, as a lossy link would;
    /// one connection is accepted meanwhile, and the second dial gets in.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_dial_whose_syn_is_lost_is_raced_by_a_second() {
        use tower::{Service, ServiceExt};
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let address = listener.local_addr().unwrap();
        let _queued = tokio::net::TcpStream::connect(address).await.unwrap();
        let secret = crate::auth::JobSecret::generate();
        let connector =
            Connector::new(Duration::from_secs(5), &secret, None, Network::default()).unwrap();
        let mut dialer = connector.tcp();
        let uri: Uri = format!("http://{address}").parse().unwrap();
        let started = Instant::now();
        let dial = tokio::spawn(async move { dialer.ready().await?.call(uri).await });
        tokio::time::sleep(SECOND_DIAL_AFTER / 3).await;
        let _accepted = listener.accept().await.unwrap();
        let dialled = dial.await.unwrap();
        let took = started.elapsed();
        assert!(dialled.is_ok(), "{:?}", dialled.err());
        // Not before the second dial: the first SYN was dropped, not answered.
        assert!(took >= SECOND_DIAL_AFTER, "{took:?}");
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    #[test]
    fn liveness_follows_the_failure_timeout_and_the_progress_deadline() {
        let mut cluster = ftrec_config::ClusterSection {
            failure_timeout_ms: 400,
            ..Default::default()
        };
        cluster.deadlines.stream_progress_ms = Some(2_000);
        assert_eq!(
            Liveness::of(&cluster.deadlines()),
            Liveness {
                ping_after: Duration::from_millis(400),
                give_up_after: Duration::from_millis(2_000),
                retransmit_min: Some(Duration::from_millis(5)),
                tail_probes: 2,
            }
        );
    }
}
