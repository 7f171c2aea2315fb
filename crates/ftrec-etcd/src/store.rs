//! One job's keys in etcd, under its prefix: the job claim (`job`), the elected leader
//! (`leader`) and the coordinator's durable record (`state`). Every call is bounded by the
//! request timeout, and every error names the endpoints and the key.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::EtcdError;

/// Where a job's keys live, and how long one call may take.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// `host:port` or `http://host:port`, one per etcd member.
    pub endpoints: Vec<String>,
    /// Every key of the job starts with it: `/ftrec/JOB`.
    pub prefix: String,
    pub request_timeout: Duration,
}

/// What `PREFIX/job` holds: which job the prefix belongs to, and its configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobClaim {
    /// Derived from the job's secret: two jobs never share one, and it reveals nothing.
    pub job_id: String,
    /// The configuration's fingerprint (16 hex digits).
    pub fingerprint: String,
}

/// A connection to the job's etcd.
#[derive(Clone)]
pub struct Etcd {
    pub(crate) client: Client,
    endpoints: String,
    prefix: String,
    pub(crate) timeout: Duration,
}

impl Etcd {
    /// Connects and checks that some endpoint answers, so that an unreachable etcd is
    /// said at start, with its addresses, rather than at the first decision.
    pub async fn connect(opts: &EtcdOptions) -> Result<Self, EtcdError> {
        validate_prefix(&opts.prefix)?;
        if opts.endpoints.is_empty() {
            return Err(EtcdError::Invalid(
                "cluster.etcd_endpoints is empty: name at least one etcd endpoint (or pass \
                 --etcd URL)"
                    .into(),
            ));
        }
        let urls: Vec<String> = opts
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        let endpoints = urls.join(",");
        let t = opts.request_timeout;
        let options = ConnectOptions::new()
            .with_connect_timeout(t)
            .with_timeout(t)
            .with_keep_alive(t / 4, t);
        let unreachable = |error: String| EtcdError::Unreachable {
            endpoints: endpoints.clone(),
            error,
        };
        let client = tokio::time::timeout(t, Client::connect(&urls, Some(options)))
            .await
            .map_err(|_| unreachable(format!("no connection within {t:?}")))?
            .map_err(|e| unreachable(e.to_string()))?;
        Self::probed(client, endpoints, opts).await
    }

    /// Connects over `channel`, a channel the caller built: the simulation's, whose
    /// connector dials over its simulated network. `opts.endpoints` only names it in
    /// errors. Each call is bounded by `opts.request_timeout` as with [`connect`](Self::connect).
    pub async fn connect_channel(
        channel: tonic::transport::Channel,
        opts: &EtcdOptions,
    ) -> Result<Self, EtcdError> {
        validate_prefix(&opts.prefix)?;
        let endpoints = opts.endpoints.join(",");
        let client = Client::from_channel(etcd_client::Channel::Tonic(channel), None)
            .await
            .map_err(|e| EtcdError::Unreachable {
                endpoints: endpoints.clone(),
                error: e.to_string(),
            })?;
        Self::probed(client, endpoints, opts).await
    }

    /// Checks that etcd answers, so that an unreachable etcd is said at start, with its
    /// addresses, rather than at the first decision.
    async fn probed(
        client: Client,
        endpoints: String,
        opts: &EtcdOptions,
    ) -> Result<Self, EtcdError> {
        let t = opts.request_timeout;
        let unreachable = |error: String| EtcdError::Unreachable {
            endpoints: endpoints.clone(),
            error,
        };
        let etcd = Self {
            client,
            endpoints: endpoints.clone(),
            prefix: opts.prefix.clone(),
            timeout: t,
        };
        let key = etcd.key("job");
        etcd.call("probing", &key, |mut c| {
            let key = key.clone();
            async move { c.get(key, None).await }
        })
        .await
        .map_err(|e| match e {
            EtcdError::Timeout { .. } => unreachable(format!("no answer within {t:?}")),
            EtcdError::Request { error, .. } => unreachable(error),
            other => other,
        })?;
        Ok(etcd)
    }

    /// `PREFIX/NAME`.
    pub fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.prefix)
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// Runs one etcd call within the request timeout; errors name `what` and `key`.
    ///
    /// A call that fails in transport is made again (on a fresh pick of endpoint) until
    /// the timeout is spent: the client balances over every endpoint and does not route
    /// around a dead member by itself, so with one member of three down a third of the
    /// calls would fail. Every call made here may be repeated: reads, idempotent puts,
    /// transactions whose retry finds what the first attempt did.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        what: &'static str,
        key: &str,
        mut call: F,
    ) -> Result<T, EtcdError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = tokio::time::Instant::now() + self.timeout;
        // An attempt gets a third of the budget: a request that reached a member just as
        // it lost its raft leader (killed, or cut off) can hang until the member gives up,
        // while the same request made again, perhaps to another member, is answered once
        // the rest elect a new leader. Every call made here may be made twice: writes put
        // whole values, a campaign that won unseen finds its own key, a lease granted twice
        // expires unused.
        let per_attempt = (self.timeout / 3).max(Duration::from_millis(200));
        loop {
            let attempt_deadline = deadline.min(tokio::time::Instant::now() + per_attempt);
            let attempt =
                tokio::time::timeout_at(attempt_deadline, call(self.client.clone())).await;
            let error = match attempt {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if transient(&e) && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Ok(Err(e)) => e,
                Err(_) if tokio::time::Instant::now() < deadline => continue,
                Err(_) => {
                    return Err(EtcdError::Timeout {
                        endpoints: self.endpoints.clone(),
                        what,
                        key: key.to_string(),
                        limit: self.timeout,
                    });
                }
            };
            return Err(EtcdError::Request {
                endpoints: self.endpoints.clone(),
                what,
                key: key.to_string(),
                error: error.to_string(),
            });
        }
    }

    /// Claims the prefix for this job, or checks that it is this job's: a prefix that
    /// another job holds, or a job file changed since the job started, is refused before
    /// anything is written.
    pub async fn claim_job(&self, claim: &JobClaim) -> Result<(), EtcdError> {
        let key = self.key("job");
        let value = to_json(claim, &key)?;
        let txn = Txn::new()
            .when([Compare::version(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), value, None)])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let reply = self
            .call("claiming the job", &key, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if reply.succeeded() {
            return Ok(());
        }
        let stored: JobClaim = match self.get_json("job").await? {
            Some((stored, _)) => stored,
            // Deleted between the two calls: claim again.
            None => return Box::pin(self.claim_job(claim)).await,
        };
        if stored.job_id != claim.job_id {
            return Err(EtcdError::OtherJob {
                key,
                stored: stored.job_id,
                ours: claim.job_id.clone(),
            });
        }
        if stored.fingerprint != claim.fingerprint {
            return Err(EtcdError::ConfigChanged {
                key,
                stored: stored.fingerprint,
                ours: claim.fingerprint.clone(),
            });
        }
        Ok(())
    }

    /// `PREFIX/NAME` decoded, with its modification revision; `None` when absent.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<(T, i64)>, EtcdError> {
        let key = self.key(name);
        let reply = self
            .call("reading", &key, |mut c| {
                let key = key.clone();
                async move { c.get(key, None).await }
            })
            .await?;
        let Some(kv) = reply.kvs().first() else {
            return Ok(None);
        };
        let value = serde_json::from_slice(kv.value()).map_err(|e| EtcdError::Corrupt {
            key: key.clone(),
            error: e.to_string(),
        })?;
        Ok(Some((value, kv.mod_revision())))
    }

    /// How many keys the job has under its prefix (for reports and tests).
    pub async fn key_count(&self) -> Result<i64, EtcdError> {
        let prefix = format!("{}/", self.prefix);
        let reply = self
            .call("counting keys", &prefix, |mut c| {
                let prefix = prefix.clone();
                async move {
                    c.get(
                        prefix,
                        Some(GetOptions::new().with_prefix().with_count_only()),
                    )
                    .await
                }
            })
            .await?;
        Ok(reply.count())
    }
}

/// An error another endpoint (or a moment later) may not give.
fn transient(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    match e {
        E::TransportError(_) | E::IoError(_) => true,
        E::GRpcStatus(s) => matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
        ),
        _ => false,
    }
}

pub(crate) fn to_json<T: Serialize>(value: &T, key: &str) -> Result<Vec<u8>, EtcdError> {
    serde_json::to_vec(value).map_err(|e| EtcdError::Corrupt {
        key: key.to_string(),
        error: e.to_string(),
    })
}

/// A prefix is an absolute key path without a trailing slash: `/ftrec/my-job`.
pub fn validate_prefix(prefix: &str) -> Result<(), EtcdError> {
    let ok = prefix.starts_with('/')
        && prefix.len() > 1
        && !prefix.ends_with('/')
        && !prefix.contains("//")
        && prefix.chars().all(|c| c.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(EtcdError::Invalid(format!(
            "cluster.etcd_prefix = {prefix:?}: an absolute key path without a trailing slash \
             or spaces, such as \"/ftrec/my-job\""
        )))
    }
}
