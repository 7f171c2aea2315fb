//! turmoil's simulated TCP as a member's [`Transport`]: the member's listeners bind on its
//! simulated host, and its channels dial other simulated hosts, so every byte between
//! members crosses the network that the simulation delays, holds and cuts.

use std::io;
use std::net::Ipv4Addr;

use ftrec_rpc::network::{Conn, Incoming, Transport};
use futures::StreamExt;
use futures::future::BoxFuture;

/// The network of the simulated host `host`.
pub struct TurmoilTransport {
    host: String,
}

impl TurmoilTransport {
    pub fn new(host: &str) -> Self {
        Self {
            host: host.to_string(),
        }
    }
}

impl Transport for TurmoilTransport {
    fn bind(&self, port: u16) -> BoxFuture<'static, io::Result<(Incoming, String)>> {
        let host = self.host.clone();
        Box::pin(async move {
            // turmoil binds only the unspecified address; others reach the listener at the
            // host's simulated address.
            let listener = turmoil::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await?;
            let port = listener.local_addr()?.port();
            let address = format!("{}:{port}", turmoil::lookup(host.as_str()));
            let incoming = futures::stream::unfold(listener, |listener| async move {
                let accepted = listener.accept().await.map(|(stream, _)| Conn::new(stream));
                Some((accepted, listener))
            });
            Ok((incoming.boxed(), address))
        })
    }

    fn dial(&self, address: String) -> BoxFuture<'static, io::Result<Conn>> {
        Box::pin(async move {
            turmoil::net::TcpStream::connect(address.as_str())
                .await
                .map(Conn::new)
        })
    }
}
