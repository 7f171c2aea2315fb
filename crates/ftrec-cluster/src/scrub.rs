//! `ftrec cluster verify-parity`: a live scrub of a running erasure-coded cluster, the way
//! Ceph scrubs placement groups, without stopping training.
//!
//! The placement (server addresses) comes from the coordinator (`Placement`); the epoch
//! from the servers themselves (a server refuses another epoch with `StaleEpoch`, which
//! names its own; a newer one makes the scrub fetch the placement again). Each table is
//! read one group at a time, in ranges of stripes: every server of the group holding a
//! slot of the range answers its data and parity slots with `FetchSlots`, which returns
//! them together with that server's applied steps, read under one lock. A range is
//! compared only when every server answered with the same applied steps: under two-phase
//! commit a server's rows, the parity differences it folded and its applied steps change
//! together at commit, so equal steps mean the data rows and parity rows read hold
//! exactly the same updates, and their code must hold bit for bit (the degraded reads'
//! rule, `ftrec-server`'s `degraded.rs`). A range read at different steps (a commit fell
//! between the reads) is read again; one that never settles within the bounded retries is
//! reported *unsettled*, never as a mismatch.
//!
//! A range whose comparison fails is read again (`confirmations`) and a stripe is reported
//! only if every settled read found it broken (a corrupted row stays broken, so this costs
//! real mismatches nothing; `unconfirmed` counts what it filtered, 0 under 2PC).
//!
//! One-round propagation (`ec.two_phase_commit = false`) is refused: there a parity
//! holder folds a difference before its data server installs the step, and neither's
//! applied steps move with the fold, so no read of a training cluster is known to be
//! consistent (tried: hot stripes read broken in every confirming re-read, and dense
//! replicas, updated in each server's own arrival order, differ at equal step). The
//! end-of-run check covers such runs.
//!
//! Dense replicas are compared with their primary (`FetchDense`) at equal dense `step`,
//! dense stripes (`ec.replicate_dense = false`) at equal applied steps of their members
//! and parity holders. The comparison itself is `parity_check`'s, shared with the
//! end-of-run check, and mismatches are named the same way.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ftrec_ec::{Codec, StripeLayout};
use ftrec_proto::proto::*;
use ftrec_proto::wire::u32s_to_bytes;
use ftrec_rpc::PsError;
use ftrec_rpc::client::{Connector, CoordinatorClient, ServerClient};
use ftrec_rpc::job::Job;

use crate::parity_check::{self, Mismatch, ParityReport, fetch_dense};

/// How a scrub reads.
#[derive(Clone, Debug)]
pub struct ScrubOptions {
    /// Stripes of one group read at once.
    pub stripes_per_range: usize,
    /// Reads of one range (or one dense check) before it is reported unsettled.
    pub attempts: u32,
    /// The wait before reading a range again (a random part of it is added, so that the
    /// reads do not fall in step with training); ten times longer after a refusal.
    pub retry_wait: Duration,
    /// Settled reads a range with a mismatch is read again; a stripe is reported only if
    /// every one of them found it broken.
    pub confirmations: u32,
}

impl Default for ScrubOptions {
    fn default() -> Self {
        Self {
            stripes_per_range: 256,
            attempts: 200,
            retry_wait: Duration::from_millis(5),
            confirmations: 2,
        }
    }
}

/// A part of the scrub that never settled: its servers never answered at the same
/// applied steps (or kept refusing) within the retries. Not a mismatch: unchecked.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Unsettled {
    /// What was being read: `table 3 stripes 512..768 (group 0)`, `dense stripe 0 of
    /// group 1`, `server 2's dense replica`.
    pub what: String,
    /// The last reason it was read again.
    pub why: String,
}

/// What a scrub found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ScrubReport {
    /// Stripes compared, mismatches (counted and named) and replica mismatches, under
    /// the keys of `cluster run --json`.
    #[serde(flatten)]
    pub parity: ParityReport,
    /// Ranges and dense checks that never settled (their stripes are not in `stripes`).
    pub unsettled: u64,
    pub unsettled_details: Vec<Unsettled>,
    /// The cluster's epoch when the scrub ended.
    pub epoch: u64,
    /// Ranges and dense checks read.
    pub ranges: u64,
    /// Reads repeated because the servers were at different steps, refused, or a
    /// mismatch was being confirmed.
    pub rereads: u64,
    /// Stripes (and dense checks) found broken in one settled read but not in a
    /// confirming one: transient, not reported. Expected only without 2PC.
    pub unconfirmed: u64,
    /// The servers' applied steps (every step below it) at the first and the last range
    /// compared: how far training went on while the scrub read.
    pub first_applied: Option<u64>,
    pub last_applied: Option<u64>,
    pub seconds: f64,
}

/// Scrubs the cluster whose coordinator listens at `coordinator`.
pub async fn scrub(
    job: &Job,
    coordinator: &str,
    options: &ScrubOptions,
) -> Result<ScrubReport, PsError> {
    let started = Instant::now();
    let layout = job.layout()?;
    let Some(stripes) = layout.stripes() else {
        return Err(PsError::Config(
            "verify-parity: the job is not erasure coded (cluster.ft = ec or ec+checkpoint)".into(),
        ));
    };
    if !job.config.ec.two_phase_commit {
        return Err(PsError::Config(
            "verify-parity: a live scrub needs ec.two_phase_commit = true (without it a parity \
             holder folds a difference before its data server installs the step, so no read \
             of a training cluster is known to be consistent); the end-of-run check of \
             `cluster run` covers such runs"
                .into(),
        ));
    }
    let codec = Codec::new(stripes.params.k, stripes.params.r)
        .map_err(|e| PsError::Config(e.to_string()))?;
    let connector = job.connector()?;
    let connector = connector.with_timeout(connector.timeout().min(Duration::from_secs(10)));
    let mut view = View {
        coordinator: connector.coordinator(coordinator).await?,
        connector,
        epoch: 0,
        servers: layout.servers(),
        clients: Vec::new(),
    };
    view.refresh().await?;
    let mut scrub = Scrub {
        view,
        stripes,
        codec,
        options: options.clone(),
        report: ScrubReport::default(),
        scratch: Vec::new(),
    };
    let config = job.config.model_config()?;
    let row_bytes = config.row_stride() * 4;
    let range = options.stripes_per_range.max(1);
    for (t, &rows) in config.table_rows.iter().enumerate() {
        for g in 0..stripes.params.groups {
            // Stripe `j` falls to group `j mod G`.
            let mine: Vec<usize> = (g..stripes.stripes(rows))
                .step_by(stripes.params.groups)
                .collect();
            for chunk in mine.chunks(range) {
                let plan = RangePlan::new(&stripes, t, rows, g, chunk, row_bytes);
                scrub.range(&plan).await?;
            }
        }
    }
    if layout.dense_coded() {
        let global = job.config.model_config()?;
        for g in 0..stripes.params.groups {
            let (first, _) = stripes.group(g);
            let len = ftrec_server::shard::dense_code::row_len(&global, layout, first)?;
            for j in 0..stripes.dense_stripes(g) {
                scrub.dense_stripe(g, j, len).await?;
            }
        }
    }
    for s in 0..layout.servers() {
        if let Some(of) = layout.replicates(s) {
            scrub.replica(s, of).await?;
        }
    }
    let mut report = scrub.report;
    report.epoch = scrub.view.epoch;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The cluster as the scrub sees it: the epoch it reads in and a client per server.
struct View {
    coordinator: CoordinatorClient,
    connector: Connector,
    epoch: u64,
    servers: usize,
    /// `None`: the slot has no address (a replacement is starting).
    clients: Vec<Option<ServerClient>>,
}

impl View {
    /// Fetches the placement map again.
    async fn refresh(&mut self) -> Result<(), PsError> {
        let placement = self
            .coordinator
            .placement(PlacementRequest {})
            .await
            .map_err(|s| PsError::rpc("verify-parity: placement", &s))?
            .into_inner();
        if placement.servers.len() != self.servers {
            return Err(PsError::Config(format!(
                "verify-parity: the coordinator places {} servers, the job file {}: another \
                 job's coordinator?",
                placement.servers.len(),
                self.servers
            )));
        }
        self.clients = placement
            .servers
            .iter()
            .map(|a| {
                (!a.is_empty())
                    .then(|| self.connector.server(a))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    /// Takes in a failed read: a newer epoch is adopted (and the placement fetched
    /// again), a passing condition is read again; anything else ends the scrub.
    async fn absorb(&mut self, error: PsError) -> Result<String, PsError> {
        let why = error.to_string();
        match error {
            PsError::StaleEpoch { current, .. } => {
                if current > self.epoch {
                    self.epoch = current;
                    self.refresh().await?;
                }
            }
            PsError::Unavailable(_)
            | PsError::Refused(_)
            | PsError::PeerUnavailable { .. }
            | PsError::Fenced(_)
            | PsError::NotOwner { .. } => {
                self.refresh().await?;
            }
            PsError::Recovering { .. } | PsError::Overloaded(_) | PsError::Timeout(_) => {}
            other => return Err(other),
        }
        Ok(why)
    }
}

/// Where the slots of one range of stripes of one group are, and what to ask each server.
struct RangePlan {
    table: usize,
    rows: usize,
    group: usize,
    stripes: Vec<usize>,
    row_bytes: usize,
    /// Per server asked: its data slots and parity slots, in the order asked.
    asks: Vec<(usize, Vec<u32>, Vec<u32>)>,
    /// Per stripe, per data position: (index into `asks`, index among its data slots);
    /// `None` for a padding row.
    data_at: Vec<Vec<Option<(usize, usize)>>>,
    /// Per stripe, per parity index: (index into `asks`, index among its parity slots).
    parity_at: Vec<Vec<(usize, usize)>>,
}

impl RangePlan {
    fn new(
        layout: &StripeLayout,
        table: usize,
        rows: usize,
        group: usize,
        stripes: &[usize],
        row_bytes: usize,
    ) -> Self {
        let (k, r) = (layout.params.k, layout.params.r);
        type Asks = Vec<(usize, Vec<u32>, Vec<u32>)>;
        fn ask_of(server: usize, asks: &mut Asks) -> usize {
            asks.iter().position(|a| a.0 == server).unwrap_or_else(|| {
                asks.push((server, Vec::new(), Vec::new()));
                asks.len() - 1
            })
        }
        let mut asks: Asks = Vec::new();
        let mut data_at = Vec::with_capacity(stripes.len());
        let mut parity_at = Vec::with_capacity(stripes.len());
        for &j in stripes {
            let mut data = Vec::with_capacity(k);
            for i in 0..k {
                if j * k + i >= rows {
                    data.push(None);
                    continue;
                }
                let slot = layout.data_slot(table, j, i);
                let n = ask_of(slot.server, &mut asks);
                data.push(Some((n, asks[n].1.len())));
                asks[n].1.push(slot.local as u32);
            }
            let mut parity = Vec::with_capacity(r);
            for p in 0..r {
                let slot = layout.parity_slot(table, j, p);
                let n = ask_of(slot.server, &mut asks);
                parity.push((n, asks[n].2.len()));
                asks[n].2.push(slot.local as u32);
            }
            data_at.push(data);
            parity_at.push(parity);
        }
        Self {
            table,
            rows,
            group,
            stripes: stripes.to_vec(),
            row_bytes,
            asks,
            data_at,
            parity_at,
        }
    }

    fn what(&self) -> String {
        format!(
            "table {} stripes {}..={} (group {})",
            self.table,
            self.stripes.first().copied().unwrap_or_default(),
            self.stripes.last().copied().unwrap_or_default(),
            self.group
        )
    }
}

/// One read of a range: settled (every server at the same steps) or not, and why.
enum Read<T> {
    Settled(T),
    Again(String),
}

/// A server's applied steps as `FetchSlots` and `FetchDense` answer them.
fn applied(below: u64, ahead: &[u64]) -> (u64, BTreeSet<u64>) {
    (below, ahead.iter().copied().collect())
}

fn all_equal<T: PartialEq>(items: &[T]) -> bool {
    items.windows(2).all(|w| w[0] == w[1])
}

struct Scrub {
    view: View,
    stripes: StripeLayout,
    codec: Codec,
    options: ScrubOptions,
    report: ScrubReport,
    scratch: Vec<u8>,
}

impl Scrub {
    /// Reads with `read` until a settled read, at most `attempts` times; `None` when it
    /// never settled (the last reason is recorded as unsettled under `what`).
    async fn settle<T, F, Fut>(&mut self, what: &str, mut read: F) -> Result<Option<T>, PsError>
    where
        F: FnMut(u64, Vec<Option<ServerClient>>) -> Fut,
        Fut: std::future::Future<Output = Result<Read<T>, PsError>>,
    {
        let mut why = String::from("never read");
        let mut wait = self.options.retry_wait;
        for attempt in 0..self.options.attempts.max(1) {
            if attempt > 0 {
                self.report.rereads += 1;
                let jitter = rand::random::<u64>() % (wait.as_micros() as u64 + 1);
                tokio::time::sleep(wait + Duration::from_micros(jitter)).await;
            }
            match read(self.view.epoch, self.view.clients.clone()).await {
                Ok(Read::Settled(t)) => return Ok(Some(t)),
                Ok(Read::Again(reason)) => {
                    why = reason;
                    wait = self.options.retry_wait;
                }
                Err(e) => {
                    let epoch = self.view.epoch;
                    why = self.view.absorb(e).await?;
                    // A newer epoch learnt (the first read learns the cluster's) is read
                    // in at once; a refusal (rows being rebuilt, a server being replaced)
                    // lasts longer than a commit between two reads.
                    wait = if self.view.epoch != epoch {
                        Duration::ZERO
                    } else {
                        self.options.retry_wait * 10
                    };
                }
            }
        }
        self.report.unsettled += 1;
        self.report.unsettled_details.push(Unsettled {
            what: what.to_string(),
            why,
        });
        Ok(None)
    }

    /// Scrubs one range of stripes.
    async fn range(&mut self, plan: &RangePlan) -> Result<(), PsError> {
        self.report.ranges += 1;
        let what = plan.what();
        let Some(first) = self.read_and_compare(plan, &what).await? else {
            return Ok(());
        };
        let mut broken = first;
        for _ in 0..self.options.confirmations {
            if broken.is_empty() {
                break;
            }
            self.report.rereads += 1;
            let Some(again) = self.read_and_compare(plan, &what).await? else {
                break;
            };
            // Only stripes broken in every settled read.
            let before = broken.len();
            broken.retain(|(n, _)| again.iter().any(|(m, _)| m == n));
            self.report.unconfirmed += (before - broken.len()) as u64;
        }
        self.report.parity.stripes += plan.stripes.len() as u64;
        for (_, m) in broken {
            self.report.parity.record(m);
        }
        Ok(())
    }

    /// One settled read of a range, compared: the broken stripes (index in the plan,
    /// named). `None`: it never settled.
    async fn read_and_compare(
        &mut self,
        plan: &RangePlan,
        what: &str,
    ) -> Result<Option<Vec<(usize, Mismatch)>>, PsError> {
        let table = plan.table as u32;
        let replies = self
            .settle(what, |epoch, clients| {
                let calls = plan.asks.iter().map(|(server, data, parity)| {
                    let client = clients.get(*server).cloned().flatten();
                    let request = FetchSlotsRequest {
                        epoch,
                        table,
                        data: u32s_to_bytes(data),
                        parity: u32s_to_bytes(parity),
                        ..Default::default()
                    };
                    let server = *server;
                    async move {
                        let mut client = client.ok_or_else(|| {
                            PsError::Unavailable(format!("server {server} has no address yet"))
                        })?;
                        client
                            .fetch_slots(request)
                            .await
                            .map(tonic::Response::into_inner)
                            .map_err(|s| {
                                PsError::rpc(format!("verify-parity: slots of server {server}"), &s)
                            })
                    }
                });
                let calls: Vec<_> = calls.collect();
                async move {
                    let replies = futures::future::join_all(calls)
                        .await
                        .into_iter()
                        .collect::<Result<Vec<_>, _>>()?;
                    let steps: Vec<_> = replies
                        .iter()
                        .map(|r| applied(r.applied_below, &r.applied_ahead))
                        .collect();
                    if !all_equal(&steps) {
                        return Ok(Read::Again(format!(
                            "the servers answered at different applied steps: {:?}",
                            steps
                                .iter()
                                .map(|(below, ahead)| (below, ahead.len()))
                                .collect::<Vec<_>>()
                        )));
                    }
                    Ok(Read::Settled(replies))
                }
            })
            .await?;
        let Some(replies) = replies else {
            return Ok(None);
        };
        if let Some(first) = replies.first() {
            let r = &mut self.report;
            r.first_applied.get_or_insert(first.applied_below);
            r.last_applied = Some(first.applied_below);
        }
        let rb = plan.row_bytes;
        for (reply, (server, data, parity)) in replies.iter().zip(&plan.asks) {
            if reply.data.len() != data.len() * rb || reply.parity.len() != parity.len() * rb {
                return Err(PsError::BadRequest(format!(
                    "verify-parity: server {server} answered {} data and {} parity bytes for \
                     {} and {} rows of {rb} bytes",
                    reply.data.len(),
                    reply.parity.len(),
                    data.len(),
                    parity.len()
                )));
            }
        }
        let zero = vec![0u8; rb];
        let mut broken = Vec::new();
        for (n, &j) in plan.stripes.iter().enumerate() {
            let data: Vec<&[u8]> = plan.data_at[n]
                .iter()
                .map(|at| match at {
                    Some((a, i)) => &replies[*a].data[i * rb..(i + 1) * rb],
                    None => &zero[..],
                })
                .collect();
            let stored = |p: usize| {
                let (a, i) = *plan.parity_at[n].get(p)?;
                replies[a].parity.get(i * rb..(i + 1) * rb)
            };
            if let Some(m) = parity_check::check_stripe(
                &self.codec,
                &self.stripes,
                plan.table,
                j,
                plan.rows,
                &data,
                stored,
                &mut self.scratch,
            )? {
                broken.push((n, m));
            }
        }
        Ok(Some(broken))
    }

    /// Server `server`'s dense replica against server `of`'s range, at equal steps.
    async fn replica(&mut self, server: usize, of: usize) -> Result<(), PsError> {
        self.report.ranges += 1;
        let what = format!("server {server}'s dense replica of server {of}'s range");
        let mut confirmations = self.options.confirmations + 1;
        loop {
            let pair = self
                .settle(&what, |epoch, clients| {
                    let fetch = |s: usize, replica: bool| {
                        let client = clients.get(s).cloned().flatten();
                        async move {
                            let client = client.ok_or_else(|| {
                                PsError::Unavailable(format!("server {s} has no address yet"))
                            })?;
                            fetch_dense(client, s, epoch, replica, None).await
                        }
                    };
                    let (a, b) = (fetch(server, true), fetch(of, false));
                    async move {
                        let (replica, primary) = futures::future::try_join(a, b).await?;
                        if replica.step != primary.step {
                            return Ok(Read::Again(format!(
                                "the replica is at step {}, the primary at {}",
                                replica.step, primary.step
                            )));
                        }
                        Ok(Read::Settled((replica, primary)))
                    }
                })
                .await?;
            let Some((replica, primary)) = pair else {
                return Ok(());
            };
            confirmations -= 1;
            match parity_check::check_replica(server, of, &replica, &primary) {
                None => {
                    if confirmations < self.options.confirmations {
                        self.report.unconfirmed += 1;
                    }
                    return Ok(());
                }
                Some(m) if confirmations == 0 => {
                    self.report.parity.record(m);
                    return Ok(());
                }
                Some(_) => self.report.rereads += 1,
            }
        }
    }

    /// Dense stripe `j` of group `g` (dense ranges coded), at equal applied steps of its
    /// members and parity holders.
    async fn dense_stripe(&mut self, g: usize, j: usize, len: usize) -> Result<(), PsError> {
        self.report.ranges += 1;
        let what = format!("dense stripe {j} of group {g}");
        let members = self.stripes.dense_members(g, j);
        let holders: Vec<usize> = (0..self.stripes.params.r)
            .map(|p| self.stripes.dense_parity_holder(g, j, p))
            .collect();
        let mut confirmations = self.options.confirmations + 1;
        loop {
            let read = self
                .settle(&what, |epoch, clients| {
                    let fetch = |s: usize, stripe: Option<u32>| {
                        let client = clients.get(s).cloned().flatten();
                        async move {
                            let client = client.ok_or_else(|| {
                                PsError::Unavailable(format!("server {s} has no address yet"))
                            })?;
                            fetch_dense(client, s, epoch, false, stripe).await
                        }
                    };
                    let member_reads: Vec<_> =
                        members.iter().flatten().map(|&m| fetch(m, None)).collect();
                    let holder_reads: Vec<_> =
                        holders.iter().map(|&h| fetch(h, Some(j as u32))).collect();
                    async move {
                        let (ms, hs) = futures::future::try_join(
                            futures::future::try_join_all(member_reads),
                            futures::future::try_join_all(holder_reads),
                        )
                        .await?;
                        let steps: Vec<_> = ms
                            .iter()
                            .chain(&hs)
                            .map(|r| applied(r.applied_below, &r.applied_ahead))
                            .collect();
                        if !all_equal(&steps) {
                            return Ok(Read::Again(
                                "the servers answered at different applied steps".into(),
                            ));
                        }
                        Ok(Read::Settled((ms, hs)))
                    }
                })
                .await?;
            let Some((ms, hs)) = read else {
                return Ok(());
            };
            let mut present = ms.iter();
            let rows = members
                .iter()
                .map(|m| match m {
                    Some(_) => present
                        .next()
                        .map(|r| parity_check::dense_row(r, len))
                        .transpose(),
                    None => Ok(None),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let held = |p: usize| hs.get(p).map(|r| &r.dense_parity[..]);
            confirmations -= 1;
            match parity_check::check_dense_stripe(
                &self.codec,
                &self.stripes,
                g,
                j,
                &rows,
                len,
                held,
            )? {
                None => {
                    if confirmations < self.options.confirmations {
                        self.report.unconfirmed += 1;
                    }
                    self.report.parity.stripes += 1;
                    return Ok(());
                }
                Some(m) if confirmations == 0 => {
                    self.report.parity.stripes += 1;
                    self.report.parity.record(m);
                    return Ok(());
                }
                Some(_) => self.report.rereads += 1,
            }
        }
    }
}
