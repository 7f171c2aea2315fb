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
use ftrec_proto::proto::*;
use ftrec_proto::wire::u32s_to_bytes;
use ftrec_rpc::PsError;

/// A background rebuild in progress on this server.
#[derive(Clone, Debug)]
pub(crate) struct Background {
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

/// What one survivor answered: per table asked, in the order asked, its data and parity
/// slots row after row; and its applied steps.
struct Answer {
    server: usize,
    tables: Vec<(Bytes, Bytes)>,
    applied: (u64, Vec<u64>),
}

/// Where row `n` of a stripe is found in the answers: the survivor, the table's index in
/// what it was asked, whether it is one of its parity slots, and its position there.
#[derive(Clone, Copy)]
struct Held {
    server: usize,
    table: usize,
    parity: bool,
    position: usize,
}

impl Answer {
    /// A reply checked against the slot counts asked, per table (`lens`).
    fn of(
        server: usize,
        reply: FetchSlotsReply,
        lens: &[(usize, usize)],
        row_bytes: usize,
    ) -> Result<Self, PsError> {
        if reply.more_tables.len() + 1 != lens.len() {
            return Err(PsError::BadRequest(format!(
                "server {server} answered {} tables of {}",
                reply.more_tables.len() + 1,
                lens.len()
            )));
        }
        let applied = (reply.applied_below, reply.applied_ahead);
        let answered = std::iter::once((reply.data, reply.parity))
            .chain(reply.more_tables.into_iter().map(|t| (t.data, t.parity)));
        let tables = answered
            .zip(lens)
            .map(|((data, parity), &(d, p))| {
                Ok((
                    rows_as_asked(d, data, row_bytes)?,
                    rows_as_asked(p, parity, row_bytes)?,
                ))
            })
            .collect::<Result<_, PsError>>()?;
        Ok(Self {
            server,
            tables,
            applied,
        })
    }

    fn row(&self, held: Held, row_bytes: usize) -> Option<&[u8]> {
        let (data, parity) = self.tables.get(held.table)?;
        let rows = if held.parity { parity } else { data };
        rows.get(held.position * row_bytes..(held.position + 1) * row_bytes)
    }
}

/// One data slot of this server to decode: of `table`, stripe `j`, its position `index`
/// in the stripe, and its local slot.
#[derive(Clone, Copy)]
struct Need {
    table: usize,
    stripe: usize,
    index: usize,
    local: u32,
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
    /// Decodes and installs the pending rows among the global rows of each table (a pull
    /// or a push needs them now), every table from one snapshot: one `FetchSlots` per
    /// survivor carries every table's slots (26 calls per survivor per pull on `tiny`,
    /// one per table, were what a step paid while the rebuild ran; issue 23). Returns the
    /// bytes installed. `holds_turn`: the caller holds this server's commit turn already
    /// (a prepare).
    pub(super) async fn materialize_tables(
        &self,
        wanted: &[(usize, Vec<u32>)],
        holds_turn: bool,
    ) -> Result<u64, PsError> {
        let pending: Vec<(usize, Vec<u32>)> = {
            let shard = self.pipeline.shard_read()?;
            if shard.pending().is_none() {
                return Ok(0);
            }
            wanted
                .iter()
                .map(|(table, rows)| (*table, shard.pending_locals(*table, rows)))
                .filter(|(_, locals)| !locals.is_empty())
                .collect()
        };
        if pending.is_empty() {
            return Ok(0);
        }
        self.materialize(pending, holds_turn).await
    }

    /// Decodes pending data slots of several tables (`(table, locals)`) from one consistent
    /// snapshot of their stripes (module docs), reading again until one is.
    async fn materialize(
        &self,
        wanted: Vec<(usize, Vec<u32>)>,
        holds_turn: bool,
    ) -> Result<u64, PsError> {
        let Some(background) = self.rebuilding.background() else {
            return Ok(0);
        };
        let Some(stripes) = self.layout.stripes() else {
            return Err(PsError::Config(
                "degraded reads without erasure coding".into(),
            ));
        };
        let global = self.job.config.model_config()?;
        let row_bytes = global.row_stride() * 4;
        let me = self.id;
        let mut needs: Vec<Need> = Vec::new();
        for (table, locals) in &wanted {
            let rows = global
                .table_rows
                .get(*table)
                .copied()
                .ok_or_else(|| PsError::BadRequest(format!("table {table} does not exist")))?;
            needs.extend(locals.iter().filter_map(|&local| {
                let (stripe, index) = stripes.data_at(*table, me, local as usize, rows)?;
                Some(Need {
                    table: *table,
                    stripe,
                    index,
                    local,
                })
            }));
        }
        let (asks, stripes_held) = plan_reads(stripes, me, &background.lost, &needs);
        let Some(peers) = self.rebuilding.peers.clone() else {
            return Err(PsError::Config("no peers to decode from".into()));
        };
        let tables_named = || {
            wanted
                .iter()
                .map(|(t, _)| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut rounds = Rounds::new(self, holds_turn);
        loop {
            let attempt = rounds.next(self).await;
            let epoch = self.pipeline.live().epoch;
            let calls = asks.iter().map(|(&server, asked)| {
                let peers = peers.clone();
                let req = asked.request(epoch);
                let lens: Vec<(usize, usize)> =
                    asked.0.iter().map(|(_, d, p)| (d.len(), p.len())).collect();
                async move {
                    let mut client = peers.client(server, attempt > 1, epoch).await?;
                    let reply = client
                        .fetch_slots(req)
                        .await
                        .map_err(|s| PsError::rpc(format!("fetch slots from server {server}"), &s))?
                        .into_inner();
                    Answer::of(server, reply, &lens, row_bytes)
                }
            });
            let what = || format!("server {me}: degraded read of tables {}", tables_named());
            let sorted = Sorted::of(futures::future::join_all(calls).await, what)?;
            rounds.unreachable.count(sorted.unreachable, what)?;
            let answers: Vec<Answer> = sorted.ok;
            let consistent = answers.windows(2).all(|w| w[0].applied == w[1].applied);
            if consistent && let Some(applied) = answers.first().map(|a| a.applied.clone()) {
                let snapshot = Snapshot {
                    answers: &answers,
                    applied,
                    row_bytes,
                };
                match self.decode_snapshot(
                    &background,
                    &snapshot,
                    &needs,
                    &stripes_held,
                    &wanted,
                )? {
                    Decoded::Installed(installed) => return Ok(installed),
                    Decoded::Failed(failed) if rounds.expired() => {
                        return Err(PsError::Degraded(format!(
                            "server {me}: cannot decode: {failed}"
                        )));
                    }
                    Decoded::Failed(_) | Decoded::Moved => {}
                }
            }
            if rounds.expired() {
                let (table, locals) = &wanted[0];
                return Err(PsError::Recovering {
                    table: *table as u32,
                    first_row: locals.first().copied().unwrap_or(0),
                    end_row: locals.last().map_or(0, |l| l + 1),
                });
            }
            // A commit landed between the reads: read again shortly.
            rounds.pause().await;
        }
    }
}

/// Where each stripe's rows will be in the survivors' answers, by `(table, stripe)`.
type StripesHeld = std::collections::HashMap<(usize, usize), Vec<Option<Held>>>;

/// What a degraded read asks each survivor for, and where each needed stripe's rows
/// will be in the answers. Each stripe's layout is worked out once, here. (Working it out
/// again per row read, with a map of the answered rows, took about 45% of a
/// replacement's CPU during a rebuild; perf, issue 23.)
fn plan_reads(
    stripes: ftrec_ec::StripeLayout,
    me: usize,
    lost: &[usize],
    needs: &[Need],
) -> (BTreeMap<usize, Asked>, StripesHeld) {
    let (k, r) = (stripes.params.k, stripes.params.r);
    // Every other slot of those stripes, by holder and table.
    let slot = |table: usize, j: usize, n: usize| {
        if n < k {
            stripes.data_slot(table, j, n)
        } else {
            stripes.parity_slot(table, j, n - k)
        }
    };
    let mut asks: BTreeMap<usize, Asked> = BTreeMap::new();
    let mut stripes_held: StripesHeld = std::collections::HashMap::with_capacity(needs.len());
    for need in needs {
        let std::collections::hash_map::Entry::Vacant(entry) =
            stripes_held.entry((need.table, need.stripe))
        else {
            continue;
        };
        let held = (0..k + r)
            .map(|n| {
                let s = slot(need.table, need.stripe, n);
                if s.server == me || lost.contains(&s.server) {
                    return None;
                }
                let asked = asks.entry(s.server).or_default().table(need.table);
                let list = if n < k { asked.1 } else { asked.2 };
                list.push(s.local as u32);
                Some(Held {
                    server: s.server,
                    table: asked.0,
                    parity: n >= k,
                    position: list.len() - 1,
                })
            })
            .collect();
        entry.insert(held);
    }
    (asks, stripes_held)
}

/// The survivors' answers of one round, which agree on the steps `applied`.
struct Snapshot<'a> {
    answers: &'a [Answer],
    applied: (u64, Vec<u64>),
    row_bytes: usize,
}

/// What became of decoding one consistent snapshot.
enum Decoded {
    /// Decoded and installed: this many bytes.
    Installed(u64),
    /// Some stripe could not be decoded from the answers (why).
    Failed(String),
    /// Decoded, but this server's steps moved past the snapshot's: read again.
    Moved,
}

impl Core {
    /// Decodes every need from a consistent snapshot and installs the rows, under the
    /// shard's write lock, if this server holds the snapshot's steps too.
    fn decode_snapshot(
        &self,
        background: &Background,
        snapshot: &Snapshot<'_>,
        needs: &[Need],
        stripes_held: &StripesHeld,
        wanted: &[(usize, Vec<u32>)],
    ) -> Result<Decoded, PsError> {
        let row_bytes = snapshot.row_bytes;
        let by_server: BTreeMap<usize, &Answer> =
            snapshot.answers.iter().map(|a| (a.server, a)).collect();
        let mut decoded: Vec<(Need, Vec<u8>)> = Vec::with_capacity(needs.len());
        for need in needs {
            let held = &stripes_held[&(need.table, need.stripe)];
            let row_of = |n: usize| {
                let held = held[n]?;
                by_server.get(&held.server)?.row(held, row_bytes)
            };
            let mut out = vec![0u8; row_bytes];
            match decode_row(&background.codec, row_of, need.index, &mut out) {
                Ok(()) => decoded.push((*need, out)),
                Err(e) => {
                    return Ok(Decoded::Failed(format!(
                        "table {} stripe {}: {e} (answered: {:?})",
                        need.table,
                        need.stripe,
                        by_server.keys().collect::<Vec<_>>()
                    )));
                }
            }
        }
        let mut shard = self.pipeline.shard_write()?;
        let mine = {
            let steps = self.pipeline.steps();
            (steps.low(), steps.ahead().collect::<Vec<_>>())
        };
        if mine != snapshot.applied {
            return Ok(Decoded::Moved);
        }
        let mut installed = 0;
        for (table, _) in wanted {
            let rows: Vec<(u32, &[u8])> = decoded
                .iter()
                .filter(|(n, _)| n.table == *table)
                .map(|(n, b)| (n.local, b.as_slice()))
                .collect();
            installed += shard.install_decoded(*table, &rows)?;
        }
        Ok(Decoded::Installed(installed))
    }
}

/// What one survivor is asked for: per table, `(table, data slots, parity slots)`.
#[derive(Default)]
struct Asked(Vec<(usize, Vec<u32>, Vec<u32>)>);

impl Asked {
    /// The lists of `table`, and their index among the tables asked.
    fn table(&mut self, table: usize) -> (usize, &mut Vec<u32>, &mut Vec<u32>) {
        let at = match self.0.iter().position(|(t, _, _)| *t == table) {
            Some(at) => at,
            None => {
                self.0.push((table, Vec::new(), Vec::new()));
                self.0.len() - 1
            }
        };
        let (_, data, parity) = &mut self.0[at];
        (at, data, parity)
    }

    /// The first table in the request's own fields, the others in `more_tables`.
    fn request(&self, epoch: u64) -> FetchSlotsRequest {
        let mut tables = self.0.iter().map(|(t, d, p)| FetchTableSlots {
            table: *t as u32,
            data: u32s_to_bytes(d),
            parity: u32s_to_bytes(p),
        });
        let first = tables.next().unwrap_or_default();
        FetchSlotsRequest {
            epoch,
            table: first.table,
            data: first.data,
            parity: first.parity,
            more_tables: tables.collect(),
            ..Default::default()
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
    /// itself, overloaded) or one an epoch apart is asked again.
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
                // A recovery's new epoch reaches the servers one by one: a survivor an epoch
                // apart from this server agrees in a moment (or a newer recovery supersedes
                // this read), so it is asked again. Taken for a refusal for good, it failed
                // a background rebuild whose slot a second failure's recovery had just
                // moved, and that ended the job.
                Err(e @ PsError::StaleEpoch { .. }) => tracing::debug!("{}: {e}", what()),
                Err(e) if !e.is_retryable() => {
                    return Err(PsError::Degraded(format!("{}: {e}", what())));
                }
                Err(e @ (PsError::Unavailable(_) | PsError::Refused(_))) => {
                    sorted.unreachable = Some(e)
                }
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
            self.turn = Some(core.pipeline.owned_turn().await);
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
        while self.pipeline.shard_read()?.pending().is_some() {
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

#[cfg(test)]
mod tests;
