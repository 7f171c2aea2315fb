//! Which peers' connections lost packets lately: what decides whether a slow call gets a
//! copy ([`crate::hedge`]).
//!
//! A copy on a second connection helps a call that a lost packet held back, and nothing
//! else: on a host short of CPU the copy is more work for the cores that are short, and
//! goes to the same busy peer. Lateness alone cannot tell the two apart when one peer is
//! busier than the others. The kernel can: each connection's tail probes read its
//! retransmission count anyway ([`crate::tail_probe`]), and retransmissions at a lossy
//! link's rate, at two looks in a row, are noted here under the peer's address, for every
//! call to that address to see. (A loaded host's loopback retransmits too, when a starved
//! peer's ACK comes after the 5 ms retransmission floor, but in ones and twos, not at
//! every look.) In a failure-free 300-step `ec` run on 2 cores the parity updates sent
//! twice went from 177 to 0.
//!
//! Only loss that this end retransmits is seen, which a link losing packets both ways (the
//! lossy links the harness and the soak make) always shows within a few calls. A link that
//! only loses what the peer sends back is not seen here; its calls still get copies where
//! nothing watches (tail probes off, TLS, a simulated network).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How long a retransmission keeps a peer's link taken for lossy.
pub const LOSS_MEMORY: Duration = Duration::from_secs(10);

/// The last retransmission seen on any connection to one address.
#[derive(Debug)]
pub struct LinkLoss {
    since: Instant,
    /// Milliseconds after `since` of the last rise in a connection's retransmissions, plus
    /// one; 0: none seen.
    last_rise: AtomicU64,
}

impl LinkLoss {
    /// A connection to this address retransmitted since it last looked.
    pub fn noted(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.last_rise.store(ms + 1, Ordering::Relaxed);
    }

    fn within(&self, memory: Duration) -> bool {
        match self.last_rise.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let seen = self.since + Duration::from_millis(at - 1);
                seen.elapsed() <= memory
            }
        }
    }
}

/// Per address, the links whose connections read their retransmissions. Cheap to clone;
/// clones share.
#[derive(Clone, Debug)]
pub struct LossWatch {
    since: Instant,
    links: Arc<Mutex<HashMap<String, Arc<LinkLoss>>>>,
}

impl Default for LossWatch {
    fn default() -> Self {
        Self {
            since: Instant::now(),
            links: Arc::default(),
        }
    }
}

impl LossWatch {
    /// The link to `address`, which a connection that reads its retransmissions notes
    /// into; from now on `address` is watched.
    pub fn link(&self, address: &str) -> Arc<LinkLoss> {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links
            .entry(address.to_owned())
            .or_insert_with(|| {
                Arc::new(LinkLoss {
                    since: self.since,
                    last_rise: AtomicU64::new(0),
                })
            })
            .clone()
    }

    /// Whether a connection to `address` retransmitted in the last `memory`; `None` where
    /// no connection to it reads its retransmissions.
    pub fn lost_within(&self, address: &str, memory: Duration) -> Option<bool> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.get(address).map(|link| link.within(memory))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_retransmission_marks_its_address_lossy_for_a_while() {
        let watch = LossWatch::default();
        assert_eq!(watch.lost_within("a:1", LOSS_MEMORY), None, "not watched");
        let link = watch.link("a:1");
        assert_eq!(watch.lost_within("a:1", LOSS_MEMORY), Some(false));
        tokio::time::advance(Duration::from_secs(3)).await;
        link.noted();
        // Every connection to the address shares it; other addresses are apart.
        assert_eq!(watch.clone().lost_within("a:1", LOSS_MEMORY), Some(true));
        assert_eq!(watch.lost_within("b:1", LOSS_MEMORY), None);
        tokio::time::advance(LOSS_MEMORY).await;
        assert_eq!(watch.lost_within("a:1", LOSS_MEMORY), Some(true));
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(
            watch.lost_within("a:1", LOSS_MEMORY),
            Some(false),
            "forgotten"
        );
        assert!(Arc::ptr_eq(&link, &watch.link("a:1")));
    }
}
