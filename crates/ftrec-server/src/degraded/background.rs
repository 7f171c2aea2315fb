//! The background part of a rebuild: every pending slot, decoded from whole *cycle
//! ranges*. A cycle of a group's `n` stripes fills `k` data and `r` parity slots on every
//! member, so cycles `[c0, c1)` are one contiguous byte range of data slots and one of
//! parity slots on each survivor: one request per survivor per range, no slot list, sent
//! from the survivor's table with its applied steps (over its bulk port, `bulk.rs`; or
//! copied into an RPC reply). If the replacement's applied steps equal every survivor's (the
//! snapshot rule of the module docs), it decodes by the cycle's shape (the same for every
//! cycle) straight into its table's still pending slots, under its write lock, on a thread
//! that may block: no buffer, no install copy.
//!
//! With `n > k + r`, or `r >= 2` and one server lost, a survivor sends rows of stripes the
//! replacement does not need (it sends whole cycles); `n = k + r` and `r = 1`, the default,
//! waste nothing.

use bytes::Bytes;
use tokio::time::Instant;

use ftrec_ec::{Codec, CycleStripe};
use ftrec_faults::points;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;

use super::{Background, Rounds, Sorted, decode_row, rows_as_asked};
use crate::Core;
use crate::bulk::RangeAsk;
use crate::rebuild::pace::Pace;

/// Bytes each survivor sends per range: small enough that a range fits the bulk
/// connection's send buffer, so the survivor hands it all to the kernel under its read
/// lock and copies none of it out; large enough that per-range costs stay small. Measured
/// at 4x rows, two runs each (issue 23): 8 MiB 783-827 MB/s and 0.87-0.91 core-seconds per
/// GB rebuilt, 4 MiB 882-899 and 0.81-0.83, 2 MiB 934-1009 and 0.70-0.71, 1 MiB 777-811 and
/// 0.78-0.79.
const RANGE_BYTES: usize = 2 << 20;

/// One survivor's answer to a cycle range.
struct CycleAnswer {
    server: usize,
    rows: Rows,
    applied: (u64, Vec<u64>),
}

/// A survivor's rows of a range: inside its RPC reply, or read from its bulk port into a
/// pooled buffer (data rows, then parity rows).
enum Rows {
    Rpc { data: Bytes, parity: Bytes },
    Bulk { rows: Vec<u8>, data_len: usize },
}

impl CycleAnswer {
    fn data(&self) -> &[u8] {
        match &self.rows {
            Rows::Rpc { data, .. } => data,
            Rows::Bulk { rows, data_len } => &rows[..*data_len],
        }
    }

    fn parity(&self) -> &[u8] {
        match &self.rows {
            Rows::Rpc { parity, .. } => parity,
            Rows::Bulk { rows, data_len } => &rows[*data_len..],
        }
    }
}

/// Range-sized buffers a rebuild reuses: a fresh range-sized allocation can be a fresh mapping,
/// and zeroing and faulting its pages in cost the replacement more than decoding did
/// (perf, issue 23).
#[derive(Default)]
pub(crate) struct Buffers(std::sync::Mutex<Vec<Vec<u8>>>);

impl Buffers {
    /// A pooled buffer, its contents unspecified (a bulk claim clears it and reads into its
    /// spare capacity, so its pages are mapped already).
    fn take(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn give(&self, rows: Vec<u8>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(rows);
    }

    fn give_answers(&self, answers: Vec<CycleAnswer>) {
        let mut pool = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for answer in answers {
            if let Rows::Bulk { rows, .. } = answer.rows {
                pool.push(rows);
            }
        }
    }
}

/// A cycle range of one table, with where its slots are.
struct CycleRange {
    table: usize,
    cycles: std::ops::Range<usize>,
    data: std::ops::Range<usize>,
    parity: std::ops::Range<usize>,
}

/// What one range took: bytes installed and snapshots read again.
#[derive(Default, Clone, Copy)]
pub(crate) struct RangeCost {
    pub bytes: u64,
    pub rereads: u64,
}

/// Decodes every row this server holds in `range` and `pending` names (`true`: a parity
/// slot; slots counted from the range's first) from the answers, into `data_out` and
/// `parity_out` (whole rows from the range's first data and parity slot: the table's own
/// bytes). `by_server[s]` is survivor `s`'s answer.
#[allow(clippy::too_many_arguments)]
fn decode_cycles(
    codec: &Codec,
    shape: &[CycleStripe],
    range: &CycleRange,
    by_server: &[Option<&CycleAnswer>],
    row_bytes: usize,
    data_out: &mut [u8],
    parity_out: &mut [u8],
    pending: &dyn Fn(bool, usize) -> bool,
) -> Result<(), String> {
    let (k, r) = (codec.k(), codec.r());
    let mut sources: Vec<Option<&[u8]>> = Vec::with_capacity(k + r);
    for c in range.cycles.clone() {
        let at = c - range.cycles.start;
        for stripe in shape {
            let mine = stripe.rows[stripe.mine];
            let (out, slot) = if mine.parity {
                (&mut *parity_out, at * r + mine.offset)
            } else {
                (&mut *data_out, at * k + mine.offset)
            };
            // Installed already (a pull or push decoded it on demand): newer than this
            // snapshot, perhaps, and not to be written over.
            if !pending(mine.parity, slot) {
                continue;
            }
            // The last cycle may end inside the table's slots: nothing to decode there.
            let Some(out) = out.get_mut(slot * row_bytes..(slot + 1) * row_bytes) else {
                continue;
            };
            sources.clear();
            for (y, row) in stripe.rows.iter().enumerate() {
                if y == stripe.mine {
                    sources.push(None);
                    continue;
                }
                let answer = by_server.get(row.server).copied().flatten();
                let (bytes, slot) = match answer {
                    Some(a) if row.parity => (a.parity(), at * r + row.offset),
                    Some(a) => (a.data(), at * k + row.offset),
                    None => {
                        sources.push(None);
                        continue;
                    }
                };
                sources.push(bytes.get(slot * row_bytes..(slot + 1) * row_bytes));
            }
            // The common case (XOR, only this row missing): the XOR of the others, with
            // no allocation per row.
            let xor_only = r == 1
                && sources
                    .iter()
                    .enumerate()
                    .all(|(y, s)| y == stripe.mine || s.is_some());
            if xor_only {
                // One pass for the first two (k >= 1, so r = 1 gives at least two
                // others unless k = 1, a copy).
                let mut others = sources.iter().flatten();
                match (others.next(), others.next()) {
                    (Some(a), Some(b)) => ftrec_ec::xor_into(a, b, out),
                    (Some(a), None) => out.copy_from_slice(a),
                    _ => {}
                }
                for row in others {
                    ftrec_ec::fold_with(1, row, out);
                }
            } else {
                decode_row(codec, |n| sources[n], stripe.mine, out).map_err(|e| {
                    format!(
                        "table {} cycle {c} stripe {} of the cycle: {e}",
                        range.table, stripe.stripe_in_cycle
                    )
                })?;
            }
        }
    }
    Ok(())
}

impl Core {
    /// A survivor's rows of a range, with its steps: over its bulk port (a pooled
    /// connection, or one opened with a ticket asked over RPC), or inside an RPC reply.
    #[allow(clippy::too_many_arguments)]
    async fn survivor_rows(
        &self,
        buffers: &Buffers,
        peers: &crate::ec::Peers,
        server: usize,
        epoch: u64,
        fresh: bool,
        range: &CycleRange,
        row_bytes: usize,
    ) -> Result<CycleAnswer, PsError> {
        let ask = RangeAsk {
            epoch,
            table: range.table as u32,
            data: range.data.start as u64..range.data.end as u64,
            parity: range.parity.start as u64..range.parity.end as u64,
        };
        let rpc =
            |e: tonic::Status, what: &str| PsError::rpc(format!("{what} server {server}"), &e);
        if let Some(bulk) = &self.rebuilding.bulk_client {
            let stream = match bulk.pooled(server) {
                Some(stream) => Some(stream),
                None => {
                    let mut client = peers.client(server, fresh, epoch).await?;
                    let reply = client
                        .fetch_slots(FetchSlotsRequest {
                            epoch,
                            bulk_session: true,
                            ..Default::default()
                        })
                        .await
                        .map_err(|s| rpc(s, "open a bulk session with"))?
                        .into_inner();
                    // A survivor without a bulk port answers inside its RPC replies.
                    match reply.bulk_ticket.is_empty() {
                        true => None,
                        false => {
                            let ticket = crate::bulk::ticket_of(&reply.bulk_ticket)?;
                            Some(bulk.open(&reply.bulk_address, ticket).await?)
                        }
                    }
                }
            };
            if let Some(mut stream) = stream {
                let mut rows = buffers.take();
                return match bulk.range(&mut stream, &ask, row_bytes, &mut rows).await {
                    Ok(answer) => {
                        bulk.keep(server, stream);
                        Ok(CycleAnswer {
                            server,
                            rows: Rows::Bulk {
                                rows,
                                data_len: answer.data_len,
                            },
                            applied: answer.applied,
                        })
                    }
                    // The connection goes with the error: the next range opens another.
                    Err(e) => {
                        buffers.give(rows);
                        Err(e)
                    }
                };
            }
        }
        let mut client = peers.client(server, fresh, epoch).await?;
        let reply = client
            .fetch_slots(FetchSlotsRequest {
                epoch,
                table: ask.table,
                ranges: true,
                data_first: ask.data.start,
                data_end: ask.data.end,
                parity_first: ask.parity.start,
                parity_end: ask.parity.end,
                ..Default::default()
            })
            .await
            .map_err(|s| rpc(s, "fetch cycles from"))?
            .into_inner();
        Ok(CycleAnswer {
            server,
            rows: Rows::Rpc {
                data: rows_as_asked(range.data.len(), reply.data, row_bytes)?,
                parity: rows_as_asked(range.parity.len(), reply.parity, row_bytes)?,
            },
            applied: (reply.applied_below, reply.applied_ahead),
        })
    }

    /// Decodes a consistent snapshot's range straight into the table if this server holds
    /// the snapshot's steps too; `None` if it does not (a commit landed here meanwhile).
    fn decode_and_install(
        &self,
        background: &Background,
        shape: &[CycleStripe],
        range: &CycleRange,
        answers: &[CycleAnswer],
        applied: &(u64, Vec<u64>),
        row_bytes: usize,
    ) -> Result<Option<u64>, PsError> {
        let me = self.id;
        let mut by_server: Vec<Option<&CycleAnswer>> = vec![None; self.layout.servers()];
        for a in answers {
            by_server[a.server] = Some(a);
        }
        let mut shard = self.pipeline.shard_write()?;
        // A restore or a newer rebuild replaced the pending set this range was read for.
        if self.rebuilding.background().map(|b| b.id) != Some(background.id) {
            return Err(PsError::Superseded(format!(
                "server {me}: background rebuild (a restore or a newer rebuild)"
            )));
        }
        let mine = {
            let steps = self.pipeline.steps();
            (steps.low(), steps.ahead().collect::<Vec<_>>())
        };
        if mine != *applied {
            return Ok(None);
        }
        // Under the write lock, which a commit waits for: an XOR of the range into the
        // table takes about as long as the copy of a decoded buffer it replaces (1-2 ms
        // per 8 MiB here, measured with 8 MiB ranges). CPU work, so off the runtime's other tasks.
        self.job
            .network()
            .in_place(|| {
                shard.install_decoding_ranges(
                    range.table,
                    range.data.clone(),
                    range.parity.clone(),
                    |data_out, parity_out, pending| {
                        decode_cycles(
                            &background.codec,
                            shape,
                            range,
                            &by_server,
                            row_bytes,
                            data_out,
                            parity_out,
                            pending,
                        )
                        .map_err(|e| PsError::Degraded(format!("server {me}: cannot decode: {e}")))
                    },
                )
            })
            .map(Some)
    }

    /// Decodes and installs the pending slots of cycles `range.cycles` of a table from
    /// one consistent snapshot of every survivor's same cycles, reading again until one is.
    async fn materialize_cycles(
        &self,
        range: CycleRange,
        buffers: &Buffers,
    ) -> Result<RangeCost, PsError> {
        let Some(background) = self.rebuilding.background() else {
            return Ok(RangeCost::default());
        };
        let Some(stripes) = self.layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        let table = range.table;
        {
            let shard = self.pipeline.shard_read()?;
            let Some(pending) = shard.pending() else {
                return Ok(RangeCost::default());
            };
            if !pending.any_data_in(table, range.data.clone())
                && !pending.any_parity_in(table, range.parity.clone())
            {
                // Pulls and pushes decoded all of it already.
                return Ok(RangeCost::default());
            }
        }
        let me = self.id;
        let (group, _) = stripes.group_of_server(me);
        let (first, members) = stripes.group(group);
        let survivors: Vec<usize> = (first..first + members)
            .filter(|&s| s != me && !background.lost.contains(&s))
            .collect();
        let shape = stripes.cycle_shape(table, me);
        let row_bytes = self.job.config.model_config()?.row_stride() * 4;
        let Some(peers) = self.rebuilding.peers.clone() else {
            return Err(PsError::Config("no peers to rebuild from".into()));
        };
        let mut rounds = Rounds::new(self, false);
        loop {
            let attempt = rounds.next(self).await;
            let epoch = self.pipeline.live().epoch;
            // The placement map is fetched again only after a survivor could not be
            // reached (a new epoch refreshes it anyway): a snapshot read again because a
            // commit straddled it must not reconnect to every peer.
            let fresh = rounds.unreachable.any();
            let calls = survivors.iter().map(|&server| {
                self.survivor_rows(buffers, &peers, server, epoch, fresh, &range, row_bytes)
            });
            let what = || format!("server {me}: rebuild of table {table}");
            let sorted = Sorted::of(futures::future::join_all(calls).await, what)?;
            let unreachable = sorted.unreachable;
            let answers: Vec<CycleAnswer> = sorted.ok;
            rounds.unreachable.count(unreachable, what)?;
            // Every survivor's rows, of one snapshot: their steps agree. (A snapshot that
            // straddled a commit moved its bytes for nothing: with the rows sent straight
            // from the survivors' tables, the steps come with them.)
            let snapshot = answers.len() == survivors.len()
                && answers.windows(2).all(|w| w[0].applied == w[1].applied);
            if snapshot && let Some(applied) = answers.first().map(|a| a.applied.clone()) {
                let installed = self.decode_and_install(
                    &background,
                    &shape,
                    &range,
                    &answers,
                    &applied,
                    row_bytes,
                );
                buffers.give_answers(answers);
                if let Some(bytes) = installed? {
                    return Ok(RangeCost {
                        bytes,
                        rereads: u64::from(attempt - 1),
                    });
                }
            } else {
                buffers.give_answers(answers);
            }
            if rounds.expired() {
                return Err(PsError::Recovering {
                    table: table as u32,
                    first_row: range.data.start as u32,
                    end_row: range.data.end as u32,
                });
            }
            rounds.pause().await;
        }
    }

    /// The background part of a rebuild: every pending slot, cycle range by cycle range,
    /// at most `ec.rebuild_locks` ranges at once, paced against training's committed rate
    /// (`rebuild/pace.rs`: `failure_free_steps_per_sec` is the job's before the failure)
    /// and at most `ec.rebuild_bytes_per_sec`. `progress` hears of each table. Returns the
    /// bytes and slots installed.
    pub(crate) async fn rebuild_in_background(
        &self,
        tables: usize,
        started: Instant,
        totals: RebuildReply,
        failure_free_steps_per_sec: f64,
        progress: &tokio::sync::mpsc::Sender<Result<RebuildReply, tonic::Status>>,
    ) -> Result<RebuildReply, PsError> {
        // Rebuild first (`rebuild/boost.rs`), for as long as the rebuild runs, whatever its end.
        let boosted = self.rebuilding.boost.as_ref().map(|b| b.hold());
        let result = self
            .rebuild_ranges(
                tables,
                started,
                totals,
                failure_free_steps_per_sec,
                progress,
            )
            .await;
        if let Some(bulk) = &self.rebuilding.bulk_client {
            bulk.close_all();
        }
        drop(boosted);
        result
    }

    async fn rebuild_ranges(
        &self,
        tables: usize,
        started: Instant,
        mut totals: RebuildReply,
        failure_free_steps_per_sec: f64,
        progress: &tokio::sync::mpsc::Sender<Result<RebuildReply, tonic::Status>>,
    ) -> Result<RebuildReply, PsError> {
        use futures::StreamExt;
        let ec = &self.job.config.ec;
        let parallel = ec.rebuild_locks.max(1);
        let mut pace = Pace::new(
            failure_free_steps_per_sec,
            ec.rebuild_training_share,
            ec.rebuild_bytes_per_sec,
            Instant::now(),
            self.pipeline.live().applied,
            totals.bytes,
        );
        let mine = self.rebuilding.background().map(|b| b.id);
        let superseded = || {
            PsError::Superseded(format!(
                "server {}: background rebuild (a restore or a newer rebuild)",
                self.id
            ))
        };
        let Some(stripes) = self.layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        let (k, r) = (stripes.params.k, stripes.params.r);
        let global = self.job.config.model_config()?;
        let row_bytes = global.row_stride() * 4;
        let per = (RANGE_BYTES / ((k + r) * row_bytes).max(1)).max(1);
        let mut rereads = 0u64;
        let buffers = Buffers::default();
        for t in 0..tables {
            if self.rebuilding.background().map(|b| b.id) != mine {
                return Err(superseded());
            }
            let (data_slots, parity_slots) = stripes.capacity(self.id, global.table_rows[t]);
            let cycles = data_slots / k;
            let ranges = (0..cycles).step_by(per).map(|c0| {
                let c1 = (c0 + per).min(cycles);
                CycleRange {
                    table: t,
                    cycles: c0..c1,
                    data: c0 * k..(c1 * k).min(data_slots),
                    parity: c0 * r..(c1 * r).min(parity_slots),
                }
            });
            let mut done = futures::stream::iter(ranges)
                .map(|range| self.materialize_cycles(range, &buffers))
                .buffer_unordered(parallel);
            while let Some(cost) = done.next().await {
                let cost = cost?;
                rereads += cost.rereads;
                totals.bytes += cost.bytes;
                totals.rows += cost.bytes / row_bytes as u64;
                let wait = pace.after(Instant::now(), totals.bytes, self.pipeline.live().applied);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
            self.faults.kill_at(points::REBUILD, None);
            totals.tables_done = t as u32 + 1;
            totals.seconds = started.elapsed().as_secs_f64();
            let _ = progress.try_send(Ok(totals));
        }
        // Slots decoded on demand by pulls and pushes meanwhile were installed by them:
        // the shard holds no pending slot now.
        if self.pipeline.shard_read()?.pending().is_some() {
            return Err(PsError::Internal(
                "background rebuild ended with slots still pending".into(),
            ));
        }
        if !self.rebuilding.finish_background(mine) {
            return Err(superseded());
        }
        self.ckpt.continue_history()?;
        totals.done = true;
        totals.serving = true;
        totals.seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            "rebuilt {} bytes in the background in {:.3} s ({:.0} MB/s); snapshots read again: {rereads}; paced back {} times (training against {:.1} failure-free steps/s)",
            totals.bytes,
            totals.seconds,
            totals.bytes as f64 / totals.seconds.max(1e-9) / 1e6,
            pace.backoffs,
            failure_free_steps_per_sec,
        );
        Ok(totals)
    }
}
