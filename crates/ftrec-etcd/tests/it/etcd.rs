//! Against a real etcd on loopback: the job claim, the election, fencing of a deposed
//! leader, and the errors a user sees.

use std::time::Duration;

use ftrec_etcd::{Etcd, EtcdError, EtcdOptions, JobClaim, LeaderInfo};
use ftrec_testkit::etcd;

use crate::options;

fn me(id: &str) -> LeaderInfo {
    LeaderInfo {
        id: id.into(),
        address: format!("127.0.0.1:{}", 7000 + id.len()),
        pid: std::process::id(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_belongs_to_one_job_and_one_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let etcd = Etcd::connect(&options(&server.endpoint, "/ftrec/a"))
        .await
        .unwrap();
    let claim = JobClaim {
        job_id: "job-1".into(),
        fingerprint: "00000000000000aa".into(),
    };
    etcd.claim_job(&claim).await.unwrap();
    // The same job again (a restart, a standby): accepted.
    etcd.claim_job(&claim).await.unwrap();
    let other_job = JobClaim {
        job_id: "job-2".into(),
        ..claim.clone()
    };
    let e = etcd.claim_job(&other_job).await.unwrap_err();
    assert!(matches!(e, EtcdError::OtherJob { .. }), "{e}");
    assert!(e.to_string().contains("/ftrec/a/job"), "{e}");
    let changed = JobClaim {
        fingerprint: "00000000000000bb".into(),
        ..claim.clone()
    };
    let e = etcd.claim_job(&changed).await.unwrap_err();
    assert!(matches!(e, EtcdError::ConfigChanged { .. }), "{e}");
    assert!(e.to_string().contains("00000000000000aa"), "{e}");
    // Refusals write nothing: the stored claim is the first one.
    let (stored, _) = etcd.get_json::<JobClaim>("job").await.unwrap().unwrap();
    assert_eq!(stored, claim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_and_a_bad_prefix_are_named() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let e = match Etcd::connect(&options(&endpoint, "/ftrec/x")).await {
        Err(e) => e,
        Ok(_) => panic!("nothing listens on {endpoint}"),
    };
    assert!(matches!(e, EtcdError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains(&endpoint), "{e}");
    for bad in ["ftrec/x", "/ftrec/x/", "/", "/a b"] {
        let e = match Etcd::connect(&options(&endpoint, bad)).await {
            Err(e) => e,
            Ok(_) => panic!("{bad:?} accepted"),
        };
        assert!(e.to_string().contains("cluster.etcd_prefix"), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_lease_expires_and_the_old_leader_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let opts = options(&server.endpoint, "/ftrec/e");
    let first = Etcd::connect(&opts).await.unwrap();
    let second = Etcd::connect(&opts).await.unwrap();
    let ttl = Duration::from_secs(2);
    let leader = first
        .campaign(&me("one"), ttl, false, |_| {})
        .await
        .unwrap();
    assert!(leader.valid());
    leader.put("state", b"1".to_vec()).await.unwrap();
    // A second coordinator without --standby is refused, naming the holder.
    let e = match second.campaign(&me("two"), ttl, false, |_| {}).await {
        Err(e) => e,
        Ok(_) => panic!("two leaders"),
    };
    assert!(matches!(e, EtcdError::LeaderHeld { .. }), "{e}");
    assert!(e.to_string().contains("one"), "{e}");
    let (info, term) = second.leader().await.unwrap().unwrap();
    assert_eq!(info.id, "one");
    assert_eq!(term as u64, leader.term());

    // The leader's lease ends without a resignation, as when its process is frozen: the
    // lease is revoked behind its back, which etcd treats as an expiry.
    let standby = tokio::spawn(async move {
        let mut waited_on = Vec::new();
        let l = second
            .campaign(&me("two"), ttl, true, |i| waited_on.push(i.id.clone()))
            .await
            .unwrap();
        (l, waited_on)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    leader.resign().await;
    let (new_leader, waited_on) = tokio::time::timeout(Duration::from_secs(10), standby)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(waited_on, vec!["one".to_string()]);
    assert!(new_leader.term() > leader.term(), "terms only grow");
    new_leader.put("state", b"2".to_vec()).await.unwrap();
    // The old leader's write is refused by the transaction, whatever its local view.
    let e = leader.put("state", b"stale".to_vec()).await.unwrap_err();
    assert!(matches!(e, EtcdError::Deposed(_)), "{e}");
    let (v, _) = first.get_json::<u32>("state").await.unwrap().unwrap();
    assert_eq!(v, 2);
    // Its keep-alive learns the lease is gone.
    let mut lost = leader.lost();
    tokio::time::timeout(Duration::from_secs(5), lost.wait_for(|l| l.is_some()))
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_survive_one_killed() {
    let dir = tempfile::tempdir().unwrap();
    let mut members = etcd::start_cluster(dir.path(), 3);
    let endpoints: Vec<String> = members.iter().map(|m| m.endpoint.clone()).collect();
    let opts = EtcdOptions {
        endpoints,
        prefix: "/ftrec/three".into(),
        request_timeout: Duration::from_secs(3),
    };
    let etcd = Etcd::connect(&opts).await.unwrap();
    let leader = etcd
        .campaign(&me("one"), Duration::from_secs(2), false, |_| {})
        .await
        .unwrap();
    leader.put("state", b"1".to_vec()).await.unwrap();
    members[0].kill();
    // Writes go on through the loss (a call that picks the dead member is made again on
    // another), and the leader keeps its lease. A renewal may miss while the remaining
    // members elect a new raft leader, so `valid` may blink; being deposed may not.
    for i in 2..8u32 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        leader
            .put("state", i.to_string().into_bytes())
            .await
            .unwrap();
    }
    assert!(leader.lost().borrow().is_none());
    let (v, _) = etcd.get_json::<u32>("state").await.unwrap().unwrap();
    assert_eq!(v, 7);
}
