//! A replacement that serves at once and rebuilds in the background (ECRec §3.4 without
//! a pause). Its slots start *pending*; a pull or push that needs a pending row decodes
//! that row's stripe on demand, and a background task decodes the rest range by range.
//!
//! Every decode reads a *consistent snapshot* of the stripe: each survivor answers its
//! slots together with the steps it has applied, under one read lock (`FetchSlots`), and
//! the decoded bytes are installed only if every survivor read *and this server* hold the
//! same steps at that moment (checked under this shard's write lock). Under two-phase
//! commit a server's rows, the parity differences it folded and its applied steps change
//! together at commit, so equal applied steps mean the data rows and parity rows read
//! include exactly the same updates, and the decoded row is bit-identical to the lost
//! one. A snapshot that straddles a commit is read again. A parity slot installed this
//! way folds every later step's difference from then on; differences of the steps before
//! it are in the data rows it was encoded from (a pending parity slot folds nothing).
//!
//! This is optimistic validation rather than ECRec's locked ranges: no update is ever
//! held back or buffered for the rebuild; `ec.rebuild_locks` bounds how many ranges are
//! decoded at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use ftrec_ec::Codec;

mod background;
mod fetch;

use crate::Core;
use ftrec_proto::PsError;
use ftrec_proto::proto::*;
use ftrec_proto::wire::u32s_to_bytes;

/// A background rebuild in progress on this server.
#[derive(Clone, Debug)]
pub(super) struct Background {
    /// Which rebuild this is (a retried recovery sends the same epoch again): a restore
    /// or a newer rebuild supersedes it.
    pub id: u64,
    /// Slots not to read from: lost together with this one (their replacements rebuild
    /// too). A survivor that fails to answer is also left out, for that attempt.
    pub lost: Vec<usize>,
    pub codec: Arc<Codec>,
}

/// Snapshot attempts before a decode takes the commit turn to let the stripe settle.
const SETTLE_AFTER: u32 = 8;

/// What one survivor answered: its data and parity slots as asked, row after row, and its
/// applied steps.
struct Answer {
    server: usize,
    data: Bytes,
    parity: Bytes,
    applied: (u64, Vec<u64>),
}

/// Where row `n` of a stripe is found in the answers: the survivor, whether it is one of
/// its parity slots, and its position in what that survivor was asked for.
#[derive(Clone, Copy)]
struct Held {
    server: usize,
    parity: bool,
    position: usize,
}

impl Answer {
    fn row(&self, held: Held, row_bytes: usize) -> Option<&[u8]> {
        let rows = if held.parity {
            &self.parity
        } else {
            &self.data
        };
        rows.get(held.position * row_bytes..(held.position + 1) * row_bytes)
    }
}

/// One slot of this server to decode: stripe `j`, its position `index` in the stripe
/// (data rows first, then parity rows), and its local slot.
#[derive(Clone, Copy)]
struct Need {
    stripe: usize,
    index: usize,
    local: u32,
    parity: bool,
}

/// Decodes row `index` of a stripe of `k + r` rows from the present ones into `out`.
pub(super) fn decode_row<'a>(
    codec: &Codec,
    row_of: impl Fn(usize) -> Option<&'a [u8]>,
    index: usize,
    out: &mut [u8],
) -> Result<(), String> {
    let (k, r) = (codec.k(), codec.r());
    // The XOR code with only this row missing (the common case: one server lost): the
    // XOR of the others, in place, without allocating.
    if r == 1 && (0..k + r).all(|n| n == index || row_of(n).is_some()) {
        out.fill(0);
        for n in (0..k + r).filter(|&n| n != index) {
            if let Some(row) = row_of(n) {
                ftrec_ec::fold_with(1, row, out);
            }
        }
        return Ok(());
    }
    let mut shards: Vec<Option<Vec<u8>>> =
        (0..k + r).map(|n| row_of(n).map(<[u8]>::to_vec)).collect();
    shards[index] = None;
    codec.reconstruct(&mut shards).map_err(|e| e.to_string())?;
    let row = shards[index].take().ok_or("not decoded")?;
    out.copy_from_slice(&row);
    Ok(())
}

impl Core {
    /// Ends any background rebuild (a restore replaced the whole shard).
    pub(super) fn cancel_background(&self) {
        *self.background.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub(super) fn background(&self) -> Option<Background> {
        self.background
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Decodes and installs the pending rows among the global rows of each table (a pull
    /// or a push needs them now), every table at once. Returns the bytes installed.
    /// `holds_turn`: the caller holds this server's commit turn already (a prepare).
    pub(super) async fn materialize_tables(
        &self,
        wanted: &[(usize, Vec<u32>)],
        holds_turn: bool,
    ) -> Result<u64, PsError> {
        let pending: Vec<(usize, Vec<u32>)> = {
            let shard = self.shard_read()?;
            if shard.pending().is_none() {
                return Ok(0);
            }
            wanted
                .iter()
                .map(|(table, rows)| (*table, shard.pending_locals(*table, rows)))
                .filter(|(_, locals)| !locals.is_empty())
                .collect()
        };
        let decodes = pending
            .into_iter()
            .map(|(table, locals)| self.materialize(table, locals, Vec::new(), holds_turn));
        futures::future::try_join_all(decodes)
            .await
            .map(|bytes| bytes.into_iter().sum())
    }

    /// Decodes pending data slots `data` and parity slots `parity` of `table` from a
    /// consistent snapshot of their stripes (module docs), reading again until one is.
    async fn materialize(
        &self,
        table: usize,
        data: Vec<u32>,
        parity: Vec<u32>,
        holds_turn: bool,
    ) -> Result<u64, PsError> {
        let Some(background) = self.background() else {
            return Ok(0);
        };
        let Some(stripes) = self.layout.stripes() else {
            return Err(PsError::Config(
                "degraded reads without erasure coding".into(),
            ));
        };
        let (k, r) = (stripes.params.k, stripes.params.r);
        let global = self.job.config.model_config()?;
        let rows = global
            .table_rows
            .get(table)
            .copied()
            .ok_or_else(|| PsError::BadRequest(format!("table {table} does not exist")))?;
        let row_bytes = global.row_stride() * 4;
        let me = self.id;
        let needs: Vec<Need> = data
            .iter()
            .filter_map(|&local| {
                let (stripe, index) = stripes.data_at(table, me, local as usize, rows)?;
                Some(Need {
                    stripe,
                    index,
                    local,
                    parity: false,
                })
            })
            .chain(parity.iter().filter_map(|&local| {
                let (stripe, p) = stripes.parity_at(table, me, local as usize, rows)?;
                Some(Need {
                    stripe,
                    index: k + p,
                    local,
                    parity: true,
                })
            }))
            .collect();
        // Every other slot of those stripes, by holder.
        let slot = |j: usize, n: usize| {
            if n < k {
                stripes.data_slot(table, j, n)
            } else {
                stripes.parity_slot(table, j, n - k)
            }
        };
        // Each stripe's layout is worked out once, here: where each of its rows will be in
        // the answers. (Working it out again per row read, with a map of the answered rows,
        // took about 45% of a replacement's CPU during a rebuild; perf, issue 23.)
        let mut asks: BTreeMap<usize, (Vec<u32>, Vec<u32>)> = BTreeMap::new();
        let mut stripes_held: std::collections::HashMap<usize, Vec<Option<Held>>> =
            std::collections::HashMap::with_capacity(needs.len());
        for need in &needs {
            let std::collections::hash_map::Entry::Vacant(entry) = stripes_held.entry(need.stripe)
            else {
                continue;
            };
            let held = (0..k + r)
                .map(|n| {
                    let s = slot(need.stripe, n);
                    if s.server == me || background.lost.contains(&s.server) {
                        return None;
                    }
                    let asked = asks.entry(s.server).or_default();
                    let list = if n < k { &mut asked.0 } else { &mut asked.1 };
                    list.push(s.local as u32);
                    Some(Held {
                        server: s.server,
                        parity: n >= k,
                        position: list.len() - 1,
                    })
                })
                .collect();
            entry.insert(held);
        }
        let Some(peers) = self.peers.clone() else {
            return Err(PsError::Config("no peers to decode from".into()));
        };
        let mut rounds = Rounds::new(self, holds_turn);
        loop {
            let attempt = rounds.next(self).await;
            let epoch = self.live().epoch;
            let calls = asks.iter().map(|(&server, (d, p))| {
                let peers = peers.clone();
                let req = FetchSlotsRequest {
                    epoch,
                    table: table as u32,
                    data: u32s_to_bytes(d),
                    parity: u32s_to_bytes(p),
                    ..Default::default()
                };
                let (d_len, p_len) = (d.len(), p.len());
                async move {
                    let mut client = peers.client(server, attempt > 1, epoch).await?;
                    let reply = client
                        .fetch_slots(req)
                        .await
                        .map_err(|s| PsError::rpc(format!("fetch slots from server {server}"), &s))?
                        .into_inner();
                    Ok::<_, PsError>(Answer {
                        server,
                        data: rows_as_asked(d_len, reply.data, row_bytes)?,
                        parity: rows_as_asked(p_len, reply.parity, row_bytes)?,
                        applied: (reply.applied_below, reply.applied_ahead),
                    })
                }
            });
            let what = || format!("server {me}: degraded read of table {table}");
            let sorted = Sorted::of(futures::future::join_all(calls).await, what)?;
            rounds.unreachable.count(sorted.unreachable, what)?;
            let answers: Vec<Answer> = sorted.ok;
            let consistent = answers.windows(2).all(|w| w[0].applied == w[1].applied);
            if consistent && let Some(applied) = answers.first().map(|a| a.applied.clone()) {
                let by_server: BTreeMap<usize, &Answer> =
                    answers.iter().map(|a| (a.server, a)).collect();
                let mut decoded: Vec<(Need, Vec<u8>)> = Vec::with_capacity(needs.len());
                let mut failed = None;
                for need in &needs {
                    let held = &stripes_held[&need.stripe];
                    let row_of = |n: usize| {
                        let held = held[n]?;
                        by_server.get(&held.server)?.row(held, row_bytes)
                    };
                    let mut out = vec![0u8; row_bytes];
                    match decode_row(&background.codec, row_of, need.index, &mut out) {
                        Ok(()) => decoded.push((*need, out)),
                        Err(e) => {
                            failed = Some(format!(
                                "table {table} stripe {}: {e} (answered: {:?})",
                                need.stripe,
                                by_server.keys().collect::<Vec<_>>()
                            ));
                            break;
                        }
                    }
                }
                if failed.is_none() {
                    let mut shard = self.shard_write()?;
                    let mine = {
                        let steps = self.steps();
                        (steps.low(), steps.ahead().collect::<Vec<_>>())
                    };
                    if mine == applied {
                        let data: Vec<(u32, &[u8])> = decoded
                            .iter()
                            .filter(|(n, _)| !n.parity)
                            .map(|(n, b)| (n.local, b.as_slice()))
                            .collect();
                        let parity: Vec<(u32, &[u8])> = decoded
                            .iter()
                            .filter(|(n, _)| n.parity)
                            .map(|(n, b)| (n.local, b.as_slice()))
                            .collect();
                        return shard.install_decoded(table, &data, &parity);
                    }
                } else if rounds.expired() {
                    return Err(PsError::Degraded(format!(
                        "server {me}: cannot decode: {}",
                        failed.unwrap_or_default()
                    )));
                }
            }
            if rounds.expired() {
                return Err(PsError::Recovering {
                    table: table as u32,
                    first_row: data.first().or(parity.first()).copied().unwrap_or(0),
                    end_row: data.last().or(parity.last()).map_or(0, |l| l + 1),
                });
            }
            // A commit landed between the reads: read again shortly.
            rounds.pause().await;
        }
    }
}

/// Reads in a row in which some survivor could not be reached before a degraded read
/// gives up and says which: its calls have each waited out their own deadline already.
const SURVIVOR_ATTEMPTS: u32 = 3;

/// One round of calls to the survivors, sorted: the answers, and a survivor that could
/// not be reached (if any).
pub(super) struct Sorted<T> {
    pub ok: Vec<T>,
    pub unreachable: Option<PsError>,
}

impl<T> Sorted<T> {
    /// A survivor that refuses for good ends the read now, named in the error (`what`
    /// says whose read), not after the read's whole deadline; a busy one (rebuilding
    /// itself, overloaded) is asked again.
    pub(super) fn of(
        results: Vec<Result<T, PsError>>,
        what: impl Fn() -> String,
    ) -> Result<Self, PsError> {
        let mut sorted = Self {
            ok: Vec::with_capacity(results.len()),
            unreachable: None,
        };
        for result in results {
            match result {
                Ok(a) => sorted.ok.push(a),
                Err(e) if !e.is_retryable() => {
                    return Err(PsError::Degraded(format!("{}: {e}", what())));
                }
                Err(e @ PsError::Unavailable(_)) => sorted.unreachable = Some(e),
                Err(e) => tracing::debug!("{}: {e}", what()),
            }
        }
        Ok(sorted)
    }
}

/// The rounds of a read that must see one consistent snapshot of its stripes, degraded
/// read or rebuild range alike: a deadline, and the commit turn taken once the snapshot
/// kept straddling commits. Under steady commits a snapshot may keep straddling one; after
/// [`SETTLE_AFTER`] rounds this server's commit turn is taken, which stops new steps here
/// and so (each step needs every server) everywhere: the survivors then settle on this
/// server's steps.
pub(super) struct Rounds {
    give_up: Instant,
    attempt: u32,
    /// The caller holds the commit turn already (a prepare).
    holds_turn: bool,
    turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    pub unreachable: Unreachable,
}

impl Rounds {
    pub(super) fn new(core: &Core, holds_turn: bool) -> Self {
        Self {
            give_up: Instant::now() + core.job.timeout() * 4,
            attempt: 0,
            holds_turn,
            turn: None,
            unreachable: Unreachable::default(),
        }
    }

    /// Starts the next round; returns its number, from 1.
    pub(super) async fn next(&mut self, core: &Core) -> u32 {
        self.attempt += 1;
        if self.attempt > SETTLE_AFTER && !self.holds_turn && self.turn.is_none() {
            self.turn = Some(core.commit_turn.clone().lock_owned().await);
        }
        self.attempt
    }

    pub(super) fn expired(&self) -> bool {
        Instant::now() > self.give_up
    }

    /// Waits before the next round: a commit landed between the reads (or a survivor
    /// was busy).
    pub(super) async fn pause(&self) {
        tokio::time::sleep(Duration::from_micros(200 * u64::from(self.attempt.min(25)))).await;
    }
}

/// Rounds in a row in which a survivor could not be reached.
#[derive(Default)]
pub(super) struct Unreachable(u32);

impl Unreachable {
    /// Whether the last round had a survivor that could not be reached.
    pub(super) fn any(&self) -> bool {
        self.0 > 0
    }

    /// Counts a round; the error once [`SURVIVOR_ATTEMPTS`] rounds in a row had one.
    pub(super) fn count(
        &mut self,
        unreachable: Option<PsError>,
        what: impl Fn() -> String,
    ) -> Result<(), PsError> {
        match unreachable {
            Some(e) if self.0 + 1 >= SURVIVOR_ATTEMPTS => {
                Err(PsError::Unavailable(format!("{}: {e}", what())))
            }
            Some(_) => {
                self.0 += 1;
                Ok(())
            }
            None => {
                self.0 = 0;
                Ok(())
            }
        }
    }
}

/// `bytes` as the rows of `asked` slots, checked for length.
pub(super) fn rows_as_asked(
    asked: usize,
    bytes: Bytes,
    row_bytes: usize,
) -> Result<Bytes, PsError> {
    if bytes.len() != asked * row_bytes {
        return Err(PsError::BadRequest(format!(
            "{} bytes for {asked} slots of {row_bytes} bytes",
            bytes.len()
        )));
    }
    Ok(bytes)
}

impl Core {
    /// Waits (bounded) until no slot is pending: whole-shard reads (gathering the model,
    /// verifying parity, a cut) must not see a slot's zeros.
    pub(super) async fn wait_rebuilt(&self) -> Result<(), PsError> {
        let give_up = Instant::now() + self.job.timeout() * 30;
        while self.shard_read()?.pending().is_some() {
            if Instant::now() > give_up {
                return Err(PsError::Unavailable(format!(
                    "server {} is still rebuilding its slots",
                    self.id
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }
}
