//! The keys and their revisions, as etcd's MVCC store keeps them: one global revision
//! that a write transaction raises by one (and a transaction that changes nothing leaves
//! alone), and per key its create revision, mod revision and version. The history of
//! changes is kept, with each change's previous value, for watches that start in the past
//! and for reads at an older revision.

use std::cmp::Ordering;
use std::collections::{BTreeMap, VecDeque};

use etcd_client::proto::{PbEvent, PbKeyValue, PbResponseHeader};
use tonic::Status;

use crate::lease::Leases;
use crate::watch::Watchers;

/// What a fresh etcd's header says: a revision of 1 before any write.
const FIRST_REVISION: i64 = 1;
/// Changes kept for watches and old reads; older ones are compacted away as etcd's
/// auto-compaction would.
const HISTORY: usize = 100_000;
const CLUSTER_ID: u64 = 0xf7ec_e7cd;
const MEMBER_ID: u64 = 0x1;
const RAFT_TERM: u64 = 2;

/// `mvccpb.Event.EventType`.
pub(crate) const PUT: i32 = 0;
pub(crate) const DELETE: i32 = 1;

pub(crate) struct Store {
    /// The revision of the last write transaction.
    pub revision: i64,
    /// The changes of revisions up to it are no longer in `history`: reads before it, and
    /// watches from it or before, are refused as compacted.
    pub compacted: i64,
    keys: BTreeMap<Vec<u8>, PbKeyValue>,
    /// Every change since `compacted`, in revision order, each with its `prev_kv`.
    pub history: VecDeque<PbEvent>,
    pub leases: Leases,
    pub watchers: Watchers,
}

/// `[key, range_end)` as etcd reads it: an empty end is the key alone, `\0` is every key
/// from `key` on (and with key `\0` too, every key).
pub(crate) fn in_range(key: &[u8], range_end: &[u8], k: &[u8]) -> bool {
    if range_end.is_empty() {
        return k == key;
    }
    if range_end == [0] {
        return k >= key;
    }
    k >= key && k < range_end
}

pub(crate) fn header_at(revision: i64) -> Option<PbResponseHeader> {
    Some(PbResponseHeader {
        cluster_id: CLUSTER_ID,
        member_id: MEMBER_ID,
        revision,
        raft_term: RAFT_TERM,
    })
}

pub(crate) fn key_required(key: &[u8]) -> Result<(), Status> {
    if key.is_empty() {
        return Err(Status::invalid_argument("etcdserver: key is not provided"));
    }
    Ok(())
}

impl Store {
    pub fn new() -> Self {
        Self {
            revision: FIRST_REVISION,
            compacted: 0,
            keys: BTreeMap::new(),
            history: VecDeque::new(),
            leases: Leases::default(),
            watchers: Watchers::default(),
        }
    }

    pub fn header(&self) -> Option<PbResponseHeader> {
        header_at(self.revision)
    }

    pub fn get(&self, key: &[u8]) -> Option<&PbKeyValue> {
        self.keys.get(key)
    }

    /// The live keys in `[key, range_end)`, in key order.
    pub fn range<'a>(
        &'a self,
        key: &'a [u8],
        range_end: &'a [u8],
    ) -> Box<dyn Iterator<Item = &'a PbKeyValue> + 'a> {
        if range_end.is_empty() {
            return Box::new(self.keys.get(key).into_iter());
        }
        let upper = if range_end == [0] {
            std::ops::Bound::Unbounded
        } else if range_end <= key {
            return Box::new(std::iter::empty());
        } else {
            std::ops::Bound::Excluded(range_end)
        };
        Box::new(
            self.keys
                .range::<[u8], _>((std::ops::Bound::Included(key), upper))
                .map(|(_, kv)| kv),
        )
    }

    /// The keys in `[key, range_end)` as they were at `revision`: the live ones with every
    /// later change undone.
    pub fn range_at(
        &self,
        key: &[u8],
        range_end: &[u8],
        revision: i64,
    ) -> Result<Vec<PbKeyValue>, Status> {
        if revision > self.revision {
            return Err(Status::out_of_range(
                "etcdserver: mvcc: required revision is a future revision",
            ));
        }
        if revision < self.compacted {
            return Err(Status::out_of_range(
                "etcdserver: mvcc: required revision has been compacted",
            ));
        }
        let mut view: BTreeMap<Vec<u8>, PbKeyValue> = self
            .range(key, range_end)
            .map(|kv| (kv.key.clone(), kv.clone()))
            .collect();
        for event in self.history.iter().rev() {
            let Some(kv) = &event.kv else { continue };
            if kv.mod_revision <= revision {
                break;
            }
            if !in_range(key, range_end, &kv.key) {
                continue;
            }
            match &event.prev_kv {
                Some(prev) => view.insert(prev.key.clone(), prev.clone()),
                None => view.remove(&kv.key),
            };
        }
        Ok(view.into_values().collect())
    }

    /// Starts a write transaction at the next revision.
    pub fn write(&mut self) -> Write<'_> {
        let revision = self.revision + 1;
        Write {
            store: self,
            revision,
            events: Vec::new(),
        }
    }

    /// Forgets the changes up to `revision`, whole revisions at a time: what is left
    /// serves every read from `revision` on, and every watch from after it.
    pub fn compact(&mut self, revision: i64) {
        while self
            .history
            .front()
            .and_then(|e| e.kv.as_ref())
            .is_some_and(|kv| kv.mod_revision <= revision)
        {
            self.history.pop_front();
        }
        self.compacted = self.compacted.max(revision);
    }

    fn commit(&mut self, revision: i64, events: Vec<PbEvent>) {
        if events.is_empty() {
            return;
        }
        self.revision = revision;
        self.watchers.notify(revision, &events);
        self.history.extend(events);
        while self.history.len() > HISTORY {
            let Some(oldest) = self.history.front().and_then(|e| e.kv.as_ref()) else {
                break;
            };
            let gone = oldest.mod_revision;
            self.compact(gone);
        }
    }
}

/// The changes of one write transaction: all at one revision, visible to the reads that
/// follow them in the same transaction, and told to watchers when it ends.
pub(crate) struct Write<'a> {
    pub store: &'a mut Store,
    pub revision: i64,
    events: Vec<PbEvent>,
}

impl Write<'_> {
    /// The revision a reply's header names: this one's, once something changed.
    pub fn header(&self) -> Option<PbResponseHeader> {
        let mut header = self.store.header();
        if let Some(h) = header.as_mut()
            && !self.events.is_empty()
        {
            h.revision = self.revision;
        }
        header
    }

    /// Puts `value` (or keeps the stored one) with `lease` (or keeps the stored one);
    /// returns the previous pair.
    pub fn put(
        &mut self,
        key: Vec<u8>,
        value: Option<Vec<u8>>,
        lease: Option<i64>,
    ) -> Result<Option<PbKeyValue>, Status> {
        key_required(&key)?;
        let prev = self.store.keys.get(&key).cloned();
        if (value.is_none() || lease.is_none()) && prev.is_none() {
            return Err(Status::invalid_argument("etcdserver: key not found"));
        }
        let old = prev.as_ref();
        let lease = lease.unwrap_or_else(|| old.map_or(0, |kv| kv.lease));
        if lease != 0 && !self.store.leases.contains(lease) {
            return Err(Status::not_found("etcdserver: requested lease not found"));
        }
        let kv = PbKeyValue {
            key: key.clone(),
            create_revision: old.map_or(self.revision, |kv| kv.create_revision),
            mod_revision: self.revision,
            version: old.map_or(0, |kv| kv.version) + 1,
            value: value.unwrap_or_else(|| old.map(|kv| kv.value.clone()).unwrap_or_default()),
            lease,
        };
        if let Some(old) = old
            && old.lease != 0
        {
            self.store.leases.detach(old.lease, &key);
        }
        if lease != 0 {
            self.store.leases.attach(lease, &key);
        }
        self.store.keys.insert(key, kv.clone());
        self.events.push(PbEvent {
            r#type: PUT,
            kv: Some(kv),
            prev_kv: prev.clone(),
        });
        Ok(prev)
    }

    /// Deletes the keys in `[key, range_end)`; returns them.
    pub fn delete(&mut self, key: &[u8], range_end: &[u8]) -> Vec<PbKeyValue> {
        let gone: Vec<PbKeyValue> = self.store.range(key, range_end).cloned().collect();
        for kv in &gone {
            self.store.keys.remove(&kv.key);
            if kv.lease != 0 {
                self.store.leases.detach(kv.lease, &kv.key);
            }
            self.events.push(PbEvent {
                r#type: DELETE,
                kv: Some(PbKeyValue {
                    key: kv.key.clone(),
                    mod_revision: self.revision,
                    ..Default::default()
                }),
                prev_kv: Some(kv.clone()),
            });
        }
        gone
    }

    /// Ends the transaction: the revision moves on if anything changed.
    pub fn commit(self) {
        let Write {
            store,
            revision,
            events,
        } = self;
        store.commit(revision, events);
    }
}

/// `etcdserverpb.Compare.CompareResult` applied to an ordering.
pub(crate) fn compare_holds(result: i32, ordering: Ordering) -> Result<bool, Status> {
    Ok(match result {
        0 => ordering == Ordering::Equal,
        1 => ordering == Ordering::Greater,
        2 => ordering == Ordering::Less,
        3 => ordering != Ordering::Equal,
        other => {
            return Err(Status::invalid_argument(format!(
                "unknown compare result {other}"
            )));
        }
    })
}
