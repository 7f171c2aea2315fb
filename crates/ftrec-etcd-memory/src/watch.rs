//! Watches: each gRPC watch stream holds any number of watchers, each on a key or a
//! range, from a start revision (history replayed first) or from now, told every change
//! of every write transaction in revision order.

use etcd_client::proto::{PbEvent, PbWatchResponse};
use tokio::sync::mpsc;
use tonic::Status;

use crate::store::{DELETE, PUT, Store, header_at, in_range};

pub(crate) type Replies = mpsc::UnboundedSender<Result<PbWatchResponse, Status>>;

/// `WatchCreateRequest.FilterType`.
const NOPUT: i32 = 0;
const NODELETE: i32 = 1;

struct Watcher {
    /// The gRPC stream it belongs to.
    stream: u64,
    id: i64,
    key: Vec<u8>,
    range_end: Vec<u8>,
    prev_kv: bool,
    no_put: bool,
    no_delete: bool,
    replies: Replies,
}

#[derive(Default)]
pub(crate) struct Watchers {
    watchers: Vec<Watcher>,
    next_stream: u64,
}

/// What a watch create request asks for.
pub(crate) struct Create {
    pub key: Vec<u8>,
    pub range_end: Vec<u8>,
    pub start_revision: i64,
    pub prev_kv: bool,
    pub filters: Vec<i32>,
    pub watch_id: i64,
}

impl Watcher {
    /// The events of one revision this watcher is told, as it asked for them.
    fn select(&self, events: &[PbEvent]) -> Vec<PbEvent> {
        events
            .iter()
            .filter(|e| {
                let Some(kv) = &e.kv else { return false };
                in_range(&self.key, &self.range_end, &kv.key)
                    && !(e.r#type == PUT && self.no_put)
                    && !(e.r#type == DELETE && self.no_delete)
            })
            .map(|e| PbEvent {
                prev_kv: if self.prev_kv {
                    e.prev_kv.clone()
                } else {
                    None
                },
                ..e.clone()
            })
            .collect()
    }
}

impl Watchers {
    pub fn new_stream(&mut self) -> u64 {
        self.next_stream += 1;
        self.next_stream
    }

    /// Tells each watcher the changes of one write transaction; forgets the watchers
    /// whose stream is gone.
    pub fn notify(&mut self, revision: i64, events: &[PbEvent]) {
        self.watchers.retain(|w| {
            let selected = w.select(events);
            if selected.is_empty() {
                return !w.replies.is_closed();
            }
            w.replies
                .send(Ok(PbWatchResponse {
                    header: header_at(revision),
                    watch_id: w.id,
                    events: selected,
                    ..Default::default()
                }))
                .is_ok()
        });
    }

    pub fn cancel(&mut self, stream: u64, id: i64) -> bool {
        let before = self.watchers.len();
        self.watchers
            .retain(|w| !(w.stream == stream && w.id == id));
        self.watchers.len() != before
    }

    pub fn end_stream(&mut self, stream: u64) {
        self.watchers.retain(|w| w.stream != stream);
    }

    fn taken(&self, stream: u64, id: i64) -> bool {
        self.watchers
            .iter()
            .any(|w| w.stream == stream && w.id == id)
    }
}

impl Store {
    /// Creates a watcher on `stream`: says so, replays the history it asked for, and from
    /// then on it is told every change (all under the store's lock: nothing is missed or
    /// told twice).
    pub fn create_watch(&mut self, stream: u64, create: Create, replies: &Replies) {
        let id = if create.watch_id != 0 {
            create.watch_id
        } else {
            (0..)
                .find(|id| !self.watchers.taken(stream, *id))
                .unwrap_or_default()
        };
        let refuse = |canceled_reason: &str, compact_revision: i64| {
            let _ = replies.send(Ok(PbWatchResponse {
                header: self.header(),
                watch_id: id,
                created: true,
                canceled: true,
                cancel_reason: canceled_reason.to_string(),
                compact_revision,
                ..Default::default()
            }));
        };
        if create.watch_id != 0 && self.watchers.taken(stream, id) {
            return refuse("etcdserver: mvcc: watcher ID already in use", 0);
        }
        if create.start_revision != 0 && create.start_revision <= self.compacted {
            return refuse(
                "etcdserver: mvcc: required revision has been compacted",
                self.compacted,
            );
        }
        let watcher = Watcher {
            stream,
            id,
            key: create.key,
            range_end: create.range_end,
            prev_kv: create.prev_kv,
            no_put: create.filters.contains(&NOPUT),
            no_delete: create.filters.contains(&NODELETE),
            replies: replies.clone(),
        };
        let _ = replies.send(Ok(PbWatchResponse {
            header: self.header(),
            watch_id: id,
            created: true,
            ..Default::default()
        }));
        if create.start_revision != 0 {
            let past: Vec<PbEvent> = self
                .history
                .iter()
                .filter(|e| {
                    e.kv.as_ref()
                        .is_some_and(|kv| kv.mod_revision >= create.start_revision)
                })
                .cloned()
                .collect();
            let selected = watcher.select(&past);
            if !selected.is_empty() {
                let _ = replies.send(Ok(PbWatchResponse {
                    header: self.header(),
                    watch_id: id,
                    events: selected,
                    ..Default::default()
                }));
            }
        }
        self.watchers.watchers.push(watcher);
    }
}
