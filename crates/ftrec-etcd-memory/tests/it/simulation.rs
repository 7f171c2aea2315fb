//! What the simulation needs of the in-memory etcd: `ftrec_etcd::Etcd` over a channel the
//! caller dials, and knobs that reproduce etcd's faults, among them the late attempt of
//! hole 5 (issue 42) and a lease that expires while etcd is stopped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::Client;
use ftrec_etcd::{Etcd, EtcdOptions, LeaderInfo};
use ftrec_etcd_memory::{MemoryEtcd, Rpc};
use tokio::time::Instant;

fn options(endpoint: &str, timeout: Duration) -> EtcdOptions {
    EtcdOptions {
        endpoints: vec![endpoint.to_string()],
        prefix: "/ftrec/sim".into(),
        request_timeout: timeout,
    }
}

fn me() -> LeaderInfo {
    LeaderInfo {
        id: "one".into(),
        address: "10.0.0.1:7000".into(),
        pid: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_etcd_wrapper_runs_over_a_channel_the_caller_dials() {
    let etcd = MemoryEtcd::new();
    let served = etcd.serve_loopback().await.unwrap();
    let dials = Arc::new(AtomicUsize::new(0));
    let counted = dials.clone();
    let address = served.endpoint.clone();
    // What the simulation does with its turmoil dialer.
    let connector = tower::service_fn(move |_uri: tonic::transport::Uri| {
        counted.fetch_add(1, Ordering::Relaxed);
        let address = address.clone();
        async move {
            tokio::net::TcpStream::connect(address)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://etcd.sim:2379")
        .connect_with_connector_lazy(connector);
    let opts = options("etcd.sim:2379", Duration::from_secs(2));
    let client = Etcd::connect_channel(channel, &opts).await.unwrap();
    assert!(dials.load(Ordering::Relaxed) >= 1, "dialed by the caller");
    let leader = client
        .campaign(&me(), Duration::from_secs(2), false, |_| {})
        .await
        .unwrap();
    let revision = leader.put("state", b"7".to_vec()).await.unwrap();
    assert_eq!(
        client.get_json::<u32>("state").await.unwrap(),
        Some((7, revision))
    );
    let stored = etcd.get(b"/ftrec/sim/state").unwrap();
    assert_eq!(
        (stored.value.as_slice(), stored.mod_revision),
        (&b"7"[..], revision)
    );
    assert_eq!(etcd.revision(), revision);
    // Errors name what the caller called the endpoint.
    let dead = tonic::transport::Endpoint::from_static("http://nowhere.sim:2379")
        .connect_with_connector_lazy(tower::service_fn(|_uri: tonic::transport::Uri| async {
            Err::<hyper_util::rt::TokioIo<tokio::net::TcpStream>, _>(std::io::Error::other(
                "no route",
            ))
        }));
    let opts = options("nowhere.sim:2379", Duration::from_millis(600));
    match Etcd::connect_channel(dead, &opts).await {
        Err(e) => assert!(e.to_string().contains("nowhere.sim:2379"), "{e}"),
        Ok(_) => panic!("connected to nothing"),
    }
}

/// Hole 5: `Etcd::call` resends a write whose first attempt takes a third of the timeout.
/// The first attempt is held until after the resend and a later write have landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_first_attempt_never_puts_an_older_record_over_a_newer_one() {
    let etcd = MemoryEtcd::new();
    let served = etcd.serve_loopback().await.unwrap();
    // Attempts get a third of 1.5 s.
    let client = Etcd::connect(&options(&served.endpoint, Duration::from_millis(1500)))
        .await
        .unwrap();
    let leader = client
        .campaign(&me(), Duration::from_secs(5), false, |_| {})
        .await
        .unwrap();
    leader.put("state", b"\"first\"".to_vec()).await.unwrap();
    etcd.delay_next(Rpc::Txn, 1, Duration::from_millis(1200));
    let started = Instant::now();
    let older = leader.put("state", b"\"older\"".to_vec()).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(450),
        "the resend answered"
    );
    let newer = leader.put("state", b"\"newer\"".to_vec()).await.unwrap();
    assert!(newer > older);
    // The held first attempt of "older" lands now.
    tokio::time::sleep_until(started + Duration::from_millis(1600)).await;
    let stored = etcd.get(b"/ftrec/sim/state").unwrap();
    assert_eq!(
        String::from_utf8_lossy(&stored.value),
        "\"newer\"",
        "the late attempt put the older record over the newer one"
    );
    assert_eq!(stored.mod_revision, newer);
    // And the leader writes on.
    leader.put("state", b"\"next\"".to_vec()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_requests_until_resumed_and_a_delay_slows_them() {
    let etcd = MemoryEtcd::new();
    let served = etcd.serve_loopback().await.unwrap();
    let mut c = Client::connect([served.endpoint.as_str()], None)
        .await
        .unwrap();
    etcd.pause();
    assert!(etcd.is_paused());
    let mut held = c.clone();
    let put = tokio::spawn(async move { held.put("/k", "v", None).await.unwrap() });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!put.is_finished(), "answered while paused");
    assert_eq!(etcd.revision(), 1, "applied while paused");
    etcd.resume();
    let reply = tokio::time::timeout(Duration::from_secs(2), put)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(reply.header().unwrap().revision(), 2);
    etcd.set_delay(Some(Duration::from_millis(300)));
    let started = Instant::now();
    c.get("/k", None).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    etcd.set_delay(None);
}

/// A leader's lease that expires while etcd is stopped: once etcd answers again, the
/// leader learns it lost, as its renewal is answered with TTL 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_expired_while_etcd_was_stopped_learns_it_lost() {
    let etcd = MemoryEtcd::new();
    let served = etcd.serve_loopback().await.unwrap();
    let client = Etcd::connect(&options(&served.endpoint, Duration::from_secs(1)))
        .await
        .unwrap();
    let leader = client
        .campaign(&me(), Duration::from_secs(2), false, |_| {})
        .await
        .unwrap();
    etcd.pause();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!leader.valid(), "no renewal for a TTL");
    assert!(leader.lost().borrow().is_none(), "nobody said so yet");
    etcd.resume();
    let mut lost = leader.lost();
    tokio::time::timeout(Duration::from_secs(5), lost.wait_for(|l| l.is_some()))
        .await
        .expect("the leader learns its lease is gone")
        .unwrap();
}
