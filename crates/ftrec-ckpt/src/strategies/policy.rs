//! The checkpoint strategies as a policy over [`Checkpoints`] and a [`DeltaTracker`]:
//! which checkpoint to take next, with which rows and which parent.

use std::time::Instant;

use ftrec_model::ModelState;

use crate::deck::{DeckEvent, DeckOptions, Stager};
use crate::incrcp;
use crate::incrcp_worker::{CommitReport, IncrcpWorker};
use crate::manifest::{CheckpointKind, Manifest};
use crate::manifest::{DeckRef, FileEntry};
use crate::merge::MergeReport;
use crate::{
    CHUNK_BYTES, Checkpoints, CkptError, DeltaTracker, Strategy, StrategyConfig, TenantId,
};

/// IncrCP §4.5: before each checkpoint, assume a failure follows it and pick the kind
/// with the shorter construction plus recovery time. A new baseline costs `C_base` (and
/// `R_base` to recover); another increment costs `C_incre`, `R_base` and `R_i`, the
/// recovery of the rows since the baseline, extrapolated from the last two checkpoints.
#[derive(Clone, Debug, Default)]
struct ResetModel {
    base_seconds: Option<f64>,
    base_bytes: u64,
    incr_seconds: Option<f64>,
    /// Estimated recovery seconds of the last two increments, oldest first.
    recovery: [Option<f64>; 2],
    /// Measured read speed, when known; otherwise the baseline's write speed stands in.
    read_bytes_per_second: Option<f64>,
}

impl ResetModel {
    fn record_recovery(&mut self, rectangle_bytes: u64) {
        let speed = self.read_bytes_per_second.or_else(|| {
            self.base_seconds
                .filter(|&s| s > 0.0)
                .map(|s| self.base_bytes as f64 / s)
        });
        if let Some(speed) = speed.filter(|&s| s > 0.0) {
            self.recovery = [self.recovery[1], Some(rectangle_bytes as f64 / speed)];
        }
    }

    fn next_recovery(&self) -> Option<f64> {
        match self.recovery {
            [Some(a), Some(b)] => Some((2.0 * b - a).max(b)),
            [_, b] => b,
        }
    }

    fn prefers_baseline(&self) -> bool {
        match (self.base_seconds, self.incr_seconds, self.next_recovery()) {
            (Some(c_base), Some(c_incre), Some(r_i)) => c_base < c_incre + r_i,
            _ => false,
        }
    }

    fn new_baseline(&mut self, seconds: f64, bytes: u64) {
        self.base_seconds = Some(seconds);
        self.base_bytes = bytes;
        self.recovery = [None, None];
    }
}

/// Takes checkpoints of a training run according to a [`StrategyConfig`].
pub struct Checkpointer {
    checkpoints: Checkpoints,
    tracker: DeltaTracker,
    tenant: TenantId,
    last: Option<String>,
    baseline: Option<String>,
    /// Seconds spent in `track` and `compact`, to report the tracking overhead.
    tracking_seconds: f64,
    mode: Mode,
}

/// Each strategy's own state.
enum Mode {
    Full,
    Differential { full_every: u64, since_full: u64 },
    NaiveIncremental { full_every: u64, since_full: u64 },
    Incrcp(Box<IncrcpState>),
    Deck(Box<DeckState>),
}

/// DECK's side of the checkpointer.
struct DeckState {
    stager: Stager,
    options: DeckOptions,
    deltas_since_full: u32,
    last_delta_bytes: u64,
    /// Bytes of live deltas and merged checkpoints on the current base.
    live_bytes: u64,
    stats: DeckStats,
}

/// What DECK did in this run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DeckStats {
    pub fulls: u32,
    pub deltas: u32,
    pub committed: u32,
    pub upload_seconds: f64,
    pub merges: MergeReport,
    pub retained_deleted: u32,
    /// Merge or retention passes that failed (and left their inputs in place).
    pub background_failures: u32,
    pub peak_resident_chunks: usize,
}

/// IncrCP's side of the checkpointer: the background writer and the reset model.
struct IncrcpState {
    full_every: u64,
    since_full: u64,
    /// Size of the row chunks increments are copied into.
    chunk_bytes: usize,
    worker: IncrcpWorker,
    column: u32,
    reset: ResetModel,
    reports: Vec<CommitReport>,
    baselines: u32,
}

/// A full checkpoint is due after `since_full` deltas under a cap of `full_every`.
fn cap_reached(full_every: u64, since_full: u64) -> bool {
    full_every > 0 && since_full + 1 >= full_every
}

impl Checkpointer {
    /// The checkpointer a job's configuration describes (`checkpoint.strategy_config()`),
    /// or none for a job that takes no checkpoints.
    pub fn start_configured(
        checkpoints: Checkpoints,
        config: Option<StrategyConfig>,
        tables: usize,
    ) -> Result<Option<Self>, CkptError> {
        config
            .map(|config| Self::start(checkpoints, config, tables))
            .transpose()
    }

    /// A checkpointer for `tables` tables, writing to `checkpoints`.
    pub fn start(
        checkpoints: Checkpoints,
        config: StrategyConfig,
        tables: usize,
    ) -> Result<Self, CkptError> {
        let mut tracker = DeltaTracker::new(tables);
        let tenant = tracker.register("checkpointer");
        let mode = match config {
            StrategyConfig::Full => Mode::Full,
            StrategyConfig::Differential { full_every } => Mode::Differential {
                full_every,
                since_full: 0,
            },
            StrategyConfig::NaiveIncremental { full_every } => Mode::NaiveIncremental {
                full_every,
                since_full: 0,
            },
            StrategyConfig::Incrcp {
                full_every,
                threshold,
            } => Mode::Incrcp(Box::new(IncrcpState {
                full_every,
                since_full: 0,
                chunk_bytes: CHUNK_BYTES,
                worker: IncrcpWorker::spawn(checkpoints.clone(), threshold.get())?,
                column: 0,
                reset: ResetModel::default(),
                reports: Vec::new(),
                baselines: 0,
            })),
            StrategyConfig::Deck(options) => Mode::Deck(Box::new(DeckState {
                stager: Stager::start(checkpoints.clone(), &options)?,
                options,
                deltas_since_full: 0,
                last_delta_bytes: 0,
                live_bytes: 0,
                stats: DeckStats::default(),
            })),
        };
        Ok(Self {
            checkpoints,
            tracker,
            tenant,
            last: None,
            baseline: None,
            tracking_seconds: 0.0,
            mode,
        })
    }

    /// `strategy` with `full_every` and IncrCP's default threshold (DECK's defaults).
    pub fn new(
        checkpoints: Checkpoints,
        strategy: Strategy,
        full_every: u64,
        tables: usize,
    ) -> Result<Self, CkptError> {
        Self::with_threshold(
            checkpoints,
            strategy,
            full_every,
            tables,
            incrcp::DEFAULT_THRESHOLD,
        )
    }

    /// `threshold` is IncrCP's R (ignored by the other strategies).
    pub fn with_threshold(
        checkpoints: Checkpoints,
        strategy: Strategy,
        full_every: u64,
        tables: usize,
        threshold: f64,
    ) -> Result<Self, CkptError> {
        let config = StrategyConfig::new(strategy, full_every, threshold, DeckOptions::default())?;
        Self::start(checkpoints, config, tables)
    }

    /// A DECK checkpointer; its full interval is `options.full_every_deltas` and
    /// `options.live_factor`.
    pub fn deck(
        checkpoints: Checkpoints,
        tables: usize,
        options: DeckOptions,
    ) -> Result<Self, CkptError> {
        let config = StrategyConfig::new(Strategy::Deck, 0, incrcp::DEFAULT_THRESHOLD, options)?;
        Self::start(checkpoints, config, tables)
    }

    /// Waits until every checkpoint is committed and DECK's merger is idle.
    pub fn flush_background(&mut self) -> Result<(), CkptError> {
        match &mut self.mode {
            Mode::Deck(d) => {
                let events = d.stager.wait_idle();
                self.absorb_deck(events)
            }
            _ => self.flush(),
        }
    }

    /// What DECK did so far (after the last `flush` or `checkpoint`).
    pub fn deck_stats(&self) -> Option<DeckStats> {
        match &self.mode {
            Mode::Deck(d) => Some(DeckStats {
                peak_resident_chunks: d.stager.peak_resident_chunks(),
                ..d.stats.clone()
            }),
            _ => None,
        }
    }

    /// Sets the size of the chunks IncrCP copies increments into and DECK stages
    /// (smaller chunks give IncrCP's key-range filter more to work with, at more objects
    /// per checkpoint). The other strategies write the engine's chunks.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        match &mut self.mode {
            Mode::Incrcp(i) => i.chunk_bytes = bytes.max(1),
            Mode::Deck(d) => d.options.chunk_bytes = bytes.max(1),
            _ => {}
        }
    }

    /// Tells IncrCP's reset model how fast checkpoints are read back (measured by a
    /// restore), instead of assuming the baseline's write speed.
    pub fn set_read_bandwidth(&mut self, bytes_per_second: f64) {
        if let Mode::Incrcp(i) = &mut self.mode {
            i.reset.read_bytes_per_second = Some(bytes_per_second);
        }
    }

    /// Reports of committed IncrCP increments, oldest first.
    pub fn incrcp_reports(&self) -> &[CommitReport] {
        match &self.mode {
            Mode::Incrcp(i) => &i.reports,
            _ => &[],
        }
    }

    /// Number of IncrCP baselines (full checkpoints) written.
    pub fn incrcp_baselines(&self) -> u32 {
        match &self.mode {
            Mode::Incrcp(i) => i.baselines,
            _ => 0,
        }
    }

    /// Takes in, without waiting, what the background writers finished: a write that
    /// failed is reported here. A caller that wants to know whether a checkpoint is
    /// committed looks for its manifest (a DECK merge may have replaced a delta since).
    pub fn poll(&mut self) -> Result<(), CkptError> {
        match &mut self.mode {
            Mode::Deck(d) => {
                let events = d.stager.poll();
                self.absorb_deck(events)
            }
            Mode::Incrcp(i) => {
                let reports = i.worker.poll();
                self.absorb(reports)
            }
            _ => Ok(()),
        }
    }

    /// Waits until every checkpoint taken so far is committed. A background write that
    /// failed is reported here (or by the next `checkpoint`).
    pub fn flush(&mut self) -> Result<(), CkptError> {
        match &mut self.mode {
            Mode::Deck(d) => {
                let events = d.stager.wait_committed();
                self.absorb_deck(events)
            }
            Mode::Incrcp(i) => {
                let reports = i.worker.wait_idle();
                self.absorb(reports)
            }
            _ => Ok(()),
        }
    }

    fn absorb_deck(&mut self, events: Vec<Result<DeckEvent, CkptError>>) -> Result<(), CkptError> {
        let Mode::Deck(d) = &mut self.mode else {
            return Ok(());
        };
        let mut first_error = None;
        for e in events {
            match e {
                Ok(DeckEvent::Committed { upload_seconds, .. }) => {
                    d.stats.committed += 1;
                    d.stats.upload_seconds += upload_seconds;
                }
                Ok(DeckEvent::Merged(report)) => {
                    // Measured from the store, so it also counts deltas that were merged.
                    if self.baseline.as_deref() == Some(report.base.as_str()) {
                        d.live_bytes = report.live_bytes;
                    }
                    d.stats.merges.absorb(report);
                }
                Ok(DeckEvent::Retained(report)) => {
                    d.stats.retained_deleted += report.checkpoints.len() as u32;
                }
                Ok(DeckEvent::BackgroundFailed(_)) => d.stats.background_failures += 1,
                Ok(DeckEvent::Idle) => {}
                Err(e) => {
                    self.baseline = None;
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn absorb(&mut self, reports: Vec<Result<CommitReport, CkptError>>) -> Result<(), CkptError> {
        let Mode::Incrcp(i) = &mut self.mode else {
            return Ok(());
        };
        let mut first_error = None;
        for r in reports {
            match r {
                Ok(report) => {
                    i.reset.record_recovery(report.rectangle_bytes);
                    i.reports.push(report);
                }
                Err(e) => {
                    // The chain is broken: the next checkpoint starts a new baseline.
                    self.baseline = None;
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    pub fn checkpoints(&self) -> &Checkpoints {
        &self.checkpoints
    }

    pub fn strategy(&self) -> Strategy {
        match self.mode {
            Mode::Full => Strategy::Full,
            Mode::Differential { .. } => Strategy::Differential,
            Mode::NaiveIncremental { .. } => Strategy::NaiveIncremental,
            Mode::Incrcp(_) => Strategy::Incrcp,
            Mode::Deck(_) => Strategy::Deck,
        }
    }

    /// Records the rows of `table` a step updated (a no-op for the full strategy).
    pub fn track(&mut self, table: usize, rows: &[u32]) {
        if !matches!(self.mode, Mode::Full) {
            let t = Instant::now();
            self.tracker.track(table, rows);
            self.tracking_seconds += t.elapsed().as_secs_f64();
        }
    }

    /// De-duplicates tracked rows; call every few steps to bound memory.
    pub fn compact(&mut self) {
        if !matches!(self.mode, Mode::Full) {
            let t = Instant::now();
            self.tracker.compact();
            self.tracking_seconds += t.elapsed().as_secs_f64();
        }
    }

    pub fn tracking_seconds(&self) -> f64 {
        self.tracking_seconds
    }

    /// Takes the next checkpoint of `state` after `step`. The first checkpoint (also the
    /// first after a resume, whose tracked history is gone) is full.
    pub fn checkpoint(
        &mut self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let manifest = match &mut self.mode {
            Mode::Incrcp(_) => return self.checkpoint_incrcp(state, step, trainer),
            Mode::Deck(_) => return self.checkpoint_deck(state, step, trainer),
            Mode::Full => self.write_baseline(state, step, trainer)?,
            Mode::Differential {
                full_every,
                since_full,
            }
            | Mode::NaiveIncremental {
                full_every,
                since_full,
            } if self.baseline.is_none() || cap_reached(*full_every, *since_full) => {
                *since_full = 0;
                self.write_baseline(state, step, trainer)?
            }
            Mode::Differential { since_full, .. } => {
                *since_full += 1;
                let rows = self.tracker.peek(self.tenant);
                let parent = self.baseline.clone();
                self.write_delta(
                    state,
                    step,
                    CheckpointKind::Differential,
                    &rows,
                    parent,
                    trainer,
                )?
            }
            Mode::NaiveIncremental { since_full, .. } => {
                *since_full += 1;
                let rows = self.tracker.take(self.tenant);
                let parent = self.last.clone();
                self.write_delta(
                    state,
                    step,
                    CheckpointKind::NaiveIncremental,
                    &rows,
                    parent,
                    trainer,
                )?
            }
        };
        self.last = Some(manifest.id.clone());
        Ok(manifest)
    }

    /// A full checkpoint that starts a new baseline: the tracked rows are covered by it.
    fn write_baseline(
        &mut self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let m = self.checkpoints.write_full(state, step, trainer)?;
        self.tracker.take(self.tenant);
        self.baseline = Some(m.id.clone());
        Ok(m)
    }

    fn write_delta(
        &self,
        state: &ModelState,
        step: u64,
        kind: CheckpointKind,
        rows: &[Vec<u32>],
        parent: Option<String>,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        let parent =
            parent.ok_or_else(|| CkptError::Invalid("delta checkpoint without a parent".into()))?;
        self.checkpoints
            .write(state, step, kind, Some(rows), vec![parent], trainer)
    }

    /// IncrCP: a new baseline when the reset model prefers one (or `full_every` asks);
    /// otherwise the changed rows are copied out and handed to the background writer.
    /// The returned manifest is committed once `flush` (or a later checkpoint) returns.
    fn checkpoint_incrcp(
        &mut self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        self.poll()?;
        let Mode::Incrcp(i) = &self.mode else {
            return Err(CkptError::Invalid(
                "incrcp checkpoint of another strategy".into(),
            ));
        };
        let reset = self.baseline.is_none()
            || cap_reached(i.full_every, i.since_full)
            || i.reset.prefers_baseline();
        if reset {
            // Finish the old chain first: its extraction rounds must not race the reset.
            self.flush()?;
            let start = Instant::now();
            let m = self.write_baseline(state, step, trainer)?;
            let seconds = start.elapsed().as_secs_f64();
            self.last = Some(m.id.clone());
            if let Mode::Incrcp(i) = &mut self.mode {
                i.since_full = 0;
                i.reset.new_baseline(seconds, m.bytes());
                i.column = 0;
                i.baselines += 1;
                i.worker.start_baseline(&m.id)?;
            }
            return Ok(m);
        }
        let start = Instant::now();
        let rows = self.tracker.take(self.tenant);
        let baseline = self
            .baseline
            .clone()
            .ok_or_else(|| CkptError::Invalid("incrcp increment without a baseline".into()))?;
        let id = self.checkpoints.id_for(step, CheckpointKind::Incrcp);
        let Mode::Incrcp(i) = &mut self.mode else {
            return Err(CkptError::Invalid(
                "incrcp checkpoint of another strategy".into(),
            ));
        };
        let place = incrcp::IncrementPlace {
            id,
            step,
            baseline: &baseline,
            column: i.column,
            quant: self.checkpoints.quant,
        };
        let inc = incrcp::copy_increment(state, place, &rows, trainer, i.chunk_bytes)?;
        let manifest = inc.manifest.clone();
        i.worker.submit(inc, state.tables().len())?;
        i.column += 1;
        i.reset.incr_seconds = Some(start.elapsed().as_secs_f64());
        i.since_full += 1;
        self.last = Some(manifest.id.clone());
        Ok(manifest)
    }

    /// DECK: a full checkpoint when due, else a delta of the rows changed since the last
    /// checkpoint; either is staged (the blocking part) and uploaded in the background.
    /// The returned manifest is committed once `flush` (or a later checkpoint) returns.
    fn checkpoint_deck(
        &mut self,
        state: &ModelState,
        step: u64,
        trainer: serde_json::Value,
    ) -> Result<Manifest, CkptError> {
        self.poll()?;
        let Mode::Deck(d) = &mut self.mode else {
            return Err(CkptError::Invalid(
                "deck checkpoint of another strategy".into(),
            ));
        };
        let o = &d.options;
        let due = (o.full_every_deltas > 0 && d.deltas_since_full >= o.full_every_deltas)
            || (o.live_factor > 0.0
                && d.last_delta_bytes > 0
                && d.live_bytes as f64 > o.live_factor * d.last_delta_bytes as f64);
        let chunk_bytes = o.chunk_bytes;
        let checkpoints = &self.checkpoints;
        let template = |kind, parents, deck| Manifest {
            id: checkpoints.id_for(step, kind),
            kind,
            step,
            parents,
            created_unix_ms: crate::engine::now_unix_ms(),
            model: state.config().clone(),
            dense: FileEntry {
                key: String::new(),
                bytes: 0,
                crc32c: 0,
                table: None,
                rows: 0,
            },
            chunks: Vec::new(),
            trainer: trainer.clone(),
            incrcp: None,
            deck,
            branch: checkpoints.branch(),
            fence: None,
            quantize: checkpoints.quant_for(state.config()),
        };
        let manifest = match self.baseline.clone().filter(|_| !due) {
            None => {
                self.tracker.take(self.tenant);
                let m = d.stager.stage(
                    state,
                    template(CheckpointKind::Full, Vec::new(), None),
                    None,
                    chunk_bytes,
                )?;
                self.baseline = Some(m.id.clone());
                d.deltas_since_full = 0;
                d.live_bytes = 0;
                d.stats.fulls += 1;
                m
            }
            Some(base) => {
                let rows = self.tracker.take(self.tenant);
                let k = d.deltas_since_full + 1;
                let deck = DeckRef {
                    from: k - 1,
                    to: k,
                    layer: 0,
                };
                let m = d.stager.stage(
                    state,
                    template(CheckpointKind::Delta, vec![base], Some(deck)),
                    Some(&rows),
                    chunk_bytes,
                )?;
                d.deltas_since_full = k;
                d.last_delta_bytes = m.bytes();
                d.live_bytes += m.bytes();
                d.stats.deltas += 1;
                m
            }
        };
        self.last = Some(manifest.id.clone());
        Ok(manifest)
    }
}
