//! Fenced writes against a real etcd (issue 42, hole 5): a leader's write never lands over
//! one it has not seen, and its own writes whose replies were lost do not stop it.
//!
//! "Behind the leader's back" is made here by a raw transaction fenced on the leader's
//! term only, which is exactly what a late first attempt of the old `Leadership::put`
//! sent. The race itself (an attempt delayed past its resend) is reproduced against the
//! in-memory etcd, whose knobs can hold one request (`ftrec-etcd-memory`'s tests).

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use ftrec_etcd::{Etcd, EtcdError, LeaderInfo, Leadership};
use ftrec_testkit::etcd;

use crate::options;

fn me(id: &str) -> LeaderInfo {
    LeaderInfo {
        id: id.into(),
        address: "127.0.0.1:7000".into(),
        pid: std::process::id(),
    }
}

/// A write of `value` to `prefix/name` fenced on `term` only; returns its revision.
async fn write_behind(raw: &mut Client, prefix: &str, term: i64, name: &str, value: &str) -> i64 {
    let leader = format!("{prefix}/leader");
    let key = format!("{prefix}/{name}");
    let txn = Txn::new()
        .when([Compare::create_revision(
            leader.as_str(),
            CompareOp::Equal,
            term,
        )])
        .and_then([TxnOp::put(key.as_str(), value, None)]);
    let reply = raw.txn(txn).await.unwrap();
    assert!(reply.succeeded());
    reply.header().unwrap().revision()
}

async fn value_of(raw: &mut Client, key: &str) -> (String, i64) {
    let reply = raw.get(key, None).await.unwrap();
    let kv = &reply.kvs()[0];
    (kv.value_str().unwrap().to_string(), kv.mod_revision())
}

async fn lead(endpoint: &str, prefix: &str, id: &str) -> (Etcd, Leadership) {
    let etcd = Etcd::connect(&options(endpoint, prefix)).await.unwrap();
    let leadership = etcd
        .campaign(&me(id), Duration::from_secs(5), true, |_| {})
        .await
        .unwrap();
    (etcd, leadership)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_made_behind_the_leaders_back_is_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let prefix = "/ftrec/behind";
    let mut raw = Client::connect([server.endpoint.as_str()], None)
        .await
        .unwrap();
    let (_etcd, leader) = lead(&server.endpoint, prefix, "one").await;
    let first = leader.put("state", b"1".to_vec()).await.unwrap();
    let term = leader.term() as i64;
    let behind = write_behind(&mut raw, prefix, term, "state", "late").await;
    assert!(behind > first);

    let e = leader.put("state", b"2".to_vec()).await.unwrap_err();
    match &e {
        EtcdError::Stale {
            key,
            expected,
            found,
        } => {
            assert_eq!(key, "/ftrec/behind/state");
            assert_eq!(*expected, first);
            assert_eq!(*found, Some(behind));
        }
        other => panic!("expected Stale, got {other}"),
    }
    let key = format!("{prefix}/state");
    assert_eq!(value_of(&mut raw, &key).await, ("late".into(), behind));
    // Refused again on the next try: a stale write is not a transient error.
    assert!(matches!(
        leader.put("state", b"3".to_vec()).await,
        Err(EtcdError::Stale { .. })
    ));
    // Other keys are fenced each on their own revision.
    leader.put("other", b"x".to_vec()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_whose_first_attempt_landed_unanswered_is_accepted_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let prefix = "/ftrec/landed";
    let mut raw = Client::connect([server.endpoint.as_str()], None)
        .await
        .unwrap();
    let (_etcd, leader) = lead(&server.endpoint, prefix, "one").await;
    leader.put("state", b"1".to_vec()).await.unwrap();
    // The put of "2" reached etcd, and its reply was lost: the resend finds "2" there.
    let landed = write_behind(&mut raw, prefix, leader.term() as i64, "state", "2").await;
    let revision = leader.put("state", b"2".to_vec()).await.unwrap();
    assert_eq!(revision, landed, "accepted as landed, not written again");
    let key = format!("{prefix}/state");
    assert_eq!(value_of(&mut raw, &key).await, ("2".into(), landed));
    // And the fence moved on with it.
    let next = leader.put("state", b"3".to_vec()).await.unwrap();
    assert!(next > landed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_writes_over_what_it_read_at_takeover_and_nothing_newer() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let prefix = "/ftrec/takeover";
    let mut raw = Client::connect([server.endpoint.as_str()], None)
        .await
        .unwrap();
    let (_old_etcd, old) = lead(&server.endpoint, prefix, "old").await;
    old.put("state", b"\"old\"".to_vec()).await.unwrap();
    old.put("unread", b"\"old\"".to_vec()).await.unwrap();
    old.resign().await;
    let (_etcd, new) = lead(&server.endpoint, prefix, "new").await;
    let (record, read_at) = new.get_json::<String>("state").await.unwrap().unwrap();
    assert_eq!(record, "old");
    // A key the new leader never read: what the old leader left is written over.
    new.put("unread", b"\"new\"".to_vec()).await.unwrap();
    // The record read at takeover, then changed by someone else before the first write.
    let behind = write_behind(&mut raw, prefix, new.term() as i64, "state", "\"x\"").await;
    let e = new.put("state", b"\"new\"".to_vec()).await.unwrap_err();
    assert!(
        matches!(e, EtcdError::Stale { expected, .. } if expected == read_at),
        "{e}"
    );
    let key = format!("{prefix}/state");
    assert_eq!(value_of(&mut raw, &key).await, ("\"x\"".into(), behind));
    // The deposed old leader is told so, not Stale.
    let e = old.put("state", b"\"old2\"".to_vec()).await.unwrap_err();
    assert!(matches!(e, EtcdError::Deposed(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_timed_out_while_etcd_was_frozen_does_not_block_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let server = etcd::start(dir.path());
    let prefix = "/ftrec/frozen";
    let mut raw = Client::connect([server.endpoint.as_str()], None)
        .await
        .unwrap();
    let (_etcd, leader) = lead(&server.endpoint, prefix, "one").await;
    leader.put("state", b"1".to_vec()).await.unwrap();
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill")
            .args([sig, &server.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    signal("-STOP");
    let e = leader.put("state", b"2".to_vec()).await.unwrap_err();
    signal("-CONT");
    assert!(matches!(e, EtcdError::Timeout { .. }), "{e}");
    // Whether or not one of its attempts landed as etcd woke, make one land now: the
    // leader's own unanswered write, which the next write goes over.
    write_behind(&mut raw, prefix, leader.term() as i64, "state", "2").await;
    let revision = leader.put("state", b"3".to_vec()).await.unwrap();
    let key = format!("{prefix}/state");
    assert_eq!(value_of(&mut raw, &key).await, ("3".into(), revision));
}
