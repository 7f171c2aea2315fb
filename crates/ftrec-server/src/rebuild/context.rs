//! What rebuilding needs beside the update pipeline: clients for the other servers, the
//! bulk transport (this server's port and its side for asking survivors), the rebuild
//! boost, a promoted spare's reserve, and the background rebuild in progress.
//!
//! Invariants this type keeps:
//! - at most one background rebuild is current, and each gets a new number: a rebuild
//!   started later, or a restore ([`RebuildContext::cancel_background`]), supersedes an
//!   older one, which then can tell ([`RebuildContext::finish_background`] refuses it);
//! - the reserve is taken once: the rebuild that takes it leaves an empty one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ftrec_ec::Codec;

use super::boost::RebuildBoost;
use super::reserve::Reserve;
use crate::bulk::{BulkClient, BulkServer};
use crate::degraded::Background;
use crate::ec::Peers;

pub(crate) struct RebuildContext {
    /// Erasure coding: clients for the other servers (parity differences, degraded reads).
    pub(crate) peers: Option<Arc<Peers>>,
    /// Erasure coding over real TCP without TLS (`ec.rebuild_transport = "bulk"`): this
    /// server's bulk port, where it sends cycle ranges to a replacement straight from its
    /// tables, and its side for asking survivors' ranges when it is one (`bulk.rs`).
    pub(crate) bulk: Option<Arc<BulkServer>>,
    pub(crate) bulk_client: Option<Arc<BulkClient>>,
    /// Rebuild first (`boost.rs`): raised while this server rebuilds uncapped into itself,
    /// and (through `bulk`) while it sends a replacement ranges.
    pub(crate) boost: Option<Arc<RebuildBoost>>,
    /// A background rebuild in progress here (`degraded/`).
    background: Mutex<Option<Background>>,
    /// Numbers each background rebuild, so a superseded one can tell.
    background_ids: AtomicU64,
    /// A promoted spare's memory, written while it waited (`reserve.rs`); the rebuild
    /// takes it.
    reserve: Mutex<Reserve>,
}

impl RebuildContext {
    pub(crate) fn new(
        peers: Option<Arc<Peers>>,
        bulk: Option<Arc<BulkServer>>,
        bulk_client: Option<Arc<BulkClient>>,
        boost: Option<Arc<RebuildBoost>>,
        reserve: Reserve,
    ) -> Self {
        Self {
            peers,
            bulk,
            bulk_client,
            boost,
            background: Mutex::new(None),
            background_ids: AtomicU64::new(0),
            reserve: Mutex::new(reserve),
        }
    }

    fn current(&self) -> MutexGuard<'_, Option<Background>> {
        self.background.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The background rebuild in progress, if any.
    pub(crate) fn background(&self) -> Option<Background> {
        self.current().clone()
    }

    /// Ends any background rebuild (a restore replaced the whole shard).
    pub(crate) fn cancel_background(&self) {
        *self.current() = None;
    }

    /// Starts a background rebuild that reads around `lost`, superseding any other.
    pub(crate) fn start_background(&self, lost: Vec<usize>, codec: Codec) {
        let id = self.background_ids.fetch_add(1, Ordering::SeqCst);
        *self.current() = Some(Background {
            id,
            lost,
            codec: Arc::new(codec),
        });
    }

    /// Ends the background rebuild numbered `mine` once it has decoded everything; `false`
    /// (and nothing changes) if another one, or none, is current now.
    pub(crate) fn finish_background(&self, mine: Option<u64>) -> bool {
        let mut background = self.current();
        if background.as_ref().map(|b| b.id) != mine {
            return false;
        }
        *background = None;
        true
    }

    /// A promoted spare's reserve, leaving an empty one.
    pub(crate) fn take_reserve(&self) -> Reserve {
        std::mem::take(&mut *self.reserve.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context() -> RebuildContext {
        RebuildContext::new(None, None, None, None, Reserve::default())
    }

    fn codec() -> Codec {
        Codec::new(2, 1).unwrap()
    }

    #[test]
    fn a_newer_background_rebuild_supersedes_an_older_one() {
        let c = context();
        assert!(c.background().is_none());
        c.start_background(vec![1], codec());
        let first = c.background().map(|b| b.id);
        c.start_background(vec![2], codec());
        let second = c.background().map(|b| b.id);
        assert_ne!(first, second);
        assert_eq!(c.background().map(|b| b.lost), Some(vec![2]));
        // The older one cannot end the newer one.
        assert!(!c.finish_background(first));
        assert_eq!(c.background().map(|b| b.id), second);
        assert!(c.finish_background(second));
        assert!(c.background().is_none());
        // Nor end twice.
        assert!(!c.finish_background(second));
    }

    #[test]
    fn a_cancelled_background_rebuild_cannot_finish() {
        let c = context();
        c.start_background(vec![0], codec());
        let mine = c.background().map(|b| b.id);
        c.cancel_background();
        assert!(!c.finish_background(mine));
        // A rebuild started after a cancel gets a number of its own.
        c.start_background(vec![0], codec());
        assert_ne!(c.background().map(|b| b.id), mine);
    }
}
