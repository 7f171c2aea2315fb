//! The rebuild's bulk stream: a survivor's cycle ranges over a raw TCP connection rather
//! than inside an RPC reply. gRPC copies a reply's bytes twice more than the data needs
//! (into the message, then out of HTTP/2 frames into the decoder's buffer) and frames
//! them; on this 2-core host that made the rebuild cost about 2.5 core-seconds per GB
//! installed, where the loopback copy itself costs about 0.27 per GB moved.
//!
//! **Straight from the table.** A survivor answers a range under one read lock of its
//! shard (the lock that makes rows and applied steps one snapshot) by handing the table's
//! own bytes to the kernel: what the socket takes at once is copied by the kernel only,
//! and just the rest is copied out, still under the lock, to be sent after it is let go.
//! Before, the whole range was copied out and then sent: a copy of every byte more, which
//! was a quarter of the rebuild's CPU (`perf`, issue 23). The lock is held about as long
//! as that copy took, and never while waiting on the network: the socket is written only
//! as far as it does not block.
//!
//! **A closed port.** A connection serves nothing until it presents a *session ticket*: a
//! random 128-bit number the survivor issued over the job's authenticated RPC
//! (`FetchSlots` with `bulk_session`), good for one connection and expiring unused after
//! the rebuild's stall deadline. Tickets only travel inside the job's RPC, so the cluster
//! stays closed; the stream is not encrypted, so a job with TLS does not use it.
//!
//! The protocol, every integer little-endian:
//! - `OPEN`: the byte `0` and the 16-byte ticket; the answer is 8 bytes, `0` (opened) or
//!   `u64::MAX` (no such ticket: the connection closes).
//! - `RANGE`, on an opened connection: the byte `1`, then epoch (8), table (4), data slots
//!   first and end, parity slots first and end (8 each). The answer: status `0`, applied
//!   floor (8), count of steps applied ahead (4) and each (8), data bytes (8), parity bytes
//!   (8), then the rows, data then parity; or status `1` and the error as the RPC would
//!   have carried it: code (4), message length (4) and message, details length (4) and
//!   details.
//!
//! One connection serves any number of ranges in turn.

use std::collections::HashMap;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use ftrec_rpc::PsError;

use crate::rebuild::boost::RebuildBoost;

const OPEN: u8 = 0;
const RANGE: u8 = 1;
const OPENED: u64 = 0;
const NO_SUCH_TICKET: u64 = u64::MAX;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;
/// A range request after its op byte: epoch, table, four slot bounds.
const RANGE_ASK_BYTES: usize = 8 + 4 + 4 * 8;

/// A cycle range asked of a survivor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RangeAsk {
    pub epoch: u64,
    pub table: u32,
    pub data: Range<u64>,
    pub parity: Range<u64>,
}

impl RangeAsk {
    fn encode(&self) -> [u8; 1 + RANGE_ASK_BYTES] {
        let mut out = [0u8; 1 + RANGE_ASK_BYTES];
        out[0] = RANGE;
        out[1..9].copy_from_slice(&self.epoch.to_le_bytes());
        out[9..13].copy_from_slice(&self.table.to_le_bytes());
        for (n, v) in [
            self.data.start,
            self.data.end,
            self.parity.start,
            self.parity.end,
        ]
        .into_iter()
        .enumerate()
        {
            out[13 + 8 * n..21 + 8 * n].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn decode(raw: &[u8; RANGE_ASK_BYTES]) -> Self {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut table = [0u8; 4];
        table.copy_from_slice(&raw[8..12]);
        Self {
            epoch: u64_at(0),
            table: u32::from_le_bytes(table),
            data: u64_at(12)..u64_at(20),
            parity: u64_at(28)..u64_at(36),
        }
    }
}

/// A range's rows, borrowed from the survivor's shard under its read lock, and the steps
/// they hold.
pub(crate) struct RangeRows<'a> {
    pub applied_below: u64,
    pub applied_ahead: Vec<u64>,
    pub data: &'a [u8],
    pub parity: &'a [u8],
}

/// Where a survivor's ranges come from: its shard (`Core`).
pub(crate) trait RangeSource: Send + Sync {
    /// Checks `ask` and calls `send` once with its rows, under the read lock that makes
    /// them and their steps one snapshot. `send` must not block.
    fn with_range(
        &self,
        ask: &RangeAsk,
        send: &mut dyn FnMut(RangeRows<'_>),
    ) -> Result<(), PsError>;
}

/// A survivor's bulk port and the session tickets it issued.
pub(crate) struct BulkServer {
    address: String,
    issued: Mutex<HashMap<u128, Instant>>,
    source: OnceLock<Weak<dyn RangeSource>>,
    /// How long an issued ticket, or an opened connection between ranges, waits.
    expiry: Duration,
    /// Held while a connection is open (`rebuild/boost.rs`): the survivor's copies are half the
    /// rebuild's CPU.
    boost: Option<Arc<RebuildBoost>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl BulkServer {
    /// Listens on `host` (a port the OS picks) and serves until dropped.
    pub(crate) async fn start(
        host: &str,
        expiry: Duration,
        boost: Option<Arc<RebuildBoost>>,
    ) -> Result<Arc<Self>, PsError> {
        let (listener, address) = ftrec_rpc::client::bind(host, 0).await?;
        Ok(Arc::new_cyclic(|me: &Weak<Self>| {
            let accepting = tokio::spawn(accept(listener, me.clone()));
            Self {
                address,
                issued: Mutex::new(HashMap::new()),
                source: OnceLock::new(),
                expiry,
                boost,
                accepting,
            }
        }))
    }

    /// Where ranges come from; set once, after the shard's owner is built.
    pub(crate) fn serve_from(&self, source: Weak<dyn RangeSource>) {
        let _ = self.source.set(source);
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// A ticket that opens one connection, if presented within the expiry.
    pub(crate) fn issue(&self) -> u128 {
        let ticket: u128 = rand::random();
        let now = Instant::now();
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        // Expired tickets go as new ones come: bounded by what is asked within one expiry.
        issued.retain(|_, at| now.duration_since(*at) < self.expiry);
        issued.insert(ticket, now);
        ticket
    }

    /// Takes `ticket` if issued and not expired.
    fn redeem(&self, ticket: u128) -> bool {
        let now = Instant::now();
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        issued.retain(|_, at| now.duration_since(*at) < self.expiry);
        issued.remove(&ticket).is_some()
    }
}

impl Drop for BulkServer {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn accept(listener: TcpListener, server: Weak<BulkServer>) {
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
        if let Some(bytes) = send_buffer_bytes() {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&stream, bytes);
        }
        let server = server.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(stream, server).await {
                tracing::debug!("bulk connection ended: {e}");
            }
        });
    }
}

/// The send buffer a bulk connection asks for: 4 MiB, which Linux doubles to 8 MiB, room
/// for several ranges, so that a range goes from the table straight to the kernel and
/// little or nothing is copied out (at 4x rows, 0.88-0.91 core-seconds per GB rebuilt against
/// 0.98-1.03 with the kernel's own sizing, two runs each, issue 23). Only where the host
/// allows that much (`net.core.wmem_max`): a fixed size turns off the kernel's own
/// sizing, which reaches 4 MiB by default, so a smaller one would cost more than it saves.
fn send_buffer_bytes() -> Option<usize> {
    const WANTED: usize = 4 << 20;
    let max: usize = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (max >= WANTED).then_some(WANTED)
}

/// Answers one connection: an `OPEN` with a good ticket, then ranges until the claimant
/// closes it or goes quiet for an expiry. Anything else closes it: a stranger gets one
/// answer, "no such ticket".
async fn serve(mut stream: TcpStream, server: Weak<BulkServer>) -> std::io::Result<()> {
    let mut opened = false;
    let mut _boosted = None;
    loop {
        let Some(expiry) = server.upgrade().map(|s| s.expiry) else {
            return Ok(());
        };
        let mut op = [0u8; 1];
        match tokio::time::timeout(expiry, stream.read_exact(&mut op)).await {
            Err(_) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
        match op[0] {
            OPEN => {
                let mut ticket = [0u8; 16];
                stream.read_exact(&mut ticket).await?;
                let good = server
                    .upgrade()
                    .is_some_and(|s| s.redeem(u128::from_le_bytes(ticket)));
                if good {
                    _boosted = server
                        .upgrade()
                        .and_then(|s| s.boost.as_ref().map(|b| b.hold()));
                }
                let answer = if good { OPENED } else { NO_SUCH_TICKET };
                stream.write_all(&answer.to_le_bytes()).await?;
                if !good {
                    return Ok(());
                }
                opened = true;
            }
            RANGE if opened => {
                let mut raw = [0u8; RANGE_ASK_BYTES];
                stream.read_exact(&mut raw).await?;
                let ask = RangeAsk::decode(&raw);
                let source = server.upgrade().and_then(|s| s.source.get()?.upgrade());
                let Some(source) = source else {
                    return Ok(());
                };
                // A claimant that stops reading (frozen, cut off) must not hold this task,
                // its copy of the rest and the connection for longer than an expiry.
                tokio::time::timeout(expiry, send_range(&mut stream, source.as_ref(), &ask))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("a range not taken in {expiry:?}"),
                        )
                    })??;
            }
            _ => {
                stream.write_all(&NO_SUCH_TICKET.to_le_bytes()).await?;
                return Ok(());
            }
        }
    }
}

/// Sends `ask`'s answer: as much as the socket takes at once straight from the table,
/// under the source's lock, and the rest from a copy made under the same lock.
async fn send_range(
    stream: &mut TcpStream,
    source: &dyn RangeSource,
    ask: &RangeAsk,
) -> std::io::Result<()> {
    // Writable now, so that the write under the lock moves bytes rather than finding the
    // socket full; waited for without the lock.
    stream.writable().await?;
    let mut rest: Vec<u8> = Vec::new();
    let answered = source.with_range(ask, &mut |rows| {
        let header = ok_header(&rows);
        let parts = [&header[..], rows.data, rows.parity];
        let sent = write_now(stream, &parts);
        rest = unsent(&parts, sent);
    });
    match answered {
        Ok(()) => stream.write_all(&rest).await,
        Err(e) => stream.write_all(&error_frame(e)).await,
    }
}

fn ok_header(rows: &RangeRows<'_>) -> Vec<u8> {
    let mut h = Vec::with_capacity(1 + 8 + 4 + 8 * rows.applied_ahead.len() + 16);
    h.push(STATUS_OK);
    h.extend_from_slice(&rows.applied_below.to_le_bytes());
    h.extend_from_slice(&(rows.applied_ahead.len() as u32).to_le_bytes());
    for step in &rows.applied_ahead {
        h.extend_from_slice(&step.to_le_bytes());
    }
    h.extend_from_slice(&(rows.data.len() as u64).to_le_bytes());
    h.extend_from_slice(&(rows.parity.len() as u64).to_le_bytes());
    h
}

/// The error as the RPC would have carried it, so the claimant reads the same `PsError`.
fn error_frame(e: PsError) -> Vec<u8> {
    let status = tonic::Status::from(e);
    let (message, details) = (status.message().as_bytes(), status.details());
    let mut out = Vec::with_capacity(1 + 12 + message.len() + details.len());
    out.push(STATUS_ERROR);
    out.extend_from_slice(&(status.code() as i32).to_le_bytes());
    out.extend_from_slice(&(message.len() as u32).to_le_bytes());
    out.extend_from_slice(message);
    out.extend_from_slice(&(details.len() as u32).to_le_bytes());
    out.extend_from_slice(details);
    out
}

/// Writes `parts` in order as far as the socket takes them without blocking; returns the
/// bytes written. An error stops it: the write of the rest reports it.
fn write_now(stream: &TcpStream, parts: &[&[u8]]) -> usize {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut sent = 0;
    while sent < total {
        let remaining = remaining_slices(parts, sent);
        match stream.try_write_vectored(&remaining) {
            Ok(0) | Err(_) => break,
            Ok(n) => sent += n,
        }
    }
    sent
}

/// The slices of `parts` after the first `skip` bytes.
fn remaining_slices<'a>(parts: &[&'a [u8]], mut skip: usize) -> Vec<IoSlice<'a>> {
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        if skip >= part.len() {
            skip -= part.len();
            continue;
        }
        out.push(IoSlice::new(&part[skip..]));
        skip = 0;
    }
    out
}

/// The bytes of `parts` after the first `skip`, copied.
fn unsent(parts: &[&[u8]], skip: usize) -> Vec<u8> {
    let slices = remaining_slices(parts, skip);
    let mut out = Vec::with_capacity(slices.iter().map(|s| s.len()).sum());
    for s in slices {
        out.extend_from_slice(&s);
    }
    out
}

/// A ticket as the RPC carries it.
pub(crate) fn ticket_bytes(ticket: u128) -> bytes::Bytes {
    bytes::Bytes::copy_from_slice(&ticket.to_le_bytes())
}

pub(crate) fn ticket_of(bytes: &[u8]) -> Result<u128, PsError> {
    let raw: [u8; 16] = bytes
        .try_into()
        .map_err(|_| PsError::BadRequest(format!("a bulk ticket of {} bytes", bytes.len())))?;
    Ok(u128::from_le_bytes(raw))
}

mod client;
pub(crate) use client::BulkClient;

#[cfg(test)]
mod tests;
