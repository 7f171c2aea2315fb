//! The worker's view of the sharded model: which server holds each row, pulls and pushes
//! split by server and sent in parallel, and the replies put back in the batch's row order.
//!
//! This is where a failed call is handled by its cause (typed on the wire, see
//! [`PsError::rpc`]): a stale placement map is refreshed and the call sent again, rows
//! being rebuilt or a server briefly unavailable are asked again shortly, and anything
//! else (a stale epoch, a dead server past the retries) loses the step, which the
//! coordinator then resolves. Only the servers whose call failed are asked again; a push
//! sent twice is harmless, as servers ignore a step they applied. ECRec's degraded reads
//! (decoding a dead server's rows from its stripe) belong here too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use tokio::time::Instant;

use ftrec_faults::{Faults, points};
use ftrec_proto::placement::{GlobalRow, Layout};
use ftrec_proto::proto::*;
use ftrec_proto::wire::{extend_f32s, f32s_to_bytes, u32s_to_bytes};
use ftrec_rpc::PsError;
use ftrec_rpc::client::{Connector, ServerClient};
use ftrec_rpc::hedge::{Hedge, HedgeCounts, Hedger, first_answer};
use ftrec_rpc::leader::CoordinatorLink;

pub use crate::routed::{Pulled, Routed};
use crate::suspicion::{CallTimes, Called, Suspicion, Watch, within};

/// Calls sent per server and step before the step is given up. All of them share one
/// deadline (the connector's, `cluster.deadlines.step_ms`): a server that does not answer
/// costs the step one deadline, not one per attempt.
const ATTEMPTS: usize = 3;
/// Wait before asking again a server that was unavailable or rebuilding rows.
const RETRY_WAIT: Duration = Duration::from_millis(50);

/// Whether asking again may succeed: a cause that passes, and no refused connection (a
/// port nobody listens on refuses every dial, so the step is given up and reported at
/// once; waiting out the attempts kept a SIGKILL undetected for 0.1 s more, issue 45).
fn will_pass(e: &PsError) -> bool {
    e.is_retryable() && !e.is_refused()
}

/// How a push installs its step on the servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitProtocol {
    /// One round: each server applies its part as it arrives.
    OneRound,
    /// ECRec's two-phase commit: every server prepares (stages and propagates its parity
    /// differences), then all commit; a failure in phase 1 aborts everywhere. `ordered`
    /// prepares one server at a time in slot order, so concurrent workers, which hold a
    /// server's commit turn from prepare to commit, never wait on each other in a cycle.
    TwoPhase { ordered: bool },
}

/// A server this worker's calls could not reach, as the step's loss report names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreachable {
    pub server: usize,
    /// This worker's own connection to it got no answer either ([`crate::suspicion`]).
    pub confirmed: bool,
}

/// The kind under which aborts are called: never sent twice ([`ShardClient::hedge_after`]).
const ABORT_CALLS: &str = "abort";

pub struct ShardClient {
    coordinator: CoordinatorLink,
    servers: Vec<ServerClient>,
    /// A second connection to each server, for the copy of a slow call
    /// ([`ftrec_rpc::hedge`]).
    seconds: Vec<ServerClient>,
    /// When a slow call is sent again, and the calls sent again.
    hedger: Hedger,
    /// The servers' addresses, in slot order, for a probe's connection of its own.
    addresses: Vec<Arc<str>>,
    placement_version: Option<u64>,
    layout: Layout,
    dim: usize,
    connector: Connector,
    /// Payload bytes sent and received since the last [`ShardClient::take_bytes`].
    bytes: u64,
    protocol: CommitProtocol,
    unreachable: Option<Unreachable>,
    /// How long each kind of call took lately, and when one is suspected (none: calls
    /// wait out the step deadline).
    times: CallTimes,
    /// With the connector the probes dial through, shared by every watch.
    suspicion: Option<(Suspicion, Arc<Connector>)>,
    /// The step whose phase 2 (commit) this client has begun: some server may have
    /// installed it, so it must never be aborted anywhere (the recovery finishes it where
    /// it is prepared).
    committing: Option<(u64, u64)>,
    /// This worker's fault points (`push`, `prepared-first`, `prepared`).
    faults: Faults,
}

impl ShardClient {
    pub fn new(
        coordinator: CoordinatorLink,
        layout: Layout,
        dim: usize,
        connector: Connector,
    ) -> Self {
        Self {
            coordinator,
            servers: Vec::new(),
            seconds: Vec::new(),
            hedger: Hedger::default(),
            addresses: Vec::new(),
            placement_version: None,
            layout,
            dim,
            connector,
            bytes: 0,
            protocol: CommitProtocol::OneRound,
            unreachable: None,
            times: CallTimes::default(),
            suspicion: None,
            committing: None,
            faults: Faults::default(),
        }
    }

    /// Suspects calls that take far longer than their kind usually does, and probes their
    /// server ([`crate::suspicion`]).
    pub fn with_suspicion(mut self, suspicion: Suspicion) -> Self {
        self.suspicion = Some((suspicion, Arc::new(self.connector.clone())));
        self
    }

    /// When a call of `kind` is suspected, if before the deadline.
    fn suspect_after(&self, kind: &str) -> Option<Duration> {
        let (suspicion, _) = self.suspicion.as_ref()?;
        suspicion.after(&self.times, kind, self.connector.timeout())
    }

    /// The watch for a call to server `s` suspected `after` ([`Self::suspect_after`]).
    fn watch(&self, after: Option<Duration>, s: usize) -> Option<Watch> {
        let (suspicion, connector) = self.suspicion.as_ref()?;
        Some(Watch::new(
            suspicion,
            after?,
            connector,
            self.addresses.get(s)?,
        ))
    }

    /// Sends a slow call again on a second connection ([`ftrec_rpc::hedge`]).
    pub fn with_hedge(mut self, hedge: Option<Hedge>) -> Self {
        self.hedger = Hedger::new(hedge);
        self
    }

    /// How long each kind of call took lately.
    pub fn call_times(&self) -> &CallTimes {
        &self.times
    }

    /// The calls sent again so far, by kind.
    pub fn hedges(&self) -> &HedgeCounts {
        self.hedger.counts()
    }

    /// When a call of `kind` to server `s` is sent again: before it would be suspected,
    /// and before the step's deadline.
    fn hedge_after(&self, kind: &'static str, s: usize) -> Option<Duration> {
        // An abort is on the failure path only, where a few milliseconds do not matter.
        // (It names its try of the step, so a copy arriving late, after the step was
        // granted again in the same epoch, would leave the new try's differences alone.)
        if kind == ABORT_CALLS {
            return None;
        }
        let limit = self
            .suspect_after(kind)
            .unwrap_or_else(|| self.connector.timeout());
        self.hedger.after_seen(kind, s, limit, self.link_lost(s))
    }

    /// Whether the link to server `s` retransmitted lately ([`ftrec_rpc::loss_watch`]).
    fn link_lost(&self, s: usize) -> Option<bool> {
        self.addresses
            .get(s)
            .and_then(|a| self.connector.lost_lately(a))
    }

    /// `call` to server `s`, bounded as [`within`] bounds it, with its copy on the second
    /// connection once the first is slow ([`ftrec_rpc::hedge`]); and whether the copy was
    /// sent.
    fn call_with_copy<Rep, F, Fut>(
        &self,
        kind: &'static str,
        s: usize,
        give_up: Instant,
        label: String,
        watch: Option<Watch>,
        call: F,
    ) -> impl std::future::Future<Output = (Called<Rep>, bool)>
    where
        F: Fn(ServerClient) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Rep>, tonic::Status>>,
    {
        let second = self
            .hedge_after(kind, s)
            .zip(self.seconds.get(s).cloned())
            .map(|(after, copy)| (after, call(copy)));
        let first = call(self.servers[s].clone());
        async move {
            let hedged = AtomicBool::new(false);
            let answered = async {
                let answered = first_answer(first, second).await;
                hedged.store(answered.hedged, Ordering::Relaxed);
                answered.result
            };
            let called = within(give_up, &label, answered, watch).await;
            (called, hedged.into_inner())
        }
    }

    /// Keeps what a call of `kind` to server `s` took, for its kind's suspicion and its
    /// copies' timing; `hedged`: its copy was sent.
    fn record_call(&mut self, kind: &'static str, s: usize, took: Option<Duration>, hedged: bool) {
        if let Some(took) = took {
            self.times.record(kind, took);
        }
        let lost = self.link_lost(s);
        self.hedger.record_seen(kind, s, took, hedged, lost);
    }

    pub fn with_protocol(mut self, protocol: CommitProtocol) -> Self {
        self.protocol = protocol;
        self
    }

    pub fn with_faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// A kill armed at `point` for `step`: a process is gone at once; a simulated worker
    /// stops here for good, and its host is crashed between ticks. Nothing more is sent.
    async fn die_at(&self, point: &str, step: u64) {
        if self.faults.kill_at(point, Some(step)) {
            std::future::pending::<()>().await;
        }
    }

    /// The server that calls last could not reach for good: the one called, when its
    /// transport failed, or the peer that the server answering named
    /// ([`PsError::unreachable_server`]); taken once. The worker names it when it reports
    /// the step lost, so the coordinator can tell a server cut off from the workers from one
    /// that is merely slow.
    pub fn take_unreachable(&mut self) -> Option<Unreachable> {
        self.unreachable.take()
    }

    /// Blames server `s` for error `e` of a call to it ([`PsError::unreachable_server`]);
    /// confirmed when this worker's own probe of `s` got no answer either.
    fn blame(&mut self, s: usize, e: &PsError, confirmed: bool) {
        if let Some(server) = e.unreachable_server(s) {
            self.unreachable = Some(Unreachable {
                server,
                confirmed: confirmed && server == s,
            });
        }
    }

    /// Payload bytes moved since the last call.
    pub fn take_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.bytes)
    }

    /// Fetches the placement map if `version` is not the one in use.
    pub async fn ensure_placement(&mut self, version: u64) -> Result<(), PsError> {
        if self.placement_version != Some(version) {
            self.refresh_placement().await?;
        }
        Ok(())
    }

    async fn refresh_placement(&mut self) -> Result<(), PsError> {
        let p = self.coordinator.placement().await?;
        // A move (`cluster scale`) changes the server count, and the rows' places with it.
        if p.servers.len() != self.layout.servers() {
            self.layout = self.layout.resized(p.servers.len())?;
        }
        self.servers = p
            .servers
            .iter()
            .map(|a| self.connector.server(a))
            .collect::<Result<_, _>>()?;
        // Each a channel of its own, so a connection of its own: a copy sent on the first
        // would wait behind the very segment it is meant to route around.
        self.seconds = p
            .servers
            .iter()
            .map(|a| self.connector.server(a))
            .collect::<Result<_, _>>()?;
        self.addresses = p.servers.into_iter().map(Arc::from).collect();
        self.placement_version = Some(p.version);
        Ok(())
    }

    /// Splits each table's unique rows (`unique[t]`, ascending) by owner.
    pub fn route(&self, unique: &[&[u32]]) -> Routed {
        Routed::new(self.layout, unique)
    }

    /// Pulls the routed rows' embeddings and every server's dense range. In
    /// deterministic mode `wait_applied` makes each server answer only once every step
    /// below it is applied.
    pub async fn pull(
        &mut self,
        epoch: u64,
        wait_applied: Option<u64>,
        routed: &Routed,
    ) -> Result<Pulled, PsError> {
        let requests: Vec<PullRequest> = routed
            .owned
            .iter()
            .map(|rows| PullRequest {
                epoch,
                wait_applied,
                tables: rows
                    .iter()
                    .enumerate()
                    .map(|(t, r)| TableRows {
                        table: t as u32,
                        rows: u32s_to_bytes(r),
                    })
                    .collect(),
            })
            .collect();
        self.bytes += requests
            .iter()
            .flat_map(|r| &r.tables)
            .map(|t| t.rows.len() as u64)
            .sum::<u64>();
        let replies = self
            .each_server("pull", requests, |mut c, r| async move { c.pull(r).await })
            .await?;
        let tables = routed.owned.first().map_or(0, Vec::len);
        let mut pulled = Pulled {
            per_server: Vec::with_capacity(replies.len()),
            dense: Vec::new(),
        };
        for (s, reply) in replies.into_iter().enumerate() {
            if reply.embeddings.len() != tables {
                return Err(PsError::BadRequest(format!(
                    "server {s} answered {} tables of {tables}",
                    reply.embeddings.len()
                )));
            }
            let mut per_table = Vec::with_capacity(tables);
            for (t, e) in reply.embeddings.iter().enumerate() {
                self.bytes += e.len() as u64;
                let expected = routed.owned[s][t].len() * self.dim;
                let mut v = Vec::with_capacity(expected);
                extend_f32s(&mut v, e, "pulled embeddings")?;
                if v.len() != expected {
                    return Err(PsError::BadRequest(format!(
                        "server {s} sent {} values for {} rows of table {t}",
                        v.len(),
                        routed.owned[s][t].len()
                    )));
                }
                per_table.push(v);
            }
            pulled.per_server.push(per_table);
            self.bytes += reply.dense.len() as u64;
            extend_f32s(&mut pulled.dense, &reply.dense, "pulled dense parameters")?;
        }
        Ok(pulled)
    }

    /// Writes table `t`'s embeddings in `unique` order (the order [`ShardClient::route`]
    /// was given) into `out`.
    pub fn assemble(&self, pulled: &Pulled, t: usize, unique: &[u32], out: &mut Vec<f32>) {
        pulled.assemble(self.layout, self.dim, t, unique, out);
    }

    /// Pushes step `step`'s gradients: `sparse[t]` holds one gradient per row of
    /// `unique[t]` (in that order), `dense` the whole dense gradient; each server gets its
    /// rows and its dense range.
    pub async fn push(
        &mut self,
        epoch: u64,
        step: u64,
        unique: &[&[u32]],
        sparse: &[&[f32]],
        dense: &[f32],
    ) -> Result<(), PsError> {
        self.die_at(points::PUSH, step).await;
        let dim = self.dim;
        let servers = self.layout.servers();
        let prepare = matches!(self.protocol, CommitProtocol::TwoPhase { .. });
        // This try of the step, the same to every server: the abort below drops only its
        // parts, whenever it lands (never 0, which an abort reads as every try).
        let attempt = rand::random::<u64>().max(1);
        let mut pushes: Vec<PushRequest> = (0..servers)
            .map(|s| PushRequest {
                epoch,
                step,
                tables: Vec::with_capacity(unique.len()),
                dense: f32s_to_bytes(&dense[self.layout.dense_range(s, dense.len())]),
                replica_dense: self
                    .layout
                    .replicates(s)
                    .map(|of| f32s_to_bytes(&dense[self.layout.dense_range(of, dense.len())]))
                    .unwrap_or_default(),
                prepare,
                attempt,
            })
            .collect();
        let mut rows_by_server: Vec<Vec<u32>> = vec![Vec::new(); servers];
        let mut grads_by_server: Vec<Vec<f32>> = vec![Vec::new(); servers];
        for (t, (rows, grads)) in unique.iter().zip(sparse).enumerate() {
            for s in 0..servers {
                rows_by_server[s].clear();
                grads_by_server[s].clear();
            }
            for (i, &row) in rows.iter().enumerate() {
                let s = self.layout.server_of(t, GlobalRow(row));
                rows_by_server[s].push(row);
                grads_by_server[s].extend_from_slice(&grads[i * dim..(i + 1) * dim]);
            }
            for (s, push) in pushes.iter_mut().enumerate() {
                push.tables.push(TableGrads {
                    table: t as u32,
                    rows: u32s_to_bytes(&rows_by_server[s]),
                    grads: f32s_to_bytes(&grads_by_server[s]),
                });
            }
        }
        self.bytes += pushes
            .iter()
            .map(|p| {
                (p.dense.len() + p.replica_dense.len()) as u64
                    + p.tables
                        .iter()
                        .map(|t| (t.rows.len() + t.grads.len()) as u64)
                        .sum::<u64>()
            })
            .sum::<u64>();
        let ordered = match self.protocol {
            CommitProtocol::OneRound => {
                self.each_server("push", pushes, |mut c, p| async move { c.push(p).await })
                    .await?;
                return Ok(());
            }
            CommitProtocol::TwoPhase { ordered } => ordered,
        };
        let prepared = if ordered {
            self.prepare_in_order(pushes).await
        } else {
            self.each_server("prepare", pushes, |mut c, p| async move { c.push(p).await })
                .await
                .map(drop)
        };
        let decision: Vec<StepDecision> = (0..servers)
            .map(|_| StepDecision {
                epoch,
                step,
                attempt,
            })
            .collect();
        if let Err(e) = prepared {
            // Best effort: a server that misses the abort drops its part when the step's
            // decision times out, or at the next epoch. The server the prepare found
            // unreachable is not asked: its call would wait out another step deadline
            // before this worker can report it (a partition took 5 s longer to detect).
            let unreachable = self.unreachable;
            let _ = self
                .each_server_except(
                    ABORT_CALLS,
                    decision,
                    unreachable.map(|u| u.server),
                    |mut c, d| async move { c.abort_step(d).await },
                )
                .await;
            if unreachable.is_some() {
                self.unreachable = unreachable;
            }
            return Err(e);
        }
        self.die_at(points::PREPARED, step).await;
        self.committing = Some((epoch, step));
        self.each_server("commit", decision, |mut c, d| async move {
            c.commit_step(d).await
        })
        .await?;
        Ok(())
    }

    /// A step given up while it may be prepared somewhere (the epoch moved under it):
    /// every server is told to abort it, in the background and best effort. A server
    /// still in the step's epoch releases the commit turn the prepared step holds at once;
    /// one already in a newer epoch refuses the call and has settled the step itself.
    /// Without it, a slot that no recovery fences (one rebuilding in the background when
    /// its leader died) kept the turn until its own rebuild waited on it forever.
    ///
    /// Never once its commit has begun: a server may have installed it, and an abort that
    /// reached another before the recovery's fence would leave the step applied on some
    /// servers only (the simulation's stalled-commit schedule caught that).
    pub fn abandon(&self, epoch: u64, step: u64) {
        if self.protocol == CommitProtocol::OneRound
            || self.servers.is_empty()
            || self.committing == Some((epoch, step))
        {
            return;
        }
        let give_up = Instant::now() + self.connector.timeout();
        let calls: Vec<_> = self
            .servers
            .iter()
            .cloned()
            .enumerate()
            .map(|(s, mut client)| async move {
                let what = format!("abort of abandoned step {step} to server {s}");
                let reply = within(
                    give_up,
                    &what,
                    // The epoch moved: no try of the step in its epoch can come again.
                    client.abort_step(StepDecision {
                        epoch,
                        step,
                        attempt: 0,
                    }),
                    None,
                );
                if let Err(e) = reply.await.result {
                    tracing::debug!("{e}");
                }
            })
            .collect();
        tokio::spawn(join_all(calls));
    }

    /// Phase 1 one server at a time, in slot order (see [`CommitProtocol::TwoPhase`]).
    async fn prepare_in_order(&mut self, pushes: Vec<PushRequest>) -> Result<(), PsError> {
        for (s, push) in pushes.into_iter().enumerate() {
            let mut attempt = 1;
            let give_up = Instant::now() + self.connector.timeout();
            loop {
                let what = format!("prepare to server {s}");
                let watch = self.watch(self.suspect_after("prepare"), s);
                let (called, hedged) = self
                    .call_with_copy("prepare", s, give_up, what, watch, |mut c| {
                        let push = push.clone();
                        async move { c.push(push).await }
                    })
                    .await;
                self.record_call("prepare", s, called.took, hedged);
                match called.result {
                    Ok(_) if s == 0 => {
                        self.die_at(points::PREPARED_FIRST, push.step).await;
                        break;
                    }
                    Ok(_) => break,
                    Err(e) => {
                        if called.confirmed_unreachable
                            || !will_pass(&e)
                            || attempt == ATTEMPTS
                            || Instant::now() >= give_up
                        {
                            self.blame(s, &e, called.confirmed_unreachable);
                            return Err(e);
                        }
                        if matches!(e, PsError::NotOwner { .. }) {
                            self.refresh_placement().await?;
                        } else {
                            tokio::time::sleep(RETRY_WAIT).await;
                        }
                        attempt += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sends `requests[s]` to server `s`, all in parallel, and asks again the servers whose
    /// call failed for a reason that may pass (module docs), up to [`ATTEMPTS`] times.
    async fn each_server<Req, Rep, F, Fut>(
        &mut self,
        what: &'static str,
        requests: Vec<Req>,
        call: F,
    ) -> Result<Vec<Rep>, PsError>
    where
        Req: Clone,
        F: Fn(ServerClient, Req) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Rep>, tonic::Status>>,
    {
        self.each_server_except(what, requests, None, call).await
    }

    /// [`ShardClient::each_server`] without server `skip` (its reply is left out).
    async fn each_server_except<Req, Rep, F, Fut>(
        &mut self,
        what: &'static str,
        requests: Vec<Req>,
        skip: Option<usize>,
        call: F,
    ) -> Result<Vec<Rep>, PsError>
    where
        Req: Clone,
        F: Fn(ServerClient, Req) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Rep>, tonic::Status>>,
    {
        let mut replies: Vec<Option<Rep>> = requests.iter().map(|_| None).collect();
        let give_up = Instant::now() + self.connector.timeout();
        for attempt in 1..=ATTEMPTS {
            let pending: Vec<usize> = (0..replies.len())
                .filter(|&s| replies[s].is_none() && Some(s) != skip)
                .collect();
            let after = self.suspect_after(what);
            let (call, requests) = (&call, &requests);
            let calls = pending.iter().map(|&s| {
                let label = format!("{what} to server {s}");
                let watch = self.watch(after, s);
                self.call_with_copy(what, s, give_up, label, watch, move |c| {
                    call(c, requests[s].clone())
                })
            });
            let mut failure: Option<PsError> = None;
            let mut failed_server = None;
            let mut confirmed = false;
            let mut stale_map = false;
            for (&s, (called, hedged)) in pending.iter().zip(join_all(calls).await) {
                self.record_call(what, s, called.took, hedged);
                match called.result {
                    Ok(r) => replies[s] = Some(r),
                    Err(e) => {
                        stale_map |= matches!(e, PsError::NotOwner { .. });
                        // A confirmed unreachable server decides (asking it again would
                        // only wait out the deadline); then a cause that will not pass (a
                        // refused connection: nobody listens there); otherwise the first.
                        if !confirmed
                            && (called.confirmed_unreachable
                                || failure.as_ref().is_none_or(will_pass))
                        {
                            failure = Some(e);
                            failed_server = Some(s);
                            confirmed = called.confirmed_unreachable;
                        }
                    }
                }
            }
            match failure {
                None => break,
                Some(e)
                    if confirmed
                        || !will_pass(&e)
                        || attempt == ATTEMPTS
                        || Instant::now() >= give_up =>
                {
                    if let Some(s) = failed_server {
                        self.blame(s, &e, confirmed);
                    }
                    return Err(e);
                }
                Some(e) => {
                    tracing::debug!("{what}: {e}; asking again (attempt {attempt})");
                    if stale_map {
                        self.refresh_placement().await?;
                    } else {
                        tokio::time::sleep(RETRY_WAIT).await;
                    }
                }
            }
        }
        Ok(replies.into_iter().flatten().collect())
    }
}
