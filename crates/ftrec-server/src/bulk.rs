//! The rebuild's bulk stream: a survivor's cycle ranges over a raw TCP connection rather
//! than inside an RPC reply. gRPC copies a reply's bytes twice more than the data needs
//! (into the message, then out of HTTP/2 frames into the decoder's buffer) and frames
//! them; on this 2-core host that made the rebuild cost about 2.5 core-seconds per GB
//! installed, where the loopback copy itself costs about 0.27 per GB moved.
//!
//! The snapshot is still taken by `FetchSlots`, over the job's authenticated RPC: the
//! survivor copies the range under its read lock, parks the copy under a random 128-bit
//! *ticket* and answers with the ticket and its applied steps. The replacement then
//! claims the ticket on the survivor's bulk port, or drops it unread when the snapshot
//! turned out inconsistent. The port serves nothing without a ticket, and tickets only
//! travel inside the job's RPC, so the cluster stays closed; the stream is not encrypted,
//! so a job with TLS does not use it. A ticket not claimed within the rebuild's stall
//! deadline expires.
//!
//! The protocol, every integer little-endian: the claimant sends one byte (`0` claim,
//! `1` drop) and the 16-byte ticket; the survivor answers the byte count `n` (8 bytes;
//! `u64::MAX`: no such ticket) and then `n` bytes, data rows then parity rows. One
//! connection serves any number of tickets in turn.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use ftrec_proto::PsError;

const CLAIM: u8 = 0;
const DROP: u8 = 1;
const NO_SUCH_TICKET: u64 = u64::MAX;

/// A parked range.
struct Parked {
    parked_at: Instant,
    data: Bytes,
    parity: Bytes,
}

/// A survivor's bulk port and the ranges parked there.
pub(crate) struct BulkServer {
    address: String,
    parked: Mutex<HashMap<u128, Parked>>,
    /// How long a parked range waits for its claim.
    expiry: Duration,
    accepting: tokio::task::JoinHandle<()>,
}

impl BulkServer {
    /// Listens on `host` (a port the OS picks) and serves claims until dropped.
    pub(crate) async fn start(host: &str, expiry: Duration) -> Result<Arc<Self>, PsError> {
        let (listener, address) = ftrec_proto::client::bind(host, 0).await?;
        Ok(Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let accepting = tokio::spawn(accept(listener, me.clone()));
            Self {
                address,
                parked: Mutex::new(HashMap::new()),
                expiry,
                accepting,
            }
        }))
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// Parks a range until claimed or expired; returns its ticket.
    pub(crate) fn park(&self, data: Bytes, parity: Bytes) -> u128 {
        let ticket: u128 = rand::random();
        let now = Instant::now();
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        // Expired ranges go as new ones come: memory stays bounded by what the
        // replacements fetch within one expiry.
        parked.retain(|_, p| now.duration_since(p.parked_at) < self.expiry);
        parked.insert(
            ticket,
            Parked {
                parked_at: now,
                data,
                parity,
            },
        );
        ticket
    }

    fn take(&self, ticket: u128) -> Option<Parked> {
        let now = Instant::now();
        let mut parked = self.parked.lock().unwrap_or_else(|p| p.into_inner());
        // Expired ranges go here too: a replacement that died leaves none behind for long.
        parked.retain(|_, p| now.duration_since(p.parked_at) < self.expiry);
        parked.remove(&ticket)
    }
}

impl Drop for BulkServer {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn accept(listener: TcpListener, server: std::sync::Weak<BulkServer>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors or the like: wait rather than spin.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if server.strong_count() == 0 {
            return;
        }
        let _ = stream.set_nodelay(true);
        let server = server.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(stream, server).await {
                tracing::debug!("bulk connection ended: {e}");
            }
        });
    }
}

/// Answers claims on one connection until the claimant closes it, goes quiet for an
/// expiry, or names a ticket that is not parked. The port is open to anyone who can reach
/// it, so a connection that claims nothing real is not kept: a stranger gets one answer,
/// "no such ticket", and the connection closes.
async fn serve(mut stream: TcpStream, server: std::sync::Weak<BulkServer>) -> std::io::Result<()> {
    let mut request = [0u8; 17];
    loop {
        let expiry = match server.upgrade() {
            Some(s) => s.expiry,
            None => return Ok(()),
        };
        match tokio::time::timeout(expiry, stream.read_exact(&mut request)).await {
            Err(_) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
        let mut ticket = [0u8; 16];
        ticket.copy_from_slice(&request[1..]);
        // Held only for the lookup: a connection keeps the port's parked ranges no longer.
        let parked = server
            .upgrade()
            .and_then(|s| s.take(u128::from_le_bytes(ticket)));
        match (request[0], parked) {
            (CLAIM, Some(p)) => {
                let n = (p.data.len() + p.parity.len()) as u64;
                stream.write_all(&n.to_le_bytes()).await?;
                stream.write_all(&p.data).await?;
                stream.write_all(&p.parity).await?;
            }
            (DROP, _) => stream.write_all(&0u64.to_le_bytes()).await?,
            _ => {
                stream.write_all(&NO_SUCH_TICKET.to_le_bytes()).await?;
                return Ok(());
            }
        }
    }
}

/// A replacement's side: connections to survivors' bulk ports, kept for the next claim.
pub(crate) struct BulkClient {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    /// Bounds each claim: a silent survivor must not hold the rebuild.
    deadline: Duration,
}

impl BulkClient {
    pub(crate) fn new(deadline: Duration) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            deadline,
        }
    }

    async fn connection(&self, address: &str) -> std::io::Result<TcpStream> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(address)
            .and_then(Vec::pop);
        match idle {
            Some(stream) => Ok(stream),
            None => {
                let stream = TcpStream::connect(address).await?;
                stream.set_nodelay(true)?;
                Ok(stream)
            }
        }
    }

    fn keep(&self, address: &str, stream: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(address.to_string())
            .or_default()
            .push(stream);
    }

    /// One request on a pooled connection: the op, the ticket, then the answer's byte
    /// count and, for a claim, `into` filled with the bytes.
    async fn exchange(
        &self,
        address: &str,
        op: u8,
        ticket: u128,
        into: &mut Vec<u8>,
        expect: u64,
    ) -> std::io::Result<u64> {
        let mut stream = self.connection(address).await?;
        let mut request = [0u8; 17];
        request[0] = op;
        request[1..].copy_from_slice(&ticket.to_le_bytes());
        stream.write_all(&request).await?;
        let n = stream.read_u64_le().await?;
        if n == NO_SUCH_TICKET {
            // The survivor closes the connection after a miss.
            return Ok(n);
        }
        if op == CLAIM && n != expect {
            // Not read: the connection is out of step with what was asked, so it closes.
            return Ok(n);
        }
        if op == CLAIM {
            // Into the buffer's spare capacity: no zeroing of what the socket overwrites,
            // and never past this answer (the connection serves the next claim).
            into.clear();
            into.reserve(n as usize);
            let mut answer = (&mut stream).take(n);
            while (into.len() as u64) < n {
                if answer.read_buf(into).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
        }
        self.keep(address, stream);
        Ok(n)
    }

    /// Claims `ticket` at `address`: exactly `expect` bytes, read into `bytes` (a buffer
    /// kept from an earlier claim: its pages are mapped already).
    pub(crate) async fn claim(
        &self,
        address: &str,
        ticket: u128,
        expect: usize,
        mut bytes: Vec<u8>,
    ) -> Result<Vec<u8>, PsError> {
        let what = || format!("bulk claim at {address}");
        let n = tokio::time::timeout(
            self.deadline,
            self.exchange(address, CLAIM, ticket, &mut bytes, expect as u64),
        )
        .await
        .map_err(|_| PsError::Unavailable(format!("{}: no answer in {:?}", what(), self.deadline)))?
        .map_err(|e| PsError::Unavailable(format!("{}: {e}", what())))?;
        if n == NO_SUCH_TICKET {
            // Expired, or the survivor restarted: the caller reads the range again.
            return Err(PsError::Overloaded(format!(
                "{}: the range is no longer parked",
                what()
            )));
        }
        if n as usize != expect {
            return Err(PsError::BadRequest(format!(
                "{}: {n} bytes for {expect} asked",
                what()
            )));
        }
        Ok(bytes)
    }

    /// Lets `ticket` go unread (its snapshot was not consistent); best effort, as the
    /// survivor expires it anyway.
    pub(crate) async fn drop_ticket(&self, address: &str, ticket: u128) {
        let mut none = Vec::new();
        let _ = tokio::time::timeout(
            self.deadline,
            self.exchange(address, DROP, ticket, &mut none, 0),
        )
        .await;
    }
}

/// A ticket as the RPC carries it.
pub(crate) fn ticket_bytes(ticket: u128) -> Bytes {
    Bytes::copy_from_slice(&ticket.to_le_bytes())
}

pub(crate) fn ticket_of(bytes: &[u8]) -> Result<u128, PsError> {
    let raw: [u8; 16] = bytes
        .try_into()
        .map_err(|_| PsError::BadRequest(format!("a bulk ticket of {} bytes", bytes.len())))?;
    Ok(u128::from_le_bytes(raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_parked_range_is_claimed_once_and_a_dropped_one_is_gone() {
        let server = BulkServer::start("127.0.0.1", Duration::from_secs(10))
            .await
            .unwrap();
        let client = BulkClient::new(Duration::from_secs(5));
        let data = Bytes::from(vec![7u8; 3 << 20]);
        let parity = Bytes::from_static(b"parity");
        let ticket = server.park(data.clone(), parity.clone());
        let got = client
            .claim(
                server.address(),
                ticket,
                data.len() + parity.len(),
                Vec::new(),
            )
            .await
            .unwrap();
        assert_eq!(&got[..data.len()], &data[..]);
        assert_eq!(&got[data.len()..], &parity[..]);
        // Claimed: a second claim finds nothing, on the same pooled connection.
        let again = client.claim(server.address(), ticket, got.len(), got).await;
        assert!(matches!(again, Err(PsError::Overloaded(_))), "{again:?}");
        // A guessed ticket gets nothing.
        let guessed = client
            .claim(server.address(), ticket ^ 1, 6, Vec::new())
            .await;
        assert!(
            matches!(guessed, Err(PsError::Overloaded(_))),
            "{guessed:?}"
        );
        let dropped = server.park(Bytes::new(), parity.clone());
        client.drop_ticket(server.address(), dropped).await;
        let late = client
            .claim(server.address(), dropped, parity.len(), Vec::new())
            .await;
        assert!(matches!(late, Err(PsError::Overloaded(_))), "{late:?}");
        // A length that disagrees with what was asked is an error, not a short read.
        let short = server.park(Bytes::from_static(b"abc"), Bytes::new());
        let wrong = client.claim(server.address(), short, 4, Vec::new()).await;
        assert!(matches!(wrong, Err(PsError::BadRequest(_))), "{wrong:?}");
    }

    #[tokio::test]
    async fn a_range_not_claimed_in_time_expires() {
        let server = BulkServer::start("127.0.0.1", Duration::from_millis(1))
            .await
            .unwrap();
        let old = server.park(Bytes::from_static(b"old"), Bytes::new());
        tokio::time::sleep(Duration::from_millis(5)).await;
        // Expiry is swept as new ranges are parked.
        let _new = server.park(Bytes::from_static(b"new"), Bytes::new());
        assert!(server.take(old).is_none());
    }

    #[test]
    fn a_ticket_of_the_wrong_length_is_refused() {
        assert!(ticket_of(&[0u8; 15]).is_err());
        assert_eq!(ticket_of(&ticket_bytes(42)).unwrap(), 42);
    }
}
