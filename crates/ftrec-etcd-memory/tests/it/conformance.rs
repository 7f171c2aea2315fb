//! One test body, run against the real etcd and against the in-memory one: what the
//! simulation relies on behaves alike on both (issue 42, §2).

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions, WatchStream,
};
use ftrec_etcd::{Etcd, EtcdError, EtcdOptions, LeaderInfo};
use ftrec_etcd_memory::MemoryEtcd;
use ftrec_testkit::etcd;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_etcd_passes_the_conformance_body() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    conformance(&server.endpoint).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_memory_etcd_passes_the_conformance_body() {
    let etcd = MemoryEtcd::new();
    let served = etcd.serve_loopback().await.unwrap();
    conformance(&served.endpoint).await;
}

/// Everything the simulation relies on, against the etcd at `endpoint` (empty at start).
async fn conformance(endpoint: &str) {
    let mut c = Client::connect([endpoint], None).await.unwrap();
    // Leases first: their expiry runs while the rest is checked.
    let leases = Leases::start(&mut c).await;
    revisions(&mut c).await;
    ranges(&mut c).await;
    compares(&mut c).await;
    watches(&mut c).await;
    leases.finish(&mut c).await;
    leadership(endpoint).await;
}

async fn rev(c: &mut Client) -> i64 {
    c.get("/nothing", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision()
}

async fn kv(c: &mut Client, key: &str) -> Option<etcd_client::KeyValue> {
    c.get(key, None).await.unwrap().kvs().first().cloned()
}

/// One revision per write transaction; per key its create and mod revision and version.
async fn revisions(c: &mut Client) {
    let r0 = rev(c).await;
    let put = c.put("/r/a", "1", None).await.unwrap();
    assert_eq!(put.header().unwrap().revision(), r0 + 1);
    let a = kv(c, "/r/a").await.unwrap();
    assert_eq!(
        (a.create_revision(), a.mod_revision(), a.version()),
        (r0 + 1, r0 + 1, 1)
    );
    let put = c
        .put("/r/a", "2", Some(PutOptions::new().with_prev_key()))
        .await
        .unwrap();
    assert_eq!(put.prev_key().unwrap().value(), b"1");
    let a = kv(c, "/r/a").await.unwrap();
    assert_eq!(
        (a.create_revision(), a.mod_revision(), a.version()),
        (r0 + 1, r0 + 2, 2)
    );
    // Reads, and a transaction of reads only, leave the revision alone.
    let read_only = Txn::new().and_then([TxnOp::get("/r/a", None)]);
    let reply = c.txn(read_only).await.unwrap();
    assert_eq!(reply.header().unwrap().revision(), r0 + 2);
    // Two puts in one transaction: one revision.
    let two = Txn::new().and_then([TxnOp::put("/r/b", "x", None), TxnOp::put("/r/c", "y", None)]);
    let reply = c.txn(two).await.unwrap();
    assert_eq!(reply.header().unwrap().revision(), r0 + 3);
    assert_eq!(kv(c, "/r/b").await.unwrap().mod_revision(), r0 + 3);
    assert_eq!(kv(c, "/r/c").await.unwrap().mod_revision(), r0 + 3);
    // A delete is a revision; deleting nothing is none.
    let deleted = c.delete("/r/b", None).await.unwrap();
    assert_eq!(deleted.deleted(), 1);
    assert_eq!(deleted.header().unwrap().revision(), r0 + 4);
    let nothing = c.delete("/r/b", None).await.unwrap();
    assert_eq!(nothing.deleted(), 0);
    assert_eq!(rev(c).await, r0 + 4);
    // A key put again after its delete starts over.
    c.put("/r/b", "z", None).await.unwrap();
    let b = kv(c, "/r/b").await.unwrap();
    assert_eq!((b.create_revision(), b.version()), (r0 + 5, 1));
    // An older revision reads as it was.
    let old = c
        .get("/r/a", Some(GetOptions::new().with_revision(r0 + 1)))
        .await
        .unwrap();
    assert_eq!(old.kvs()[0].value(), b"1");
    let gone = c
        .get("/r/b", Some(GetOptions::new().with_revision(r0 + 4)))
        .await
        .unwrap();
    assert!(gone.kvs().is_empty());
    assert!(
        c.get("/r/a", Some(GetOptions::new().with_revision(r0 + 100)))
            .await
            .is_err(),
        "a future revision is refused"
    );
}

/// Prefixes and ranges, count, limit, count only.
async fn ranges(c: &mut Client) {
    for k in ["/p/1", "/p/2", "/p/3", "/q"] {
        c.put(k, k, None).await.unwrap();
    }
    let all = c
        .get("/p/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    let keys: Vec<&str> = all.kvs().iter().map(|kv| kv.key_str().unwrap()).collect();
    assert_eq!(keys, ["/p/1", "/p/2", "/p/3"]);
    assert_eq!(all.count(), 3);
    let counted = c
        .get(
            "/p/",
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap();
    assert_eq!((counted.count(), counted.kvs().len()), (3, 0));
    let limited = c
        .get("/p/", Some(GetOptions::new().with_prefix().with_limit(2)))
        .await
        .unwrap();
    assert_eq!((limited.count(), limited.kvs().len()), (3, 2));
    assert!(limited.more());
    let ranged = c
        .get("/p/2", Some(GetOptions::new().with_range("/q")))
        .await
        .unwrap();
    assert_eq!(ranged.count(), 2, "[/p/2, /q)");
    let missing = c.get("/p/none", None).await.unwrap();
    assert_eq!((missing.count(), missing.kvs().len()), (0, 0));
}

/// Transactions comparing create and mod revision, version and value, with both branches.
async fn compares(c: &mut Client) {
    c.put("/t/k", "v1", None).await.unwrap();
    let k = kv(c, "/t/k").await.unwrap();
    let (created, modified) = (k.create_revision(), k.mod_revision());
    let txn = |cmp: Compare| {
        Txn::new()
            .when([cmp])
            .and_then([TxnOp::put("/t/k", "won", None)])
            .or_else([TxnOp::get("/t/k", None)])
    };
    let holds = [
        Compare::create_revision("/t/k", CompareOp::Equal, created),
        Compare::mod_revision("/t/k", CompareOp::Less, modified + 5),
        Compare::version("/t/k", CompareOp::Greater, 0),
    ];
    for cmp in holds {
        let reply = c.txn(txn(cmp)).await.unwrap();
        assert!(reply.succeeded());
    }
    let k = kv(c, "/t/k").await.unwrap();
    assert_eq!((k.create_revision(), k.version()), (created, 4));
    let fails = [
        Compare::create_revision("/t/k", CompareOp::Equal, 0),
        Compare::mod_revision("/t/k", CompareOp::Equal, modified),
        Compare::value("/t/k", CompareOp::Equal, "v1"),
        Compare::version("/t/k", CompareOp::NotEqual, 4),
    ];
    for cmp in fails {
        let reply = c.txn(txn(cmp)).await.unwrap();
        assert!(!reply.succeeded());
        let Some(TxnOpResponse::Get(got)) = reply.op_responses().into_iter().next() else {
            panic!("the failure branch's read");
        };
        assert_eq!(got.kvs()[0].value(), b"won");
    }
    // A missing key compares as revision 0 and version 0, and has no value to compare.
    for (cmp, expected) in [
        (
            Compare::create_revision("/t/none", CompareOp::Equal, 0),
            true,
        ),
        (Compare::mod_revision("/t/none", CompareOp::Equal, 0), true),
        (Compare::version("/t/none", CompareOp::Equal, 0), true),
        (Compare::value("/t/none", CompareOp::Equal, ""), false),
    ] {
        let reply = c.txn(Txn::new().when([cmp])).await.unwrap();
        assert_eq!(reply.succeeded(), expected);
    }
    // A put with a lease that does not exist is refused, and changes nothing.
    let r = rev(c).await;
    let bad = Txn::new().and_then([
        TxnOp::put("/t/a", "1", None),
        TxnOp::put("/t/b", "1", Some(PutOptions::new().with_lease(0x7777))),
    ]);
    assert!(c.txn(bad).await.is_err());
    assert_eq!(rev(c).await, r);
    assert!(kv(c, "/t/a").await.is_none());
}

async fn next_events(w: &mut WatchStream) -> Vec<etcd_client::Event> {
    let reply = tokio::time::timeout(Duration::from_secs(5), w.message())
        .await
        .expect("a watch reply within 5 s")
        .unwrap()
        .unwrap();
    reply.events().to_vec()
}

/// Watches on a prefix, with prev_kv, from now and from a past revision; cancel.
async fn watches(c: &mut Client) {
    let from = rev(c).await + 1;
    let options = WatchOptions::new().with_prefix().with_prev_key();
    let mut w = c.watch("/w/", Some(options)).await.unwrap();
    let created = w.message().await.unwrap().unwrap();
    assert!(created.created());
    let id = created.watch_id();
    c.put("/w/1", "a", None).await.unwrap();
    c.put("/elsewhere", "x", None).await.unwrap();
    c.put("/w/1", "b", None).await.unwrap();
    c.delete("/w/1", None).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        seen.extend(next_events(&mut w).await);
    }
    let kinds: Vec<EventType> = seen.iter().map(|e| e.event_type()).collect();
    assert_eq!(kinds, [EventType::Put, EventType::Put, EventType::Delete]);
    assert_eq!(seen[0].kv().unwrap().value(), b"a");
    assert!(seen[0].prev_kv().is_none());
    assert_eq!(seen[1].prev_kv().unwrap().value(), b"a");
    let deleted = seen[2].kv().unwrap();
    assert_eq!(deleted.key(), b"/w/1");
    assert_eq!(deleted.mod_revision(), from + 3);
    assert_eq!(seen[2].prev_kv().unwrap().value(), b"b");
    w.cancel(id).await.unwrap();
    let canceled = w.message().await.unwrap().unwrap();
    assert!(canceled.canceled());

    // From a past revision: the history is replayed, without prev_kv unless asked.
    let past = WatchOptions::new().with_prefix().with_start_revision(from);
    let mut w = c.watch("/w/", Some(past)).await.unwrap();
    assert!(w.message().await.unwrap().unwrap().created());
    let mut replayed = Vec::new();
    while replayed.len() < 3 {
        replayed.extend(next_events(&mut w).await);
    }
    let revisions: Vec<i64> = replayed
        .iter()
        .map(|e| e.kv().unwrap().mod_revision())
        .collect();
    assert_eq!(revisions, [from, from + 2, from + 3]);
    assert!(replayed[1].prev_kv().is_none());
}

/// One lease left to expire, one kept alive, one revoked.
struct Leases {
    granted: Instant,
    expiring: i64,
    kept: i64,
    keeper: tokio::task::JoinHandle<()>,
    watch: WatchStream,
}

impl Leases {
    async fn start(c: &mut Client) -> Self {
        let mut watch = c
            .watch("/l/", Some(WatchOptions::new().with_prefix()))
            .await
            .unwrap();
        assert!(watch.message().await.unwrap().unwrap().created());
        let granted = Instant::now();
        let expiring = c.lease_grant(1, None).await.unwrap();
        // etcd's smallest TTL with its default election timeout is 2 s.
        assert_eq!(expiring.ttl(), 2);
        let expiring = expiring.id();
        let kept = c.lease_grant(2, None).await.unwrap().id();
        let with = |l| Some(PutOptions::new().with_lease(l));
        c.put("/l/expiring", "1", with(expiring)).await.unwrap();
        c.put("/l/kept", "1", with(kept)).await.unwrap();
        let ttl = c.lease_time_to_live(expiring, None).await.unwrap();
        assert_eq!(ttl.granted_ttl(), 2);
        assert!((1..=2).contains(&ttl.ttl()), "{}", ttl.ttl());
        let (mut keeper, mut replies) = c.lease_keep_alive(kept).await.unwrap();
        let keeper = tokio::spawn(async move {
            loop {
                keeper.keep_alive().await.unwrap();
                let reply = replies.message().await.unwrap().unwrap();
                assert_eq!((reply.id(), reply.ttl()), (kept, 2));
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        });
        Self {
            granted,
            expiring,
            kept,
            keeper,
            watch,
        }
    }

    async fn finish(mut self, c: &mut Client) {
        // Revoking deletes the lease's keys in one revision.
        let revoked = c.lease_grant(5, None).await.unwrap().id();
        let with = |l| Some(PutOptions::new().with_lease(l));
        c.put("/l/r1", "1", with(revoked)).await.unwrap();
        c.put("/l/r2", "1", with(revoked)).await.unwrap();
        let before = rev(c).await;
        c.lease_revoke(revoked).await.unwrap();
        assert_eq!(rev(c).await, before + 1);
        assert!(kv(c, "/l/r1").await.is_none() && kv(c, "/l/r2").await.is_none());
        assert!(c.lease_revoke(revoked).await.is_err(), "revoked twice");
        // A keep-alive of a lease that is gone answers TTL 0, which the client's opening
        // of the stream turns into an error.
        match c.lease_keep_alive(revoked).await {
            Err(etcd_client::Error::LeaseKeepAliveError(_)) => {}
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a revoked lease renewed"),
        }

        // The unrenewed lease expires (etcd looks every 500 ms), and its key goes with it.
        tokio::time::sleep_until(self.granted + Duration::from_millis(3500)).await;
        assert!(
            kv(c, "/l/expiring").await.is_none(),
            "expired with its lease"
        );
        let ttl = c.lease_time_to_live(self.expiring, None).await.unwrap();
        assert_eq!(ttl.ttl(), -1);
        assert!(kv(c, "/l/kept").await.is_some(), "kept alive");
        let ttl = c.lease_time_to_live(self.kept, None).await.unwrap();
        assert!(ttl.ttl() > 0);
        self.keeper.abort();
        // The watch saw the puts, the revocation's deletes and the expiry's.
        let mut deleted = Vec::new();
        while deleted.len() < 3 {
            for e in next_events(&mut self.watch).await {
                if e.event_type() == EventType::Delete {
                    deleted.push(e.kv().unwrap().key_str().unwrap().to_string());
                }
            }
        }
        assert_eq!(deleted, ["/l/r1", "/l/r2", "/l/expiring"]);
    }
}

fn me(id: &str) -> LeaderInfo {
    LeaderInfo {
        id: id.into(),
        address: "127.0.0.1:7000".into(),
        pid: 1,
    }
}

/// ftrec's own election and fenced writes.
async fn leadership(endpoint: &str) {
    let opts = EtcdOptions {
        endpoints: vec![endpoint.to_string()],
        prefix: "/ftrec/conformance".into(),
        request_timeout: Duration::from_secs(2),
    };
    let first = Etcd::connect(&opts).await.unwrap();
    let second = Etcd::connect(&opts).await.unwrap();
    let ttl = Duration::from_secs(2);
    let leader = first
        .campaign(&me("one"), ttl, false, |_| {})
        .await
        .unwrap();
    let written = leader.put("state", b"1".to_vec()).await.unwrap();
    assert!(written > 0);
    let e = match second.campaign(&me("two"), ttl, false, |_| {}).await {
        Err(e) => e,
        Ok(_) => panic!("two leaders"),
    };
    assert!(matches!(e, EtcdError::LeaderHeld { .. }), "{e}");
    let standby = tokio::spawn(async move {
        second
            .campaign(&me("two"), ttl, true, |_| {})
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    leader.resign().await;
    let new_leader = tokio::time::timeout(Duration::from_secs(10), standby)
        .await
        .unwrap()
        .unwrap();
    assert!(new_leader.term() > leader.term());
    let (record, at) = new_leader.get_json::<u32>("state").await.unwrap().unwrap();
    assert_eq!((record, at), (1, written));
    new_leader.put("state", b"2".to_vec()).await.unwrap();
    let e = leader.put("state", b"3".to_vec()).await.unwrap_err();
    assert!(matches!(e, EtcdError::Deposed(_)), "{e}");
    let mut lost = leader.lost();
    tokio::time::timeout(Duration::from_secs(5), lost.wait_for(|l| l.is_some()))
        .await
        .unwrap()
        .unwrap();
    // The new leader's lease is kept alive past its TTL.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(new_leader.lost().borrow().is_none());
    assert!(new_leader.valid());
    new_leader.put("state", b"4".to_vec()).await.unwrap();
}
