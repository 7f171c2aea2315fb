//! Which coordinator a member talks to. With embedded membership, the one address it was
//! given. With etcd, whoever leads the job: read from the leader key at start, then
//! followed, so that a member's next call after a takeover goes to the new leader without
//! anyone telling it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::PsError;
use crate::client::{Connector, CoordinatorClient};
use crate::job::Job;

/// Where a member finds its coordinator.
#[derive(Clone, Debug)]
pub enum CoordinatorSource {
    /// `--coordinator HOST:PORT`.
    Address(String),
    /// `--etcd URL,...`: the job's leader, followed as it changes.
    Etcd,
}

/// The current coordinator's address, kept up to date (etcd) or fixed.
#[derive(Clone)]
pub struct Locator {
    address: watch::Receiver<String>,
    /// etcd: a call that finds no coordinator may wait this long for the next leader
    /// (the lease TTL and a second); zero for a fixed address.
    patience: Duration,
    /// The job's etcd, where it is followed there: a member cut off from every
    /// coordinator learns there whether the job has ended.
    etcd: Option<ftrec_etcd::Etcd>,
}

/// The few fields of the coordinator's record (`PREFIX/state`) a member reads to learn that
/// the job is over; the record is the coordinator's, and everything else in it is skipped.
#[derive(serde::Deserialize)]
struct JobEnd {
    #[serde(default)]
    done: bool,
    #[serde(default)]
    fatal: Option<String>,
}

/// How often a member reads the leader key. A takeover reaches a member at most this
/// long after it happens; a failed call does not wait for it (see [`CoordinatorLink`]).
const FOLLOW_PERIOD: Duration = Duration::from_millis(200);

impl Locator {
    /// Finds the coordinator. With etcd, checks that the job's prefix is this job's, and
    /// waits up to the job's control deadline for a leader to be elected. An etcd that
    /// does not answer is waited for up to `cluster.control_plane_grace_s`: a member
    /// started during an outage (a supervisor's restart, a replacement) must not exit
    /// before it (issue 42: found by the simulation, a replacement server that met slow
    /// etcd exited, and the recovery waited for it forever).
    pub async fn start(job: &Job, source: &CoordinatorSource) -> Result<Self, PsError> {
        let opts = match (source, job.etcd_options()) {
            (CoordinatorSource::Address(a), _) => {
                return Ok(Self {
                    address: watch::channel(a.clone()).1,
                    patience: Duration::ZERO,
                    etcd: None,
                });
            }
            (CoordinatorSource::Etcd, Some(opts)) => opts,
            (CoordinatorSource::Etcd, None) => {
                return Err(PsError::Config(
                    "no coordinator address: pass --coordinator HOST:PORT, or --etcd URL with \
                     cluster.membership = \"etcd\""
                        .into(),
                ));
            }
        };
        let grace = Duration::from_secs(job.config.cluster.control_plane_grace_s);
        let started = Instant::now();
        let mut said = false;
        let (etcd, first) = loop {
            match find_leader(job, &opts).await {
                Err(PsError::Membership(e)) if e.unanswered() => {
                    let waited = started.elapsed();
                    if waited >= grace {
                        return Err(PsError::Unavailable(format!(
                            "{e}; gave up after waiting {:.1} s for it \
                             (cluster.control_plane_grace_s)",
                            waited.as_secs_f64()
                        )));
                    }
                    if !std::mem::replace(&mut said, true) {
                        tracing::warn!(
                            "{e}; waiting up to {grace:?} (cluster.control_plane_grace_s) for it"
                        );
                    }
                    tokio::time::sleep(FOLLOW_PERIOD).await;
                }
                found => break found?,
            }
        };
        let (tx, address) = watch::channel(first);
        tokio::spawn(follow(etcd.clone(), tx));
        let ttl = Duration::from_secs(job.config.cluster.etcd_lease_ttl_s);
        Ok(Self {
            address,
            patience: ttl + Duration::from_secs(1),
            etcd: Some(etcd),
        })
    }

    /// Whether the job's coordinators follow one another through etcd (a standby may
    /// take over), rather than one fixed address whose loss ends the job.
    pub fn follows_etcd(&self) -> bool {
        self.etcd.is_some()
    }

    /// Why the job is over, once its record in etcd says so (finished, or failed); `None`
    /// while it runs, without etcd, or when etcd does not answer.
    pub async fn job_ended(&self) -> Option<String> {
        let etcd = self.etcd.as_ref()?;
        match etcd.get_json::<JobEnd>("state").await {
            Ok(Some((end, _))) if end.fatal.is_some() => end.fatal,
            Ok(Some((end, _))) if end.done => Some("the job finished".into()),
            _ => None,
        }
    }

    pub fn address(&self) -> String {
        self.address.borrow().clone()
    }

    /// A link of its own (its own connection) to whoever is the coordinator.
    pub async fn link(&self, connector: Connector) -> Result<CoordinatorLink, PsError> {
        let address = self.address();
        let client = connector.coordinator(&address).await?;
        Ok(CoordinatorLink {
            connector,
            locator: self.clone(),
            current: Arc::new(Mutex::new((address, client))),
        })
    }
}

/// Reads the leader key until the process ends; publishes each new leader's address. An
/// etcd that does not answer changes nothing: the member keeps its coordinator.
async fn follow(etcd: ftrec_etcd::Etcd, tx: watch::Sender<String>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(FOLLOW_PERIOD).await;
        match etcd.leader().await {
            Ok(Some((leader, _))) => {
                failing = false;
                tx.send_if_modified(|a| {
                    let moved = *a != leader.address;
                    if moved {
                        tracing::info!(
                            "the job's coordinator is now {} at {}",
                            leader.id,
                            leader.address
                        );
                        *a = leader.address.clone();
                    }
                    moved
                });
            }
            Ok(None) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!("following the job's leader: {e}; keeping the current one");
            }
            Err(_) => {}
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// A coordinator client that follows the leader: each call goes to the coordinator the
/// locator names now (a new leader gets a fresh connection, made on first use).
#[derive(Clone)]
pub struct CoordinatorLink {
    connector: Connector,
    locator: Locator,
    current: Arc<Mutex<(String, CoordinatorClient)>>,
}

impl CoordinatorLink {
    /// The client for the current coordinator.
    pub fn client(&self) -> Result<CoordinatorClient, PsError> {
        let address = self.locator.address();
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.0 != address {
            let client = self.connector.coordinator_lazy(&address)?;
            *current = (address, client);
        }
        Ok(current.1.clone())
    }

    /// Where the calls go now.
    pub fn address(&self) -> String {
        self.locator.address()
    }

    /// The placement map. Following a leader in etcd, a call that fails for want of a
    /// coordinator (the leader just died, or was deposed) is tried again until the next
    /// leader answers, within the lease TTL and a second: a rebuild or a parity update
    /// in flight across a takeover goes on instead of failing.
    pub async fn placement(&self) -> Result<ftrec_proto::proto::PlacementReply, PsError> {
        let started = Instant::now();
        loop {
            let reply = self
                .client()?
                .placement(ftrec_proto::proto::PlacementRequest {})
                .await;
            match reply {
                Ok(r) => return Ok(r.into_inner()),
                Err(s)
                    if started.elapsed() < self.locator.patience
                        && matches!(
                            s.code(),
                            tonic::Code::Unavailable
                                | tonic::Code::Unknown
                                | tonic::Code::FailedPrecondition
                                | tonic::Code::DeadlineExceeded
                        ) =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(s) => return Err(PsError::rpc("placement", &s)),
            }
        }
    }
}

/// Connects to the job's etcd, checks that its prefix is this job's, and waits up to the
/// job's control deadline for a leader to be elected.
async fn find_leader(
    job: &Job,
    opts: &ftrec_etcd::EtcdOptions,
) -> Result<(ftrec_etcd::Etcd, String), PsError> {
    let etcd = job.network().connect_etcd(opts).await?;
    etcd.claim_job(&job.etcd_claim()).await?;
    let patience = job.deadlines().control;
    let started = Instant::now();
    loop {
        if let Some((leader, _)) = etcd.leader().await? {
            return Ok((etcd, leader.address));
        }
        if started.elapsed() > patience {
            return Err(PsError::Unavailable(format!(
                "no coordinator leads the job: etcd key {} at {} stayed empty for {:?}",
                etcd.key("leader"),
                etcd.endpoints(),
                patience
            )));
        }
        tokio::time::sleep(FOLLOW_PERIOD).await;
    }
}
