//! The background thread that writes IncrCP increments and runs extraction rounds, so
//! training blocks only while an increment is copied out of the model.

use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, channel, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::incrcp::{ExtractionStats, IncrcpChain, Increment};
use crate::{Checkpoints, CkptError, Manifest};

enum Job {
    /// Later increments build on this (already committed) full checkpoint.
    Baseline(String),
    Increment(Box<Increment>, usize),
}

/// What the worker did with one increment.
#[derive(Clone, Debug)]
pub struct CommitReport {
    pub manifest: Manifest,
    /// Seconds to write and commit the increment (not blocking training).
    pub write_seconds: f64,
    pub extraction: ExtractionStats,
    /// Bytes a restore of this checkpoint reads from the chunk list after its extraction
    /// round (the baseline not counted).
    pub rectangle_bytes: u64,
}

pub struct IncrcpWorker {
    jobs: Option<SyncSender<Job>>,
    reports: Receiver<Result<CommitReport, CkptError>>,
    thread: Option<JoinHandle<()>>,
    pending: usize,
}

impl IncrcpWorker {
    pub fn spawn(checkpoints: Checkpoints, threshold: f64) -> Result<Self, CkptError> {
        // One increment queued while one is written: bounded memory, and the foreground
        // waits (counted as blocking time) only when the disk cannot keep up.
        let (jobs, job_rx) = sync_channel::<Job>(1);
        let (report_tx, reports) = channel();
        let thread = std::thread::Builder::new()
            .name("incrcp-writer".into())
            .spawn(move || {
                let mut chain: Option<IncrcpChain> = None;
                for job in job_rx {
                    match job {
                        Job::Baseline(id) => chain = Some(IncrcpChain::new(&id, threshold)),
                        Job::Increment(inc, tables) => {
                            let result = match chain.as_mut() {
                                Some(c) => run(c, &checkpoints, *inc, tables),
                                None => Err(CkptError::Invalid(
                                    "incrcp: increment without a baseline".into(),
                                )),
                            };
                            if result.is_err() {
                                // The stored list may now lag the in-memory one: start over
                                // from a new baseline rather than extend it.
                                chain = None;
                            }
                            if report_tx.send(result).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
            .map_err(|e| CkptError::Invalid(format!("cannot start the incrcp writer: {e}")))?;
        Ok(Self {
            jobs: Some(jobs),
            reports,
            thread: Some(thread),
            pending: 0,
        })
    }

    fn send(&mut self, job: Job) -> Result<(), CkptError> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| CkptError::Invalid("the incrcp writer thread has stopped".into()))
    }

    pub fn start_baseline(&mut self, id: &str) -> Result<(), CkptError> {
        self.send(Job::Baseline(id.to_string()))
    }

    /// Queues an increment; blocks while another one is already queued.
    pub fn submit(&mut self, increment: Increment, tables: usize) -> Result<(), CkptError> {
        self.send(Job::Increment(Box::new(increment), tables))?;
        self.pending += 1;
        Ok(())
    }

    /// Reports of increments finished so far, without waiting.
    pub fn poll(&mut self) -> Vec<Result<CommitReport, CkptError>> {
        let mut out = Vec::new();
        while self.pending > 0 {
            match self.reports.try_recv() {
                Ok(r) => {
                    self.pending -= 1;
                    out.push(r);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.pending = 0;
                    out.push(Err(CkptError::Invalid(
                        "the incrcp writer thread stopped".into(),
                    )));
                }
            }
        }
        out
    }

    /// Waits until every queued increment is committed and returns their reports.
    pub fn wait_idle(&mut self) -> Vec<Result<CommitReport, CkptError>> {
        let mut out = Vec::new();
        while self.pending > 0 {
            self.pending -= 1;
            out.push(self.reports.recv().unwrap_or_else(|_| {
                Err(CkptError::Invalid(
                    "the incrcp writer thread stopped".into(),
                ))
            }));
        }
        out
    }
}

fn run(
    chain: &mut IncrcpChain,
    checkpoints: &Checkpoints,
    inc: Increment,
    tables: usize,
) -> Result<CommitReport, CkptError> {
    let start = Instant::now();
    let keys = inc.keys(tables);
    let store = checkpoints.store();
    let manifest = chain.commit(checkpoints, inc)?;
    let write_seconds = start.elapsed().as_secs_f64();
    let column = manifest.incrcp.as_ref().map_or(0, |r| r.column);
    let extraction = chain.extract(store, column, &keys)?;
    Ok(CommitReport {
        rectangle_bytes: chain.rectangle_bytes(column),
        manifest,
        write_seconds,
        extraction,
    })
}

impl Drop for IncrcpWorker {
    fn drop(&mut self) {
        // Closing the queue lets the thread finish what it holds and exit.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
