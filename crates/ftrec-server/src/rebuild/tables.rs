//! A whole-slot rebuild's tables: each survivor's slots of a table streamed in while the
//! previous table decodes, then every data row and parity row of this slot decoded from
//! its stripe, spread over rayon's threads.

use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

use ftrec_ec::{Codec, StripeLayout};
use ftrec_model::EmbeddingTable;

use super::WholeRebuild;
use crate::shard::Redundancy;
use ftrec_faults::points;
use ftrec_proto::proto::RebuildReply;
use ftrec_proto::wire::bytes_to_f32s;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;
use ftrec_rpc::network::Network;

/// Every survivor's data and parity slots of table `t`, streamed from all at once. A
/// survivor silent for `silence` mid-stream fails the rebuild, blamed on it.
async fn fetch_table(
    clients: BTreeMap<usize, ServerClient>,
    epoch: u64,
    t: usize,
    with_parity: bool,
    silence: Duration,
) -> Result<(BTreeMap<usize, Vec<u8>>, BTreeMap<usize, Vec<u8>>), PsError> {
    use ftrec_rpc::gather::fetch_all;
    let fetches = clients.into_iter().map(|(s, client)| {
        let (mut rows_client, mut parity_client) = (client.clone(), client);
        async move {
            let what = format!("rebuild: table {t} from server {s}");
            let parity = async {
                if with_parity {
                    fetch_all(&mut parity_client, epoch, t, true, &what, silence)
                        .await
                        .map(Some)
                } else {
                    Ok(None)
                }
            };
            let (d, p) = futures::future::join(
                fetch_all(&mut rows_client, epoch, t, false, &what, silence),
                parity,
            )
            .await;
            let blamed = |e: PsError| e.blaming(s);
            Ok::<_, PsError>((s, d.map_err(blamed)?, p.map_err(blamed)?))
        }
    });
    let mut data = BTreeMap::new();
    let mut parity = BTreeMap::new();
    for fetched in futures::future::join_all(fetches).await {
        let (s, d, p) = fetched?;
        data.insert(s, d);
        if let Some(p) = p {
            parity.insert(s, p);
        }
    }
    Ok((data, parity))
}

/// What decoding a table needs beside the survivors' rows.
pub(super) struct TablePlan<'a> {
    pub stripes: StripeLayout,
    pub codec: &'a Codec,
    pub me: usize,
    pub servers: usize,
    pub row_bytes: usize,
    /// Re-deriving parity (and replicas) after a rollback: the data rows stay.
    pub parity_only: bool,
    /// A survivor's stream silent this long fails the rebuild (`rebuild_stall_ms`).
    pub silence: Duration,
}

/// The tables rebuilt, and what it took.
pub(super) struct RebuiltTables {
    pub tables: Vec<EmbeddingTable>,
    pub rows: u64,
    pub bytes: u64,
    /// Waiting for fetches.
    pub waited: Duration,
    pub decoding: Duration,
}

/// Every table of the slot, in order: table t + 1 streams in while table t decodes. The
/// parity rows go into `redundancy`; `own_rows` are this server's restored rows
/// (re-encoding only).
pub(super) async fn rebuild_tables(
    plan: &TablePlan<'_>,
    w: &WholeRebuild<'_>,
    own_rows: Vec<Vec<u8>>,
    redundancy: &mut Redundancy,
    network: &Network,
    faults: &ftrec_faults::Faults,
) -> Result<RebuiltTables, PsError> {
    let global = w.global;
    let stride = global.row_stride();
    let mut out = RebuiltTables {
        tables: Vec::with_capacity(global.tables()),
        rows: 0,
        bytes: 0,
        waited: Duration::ZERO,
        decoding: Duration::ZERO,
    };
    let mut next = Some(tokio::spawn(fetch_table(
        w.clients.clone(),
        w.epoch,
        0,
        !plan.parity_only,
        plan.silence,
    )));
    for t in 0..global.tables() {
        let Some(fetching) = next.take() else {
            return Err(PsError::Internal("rebuild: fetch not started".into()));
        };
        let wait_started = Instant::now();
        let (mut data, parity) = fetching
            .await
            .map_err(|e| PsError::Internal(format!("rebuild: fetch task: {e}")))??;
        // This server's own restored rows (re-encoding only).
        let own = own_rows.get(t).cloned().unwrap_or_default();
        if plan.parity_only {
            data.insert(plan.me, own.clone());
        }
        out.waited += wait_started.elapsed();
        if t + 1 < global.tables() {
            next = Some(tokio::spawn(fetch_table(
                w.clients.clone(),
                w.epoch,
                t + 1,
                !plan.parity_only,
                plan.silence,
            )));
        }
        let decode_started = Instant::now();
        let mut mine = if plan.parity_only {
            own
        } else {
            let (data_slots, _) = plan.stripes.capacity(plan.me, global.table_rows[t]);
            vec![0u8; data_slots * plan.row_bytes]
        };
        let held = &mut redundancy.parity[t];
        let survivors = Survivors::of(plan.servers, data, parity);
        // Decoding is CPU work: on this runtime thread, spread over rayon's threads.
        let decoded = network.in_place(|| {
            decode_table(plan, t, global.table_rows[t], &survivors, &mut mine, held)
        })?;
        out.rows += decoded;
        out.decoding += decode_started.elapsed();
        out.bytes += if plan.parity_only {
            held.len()
        } else {
            mine.len() + held.len()
        } as u64;
        faults.kill_at(points::REBUILD, None);
        // Progress is best effort: a slow reader must not hold the rebuild up.
        let _ = w.progress.try_send(Ok(RebuildReply {
            bytes: out.bytes,
            rows: out.rows,
            seconds: w.started.elapsed().as_secs_f64(),
            tables_done: t as u32 + 1,
            tables: global.tables() as u32,
            done: false,
            serving: false,
        }));
        let values = bytes_to_f32s(&mine, "rebuilt rows")?;
        out.tables.push(
            EmbeddingTable::from_data(w.config.table_rows[t], global.dim, stride, values)
                .ok_or_else(|| PsError::Config("rebuilt table shape".into()))?,
        );
    }
    Ok(out)
}

/// The survivors' data and parity slots of one table, by server index: no hashing per
/// row.
struct Survivors {
    data: Vec<Option<Vec<u8>>>,
    parity: Vec<Option<Vec<u8>>>,
}

impl Survivors {
    fn of(
        servers: usize,
        data: BTreeMap<usize, Vec<u8>>,
        parity: BTreeMap<usize, Vec<u8>>,
    ) -> Self {
        let by_server = |held: BTreeMap<usize, Vec<u8>>| {
            let mut v: Vec<Option<Vec<u8>>> = vec![None; servers];
            for (s, bytes) in held {
                v[s] = Some(bytes);
            }
            v
        };
        Self {
            data: by_server(data),
            parity: by_server(parity),
        }
    }
}

fn slot_bytes(
    held: &[Option<Vec<u8>>],
    server: usize,
    local: usize,
    row_bytes: usize,
) -> Option<&[u8]> {
    held[server]
        .as_deref()
        .and_then(|b| b.get(local * row_bytes..(local + 1) * row_bytes))
}

/// Decodes table `t` (of `rows` global rows) of this slot: its data rows into `mine`
/// (unless re-deriving parity) and its parity rows into `held`. Returns the rows decoded.
fn decode_table(
    plan: &TablePlan<'_>,
    t: usize,
    rows: usize,
    survivors: &Survivors,
    mine: &mut [u8],
    held: &mut [u8],
) -> Result<u64, PsError> {
    use rayon::prelude::*;
    let (stripes, me, k, row_bytes) =
        (plan.stripes, plan.me, plan.stripes.params.k, plan.row_bytes);
    // Decodes stripe `j` from the survivors into `out`: its row `index` (data rows
    // first, then parity rows).
    let decode = |j: usize, index: usize, out: &mut [u8]| -> Result<(), PsError> {
        let row_of = |n: usize| {
            let slot = if n < k {
                stripes.data_slot(t, j, n)
            } else {
                stripes.parity_slot(t, j, n - k)
            };
            let held = if n < k {
                &survivors.data
            } else {
                &survivors.parity
            };
            slot_bytes(held, slot.server, slot.local, row_bytes)
        };
        crate::degraded::decode_row(plan.codec, row_of, index, out)
            .map_err(|e| PsError::Degraded(format!("rebuild: table {t} stripe {j}: {e}")))
    };
    let data_rows: u64 = if plan.parity_only {
        0
    } else {
        mine.par_chunks_mut(row_bytes)
            .enumerate()
            .map(|(local, out)| match stripes.data_at(t, me, local, rows) {
                Some((j, i)) => decode(j, i, out).map(|()| 1),
                None => Ok(0),
            })
            .sum::<Result<u64, PsError>>()?
    };
    let parity_rows: u64 = held
        .par_chunks_mut(row_bytes)
        .enumerate()
        .map(|(local, out)| match stripes.parity_at(t, me, local, rows) {
            Some((j, p)) => decode(j, k + p, out).map(|()| 1),
            None => Ok(0),
        })
        .sum::<Result<u64, PsError>>()?;
    Ok(data_rows + parity_rows)
}
