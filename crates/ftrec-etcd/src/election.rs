//! Leader election with a lease, and writes fenced by it.
//!
//! A coordinator leads while `PREFIX/leader` is its own: created in a transaction that
//! succeeds only when the key is absent, attached to a lease it keeps alive. The key's
//! create revision is the leader's *term*: etcd's revisions only grow, so every later
//! leader's term is larger, and a deposed leader's writes (each a transaction conditioned
//! on that revision) fail however late they arrive.
//!
//! A leader that cannot reach etcd cannot tell an etcd that is down (nobody else can lead
//! either) from one it alone is cut off from (a standby may lead now). It is deposed only
//! when etcd says its lease is gone; until then [`Leadership::valid`] turns false once
//! the lease may have expired, and its caller keeps to what stays safe either way: work
//! the servers' epoch fence refuses once a newer leader has taken over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::fenced::Fence;
use crate::store::to_json;
use crate::{Etcd, EtcdError};

/// What `PREFIX/leader` holds: who leads, and where its RPC service listens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderInfo {
    /// The coordinator's id (`--id`, or host and pid).
    pub id: String,
    pub address: String,
    pub pid: u32,
}

/// How one round of a campaign went.
enum Campaign {
    Won {
        lease: i64,
        term: i64,
        since: Instant,
    },
    /// Someone else leads (or nobody, between an expiry and the next campaign).
    Held(Option<(LeaderInfo, i64)>),
}

/// This process leads the job until [`Leadership::lost`] says otherwise.
#[derive(Clone)]
pub struct Leadership {
    pub(crate) etcd: Etcd,
    /// `PREFIX/leader`.
    pub(crate) key: String,
    lease: i64,
    pub(crate) term: i64,
    ttl: Duration,
    /// Until when the lease is surely alive: the send time of the last renewal etcd
    /// answered, plus the TTL. Past it, another coordinator may lead.
    valid_until: Arc<Mutex<Instant>>,
    pub(crate) lost: watch::Receiver<Option<String>>,
    /// What this leadership knows of the keys it writes (`fenced.rs`).
    pub(crate) fence: Arc<Fence>,
}

impl Etcd {
    /// The coordinator that leads the job now, if any.
    pub async fn leader(&self) -> Result<Option<(LeaderInfo, i64)>, EtcdError> {
        Ok(self.leader_key().await?.map(|(info, term, _)| (info, term)))
    }

    /// The leader key: who leads, the key's create revision (the term) and its lease.
    async fn leader_key(&self) -> Result<Option<(LeaderInfo, i64, i64)>, EtcdError> {
        let key = self.key("leader");
        let reply = self
            .call("finding the leader", &key, |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = reply.kvs().first() else {
            return Ok(None);
        };
        let info = serde_json::from_slice(kv.value()).map_err(|e| EtcdError::Corrupt {
            key: key.clone(),
            error: e.to_string(),
        })?;
        Ok(Some((info, kv.create_revision(), kv.lease())))
    }

    /// Becomes the leader. With `standby`, waits for the current leader's key to go (its
    /// lease expired, or it resigned) and takes over; without, a held key is an error.
    /// `on_wait` is told who leads while this one waits (once per leader).
    pub async fn campaign(
        &self,
        me: &LeaderInfo,
        ttl: Duration,
        standby: bool,
        mut on_wait: impl FnMut(&LeaderInfo),
    ) -> Result<Leadership, EtcdError> {
        let key = self.key("leader");
        let ttl_s = ttl.as_secs().max(1) as i64;
        let value = to_json(me, &key)?;
        let mut told: Option<LeaderInfo> = None;
        let mut failing = false;
        loop {
            let round = self.campaign_round(&key, &value, ttl_s).await;
            let holder = match round {
                Ok(Campaign::Won { lease, term, since }) => {
                    return self.lead(key, lease, term, ttl, since).await;
                }
                Ok(Campaign::Held(holder)) => {
                    failing = false;
                    holder
                }
                // A standby outlives an etcd that does not answer for a while (a member
                // restarting, a lost quorum); a coordinator starting without one says so.
                Err(e @ (EtcdError::Request { .. } | EtcdError::Timeout { .. })) if standby => {
                    if !failing {
                        tracing::warn!("standby: {e}; trying again");
                        failing = true;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            match holder {
                Some((info, _)) if !standby => {
                    return Err(EtcdError::LeaderHeld {
                        key,
                        holder: format!("{} at {} (pid {})", info.id, info.address, info.pid),
                    });
                }
                Some((info, _)) => {
                    if told.as_ref() != Some(&info) {
                        on_wait(&info);
                        told = Some(info);
                    }
                }
                None => continue,
            }
            // A poll every 100 ms: a takeover starts at most that long after the lease
            // expires, for ten small reads a second from one standby.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One try: a lease, then the leader key if absent. An attempt whose reply was lost
    /// but which did create the key (its lease is this round's) is a win too.
    async fn campaign_round(
        &self,
        key: &str,
        value: &[u8],
        ttl_s: i64,
    ) -> Result<Campaign, EtcdError> {
        let since = Instant::now();
        let lease = self
            .call("granting a lease", key, |mut c| async move {
                c.lease_grant(ttl_s, None).await
            })
            .await?
            .id();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value.to_vec(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let reply = self
            .call("campaigning for leader", key, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if reply.succeeded() {
            let term = reply.header().map_or(0, |h| h.revision());
            return Ok(Campaign::Won { lease, term, since });
        }
        let holder = self.leader_key().await?;
        if let Some((_, term, holder_lease)) = &holder
            && *holder_lease == lease
        {
            return Ok(Campaign::Won {
                lease,
                term: *term,
                since,
            });
        }
        // Not ours: give the lease back at once rather than let it linger for a TTL.
        let _ = self
            .call("revoking a lease", key, |mut c| async move {
                c.lease_revoke(lease).await
            })
            .await;
        Ok(Campaign::Held(holder.map(|(info, term, _)| (info, term))))
    }

    async fn lead(
        &self,
        key: String,
        lease: i64,
        term: i64,
        ttl: Duration,
        granted: Instant,
    ) -> Result<Leadership, EtcdError> {
        let valid_until = Arc::new(Mutex::new(granted + ttl));
        let (lost_tx, lost) = watch::channel(None);
        let leadership = Leadership {
            etcd: self.clone(),
            key,
            lease,
            term,
            ttl,
            valid_until: valid_until.clone(),
            lost,
            fence: Arc::default(),
        };
        tokio::spawn(keep_alive(leadership.clone(), lost_tx));
        Ok(leadership)
    }
}

/// Renews the lease every third of its TTL, and ends, saying why, when etcd says the
/// lease is gone (it expired: this process was stopped, or cut off from etcd, for longer
/// than the TTL). An etcd that does not answer ends nothing: renewals go on.
async fn keep_alive(l: Leadership, lost: watch::Sender<Option<String>>) {
    let period = l.ttl / 3;
    let mut stream = None;
    loop {
        let sent = Instant::now();
        // The TTL etcd answered (0: the lease is gone), or `None` without an answer.
        let mut renewed = None;
        if stream.is_none() {
            let lease = l.lease;
            let opened = l
                .etcd
                .call("renewing the lease", &l.key, |mut c| async move {
                    match c.lease_keep_alive(lease).await {
                        Ok(opened) => Ok(Some(opened)),
                        // The client opens the stream with a renewal, and turns its
                        // answer of TTL 0 into this error: a lease that expired while the
                        // stream was down (etcd stalled or out of reach for a TTL) is
                        // gone, not unanswered, and renewing it on forever never says so.
                        Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(None),
                        Err(e) => Err(e),
                    }
                })
                .await;
            match opened {
                Ok(Some(opened)) => stream = Some(opened),
                Ok(None) => renewed = Some(0),
                Err(_) => {}
            }
        }
        if renewed.is_none()
            && let Some((keeper, replies)) = stream.as_mut()
        {
            let round = async {
                keeper.keep_alive().await?;
                replies.message().await
            };
            if let Ok(Ok(Some(reply))) =
                tokio::time::timeout(period.max(Duration::from_millis(100)), round).await
            {
                renewed = Some(reply.ttl());
            }
        }
        match renewed {
            Some(ttl) if ttl > 0 => {
                if let Ok(mut v) = l.valid_until.lock() {
                    *v = sent + l.ttl;
                }
            }
            Some(_) => {
                let why = format!(
                    "lease {:x} on {} expired (etcd says so): another coordinator leads now",
                    l.lease, l.key
                );
                lost.send_replace(Some(why));
                return;
            }
            // A broken stream is opened again on the next round.
            None => stream = None,
        }
        let next = sent + period;
        tokio::time::sleep_until(next).await;
    }
}

impl Leadership {
    /// The leader's term: its key's create revision, larger for every later leader.
    pub fn term(&self) -> u64 {
        self.term as u64
    }

    pub fn lease(&self) -> i64 {
        self.lease
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether the lease is surely alive now (a renewal answered within the TTL).
    pub fn valid(&self) -> bool {
        self.valid_until
            .lock()
            .map(|v| Instant::now() < *v)
            .unwrap_or(false)
    }

    /// When the last renewal that etcd answered was sent (the grant, before the first):
    /// this process reached etcd then.
    pub fn renewed_at(&self) -> Option<Instant> {
        self.valid_until
            .lock()
            .ok()
            .and_then(|v| v.checked_sub(self.ttl))
    }

    /// Why this process no longer leads, once etcd has said so (or a fenced write was
    /// refused).
    pub fn lost(&self) -> watch::Receiver<Option<String>> {
        self.lost.clone()
    }

    /// Gives up leadership at once (a clean exit): a standby takes over without waiting
    /// out the TTL.
    pub async fn resign(&self) {
        let lease = self.lease;
        let _ = self
            .etcd
            .call("resigning", &self.key, |mut c| async move {
                c.lease_revoke(lease).await
            })
            .await;
    }
}
