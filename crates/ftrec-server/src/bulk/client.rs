//! A replacement's side of the bulk stream: connections opened with a session ticket,
//! pooled per survivor, and ranges read into buffers the rebuild reuses.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use ftrec_rpc::PsError;

use super::{OPEN, OPENED, RangeAsk, STATUS_OK};

/// What a survivor answered to a range: its steps, and how many of the bytes read are data.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct RangeAnswer {
    pub applied: (u64, Vec<u64>),
    pub data_len: usize,
}

/// A replacement's side: opened connections to survivors' bulk ports, kept for the next
/// range.
pub(crate) struct BulkClient {
    /// Per survivor, opened connections and when each was kept.
    idle: Mutex<HashMap<usize, Vec<(TcpStream, Instant)>>>,
    /// Bounds each exchange: a silent survivor must not hold the rebuild.
    deadline: Duration,
}

impl BulkClient {
    pub(crate) fn new(deadline: Duration) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            deadline,
        }
    }

    /// An opened connection to `server` kept from an earlier range, if any. Connections
    /// idle for half the deadline or more are dropped instead: the survivor closes a
    /// connection idle for its own deadline (the same setting), and a rebuild that found
    /// only closed ones would count the survivor unreachable.
    pub(crate) fn pooled(&self, server: usize) -> Option<TcpStream> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let kept = idle.get_mut(&server)?;
        kept.retain(|(_, since)| since.elapsed() < self.deadline / 2);
        kept.pop().map(|(stream, _)| stream)
    }

    /// Keeps an opened connection to `server` whose last exchange ended cleanly.
    pub(crate) fn keep(&self, server: usize, stream: TcpStream) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(server)
            .or_default()
            .push((stream, Instant::now()));
    }

    /// Closes every kept connection: a survivor holds its rebuild-first priority while
    /// one is open (`rebuild/boost.rs`), so a rebuild that ended lets them go at once rather than
    /// after the survivor's idle deadline.
    pub(crate) fn close_all(&self) {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Connects to `address` and opens the connection with `ticket`.
    pub(crate) async fn open(&self, address: &str, ticket: u128) -> Result<TcpStream, PsError> {
        let what = || format!("bulk port {address}");
        let opening = async {
            let mut stream = TcpStream::connect(address).await?;
            stream.set_nodelay(true)?;
            let mut request = [0u8; 17];
            request[0] = OPEN;
            request[1..].copy_from_slice(&ticket.to_le_bytes());
            stream.write_all(&request).await?;
            let answer = stream.read_u64_le().await?;
            Ok::<_, std::io::Error>((stream, answer))
        };
        let (stream, answer) = tokio::time::timeout(self.deadline, opening)
            .await
            .map_err(|_| {
                PsError::Unavailable(format!("{}: no answer in {:?}", what(), self.deadline))
            })?
            .map_err(|e| PsError::Unavailable(format!("{}: {e}", what())))?;
        if answer != OPENED {
            // Expired, or the survivor restarted: the caller asks for a ticket again.
            return Err(PsError::Overloaded(format!(
                "{}: the session ticket was refused",
                what()
            )));
        }
        Ok(stream)
    }

    /// Asks `ask` on `stream` and reads its rows into `into` (a buffer kept from an
    /// earlier range: its pages are mapped already), checked against the slot counts
    /// asked. An I/O failure leaves the connection unusable: the caller drops it.
    pub(crate) async fn range(
        &self,
        stream: &mut TcpStream,
        ask: &RangeAsk,
        row_bytes: usize,
        into: &mut Vec<u8>,
    ) -> Result<RangeAnswer, PsError> {
        let exchange = async {
            stream.write_all(&ask.encode()).await?;
            read_answer(stream, into).await
        };
        let answer = tokio::time::timeout(self.deadline, exchange)
            .await
            .map_err(|_| {
                PsError::Unavailable(format!("bulk range: no answer in {:?}", self.deadline))
            })?
            .map_err(|e| PsError::Unavailable(format!("bulk range: {e}")))??;
        let asked = |r: &Range<u64>| (r.end.saturating_sub(r.start) as usize) * row_bytes;
        let parity_len = into.len().saturating_sub(answer.data_len);
        if answer.data_len != asked(&ask.data) || parity_len != asked(&ask.parity) {
            return Err(PsError::BadRequest(format!(
                "bulk range: {} + {parity_len} bytes for {} + {} asked",
                answer.data_len,
                asked(&ask.data),
                asked(&ask.parity)
            )));
        }
        Ok(answer)
    }
}

/// Reads one answer: `Ok(Ok)` with the rows in `into`, `Ok(Err)` for the survivor's error
/// (the connection stays usable), `Err` for a broken stream.
async fn read_answer(
    stream: &mut TcpStream,
    into: &mut Vec<u8>,
) -> std::io::Result<Result<RangeAnswer, PsError>> {
    let status = stream.read_u8().await?;
    if status != STATUS_OK {
        let code = stream.read_i32_le().await?;
        let message = read_sized(stream).await?;
        let details = read_sized(stream).await?;
        let status = tonic::Status::with_details(
            tonic::Code::from(code),
            String::from_utf8_lossy(&message),
            details.into(),
        );
        return Ok(Err(PsError::rpc("bulk range", &status)));
    }
    let applied_below = stream.read_u64_le().await?;
    let ahead = stream.read_u32_le().await?;
    // Each step ahead is one in flight: a handful, never millions.
    if ahead > 1 << 20 {
        return Err(std::io::Error::other(format!(
            "{ahead} steps applied ahead"
        )));
    }
    let mut applied_ahead = Vec::with_capacity(ahead as usize);
    for _ in 0..ahead {
        applied_ahead.push(stream.read_u64_le().await?);
    }
    let data_len = stream.read_u64_le().await? as usize;
    let parity_len = stream.read_u64_le().await? as usize;
    let n = data_len
        .checked_add(parity_len)
        .ok_or_else(|| std::io::Error::other("a range longer than memory"))?;
    // Into the buffer's spare capacity: no zeroing of what the socket overwrites, and never
    // past this answer (the connection serves the next range).
    into.clear();
    into.reserve(n);
    let mut body = (&mut *stream).take(n as u64);
    while into.len() < n {
        if body.read_buf(into).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(Ok(RangeAnswer {
        applied: (applied_below, applied_ahead),
        data_len,
    }))
}

async fn read_sized(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = stream.read_u32_le().await? as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::other(format!("an error of {len} bytes")));
    }
    let mut out = vec![0u8; len];
    stream.read_exact(&mut out).await?;
    Ok(out)
}
