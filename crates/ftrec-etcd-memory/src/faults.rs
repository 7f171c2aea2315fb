//! The simulation's knobs: a pause that stops answering (requests wait, as at a
//! SIGSTOPped etcd, and are applied once it resumes), a delay before every request is
//! applied (a slow disk or raft), and a longer delay for the next few requests of one
//! kind (a request that lands after its resend).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

/// Which kind of request a knob aims at: one per etcd RPC served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rpc {
    Range,
    Put,
    DeleteRange,
    Txn,
    Compact,
    LeaseGrant,
    LeaseRevoke,
    /// Each renewal on a keep-alive stream.
    LeaseKeepAlive,
    LeaseTimeToLive,
    LeaseLeases,
    /// Each create or cancel on a watch stream.
    Watch,
}

pub(crate) struct Faults {
    paused: watch::Sender<bool>,
    knobs: Mutex<Knobs>,
}

#[derive(Default)]
struct Knobs {
    delay: Option<Duration>,
    /// The delay the next `count` requests of a kind get instead.
    next: HashMap<Rpc, (usize, Duration)>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            paused: watch::Sender::new(false),
            knobs: Mutex::default(),
        }
    }
}

impl Faults {
    fn knobs(&self) -> std::sync::MutexGuard<'_, Knobs> {
        // The knobs are plain values: a panic elsewhere leaves them whole.
        self.knobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    pub fn paused(&self) -> bool {
        *self.paused.borrow()
    }

    pub fn set_delay(&self, delay: Option<Duration>) {
        self.knobs().delay = delay;
    }

    pub fn delay_next(&self, rpc: Rpc, count: usize, delay: Duration) {
        self.knobs().next.insert(rpc, (count, delay));
    }

    /// Returns once the server is not paused.
    pub async fn resumed(&self) {
        let mut paused = self.paused.subscribe();
        // The sender lives as long as the server: an error cannot happen while it serves.
        let _ = paused.wait_for(|p| !*p).await;
    }

    /// Waits until a request of kind `rpc` may be applied: while paused, then its delay.
    pub async fn admit(&self, rpc: Rpc) {
        self.resumed().await;
        let delay = {
            let mut knobs = self.knobs();
            match knobs.next.get_mut(&rpc) {
                Some((count, delay)) if *count > 0 => {
                    *count -= 1;
                    Some(*delay)
                }
                _ => knobs.delay,
            }
        };
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
            self.resumed().await;
        }
    }
}
