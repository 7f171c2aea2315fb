//! Starting a coordinator: its service and control loop, as the leader or as a standby
//! (etcd membership), and the handle its caller waits on.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use ftrec_proto::proto::ResumePoint;
use ftrec_proto::proto::coordinator_server::CoordinatorServer;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;
use ftrec_rpc::job::{Job, Schedule};
use ftrec_rpc::metrics::{self, Metrics};

use crate::leader::{durable, takeover};
use crate::state::State;
use crate::{Shared, Spawner, control, service};

pub struct CoordinatorOptions {
    pub job: Job,
    pub host: String,
    /// Port to listen on (0: any).
    pub port: u16,
    pub spawner: Option<Arc<dyn Spawner>>,
    /// etcd membership: wait while another coordinator leads, and take over when its
    /// lease expires (`--standby`); without, a held leadership is an error.
    pub standby: bool,
    /// This coordinator's name in etcd and the reports (default: `HOST:PORT/pid-PID`).
    pub id: Option<String>,
    /// This coordinator's fault points (`ftrec_faults::points::RECOVERY`, `TAKEOVER`).
    pub faults: ftrec_faults::Faults,
    /// A resumed job (`cluster.resume_from`, resolved to one cut by the caller): training
    /// starts at its step, and every server starts from its share of it.
    pub resume: Option<ResumePoint>,
}

/// Knobs and observers for tests (the simulation, `ftrec-sim`): `Default` is production
/// behaviour, and only [`start_with`] takes them, so no production caller can set one.
#[derive(Clone, Default)]
pub struct TestHooks {
    /// A planted bug, for a test to show that the simulation catches it: the leader grants
    /// steps without checking that it may still decide (its lease valid, not deposed).
    pub grant_without_lease_check: bool,
    /// Called with `(epoch, step)` for every step this coordinator grants, as it grants
    /// it: lets a test check that decisions of two leaders never interleave.
    pub on_grant: Option<Arc<dyn Fn(u64, u64) + Send + Sync>>,
}

/// A running coordinator (embedded in `cluster run`, or `ftrec coordinator`).
pub struct Handle {
    pub shared: Arc<Shared>,
    pub metrics_address: Option<String>,
    done: watch::Receiver<bool>,
    /// etcd membership: the job had finished under an earlier leader when this one took
    /// over (its servers may be gone: there is nothing to gather).
    pub inherited_done: bool,
}

impl Handle {
    /// Waits until every step is trained (bounded by `limit`).
    pub async fn wait_done(&mut self, limit: Duration) -> Result<(), PsError> {
        tokio::time::timeout(limit, self.done.wait_for(|d| *d))
            .await
            .map_err(|_| PsError::Timeout(format!("training did not finish within {limit:?}")))?
            .map_err(|_| PsError::Stopped("the coordinator stopped".into()))?;
        match self.shared.lock().recovery.fatal.clone() {
            Some(why) => Err(PsError::Fatal(why)),
            None => Ok(()),
        }
    }

    /// Waits until etcd records that the job ended (a no-op with embedded membership),
    /// before the members are told to stop: a job that trained its last step through an
    /// etcd outage, told its servers to stop and exited, left a record of a running job
    /// whose servers were gone, and the leader after it failed the job (`bench soak`'s
    /// quorum loss). An outage is waited out; a newer leader (this one deposed) is an
    /// error, and the members are left to it.
    pub async fn record_end(&self) -> Result<(), PsError> {
        if self.shared.durable.is_none() {
            return Ok(());
        }
        let mut clock = crate::leader::OutageClock::start();
        loop {
            match self.shared.sync_durable().await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    if let Some(waited) = clock.report_due() {
                        tracing::warn!(
                            "the job's end waits for etcd to record it ({e}; {waited:.0} s so far)"
                        );
                    }
                    // Deposed (`sync_durable` says so to `leading`): the members are
                    // the new leader's.
                    if !self.shared.leading() {
                        return Err(e);
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Ends a finished run's leadership: the record says the job is done, and the lease
    /// is given back so a standby learns it at once (and exits) instead of waiting out
    /// the TTL. A no-op with embedded membership.
    pub async fn finish(&self) -> Result<(), PsError> {
        let Some(d) = &self.shared.durable else {
            return Ok(());
        };
        self.shared.sync_durable().await?;
        d.leadership.resign().await;
        Ok(())
    }
}

pub async fn start(opts: CoordinatorOptions) -> Result<Handle, PsError> {
    start_with(opts, TestHooks::default()).await
}

/// [`start`] with test hooks (see [`TestHooks`]).
pub async fn start_with(opts: CoordinatorOptions, testing: TestHooks) -> Result<Handle, PsError> {
    let job = opts.job;
    let data = job.train_data()?;
    let schedule = Schedule {
        samples: data.len() as u64,
        batch_size: job.config.train.batch_size as u64,
    };
    let c = &job.config;
    let total_steps = if c.train.steps > 0 {
        c.train.steps
    } else {
        c.train.epochs * schedule.batches_per_epoch()
    };
    let network = job.network().clone();
    let (incoming, address) = job.bind(&opts.host, opts.port).await?;
    let id = opts
        .id
        .clone()
        .unwrap_or_else(|| format!("{address}/pid-{}", std::process::id()));
    // etcd membership: leading is the first thing; a standby waits here.
    let (durable, record) = match job.etcd_options() {
        Some(etcd) => {
            let (d, r) = takeover::elect(&job, &etcd, &address, opts.standby, &id).await?;
            (Some(d), r)
        }
        None => (None, None),
    };
    let metrics = Arc::new(
        Metrics::new("role=\"coordinator\"".into())
            .counter("ftrec_samples_total", "Samples trained")
            .counter("ftrec_steps_total", "Steps finished")
            .counter(
                "ftrec_lost_samples_total",
                "Samples of steps lost to failures",
            )
            .counter("ftrec_rpc_bytes_total", "Worker RPC payload bytes")
            .counter("ftrec_failures_total", "Server failures detected")
            .counter("ftrec_checkpoints_total", "Cluster checkpoints")
            .gauge("ftrec_epoch", "Cluster epoch")
            .gauge(
                "ftrec_pls",
                "Portion of lost samples (partial recovery, CPR Eq. 3)",
            ),
    );
    let metrics_address = metrics::start(&network, &opts.host, metrics.clone()).await;
    let (done_tx, done_rx) = watch::channel(false);
    let mut state = State::new(
        &job,
        total_steps,
        schedule.samples_before(total_steps),
        opts.resume.clone(),
    )?;
    if let Some(point) = &opts.resume {
        if point.step >= total_steps {
            return Err(PsError::Config(format!(
                "resuming from the cut at step {} of {}: the job trains {total_steps} steps \
                 (train.steps), so nothing is left to train",
                point.step, point.location
            )));
        }
        state.steps.ledger.rewind(point.step);
    }
    let shared = Arc::new(Shared {
        schedule,
        address: address.clone(),
        state: Mutex::new(state),
        spawner: opts.spawner,
        metrics,
        done: done_tx,
        epochs: watch::Sender::new(0),
        durable,
        wake: tokio::sync::Notify::new(),
        testing,
        faults: opts.faults,
        job,
    });
    let inherited_done = record.as_ref().is_some_and(|r| r.done || r.fatal.is_some());
    let takeover_from = match (&shared.durable, record) {
        (Some(d), Some(record)) => Some(takeover::restore(&shared, d, record)?),
        (Some(d), None) => {
            let epoch = takeover::first_epoch(d.leadership.term());
            shared.lock().epoch = epoch;
            shared.epoch_moved(epoch);
            None
        }
        _ => None,
    };
    let service = tonic::service::interceptor::InterceptedService::new(
        CoordinatorServer::new(service::Service(shared.clone())),
        shared.job.secret().checker(),
    );
    let mut builder = ftrec_rpc::auth::server_builder(&shared.job)?;
    tokio::spawn(async move {
        if let Err(e) = builder
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!("coordinator RPC server stopped: {e}");
        }
    });
    tokio::spawn(control::control_loop(shared.clone()));
    if shared.durable.is_some() {
        tokio::spawn(durable::flush_loop(shared.clone()));
        tokio::spawn(durable::watch_leadership(shared.clone()));
        if let Some(settled_through) = takeover_from.filter(|_| !inherited_done) {
            tokio::spawn(takeover::take_over(shared.clone(), settled_through));
        }
    }
    shared.event(
        EventKind::Coordinator,
        format!(
            "listening on {address} (metrics http://{}/metrics)",
            metrics_address.as_deref().unwrap_or("-")
        ),
    );
    Ok(Handle {
        shared,
        metrics_address,
        done: done_rx,
        inherited_done,
    })
}
