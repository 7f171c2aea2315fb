//! Writes that only the leader makes, and that never overwrite a newer one (issue 42,
//! hole 5).
//!
//! A write is a transaction with two compares: the leader key's create revision is this
//! term's (no deposed leader writes), and the written key's mod revision is the one this
//! leadership last wrote or read (no older write of this leader lands over a newer one).
//! The second matters because [`Etcd::call`](crate::Etcd) sends a request again when an
//! attempt takes a third of the timeout: the first attempt may still reach etcd after the
//! second was answered, or after a later write. With the term alone it would be applied,
//! and put an older record over the newer one. With the revision it is refused, however
//! late it comes, because the key has moved on past the revision it names.
//!
//! A refused compare is not always a stale write: the put's own earlier attempt may have
//! landed (its reply lost), or an earlier put whose call timed out may have landed after
//! all. Both are this leader's own writes, older than the put at hand; the failure branch
//! of the transaction reads both keys, in the same revision, to tell them apart.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use etcd_client::{Compare, CompareOp, KeyValue, Txn, TxnOp, TxnOpResponse, TxnResponse};
use serde::de::DeserializeOwned;

use crate::{EtcdError, Leadership};

/// What a leadership knows of the keys it writes.
#[derive(Default)]
pub(crate) struct Fence {
    /// One write at a time: each expects the revision the one before it left.
    writing: tokio::sync::Mutex<()>,
    keys: Mutex<HashMap<String, KeyFence>>,
}

#[derive(Default)]
struct KeyFence {
    /// The key's mod revision as this leadership last wrote or read it (0: absent).
    revision: i64,
    /// Digests of this leadership's writes to the key whose outcome is unknown (the call
    /// failed, or is under way): any of them may still land, and one that did is this
    /// leader's own, older write, not a stranger's. A digest rather than the bytes: an
    /// etcd outage may leave hundreds of records unanswered.
    pending: HashSet<u64>,
}

fn digest(bytes: &[u8]) -> u64 {
    // A collision could only make a stranger's write pass for one of ours; there are
    // none under a correct fence, and 2^-64 does not make one.
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

impl Fence {
    fn with<T>(&self, name: &str, f: impl FnOnce(&mut KeyFence) -> T) -> T {
        // A poisoned lock only means another thread panicked mid-update of plain numbers.
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        f(keys.entry(name.to_string()).or_default())
    }
}

/// How a refused write is read.
enum Refused {
    Deposed,
    /// The key holds this very put's value: an earlier attempt of it landed.
    Landed(i64),
    /// The key holds an older write of this leader (or the record a previous leader left,
    /// never read by this one): expect its revision, and write again.
    Adopt(i64),
    /// Someone else wrote the key, or deleted it.
    Stale(Option<i64>),
}

impl Leadership {
    /// `PREFIX/NAME` decoded, with its mod revision, which this leadership's next
    /// [`put`](Self::put) of NAME then expects. A new leader reads its record so: a write
    /// made by anyone but this leader after the read is then never overwritten.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<(T, i64)>, EtcdError> {
        let read = self.etcd.get_json::<T>(name).await?;
        let revision = read.as_ref().map_or(0, |(_, r)| *r);
        self.fence
            .with(name, |k| k.revision = k.revision.max(revision));
        Ok(read)
    }

    /// Writes `PREFIX/NAME` if and only if this process still leads and the key is as
    /// this leadership last wrote or read it. Returns the write's revision.
    ///
    /// `EtcdError::Deposed` when another coordinator leads; `EtcdError::Stale` when the key
    /// changed behind this leader's back (nothing is written then: the caller treats it
    /// as a failed write). A first write of a key this leadership never read replaces
    /// what a previous leader left.
    pub async fn put(&self, name: &str, value: Vec<u8>) -> Result<i64, EtcdError> {
        if let Some(why) = self.lost.borrow().clone() {
            return Err(EtcdError::Deposed(why));
        }
        let _one_at_a_time = self.fence.writing.lock().await;
        let key = self.etcd.key(name);
        let mine = digest(&value);
        self.fence.with(name, |k| k.pending.insert(mine));
        // An adopted revision is followed by this put's own attempts only, so the second
        // round ends it; the third is slack.
        for _ in 0..3 {
            let expected = self.fence.with(name, |k| k.revision);
            let reply = self.fenced_txn(&key, expected, &value).await?;
            let revision = match self.refused(&reply, mine, name) {
                None => reply.header().map_or(0, |h| h.revision()),
                Some(Refused::Landed(revision)) => revision,
                Some(Refused::Adopt(revision)) => {
                    tracing::debug!(
                        "{key}: an earlier write of this leader landed at revision {revision} \
                         (expected {expected}); writing over it"
                    );
                    self.fence.with(name, |k| {
                        k.revision = revision;
                        k.pending.retain(|d| *d == mine);
                    });
                    continue;
                }
                Some(Refused::Deposed) => {
                    return Err(EtcdError::Deposed(format!(
                        "{} is no longer this coordinator's (term {}): another coordinator \
                         leads, and this write to {key} was refused",
                        self.key, self.term
                    )));
                }
                Some(Refused::Stale(found)) => {
                    return Err(EtcdError::Stale {
                        key,
                        expected,
                        found,
                    });
                }
            };
            // Every attempt still in flight expects an older revision: none can land now.
            self.fence.with(name, |k| {
                k.revision = revision;
                k.pending.clear();
            });
            return Ok(revision);
        }
        let expected = self.fence.with(name, |k| k.revision);
        Err(EtcdError::Stale {
            key,
            expected,
            found: None,
        })
    }

    /// One fenced write, sent again as `Etcd::call` does; when refused, it reads the
    /// leader key and the written key in the same revision.
    async fn fenced_txn(
        &self,
        key: &str,
        expected: i64,
        value: &[u8],
    ) -> Result<TxnResponse, EtcdError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(self.key.as_str(), CompareOp::Equal, self.term),
                Compare::mod_revision(key, CompareOp::Equal, expected),
            ])
            .and_then([TxnOp::put(key, value.to_vec(), None)])
            .or_else([TxnOp::get(self.key.as_str(), None), TxnOp::get(key, None)]);
        self.etcd
            .call("a fenced write", key, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
    }

    /// `None` when the write succeeded; otherwise why it was refused.
    fn refused(&self, reply: &TxnResponse, mine: u64, name: &str) -> Option<Refused> {
        if reply.succeeded() {
            return None;
        }
        let mut reads = reply.op_responses().into_iter().map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().cloned(),
            _ => None,
        });
        let leader: Option<KeyValue> = reads.next().flatten();
        let written: Option<KeyValue> = reads.next().flatten();
        if leader.map(|kv| kv.create_revision()) != Some(self.term) {
            return Some(Refused::Deposed);
        }
        let Some(kv) = written else {
            return Some(Refused::Stale(None));
        };
        let found = digest(kv.value());
        if found == mine {
            return Some(Refused::Landed(kv.mod_revision()));
        }
        // Written before this term began: by an earlier leader, whose writes stop at it.
        let before_term = kv.mod_revision() < self.term;
        if before_term || self.fence.with(name, |k| k.pending.contains(&found)) {
            return Some(Refused::Adopt(kv.mod_revision()));
        }
        Some(Refused::Stale(Some(kv.mod_revision())))
    }
}
