//! Where a member's connections go: the host's TCP stack, or a simulated network that a
//! test drives (`ftrec-sim`, over turmoil). Every listener a member opens and every
//! channel it dials goes through its job's [`Network`], so the real coordinator, servers
//! and workers run unchanged in one process over a network the test controls.
//!
//! A simulated network also changes three things that would otherwise escape the
//! simulation: no metrics endpoint is opened (it would bind a real port), members report
//! no process id (so nothing can SIGKILL the test itself), and work that a member would
//! hand to tokio's blocking pool runs inline, so its order is the simulation's.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::PsError;

/// A byte stream to another member.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// One connection, of whichever network. tonic serves it, and hyper speaks over it.
pub struct Conn(Box<dyn Io>);

impl Conn {
    pub fn new(io: impl Io) -> Self {
        Self(Box::new(io))
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

/// The connections a listener accepts.
pub type Incoming = BoxStream<'static, io::Result<Conn>>;

/// A network other than the host's: binds listeners and dials addresses.
pub trait Transport: Send + Sync + 'static {
    /// Listens on `port` (0: any) and returns the address others reach it at.
    fn bind(&self, port: u16) -> BoxFuture<'static, io::Result<(Incoming, String)>>;
    fn dial(&self, address: String) -> BoxFuture<'static, io::Result<Conn>>;
}

/// The network of one member. The default is the host's TCP stack.
#[derive(Clone, Default)]
pub struct Network(Option<Arc<dyn Transport>>);

impl fmt::Debug for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_simulated() {
            "Network(simulated)"
        } else {
            "Network(tcp)"
        })
    }
}

impl Network {
    pub fn simulated(transport: Arc<dyn Transport>) -> Self {
        Self(Some(transport))
    }

    pub fn is_simulated(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.0.as_ref()
    }

    /// Listens on `host:port` (port 0: any) and returns the connections with the address
    /// the listener got. Accepted TCP connections give up on a silent peer as `liveness`
    /// says (keepalive probes, `TCP_USER_TIMEOUT`): tonic's own settings for them do not
    /// apply to connections it is handed. They send `liveness.tail_probes` tail probes
    /// (the caller sets none under TLS).
    pub async fn bind(
        &self,
        host: &str,
        port: u16,
        liveness: crate::client::Liveness,
    ) -> Result<(Incoming, String), PsError> {
        let io = |error| PsError::Io {
            path: format!("{host}:{port}"),
            error,
        };
        if let Some(transport) = &self.0 {
            return transport.bind(port).await.map_err(io);
        }
        let (listener, address) = crate::client::bind(host, port).await?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(liveness.ping_after))
            .with_keepalive_interval(Some(liveness.ping_after))
            .map(move |accepted| {
                accepted.map(|stream| {
                    liveness.tune(&stream);
                    Conn::new(crate::tail_probe::TailProbes::new(
                        stream,
                        crate::tail_probe::Side::Server,
                        liveness.tail_probes,
                    ))
                })
            });
        Ok((incoming.boxed(), address))
    }

    /// Opens a connection to `address` (the coordinator probes a suspect this way: a
    /// refusal means nothing listens there any more).
    pub async fn connect(&self, address: &str) -> io::Result<Conn> {
        match &self.0 {
            Some(transport) => transport.dial(address.to_string()).await,
            None => tokio::net::TcpStream::connect(address).await.map(Conn::new),
        }
    }

    /// Connects to the job's etcd: over the host's TCP stack as `etcd-client` dials it, or
    /// over the simulated network (the first endpoint, dialed through the transport, with
    /// the same timeouts and HTTP/2 keep-alives), so that a simulated etcd host's faults
    /// reach the coordinators and members as a real etcd's would.
    pub async fn connect_etcd(
        &self,
        opts: &ftrec_etcd::EtcdOptions,
    ) -> Result<ftrec_etcd::Etcd, ftrec_etcd::EtcdError> {
        let Some(transport) = &self.0 else {
            return ftrec_etcd::Etcd::connect(opts).await;
        };
        let unreachable = |error: String| ftrec_etcd::EtcdError::Unreachable {
            endpoints: opts.endpoints.join(","),
            error,
        };
        let first = opts
            .endpoints
            .first()
            .ok_or_else(|| unreachable("cluster.etcd_endpoints is empty".into()))?;
        let url = if first.contains("://") {
            first.clone()
        } else {
            format!("http://{first}")
        };
        let t = opts.request_timeout;
        let endpoint = tonic::transport::Endpoint::from_shared(url)
            .map_err(|e| unreachable(e.to_string()))?
            .connect_timeout(t)
            .timeout(t)
            .keep_alive_while_idle(true)
            .http2_keep_alive_interval(t / 4)
            .keep_alive_timeout(t);
        let channel =
            endpoint.connect_with_connector_lazy(crate::client::dialer(transport.clone()));
        ftrec_etcd::Etcd::connect_channel(channel, opts).await
    }

    /// The process id a member reports, for SIGKILL fault injection; none in a
    /// simulation, where every member shares the test's process.
    pub fn pid(&self) -> u32 {
        if self.is_simulated() {
            0
        } else {
            std::process::id()
        }
    }

    /// Runs CPU- or disk-bound work off the async threads, or inline in a simulation
    /// (where a blocking thread would run outside the simulated schedule).
    pub async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PsError> {
        if self.is_simulated() {
            return Ok(work());
        }
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| PsError::Internal(format!("blocking task: {e}")))
    }

    /// Runs CPU-bound work on this thread, telling a multi-threaded runtime to move its
    /// other tasks elsewhere meanwhile; a simulation (a single-threaded runtime) just runs
    /// it.
    pub fn in_place<T>(&self, work: impl FnOnce() -> T) -> T {
        if self.is_simulated() {
            return work();
        }
        tokio::task::block_in_place(work)
    }
}
