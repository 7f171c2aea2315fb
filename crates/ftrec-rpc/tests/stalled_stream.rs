//! Streams that go wrong on the wire. Streamed replies whose sender goes silent mid-stream
//! (issue 42, hole 3): a call's deadline ends with the reply's headers; before the streams
//! had a progress deadline, each reader here waited forever. Each test is bounded by an
//! outer timeout, so a hang fails it. And calls cancelled in a burst, as hedged copies on
//! a lossy link arrive (issue 44 §3): the server must keep the connection.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use prost::bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::{Request, Response, Status};

use ftrec_proto::proto::parameter_server_server::{ParameterServer, ParameterServerServer};
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::auth::JobSecret;
use ftrec_rpc::client::{Connector, Liveness};
use ftrec_rpc::network::Network;

/// How long a stream may be silent in these tests.
const SILENCE: Duration = Duration::from_millis(300);
/// What counts as a hang.
const HANG: Duration = Duration::from_secs(10);

/// How the stub answers `FetchRows`.
#[derive(Clone, Copy)]
enum Rows {
    /// One empty piece, then nothing, for ever: a server stalled mid-stream.
    OneThenSilence,
    /// 16 KiB pieces every 5 ms, for ever: a server that streams until its link dies.
    Endless,
}

struct Stub(Rows);

type Replies<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The stub's RPCs other than `FetchRows`: none is called here.
macro_rules! stub_server {
    ($($name:ident($request:ty) -> $reply:ty;)*) => {
        #[tonic::async_trait]
        impl ParameterServer for Stub {
            type FetchRowsStream = Replies<FetchRowsChunk>;
            type RebuildStream = Replies<RebuildReply>;

            async fn fetch_rows(
                &self,
                _: Request<FetchRowsRequest>,
            ) -> Result<Response<Self::FetchRowsStream>, Status> {
                let rows: Self::FetchRowsStream = match self.0 {
                    Rows::OneThenSilence => Box::pin(
                        futures::stream::iter([Ok(FetchRowsChunk::default())])
                            .chain(futures::stream::pending()),
                    ),
                    Rows::Endless => Box::pin(futures::stream::unfold(0u32, |n| async move {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        let piece = FetchRowsChunk {
                            first_row: n,
                            rows: Bytes::from(vec![0u8; 16 << 10]),
                        };
                        Some((Ok(piece), n + 1))
                    })),
                };
                Ok(Response::new(rows))
            }

            async fn rebuild(
                &self,
                _: Request<RebuildRequest>,
            ) -> Result<Response<Self::RebuildStream>, Status> {
                Err(Status::unimplemented("stub"))
            }

            $(async fn $name(&self, _: Request<$request>) -> Result<Response<$reply>, Status> {
                Err(Status::unimplemented("stub"))
            })*
        }
    };
}

stub_server! {
    pull(PullRequest) -> PullReply;
    push(PushRequest) -> PushReply;
    checkpoint(CheckpointRequest) -> CheckpointReply;
    cut_committed(CutCommittedRequest) -> CutCommittedReply;
    restore(RestoreRequest) -> RestoreReply;
    set_epoch(SetEpochRequest) -> SetEpochReply;
    fence(FenceRequest) -> AppliedReply;
    fetch_dense(FetchDenseRequest) -> FetchDenseReply;
    applied(AppliedRequest) -> AppliedReply;
    prune(PruneRequest) -> PruneReply;
    shutdown(ShutdownRequest) -> ShutdownReply;
    parity_update(ParityUpdateRequest) -> ParityUpdateReply;
    commit_step(StepDecision) -> StepDecisionReply;
    abort_step(StepDecision) -> StepDecisionReply;
    fetch_slots(FetchSlotsRequest) -> FetchSlotsReply;
}

/// Serves the stub on loopback; returns its address.
async fn serve(rows: Rows) -> String {
    serve_with(tonic::transport::Server::builder(), rows).await
}

/// [`serve`] with the given server settings.
async fn serve_with(mut builder: tonic::transport::Server, rows: Rows) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        builder
            .add_service(ParameterServerServer::new(Stub(rows)))
            .serve_with_incoming(incoming),
    );
    address
}

/// A TCP relay to `upstream` whose link dies, both ways and without a FIN or RST, once
/// `budget` bytes went downstream: as a frozen host (SIGSTOP) or a pulled cable looks to
/// the reader, who sees nothing more, not even an answer to a ping.
async fn dying_link(upstream: String, budget: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let up = TcpStream::connect(&upstream).await.unwrap();
            let dead = Arc::new(AtomicBool::new(false));
            let (down_r, down_w) = down.into_split();
            let (up_r, up_w) = up.into_split();
            tokio::spawn(relay(down_r, up_w, usize::MAX, dead.clone()));
            tokio::spawn(relay(up_r, down_w, budget, dead));
        }
    });
    address
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut budget: usize,
    dead: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok(n) = from.read(&mut buf).await else {
            return;
        };
        if n == 0 || n > budget {
            dead.store(true, Ordering::SeqCst);
        }
        if dead.load(Ordering::SeqCst) {
            // Holds both sockets open, silent, for the rest of the test.
            futures::future::pending::<()>().await;
        }
        budget -= n;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

fn connector() -> Connector {
    Connector::new(
        Duration::from_secs(5),
        &JobSecret::generate(),
        None,
        Network::default(),
    )
    .unwrap()
}

fn assert_unavailable_naming(result: Result<Vec<u8>, PsError>, what: &str) {
    match result {
        Err(PsError::Unavailable(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("a silent server must be unavailable: {other:?}"),
    }
}

/// `fetch_all` (the rebuild's transfers from survivors, verify-parity) from a server that
/// sends one piece and then nothing.
#[tokio::test]
async fn fetch_all_from_a_server_stalled_mid_stream_fails_within_its_deadline() {
    let address = serve(Rows::OneThenSilence).await;
    let mut client = connector().server(&address).unwrap();
    let started = tokio::time::Instant::now();
    let fetched = tokio::time::timeout(
        HANG,
        ftrec_rpc::gather::fetch_all(&mut client, 1, 0, false, "table 0 of server 3", SILENCE),
    )
    .await
    .expect("fetch_all hung on a stalled stream");
    assert_unavailable_naming(fetched, "table 0 of server 3");
    assert!(started.elapsed() >= SILENCE);
}

/// The same through a link that dies after 200 KiB, the server still streaming behind it:
/// the stream's deadline ends it, well before the connection's keepalive would (a ping
/// after 1 s, given up 5 s later, with the default failure timeout).
#[tokio::test]
async fn fetch_all_through_a_link_that_dies_mid_stream_fails_within_its_deadline() {
    let relay = dying_link(serve(Rows::Endless).await, 200 << 10).await;
    let mut client = connector().server(&relay).unwrap();
    let started = tokio::time::Instant::now();
    let fetched = tokio::time::timeout(
        HANG,
        ftrec_rpc::gather::fetch_all(&mut client, 1, 0, true, "parity of server 1", SILENCE),
    )
    .await
    .expect("fetch_all hung behind a dead link");
    assert_unavailable_naming(fetched, "parity of server 1");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// A stream read with no deadline of its own, through a link that dies: the channel's
/// HTTP/2 keepalive finds the connection dead (a ping unanswered) and closes it, which
/// ends the stream with an error instead of a wait for ever.
#[tokio::test]
async fn keepalive_closes_a_connection_whose_link_died_under_an_open_stream() {
    let relay = dying_link(serve(Rows::Endless).await, 200 << 10).await;
    let mut client = connector()
        .with_liveness(Liveness {
            ping_after: Duration::from_millis(200),
            give_up_after: SILENCE,
            retransmit_min: None,
            tail_probes: 2,
        })
        .server(&relay)
        .unwrap();
    let mut pieces = client
        .fetch_rows(FetchRowsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ended = tokio::time::timeout(HANG, async {
        loop {
            match pieces.message().await {
                Ok(Some(_)) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the stream hung on a dead connection");
    let status = ended.unwrap_err();
    assert!(
        PsError::rpc("rows", &status).unreachable_server(1) == Some(1),
        "{status:?}"
    );
}

/// The end of a run's gather, from a server stalled mid-stream: the job's own deadline
/// (`cluster.deadlines.stream_progress_ms`) bounds each ask, and a sender that stalls
/// again each time it is asked again (an empty piece is no progress) is given up.
#[tokio::test]
async fn the_final_gather_from_a_server_stalled_mid_stream_fails_within_the_jobs_deadline() {
    let address = serve(Rows::OneThenSilence).await;
    let data = tempfile::tempdir().unwrap();
    let mut config = ftrec_config::JobConfig::preset("tiny").unwrap();
    config.cluster.servers = 1;
    config.data.dir = Some(data.path().to_path_buf());
    config.cluster.deadlines.stream_progress_ms = Some(SILENCE.as_millis() as u64);
    let job = ftrec_rpc::Job::new(config).unwrap();
    let gathered = tokio::time::timeout(
        HANG,
        ftrec_rpc::gather::gather_state(&job, std::slice::from_ref(&address), 1),
    )
    .await
    .expect("the gather hung on a stalled stream");
    match gathered {
        Err(PsError::Unavailable(m)) => {
            assert!(
                m.contains("table 0 from server 0") && m.contains(&address),
                "{m}"
            );
        }
        Err(e) => panic!("a silent server must be unavailable: {e}"),
        Ok(_) => panic!("a silent server must be unavailable, not gathered"),
    }
}

/// The helper on a raw tonic stream, as the coordinator follows a rebuild: the messages
/// sent pass, then the silence ends the stream as the sender unreachable.
#[tokio::test]
async fn a_tonic_stream_read_with_a_progress_deadline_ends_when_its_sender_stalls() {
    use ftrec_rpc::stream::ProgressDeadline;
    let address = serve(Rows::OneThenSilence).await;
    let mut client = connector().server(&address).unwrap();
    let mut pieces = client
        .fetch_rows(FetchRowsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .with_progress_deadline(SILENCE, format!("server 4's rows ({address})"));
    let first = tokio::time::timeout(HANG, pieces.message()).await.unwrap();
    assert_eq!(first.unwrap(), Some(FetchRowsChunk::default()));
    let status = tokio::time::timeout(HANG, pieces.message())
        .await
        .expect("the stream hung")
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(status.message().contains(&address), "{status:?}");
    assert_eq!(
        PsError::rpc("rebuild", &status).unreachable_server(4),
        Some(4)
    );
}

/// A port no process listens on refuses the dial, and the call says so (a SIGKILLed
/// server's, once its sockets closed): its caller may give up at once. A port that accepts
/// and never answers (a frozen server) is not a refusal: that one may only be slow.
#[tokio::test]
async fn a_dead_port_is_refused_and_a_silent_one_is_not() {
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = gone.local_addr().unwrap().to_string();
    drop(gone);
    let mut client = connector().server(&address).unwrap();
    let status = tokio::time::timeout(HANG, client.applied(AppliedRequest::default()))
        .await
        .expect("a refused dial answers at once")
        .unwrap_err();
    let e = PsError::rpc("applied", &status);
    assert!(matches!(e, PsError::Refused(_)) && e.is_refused(), "{e:?}");
    assert_eq!(e.unreachable_server(4), Some(4));
    assert!(e.blaming(4).is_refused());

    let frozen = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = frozen.local_addr().unwrap().to_string();
    let mut client = connector()
        .with_timeout(Duration::from_millis(200))
        .server(&address)
        .unwrap();
    let status = tokio::time::timeout(HANG, client.applied(AppliedRequest::default()))
        .await
        .expect("the call's deadline ends it")
        .unwrap_err();
    let e = PsError::rpc("applied", &status);
    assert!(!e.is_refused(), "{e:?}");
    drop(frozen);
}

/// One HTTP/2 frame: length, type, flags, stream id, payload (RFC 9113 §4.1).
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// A request's headers in HPACK literals without indexing (RFC 7541 §6.2.2): a unary
/// call to `Pull`, whose body never comes.
fn pull_headers(authority: &str) -> Vec<u8> {
    let mut h = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    for (name_index, value) in [(4u8, "/ftrec.ParameterServer/Pull"), (1, authority)] {
        h.push(name_index);
        h.push(value.len() as u8);
        h.extend(value.as_bytes());
    }
    // content-type is entry 31 of the static table: past the 4-bit prefix.
    h.extend([0x0f, 31 - 15, 16]);
    h.extend(b"application/grpc");
    h.extend([0x00, 2]);
    h.extend(b"te");
    h.push(8);
    h.extend(b"trailers");
    h
}

/// Writes `streams` requests, each cancelled at once, in one segment, then a ping; returns
/// whether the server answered the ping (it kept the connection) rather than going away.
async fn survives_cancelled_burst(address: &str, streams: u32) -> bool {
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;
    const SETTINGS: u8 = 0x4;
    const PING: u8 = 0x6;
    const GOAWAY: u8 = 0x7;
    const END_HEADERS: u8 = 0x4;
    const ACK: u8 = 0x1;
    const CANCEL: u32 = 0x8;
    let mut tcp = TcpStream::connect(address).await.unwrap();
    let mut burst = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    burst.extend(frame(SETTINGS, 0, 0, &[]));
    let headers = pull_headers(address);
    for n in 0..streams {
        let id = 2 * n + 1;
        burst.extend(frame(HEADERS, END_HEADERS, id, &headers));
        burst.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    burst.extend(frame(PING, 0, 0, b"ftrecok!"));
    tcp.write_all(&burst).await.unwrap();
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // Frames from the server: its settings, the ack of ours, and the ping's answer or
        // a GOAWAY.
        let mut at = 0;
        while read.len() >= at + 9 {
            let len = u32::from_be_bytes([0, read[at], read[at + 1], read[at + 2]]) as usize;
            if read.len() < at + 9 + len {
                break;
            }
            match (read[at + 3], read[at + 4] & ACK) {
                (PING, ACK) => return true,
                (GOAWAY, _) => return false,
                _ => {}
            }
            at += 9 + len;
        }
        let n = tokio::time::timeout(HANG, tcp.read(&mut buf))
            .await
            .expect("the server neither answered the ping nor went away")
            .unwrap();
        if n == 0 {
            return false;
        }
        read.extend_from_slice(&buf[..n]);
    }
}

/// A hedged call cancels its slower copy, and a lossy link delivers a held-back queue of
/// requests with their cancellations at once, before the server took them up. h2 guards
/// against "rapid reset" floods by closing such a connection, every call on it failing:
/// with its default of 20, 10 of 25 lossy runs lost a step that way. The job's servers
/// allow [`ftrec_rpc::auth::MAX_PENDING_ACCEPT_RESETS`]; the default server is the
/// control, showing that the burst reaches the guard.
#[tokio::test]
async fn a_burst_of_cancelled_calls_keeps_the_jobs_server_connection() {
    let data = tempfile::tempdir().unwrap();
    let mut config = ftrec_config::JobConfig::preset("tiny").unwrap();
    config.data.dir = Some(data.path().to_path_buf());
    let job = ftrec_rpc::Job::new(config).unwrap();
    let ours = serve_with(
        ftrec_rpc::auth::server_builder(&job).unwrap(),
        Rows::Endless,
    )
    .await;
    let default = serve(Rows::Endless).await;
    assert!(
        !survives_cancelled_burst(&default, 64).await,
        "the default server kept a connection past 20 cancelled calls: the burst no longer reaches h2's guard"
    );
    assert!(
        survives_cancelled_burst(&ours, 64).await,
        "the job's server closed a connection on 64 cancelled calls"
    );
}
