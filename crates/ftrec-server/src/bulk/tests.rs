//! The bulk port against a table of its own: sessions, ranges straight from the table
//! (and the rest copied), errors carried as the RPC would carry them.

use super::*;
use proptest::prelude::*;
use std::sync::RwLock;

/// A table of `u8` rows behind a read-write lock, with its applied steps.
struct Table {
    rows: RwLock<(Vec<u8>, u64)>,
    parity: Vec<u8>,
}

impl RangeSource for Table {
    fn with_range(
        &self,
        ask: &RangeAsk,
        send: &mut dyn FnMut(RangeRows<'_>),
    ) -> Result<(), PsError> {
        if ask.epoch != 1 {
            return Err(PsError::StaleEpoch {
                got: ask.epoch,
                current: 1,
            });
        }
        let rows = self.rows.read().unwrap();
        let span = |r: &Range<u64>| r.start as usize..r.end as usize;
        let (Some(data), Some(parity)) = (
            rows.0.get(span(&ask.data)),
            self.parity.get(span(&ask.parity)),
        ) else {
            return Err(PsError::Recovering {
                table: ask.table,
                first_row: ask.data.start as u32,
                end_row: ask.data.end as u32,
            });
        };
        send(RangeRows {
            applied_below: rows.1,
            applied_ahead: vec![rows.1 + 2],
            data,
            parity,
        });
        Ok(())
    }
}

async fn port(table: &Arc<Table>, expiry: Duration) -> Arc<BulkServer> {
    let server = BulkServer::start("127.0.0.1", expiry, None).await.unwrap();
    let source: Weak<dyn RangeSource> = Arc::downgrade(table) as _;
    server.serve_from(source);
    server
}

fn ask(epoch: u64, data: Range<u64>, parity: Range<u64>) -> RangeAsk {
    RangeAsk {
        epoch,
        table: 3,
        data,
        parity,
    }
}

#[tokio::test]
async fn ranges_come_straight_from_the_table_on_an_opened_connection() {
    // Larger than any socket buffer here: part goes straight from the table, the rest
    // from the copy made under the same lock.
    let big = 24 << 20;
    let table = Arc::new(Table {
        rows: RwLock::new(((0..big).map(|i| (i * 7 + i / 251) as u8).collect(), 41)),
        parity: (0..1000).map(|i| i as u8).collect(),
    });
    let server = port(&table, Duration::from_secs(10)).await;
    let client = BulkClient::new(Duration::from_secs(10));
    let mut stream = client.open(server.address(), server.issue()).await.unwrap();
    let mut into = Vec::new();
    let whole = ask(1, 0..big as u64, 100..400);
    let answer = client
        .range(&mut stream, &whole, 1, &mut into)
        .await
        .unwrap();
    assert_eq!(answer.applied, (41, vec![43]));
    assert_eq!(answer.data_len, big);
    assert_eq!(&into[..big], &table.rows.read().unwrap().0[..]);
    assert_eq!(&into[big..], &table.parity[100..400]);

    // The same connection serves the next range, which sees the table as it is now.
    {
        let mut rows = table.rows.write().unwrap();
        rows.0[5] ^= 0xff;
        rows.1 = 42;
    }
    let small = ask(1, 3..9, 0..0);
    let answer = client.range(&mut stream, &small, 2, &mut into).await;
    // Two bytes a row: 6 slots asked are 12 bytes, but the table sent 6.
    assert!(matches!(answer, Err(PsError::BadRequest(_))), "{answer:?}");
    let answer = client
        .range(&mut stream, &small, 1, &mut into)
        .await
        .unwrap();
    assert_eq!(answer.applied, (42, vec![44]));
    assert_eq!(&into[..], &table.rows.read().unwrap().0[3..9]);

    // The survivor's own refusals arrive as the error the RPC would have carried, and
    // leave the connection usable.
    let stale = client
        .range(&mut stream, &ask(7, 0..1, 0..0), 1, &mut into)
        .await;
    assert!(
        matches!(stale, Err(PsError::StaleEpoch { got: 7, current: 1 })),
        "{stale:?}"
    );
    let outside = ask(1, 0..1, 999..1001);
    let recovering = client.range(&mut stream, &outside, 1, &mut into).await;
    assert!(
        matches!(
            recovering,
            Err(PsError::Recovering {
                table: 3,
                first_row: 0,
                end_row: 1
            })
        ),
        "{recovering:?}"
    );
    let again = client
        .range(&mut stream, &small, 1, &mut into)
        .await
        .unwrap();
    assert_eq!(again.data_len, 6);
}

#[tokio::test]
async fn a_connection_needs_a_ticket_issued_over_rpc_used_once_in_time() {
    let table = Arc::new(Table {
        rows: RwLock::new((vec![1; 64], 5)),
        parity: vec![2; 8],
    });
    let server = port(&table, Duration::from_secs(10)).await;
    let client = BulkClient::new(Duration::from_secs(5));
    let ticket = server.issue();
    // A guessed ticket opens nothing.
    let guessed = client.open(server.address(), ticket ^ 1).await;
    assert!(
        matches!(guessed, Err(PsError::Overloaded(_))),
        "{guessed:?}"
    );
    // The issued one opens one connection, once.
    client.open(server.address(), ticket).await.unwrap();
    let twice = client.open(server.address(), ticket).await;
    assert!(matches!(twice, Err(PsError::Overloaded(_))), "{twice:?}");
    // A range asked without opening gets no rows: one refusal, and the port closes it.
    let mut stranger = TcpStream::connect(server.address()).await.unwrap();
    stranger
        .write_all(&ask(1, 0..64, 0..8).encode())
        .await
        .unwrap();
    assert_eq!(stranger.read_u64_le().await.unwrap(), NO_SUCH_TICKET);
    // Closed with the request's bytes unread, which may reset the connection.
    let mut rest = Vec::new();
    let _ = stranger.read_to_end(&mut rest).await;
    assert!(rest.is_empty(), "no rows for a stranger");

    // A ticket not presented within the expiry is gone.
    let short = port(&table, Duration::from_millis(1)).await;
    let late = short.issue();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let refused = client.open(short.address(), late).await;
    assert!(
        matches!(refused, Err(PsError::Overloaded(_))),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_claimant_that_stops_reading_is_let_go_after_the_expiry() {
    let big = 64 << 20;
    let table = Arc::new(Table {
        rows: RwLock::new((vec![9; big], 1)),
        parity: Vec::new(),
    });
    let server = port(&table, Duration::from_millis(300)).await;
    let client = BulkClient::new(Duration::from_secs(5));
    let mut stream = client.open(server.address(), server.issue()).await.unwrap();
    stream
        .write_all(&ask(1, 0..big as u64, 0..0).encode())
        .await
        .unwrap();
    // Frozen: nothing read for longer than the expiry. More than the socket buffers hold
    // is owed, so the survivor's write of the rest waits, and gives up.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut got = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got)).await;
    assert!(ended.is_ok(), "the survivor closed the connection");
    assert!(got.len() < big, "{} bytes of {big} came", got.len());
}

#[tokio::test]
async fn a_connection_idle_for_half_the_deadline_is_not_reused() {
    let table = Arc::new(Table {
        rows: RwLock::new((vec![3; 16], 1)),
        parity: Vec::new(),
    });
    let server = port(&table, Duration::from_secs(10)).await;
    let client = BulkClient::new(Duration::from_millis(200));
    let stream = client.open(server.address(), server.issue()).await.unwrap();
    client.keep(4, stream);
    assert!(client.pooled(4).is_some(), "kept just now: reused");
    assert!(client.pooled(4).is_none(), "taken: the pool is empty");
    let stream = client.open(server.address(), server.issue()).await.unwrap();
    client.keep(4, stream);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(
        client.pooled(4).is_none(),
        "idle past half the deadline: dropped"
    );
}

#[test]
fn a_ticket_of_the_wrong_length_is_refused() {
    assert!(ticket_of(&[0u8; 15]).is_err());
    assert_eq!(ticket_of(&ticket_bytes(42)).unwrap(), 42);
}

proptest! {
    #[test]
    fn a_range_ask_round_trips(
        epoch in any::<u64>(),
        table in any::<u32>(),
        bounds in proptest::array::uniform4(any::<u64>()),
    ) {
        let ask = RangeAsk { epoch, table, data: bounds[0]..bounds[1], parity: bounds[2]..bounds[3] };
        let raw = ask.encode();
        prop_assert_eq!(raw[0], RANGE);
        let mut body = [0u8; RANGE_ASK_BYTES];
        body.copy_from_slice(&raw[1..]);
        prop_assert_eq!(RangeAsk::decode(&body), ask);
    }

    #[test]
    fn what_is_sent_now_and_what_is_copied_make_the_whole(
        parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..5),
        skip_share in 0.0f64..=1.0,
    ) {
        let parts: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        let whole: Vec<u8> = parts.concat();
        let skip = (whole.len() as f64 * skip_share) as usize;
        prop_assert_eq!(unsent(&parts, skip), whole[skip..].to_vec());
        let remaining: Vec<u8> = remaining_slices(&parts, skip).iter().flat_map(|s| s.to_vec()).collect();
        prop_assert_eq!(remaining, whole[skip..].to_vec());
    }
}

/// A survivor goes first while a replacement's connection is open, and lets go once the
/// replacement closes it (`BulkClient::close_all`, at the end of a rebuild). As root (CI)
/// it raises priority as a rebuild does; otherwise it lowers it, and checks the let-go only
/// where the host allows going back.
#[tokio::test]
// The guard only keeps the other nice-changing test out; no task here takes it.
#[allow(clippy::await_holding_lock)]
async fn a_survivor_goes_first_while_a_connection_is_open() {
    use rustix::process::getpriority_process;
    let _serial = crate::rebuild::boost::NICE_TESTS
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // This runtime's one thread runs the port's tasks too.
    let nice = || getpriority_process(None).unwrap_or(i32::MIN);
    let before = nice();
    let root = rustix::process::geteuid().is_root();
    let target = if root { before - 5 } else { before + 3 }.clamp(-20, 19);
    if target == before {
        return;
    }
    let table = Arc::new(Table {
        rows: RwLock::new(((0..64).collect(), 5)),
        parity: vec![0; 8],
    });
    let boost = crate::rebuild::boost::RebuildBoost::new(target);
    let server = BulkServer::start("127.0.0.1", Duration::from_secs(10), boost)
        .await
        .unwrap();
    let source: Weak<dyn RangeSource> = Arc::downgrade(&table) as _;
    server.serve_from(source);
    let client = BulkClient::new(Duration::from_secs(10));
    let mut stream = client.open(server.address(), server.issue()).await.unwrap();
    let mut into = Vec::new();
    client
        .range(&mut stream, &ask(1, 0..4, 0..0), 1, &mut into)
        .await
        .unwrap();
    assert_eq!(nice(), target, "raised while the connection is open");
    client.keep(0, stream);
    client.close_all();
    let mut waited = 0;
    while nice() == target && waited < 200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    if root {
        assert_eq!(nice(), before, "put back once the connection closed");
    }
}
