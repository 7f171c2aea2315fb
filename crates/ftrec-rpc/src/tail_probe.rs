//! Tail probes: a lost *last* segment of a call found in one round trip, not in two timer
//! ticks.
//!
//! TCP finds a lost segment at once when later segments arrive: the receiver SACKs them
//! and the sender's RACK marks the hole lost. The last segment of a burst has nothing
//! after it, so its loss waits for the loss-probe timer, which Linux keeps in whole ticks:
//! at least 8 ms at 250 Hz, against step calls of about a millisecond. On a link losing 5%
//! of its packets that was most of what the loss still cost (BENCHMARKS [F8]: pushes 3.5
//! → 8.1 ms a step). So after each burst a connection writes `probes` empty HTTP/2 frames
//! of an unassigned type, each in a segment of its own: a receiver must ignore a frame of
//! a type it does not know (RFC 9113 §4.1, §5.5; h2 does), and if the burst's tail was
//! lost, the probes arrive behind the hole and the sender retransmits within a round
//! trip. Two probes, not one: with one segment SACKed past the hole, RACK waits a reorder
//! window that it arms as a timer of at least two ticks; with as many SACKed as TCP's
//! duplicate threshold it retransmits at once, and the burst's last data segment counts.
//! A scratch test in two namespaces with 5% loss each way (2,000-byte calls, 500-byte
//! answers, 3,000 calls): 1.37-1.55 ms a call without probes, 0.51-0.53 with one, 0.33-0.37
//! with two.
//!
//! Probes cost a write and a segment per burst, so they are sent only on a connection that
//! has lost packets lately: every [`CHECK_EVERY`] bursts the socket's retransmission count
//! is read (`TCP_INFO`), and a rise turns probes on for the next [`PROBE_FOR`] bursts. A
//! connection that never loses a packet never sends one.
//!
//! A probe goes only between whole frames, outside a header block (a frame inside one is
//! a protocol error): the writer follows the frames it passes on ([`FrameCursor`]) rather
//! than trusting that hyper flushes at frame boundaries. Not under TLS, whose stream no
//! byte may be added to: TLS connections are left as they are.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::loss_watch::LinkLoss;

/// An empty frame of type 0xf5 (RFC 9113 reserves 0xf0-0xff for experiments) on stream 0.
const PROBE: [u8; 9] = [0, 0, 0, 0xf5, 0, 0, 0, 0, 0];
/// What a client writes before its first frame (RFC 9113 §3.4).
const CLIENT_PREFACE_LEN: usize = 24;
/// How often, in bursts, a connection reads its retransmission count.
pub const CHECK_EVERY: u64 = 16;
/// A connection is losing packets when, since it last looked, at least this many of its
/// segments were retransmitted...
pub const LOSS_RETRANSMITS: u32 = 2;
/// ...and they were at least this percent of the segments it sent. A lone retransmission
/// is no loss: on a loaded host's loopback, with the retransmission floor at 5 ms, a few
/// timers fire before a starved peer's ACK (76 of 152,000 segments in a 300-step `ec` run on
/// 2 cores), and each one used to keep a connection's probes on for [`PROBE_FOR`] bursts:
/// most connections of a failure-free run probed, thousands of probes a run.
pub const LOSS_PERCENT: u64 = 1;

/// Whether `retransmitted` of `segments` sent says the link loses packets.
fn losing(retransmitted: u32, segments: u32) -> bool {
    retransmitted >= LOSS_RETRANSMITS
        && u64::from(retransmitted) * 100 >= u64::from(segments) * LOSS_PERCENT
}
/// How long, in bursts, a retransmission keeps probes on.
pub const PROBE_FOR: u64 = 1024;
/// The most probes a burst may be followed by (`cluster.deadlines.tail_probes`).
pub const MAX_PROBES: u32 = 4;

const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

/// Which end of an HTTP/2 connection writes through the probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// Where the bytes written so far leave the HTTP/2 frame stream.
#[derive(Clone, Debug)]
pub(crate) struct FrameCursor {
    preface_left: usize,
    head: [u8; 9],
    head_len: usize,
    payload_left: usize,
    in_header_block: bool,
    /// A preface must be followed by SETTINGS (RFC 9113 §3.4): no probe before the first
    /// frame.
    framed: bool,
}

impl FrameCursor {
    pub(crate) fn new(side: Side) -> Self {
        Self {
            preface_left: match side {
                Side::Client => CLIENT_PREFACE_LEN,
                Side::Server => 0,
            },
            head: [0; 9],
            head_len: 0,
            payload_left: 0,
            in_header_block: false,
            framed: false,
        }
    }

    /// Follows `bytes`, written after everything passed before.
    pub(crate) fn advance(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = if self.preface_left > 0 {
                let n = self.preface_left.min(bytes.len());
                self.preface_left -= n;
                n
            } else if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                n
            } else {
                let n = (self.head.len() - self.head_len).min(bytes.len());
                self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
                self.head_len += n;
                if self.head_len == self.head.len() {
                    self.head_len = 0;
                    self.end_of_head();
                }
                n
            };
            bytes = &bytes[n..];
        }
    }

    fn end_of_head(&mut self) {
        self.framed = true;
        let [l0, l1, l2, kind, flags, ..] = self.head;
        self.payload_left = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
        if matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION) {
            self.in_header_block = flags & END_HEADERS == 0;
        }
    }

    /// Whether a frame may be written next.
    pub(crate) fn between_frames(&self) -> bool {
        self.framed
            && self.preface_left == 0
            && self.head_len == 0
            && self.payload_left == 0
            && !self.in_header_block
    }
}

/// What a socket has sent in its life: data segments, and how many of them were
/// retransmissions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub segments: u32,
    pub retransmitted: u32,
}

/// A socket that can say how many segments it has sent and retransmitted.
pub trait Retransmits {
    /// None where the platform does not say.
    fn sent(&self) -> Option<Sent>;
}

impl Retransmits for tokio::net::TcpStream {
    fn sent(&self) -> Option<Sent> {
        #[cfg(target_os = "linux")]
        {
            crate::retransmit::sent(self).ok()
        }
        #[cfg(not(target_os = "linux"))]
        None
    }
}

/// A connection that follows its bursts with tail probes while it loses packets (see the
/// module's text). With `probes` 0 it passes everything through untouched.
pub struct TailProbes<S> {
    inner: S,
    probes: u32,
    frames: FrameCursor,
    /// Bytes were written since the last burst ended.
    wrote: bool,
    /// Bytes of a probe the socket took only part of: written before anything else.
    owed: usize,
    bursts: u64,
    probe_until: u64,
    seen: Sent,
    /// The last look found the link [`losing`].
    losing_before: bool,
    probes_sent: u64,
    /// Where loss at two looks in a row is told, for the peer's calls to see
    /// ([`crate::loss_watch`]).
    loss: Option<Arc<LinkLoss>>,
}

impl<S> TailProbes<S> {
    pub fn new(inner: S, side: Side, probes: u32) -> Self {
        Self {
            inner,
            probes: probes.min(MAX_PROBES),
            frames: FrameCursor::new(side),
            wrote: false,
            owed: 0,
            bursts: 0,
            probe_until: 0,
            seen: Sent::default(),
            losing_before: false,
            probes_sent: 0,
            loss: None,
        }
    }

    /// The same, telling `link` whenever two looks in a row find the connection
    /// [`losing`] (only a connection with probes on reads its retransmissions).
    pub fn watched_by(mut self, link: Arc<LinkLoss>) -> Self {
        self.loss = Some(link);
        self
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncWrite + Retransmits + Unpin> TailProbes<S> {
    /// Writes what is owed of a probe taken in part.
    fn poll_owed(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.owed > 0 {
            let from = PROBE.len() - self.owed;
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &PROBE[from..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.owed -= n;
        }
        Poll::Ready(Ok(()))
    }

    /// Whether this burst's end gets probes: whether the socket retransmitted lately.
    fn probing(&mut self) -> bool {
        self.bursts += 1;
        if self.bursts % CHECK_EVERY == 1
            && let Some(now) = self.inner.sent()
        {
            let retransmitted = now.retransmitted.wrapping_sub(self.seen.retransmitted);
            let segments = now.segments.wrapping_sub(self.seen.segments);
            let losing_now = losing(retransmitted, segments);
            // Calls' copies cost far more than probes: they wait for loss seen at two
            // looks in a row, which a starved peer's one stall does not make.
            if losing_now
                && self.losing_before
                && let Some(loss) = &self.loss
            {
                loss.noted();
            }
            self.losing_before = losing_now;
            if losing_now {
                if self.bursts > self.probe_until {
                    tracing::debug!(
                        "tail probes on after {} bursts: {retransmitted} of {segments} segments \
                         retransmitted since the last look, {} probes so far",
                        self.bursts,
                        self.probes_sent
                    );
                }
                self.probe_until = self.bursts + PROBE_FOR;
            }
            self.seen = now;
        }
        self.bursts <= self.probe_until
    }

    /// Ends a burst: its probes, each a write of its own so that each is a segment of its
    /// own. A socket with no room skips them: with its buffer full it has segments in
    /// flight behind which a loss is found anyway.
    fn probe(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        for _ in 0..self.probes {
            match Pin::new(&mut self.inner).poll_write(cx, &PROBE) {
                Poll::Ready(Ok(n)) if n == PROBE.len() => self.probes_sent += 1,
                Poll::Ready(Ok(n)) => {
                    self.owed = PROBE.len() - n;
                    return Ok(());
                }
                Poll::Ready(Err(e)) => return Err(e),
                Poll::Pending => return Ok(()),
            }
        }
        Ok(())
    }

    fn wrote(&mut self, bufs: &[io::IoSlice<'_>], mut n: usize) {
        if n > 0 {
            self.wrote = true;
        }
        for buf in bufs {
            if n == 0 {
                break;
            }
            let take = n.min(buf.len());
            self.frames.advance(&buf[..take]);
            n -= take;
        }
    }
}

impl<S> Drop for TailProbes<S> {
    fn drop(&mut self) {
        if self.probes_sent > 0 {
            tracing::debug!(
                "a connection sent {} tail probes after {} bursts ({} retransmits)",
                self.probes_sent,
                self.bursts,
                self.seen.retransmitted
            );
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for TailProbes<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Retransmits + Unpin> AsyncWrite for TailProbes<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.probes == 0 {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        ready!(this.poll_owed(cx))?;
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.wrote(&[io::IoSlice::new(buf)], n);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.probes == 0 {
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        ready!(this.poll_owed(cx))?;
        let n = ready!(Pin::new(&mut this.inner).poll_write_vectored(cx, bufs))?;
        this.wrote(bufs, n);
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    /// hyper flushes when it has written what it had: the end of a burst.
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.probes > 0 {
            ready!(this.poll_owed(cx))?;
            if this.wrote && this.frames.between_frames() {
                this.wrote = false;
                if this.probing() {
                    this.probe(cx)?;
                }
            }
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.probes > 0 {
            ready!(this.poll_owed(cx))?;
        }
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::io::AsyncWriteExt;

    fn frame(kind: u8, flags: u8, payload: usize) -> Vec<u8> {
        let mut f = vec![
            (payload >> 16) as u8,
            (payload >> 8) as u8,
            payload as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.extend(std::iter::repeat_n(0xab, payload));
        f
    }

    /// A socket that records what it was given, in at most `room` bytes a write, and says
    /// it retransmitted as often as the test sets.
    struct Wire {
        got: Vec<u8>,
        writes: usize,
        room: usize,
        retransmits: Arc<AtomicU32>,
    }

    impl AsyncWrite for Wire {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.room);
            self.got.extend_from_slice(&buf[..n]);
            self.writes += 1;
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl Retransmits for Wire {
        fn sent(&self) -> Option<Sent> {
            Some(Sent {
                segments: self.writes as u32,
                retransmitted: self.retransmits.load(Ordering::Relaxed),
            })
        }
    }

    fn wire(room: usize) -> (Wire, Arc<AtomicU32>) {
        let retransmits = Arc::new(AtomicU32::new(0));
        let w = Wire {
            got: Vec::new(),
            writes: 0,
            room,
            retransmits: retransmits.clone(),
        };
        (w, retransmits)
    }

    /// The frames of `bytes` (after a client's preface), each as (kind, payload length).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, usize)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len =
                usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
            out.push((bytes[3], len));
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// Loss in the socket's retransmissions at two looks in a row is told to the peer's
    /// link, for its calls' copies to see ([`crate::loss_watch`]); nothing is told while
    /// the count stays, rises by one, or rises at one look only.
    #[tokio::test]
    async fn a_rise_in_retransmissions_marks_the_link_lossy() {
        let watch = crate::loss_watch::LossWatch::default();
        let memory = crate::loss_watch::LOSS_MEMORY;
        let (w, retransmits) = wire(usize::MAX);
        let mut conn = TailProbes::new(w, Side::Server, 2).watched_by(watch.link("peer:1"));
        let burst = frame(0x0, 0, 100);
        for _ in 0..3 * CHECK_EVERY {
            conn.write_all(&burst).await.unwrap();
            conn.flush().await.unwrap();
        }
        assert_eq!(watch.lost_within("peer:1", memory), Some(false));
        // One retransmission between two looks is no loss (a timer on a loaded host).
        retransmits.store(1, Ordering::Relaxed);
        for _ in 0..CHECK_EVERY {
            conn.write_all(&burst).await.unwrap();
            conn.flush().await.unwrap();
        }
        assert_eq!(watch.lost_within("peer:1", memory), Some(false));
        // Loss at one look turns probes on, but marks the link only at the second in a row.
        for (retransmitted, lossy) in [(4, false), (7, true)] {
            retransmits.store(retransmitted, Ordering::Relaxed);
            for _ in 0..CHECK_EVERY {
                conn.write_all(&burst).await.unwrap();
                conn.flush().await.unwrap();
            }
            assert_eq!(watch.lost_within("peer:1", memory), Some(lossy));
        }
    }

    #[tokio::test]
    async fn a_burst_is_followed_by_probes_only_while_its_socket_retransmits() {
        let (w, retransmits) = wire(usize::MAX);
        let mut conn = TailProbes::new(w, Side::Server, 2);
        let burst = frame(0x0, 0, 100);
        conn.write_all(&burst).await.unwrap();
        conn.flush().await.unwrap();
        assert_eq!(conn.get_ref().got, burst, "no loss yet: no probe");

        retransmits.store(3, Ordering::Relaxed);
        // The count is read every CHECK_EVERY bursts: the rise is seen at the next reading.
        for _ in 1..CHECK_EVERY {
            conn.write_all(&burst).await.unwrap();
            conn.flush().await.unwrap();
        }
        let before = conn.get_ref().got.len();
        conn.write_all(&burst).await.unwrap();
        conn.flush().await.unwrap();
        let written = conn.get_ref().got[before..].to_vec();
        assert_eq!(frames(&written), vec![(0x0, 100), (0xf5, 0), (0xf5, 0)]);

        // A flush with nothing written since is no burst.
        let writes = conn.get_ref().writes;
        conn.flush().await.unwrap();
        assert_eq!(conn.get_ref().writes, writes);

        // Each probe is a write of its own, so a segment of its own.
        conn.write_all(&burst).await.unwrap();
        conn.flush().await.unwrap();
        assert_eq!(conn.get_ref().writes, writes + 3);

        // Without further loss, probes stop after PROBE_FOR bursts.
        for _ in 0..PROBE_FOR + CHECK_EVERY {
            conn.write_all(&burst).await.unwrap();
            conn.flush().await.unwrap();
        }
        let before = conn.get_ref().got.len();
        conn.write_all(&burst).await.unwrap();
        conn.flush().await.unwrap();
        assert_eq!(conn.get_ref().got[before..], burst[..]);
    }

    #[tokio::test]
    async fn no_probe_goes_inside_a_frame_or_a_header_block() {
        let (w, retransmits) = wire(usize::MAX);
        retransmits.store(LOSS_RETRANSMITS, Ordering::Relaxed);
        let mut conn = TailProbes::new(w, Side::Client, 2);
        // The preface, then half a frame: hyper never flushes there, but if it did the
        // stream must stay whole.
        conn.write_all(&[b'P'; CLIENT_PREFACE_LEN]).await.unwrap();
        conn.flush().await.unwrap();
        let data = frame(0x0, 0, 50);
        conn.write_all(&data[..20]).await.unwrap();
        conn.flush().await.unwrap();
        conn.write_all(&data[20..]).await.unwrap();
        // HEADERS without END_HEADERS opens a block that only a CONTINUATION with it ends.
        conn.write_all(&frame(HEADERS, 0, 10)).await.unwrap();
        conn.flush().await.unwrap();
        conn.write_all(&frame(CONTINUATION, END_HEADERS, 5))
            .await
            .unwrap();
        conn.flush().await.unwrap();
        let got = &conn.get_ref().got[CLIENT_PREFACE_LEN..];
        assert_eq!(
            frames(got),
            vec![
                (0x0, 50),
                (HEADERS, 10),
                (CONTINUATION, 5),
                (0xf5, 0),
                (0xf5, 0)
            ]
        );
    }

    #[tokio::test]
    async fn a_probe_taken_in_part_is_finished_before_the_next_frame() {
        let (w, retransmits) = wire(4);
        retransmits.store(LOSS_RETRANSMITS, Ordering::Relaxed);
        let mut conn = TailProbes::new(w, Side::Server, 2);
        let data = frame(0x0, 0, 3);
        conn.write_all(&data).await.unwrap();
        conn.flush().await.unwrap();
        conn.write_all(&data).await.unwrap();
        conn.shutdown().await.unwrap();
        let got = conn.get_ref().got.clone();
        assert_eq!(frames(&got)[0], (0x0, 3));
        assert_eq!(frames(&got)[1], (0xf5, 0));
        assert_eq!(*frames(&got).last().unwrap(), (0x0, 3));
    }

    #[tokio::test]
    async fn with_no_probes_the_bytes_pass_untouched() {
        let (w, retransmits) = wire(usize::MAX);
        retransmits.store(9, Ordering::Relaxed);
        let mut conn = TailProbes::new(w, Side::Server, 0);
        let data = frame(0x0, 0, 7);
        conn.write_all(&data).await.unwrap();
        conn.flush().await.unwrap();
        assert_eq!(conn.get_ref().got, data);
    }

    proptest! {
        /// However a frame stream is cut into writes, the cursor is between frames exactly
        /// at frame ends outside header blocks.
        #[test]
        fn the_cursor_finds_every_frame_end_however_the_writes_split(
            kinds in prop::collection::vec((0u8..12, any::<bool>(), 0usize..300), 1..20),
            cuts in prop::collection::vec(1usize..64, 1..40),
        ) {
            let mut stream = Vec::new();
            let mut ends = std::collections::BTreeSet::new();
            let mut in_block = false;
            for (kind, end_headers, len) in kinds {
                let flags = if end_headers { END_HEADERS } else { 0 };
                stream.extend(frame(kind, flags, len));
                if matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION) {
                    in_block = !end_headers;
                }
                if !in_block {
                    ends.insert(stream.len());
                }
            }
            let mut cursor = FrameCursor::new(Side::Server);
            let mut at = 0;
            let mut cut = cuts.iter().cycle();
            while at < stream.len() {
                let n = (*cut.next().unwrap()).min(stream.len() - at);
                cursor.advance(&stream[at..at + n]);
                at += n;
                prop_assert_eq!(cursor.between_frames(), ends.contains(&at), "at {}", at);
            }
        }
    }
}
