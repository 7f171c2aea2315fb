//! etcd's KV requests applied to the store: Range, Put, DeleteRange, Txn (compares on
//! version, create and mod revision, value and lease; nested transactions) and Compact.

use std::cmp::Ordering;

use etcd_client::proto::{
    PbCompactionRequest, PbCompactionResponse, PbCompare, PbDeleteRequest, PbDeleteResponse,
    PbKeyValue, PbPutRequest, PbPutResponse, PbRangeRequest, PbRangeResponse, PbResponseOp,
    PbTargetUnion, PbTxnOpRequest, PbTxnOpResponse, PbTxnRequest, PbTxnResponse,
};
use tonic::Status;

use crate::store::{Store, Write, compare_holds, key_required};

/// `RangeRequest.SortOrder` and `SortTarget`.
const SORT_NONE: i32 = 0;
const SORT_DESCEND: i32 = 2;
const TARGET_KEY: i32 = 0;

/// A read, at the current revision (seeing the transaction's own writes) or an older one.
pub(crate) fn range(store: &Store, r: &PbRangeRequest) -> Result<PbRangeResponse, Status> {
    let mut kvs: Vec<PbKeyValue> = if r.revision > 0 && r.revision != store.revision {
        store.range_at(&r.key, &r.range_end, r.revision)?
    } else {
        store.range(&r.key, &r.range_end).cloned().collect()
    };
    let count = kvs.len() as i64;
    kvs.retain(|kv| {
        (r.min_mod_revision == 0 || kv.mod_revision >= r.min_mod_revision)
            && (r.max_mod_revision == 0 || kv.mod_revision <= r.max_mod_revision)
            && (r.min_create_revision == 0 || kv.create_revision >= r.min_create_revision)
            && (r.max_create_revision == 0 || kv.create_revision <= r.max_create_revision)
    });
    sort(&mut kvs, r.sort_order, r.sort_target);
    let more = r.limit > 0 && kvs.len() as i64 > r.limit;
    if more {
        kvs.truncate(r.limit as usize);
    }
    if r.count_only {
        kvs.clear();
    } else if r.keys_only {
        for kv in &mut kvs {
            kv.value.clear();
        }
    }
    Ok(PbRangeResponse {
        header: store.header(),
        kvs,
        more,
        count,
    })
}

fn sort(kvs: &mut [PbKeyValue], order: i32, target: i32) {
    // Like etcd: a target other than the key with no order given sorts ascending.
    if order == SORT_NONE && target == TARGET_KEY {
        return;
    }
    kvs.sort_by(|a, b| match target {
        1 => a.version.cmp(&b.version),
        2 => a.create_revision.cmp(&b.create_revision),
        3 => a.mod_revision.cmp(&b.mod_revision),
        4 => a.value.cmp(&b.value),
        _ => a.key.cmp(&b.key),
    });
    if order == SORT_DESCEND {
        kvs.reverse();
    }
}

pub(crate) fn put(w: &mut Write, p: PbPutRequest) -> Result<PbPutResponse, Status> {
    let value = (!p.ignore_value).then_some(p.value);
    let lease = (!p.ignore_lease).then_some(p.lease);
    let prev = w.put(p.key, value, lease)?;
    Ok(PbPutResponse {
        header: w.header(),
        prev_kv: if p.prev_kv { prev } else { None },
    })
}

pub(crate) fn delete(w: &mut Write, d: &PbDeleteRequest) -> PbDeleteResponse {
    let gone = w.delete(&d.key, &d.range_end);
    PbDeleteResponse {
        header: w.header(),
        deleted: gone.len() as i64,
        prev_kvs: if d.prev_kv { gone } else { Vec::new() },
    }
}

/// One compare, as etcd's `applyCompare`: every key in the range must satisfy it; a key
/// that does not exist compares as zero revisions and version, and no value.
fn compare(store: &Store, c: &PbCompare) -> Result<bool, Status> {
    const VALUE: i32 = 3;
    let kvs: Vec<&PbKeyValue> = store.range(&c.key, &c.range_end).collect();
    if kvs.is_empty() {
        if c.target == VALUE {
            return Ok(false);
        }
        return compare_one(&PbKeyValue::default(), c);
    }
    for kv in kvs {
        if !compare_one(kv, c)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn compare_one(kv: &PbKeyValue, c: &PbCompare) -> Result<bool, Status> {
    let number = |stored: i64| -> Result<Ordering, Status> {
        let wanted = match &c.target_union {
            Some(PbTargetUnion::Version(v))
            | Some(PbTargetUnion::CreateRevision(v))
            | Some(PbTargetUnion::ModRevision(v))
            | Some(PbTargetUnion::Lease(v)) => *v,
            Some(PbTargetUnion::Value(_)) => {
                return Err(Status::invalid_argument("a number compared with a value"));
            }
            None => 0,
        };
        Ok(stored.cmp(&wanted))
    };
    let ordering = match c.target {
        0 => number(kv.version)?,
        1 => number(kv.create_revision)?,
        2 => number(kv.mod_revision)?,
        3 => match &c.target_union {
            Some(PbTargetUnion::Value(v)) => kv.value.as_slice().cmp(v.as_slice()),
            None => kv.value.as_slice().cmp(&[]),
            Some(_) => return Err(Status::invalid_argument("a value compared with a number")),
        },
        4 => number(kv.lease)?,
        other => {
            return Err(Status::invalid_argument(format!(
                "unknown compare target {other}"
            )));
        }
    };
    compare_holds(c.result, ordering)
}

/// Refuses, before anything is applied, what etcd's `checkRequests` refuses: a put
/// without a key, or with a lease that does not exist. Nested transactions are checked
/// in both branches.
fn check(store: &Store, ops: &[etcd_client::proto::PbTxnRequestOp]) -> Result<(), Status> {
    for op in ops {
        match &op.request {
            Some(PbTxnOpRequest::RequestPut(p)) => {
                key_required(&p.key)?;
                if !p.ignore_lease && p.lease != 0 && !store.leases.contains(p.lease) {
                    return Err(Status::not_found("etcdserver: requested lease not found"));
                }
            }
            Some(PbTxnOpRequest::RequestTxn(t)) => {
                check(store, &t.success)?;
                check(store, &t.failure)?;
            }
            Some(PbTxnOpRequest::RequestRange(r)) => {
                key_required(&r.key)?;
                if r.revision > 0 && r.revision != store.revision {
                    store.range_at(&r.key, &r.range_end, r.revision)?;
                }
            }
            Some(PbTxnOpRequest::RequestDeleteRange(d)) => key_required(&d.key)?,
            None => return Err(Status::invalid_argument("etcdserver: empty request op")),
        }
    }
    Ok(())
}

/// A transaction: its compares against the store as it is, then one branch, all in one
/// revision.
pub(crate) fn txn(w: &mut Write, t: PbTxnRequest) -> Result<PbTxnResponse, Status> {
    let mut succeeded = true;
    for c in &t.compare {
        if !compare(w.store, c)? {
            succeeded = false;
            break;
        }
    }
    let ops = if succeeded { t.success } else { t.failure };
    check(w.store, &ops)?;
    let mut responses = Vec::with_capacity(ops.len());
    for op in ops {
        let response = match op.request {
            Some(PbTxnOpRequest::RequestRange(r)) => {
                let mut reply = range(w.store, &r)?;
                reply.header = w.header();
                PbTxnOpResponse::ResponseRange(reply)
            }
            Some(PbTxnOpRequest::RequestPut(p)) => PbTxnOpResponse::ResponsePut(put(w, p)?),
            Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                PbTxnOpResponse::ResponseDeleteRange(delete(w, &d))
            }
            Some(PbTxnOpRequest::RequestTxn(nested)) => {
                PbTxnOpResponse::ResponseTxn(txn(w, nested)?)
            }
            None => return Err(Status::invalid_argument("etcdserver: empty request op")),
        };
        responses.push(PbResponseOp {
            response: Some(response),
        });
    }
    Ok(PbTxnResponse {
        header: w.header(),
        succeeded,
        responses,
    })
}

pub(crate) fn compact(
    store: &mut Store,
    c: &PbCompactionRequest,
) -> Result<PbCompactionResponse, Status> {
    if c.revision > store.revision {
        return Err(Status::out_of_range(
            "etcdserver: mvcc: required revision is a future revision",
        ));
    }
    if c.revision <= store.compacted {
        return Err(Status::out_of_range(
            "etcdserver: mvcc: required revision has been compacted",
        ));
    }
    store.compact(c.revision);
    Ok(PbCompactionResponse {
        header: store.header(),
    })
}
