//! Reassembles the whole model from the servers' shards (the end of a run, `ftrec
//! coordinator`), streaming each table in bounded pieces, and digests each shard.

use std::time::Duration;

use ftrec_model::{DenseState, EmbeddingTable, ModelState};
use xxhash_rust::xxh3::Xxh3;

use crate::PsError;
use crate::client::ServerClient;
use crate::job::Job;
use crate::stream::{ProgressDeadline, Read};
use ftrec_proto::placement::LocalRow;
use ftrec_proto::proto::{FetchDenseRequest, FetchRowsChunk, FetchRowsRequest};
use ftrec_proto::wire::extend_f32s;

/// The global model, and one digest per server: xxh3 of its shard (each table's local rows
/// in order, then its dense range, their optimizer state and the dense step), so a test can
/// tell which servers' state a recovery touched.
pub async fn gather_state(
    job: &Job,
    addresses: &[String],
    epoch: u64,
) -> Result<(ModelState, Vec<String>), PsError> {
    let config = job.config.model_config()?;
    // The servers the job runs on now: a move (`cluster scale`) may have left the job
    // file's count.
    let layout = job.layout_for(addresses.len())?;
    let stride = config.row_stride();
    let connector = job.connector()?;
    let mut clients = addresses
        .iter()
        .map(|a| connector.server(a))
        .collect::<Result<Vec<_>, _>>()?;
    let silence = job.deadlines().stream_progress;
    let mut hashes: Vec<Xxh3> = addresses.iter().map(|_| Xxh3::new()).collect();
    let mut tables = Vec::with_capacity(config.tables());
    let mut local = Vec::new();
    for (t, &rows) in config.table_rows.iter().enumerate() {
        let mut data = vec![0.0f32; rows * stride];
        for (s, client) in clients.iter_mut().enumerate() {
            let what = || format!("fetching table {t} from server {s} ({})", addresses[s]);
            let expected = layout.local_rows(t, s, rows);
            let mut next = 0usize;
            let table = TableStream {
                epoch,
                table: t,
                parity: false,
                what: &what(),
                silence,
            };
            table
                .read(client, |piece| {
                    hashes[s].update(&piece.rows);
                    local.clear();
                    extend_f32s(&mut local, &piece.rows, "shard rows")?;
                    if local.len() % stride != 0 || next + local.len() / stride > expected {
                        return Err(PsError::BadRequest(format!(
                            "{}: ragged or too many rows",
                            what()
                        )));
                    }
                    for (i, row) in local.chunks_exact(stride).enumerate() {
                        // Padding slots of a striped layout hold no row.
                        let local = LocalRow((next + i) as u32);
                        if let Some(g) = layout.global_row(t, s, local, rows) {
                            let g = g.0 as usize;
                            data[g * stride..(g + 1) * stride].copy_from_slice(row);
                        }
                    }
                    next += local.len() / stride;
                    Ok(local.len() / stride)
                })
                .await?;
            if next != expected {
                return Err(PsError::BadRequest(format!(
                    "{}: {next} rows, the layout gives it {expected}",
                    what()
                )));
            }
        }
        tables.push(
            EmbeddingTable::from_data(rows, config.dim, stride, data)
                .ok_or_else(|| PsError::Config("table shape".into()))?,
        );
    }
    let mut dense = DenseState::initial(&config, job.config.seed)?;
    let total = dense.params.len();
    let per_param = config.dense_optimizer.dense_state_len(1)?;
    for (s, client) in clients.iter_mut().enumerate() {
        let reply = client
            .fetch_dense(FetchDenseRequest {
                epoch,
                replica: false,
                ..Default::default()
            })
            .await
            .map_err(|st| PsError::rpc(format!("fetching server {s}'s dense range"), &st))?
            .into_inner();
        hashes[s].update(&reply.params);
        hashes[s].update(&reply.state);
        hashes[s].update(&reply.step.to_le_bytes());
        let len = layout.dense_range(s, total).len();
        let (mut params, mut state) = (Vec::new(), Vec::new());
        extend_f32s(&mut params, &reply.params, "dense params")?;
        extend_f32s(&mut state, &reply.state, "dense state")?;
        if params.len() != len || state.len() != per_param * len {
            return Err(PsError::BadRequest(format!(
                "server {s} sent a dense range of the wrong size"
            )));
        }
        ftrec_proto::assemble::place_dense(&mut dense, layout, s, &params, &state, per_param)?;
        if s == 0 {
            dense.step = reply.step;
        }
    }
    let digests = hashes
        .iter()
        .map(|h| format!("{:016x}", h.digest()))
        .collect();
    Ok((ModelState::from_parts(config, tables, dense)?, digests))
}

/// A whole table's data rows (or parity rows) of one server, streamed: a server silent
/// for `silence` mid-stream fails the fetch as [`PsError::Unavailable`].
pub async fn fetch_all(
    client: &mut ServerClient,
    epoch: u64,
    table: usize,
    parity: bool,
    what: &str,
    silence: Duration,
) -> Result<Vec<u8>, PsError> {
    let mut pieces = client
        .fetch_rows(FetchRowsRequest {
            epoch,
            table: table as u32,
            first_row: 0,
            end_row: u32::MAX,
            parity,
        })
        .await
        .map_err(|s| PsError::rpc(what, &s))?
        .into_inner()
        .with_progress_deadline(silence, what);
    let mut out = Vec::new();
    while let Some(piece) = pieces.next_message().await? {
        out.extend_from_slice(&piece.rows);
    }
    Ok(out)
}

/// Stalls in a row a [`TableStream`] resumes from before it gives up: rows received
/// reset the count.
const STALLS_RESUMED: u32 = 3;

/// One table's rows (or parity rows) of one server, streamed from local row 0 to the
/// table's end, for reads that must not fail on a hiccup: the end of a run (its gather
/// and its parity check). A stream silent for `silence` after its sender answered (a
/// stalled sender that otherwise lives on) is asked again from the first row not yet
/// received, [`STALLS_RESUMED`] times in a row at most. Before, one stall of the final
/// gather failed a finished run (found by the control-plane simulation). A rebuild's
/// streams do not resume: they give the survivor up and the recovery is tried again.
pub struct TableStream<'a> {
    pub epoch: u64,
    pub table: usize,
    pub parity: bool,
    pub what: &'a str,
    pub silence: Duration,
}

impl TableStream<'_> {
    /// Hands each piece to `take`, which returns how many rows it held.
    pub async fn read(
        &self,
        client: &mut ServerClient,
        mut take: impl FnMut(&FetchRowsChunk) -> Result<usize, PsError>,
    ) -> Result<(), PsError> {
        let mut next = 0u32;
        let mut stalls = 0;
        loop {
            let mut pieces = client
                .fetch_rows(FetchRowsRequest {
                    epoch: self.epoch,
                    table: self.table as u32,
                    first_row: next,
                    end_row: u32::MAX,
                    parity: self.parity,
                })
                .await
                .map_err(|st| PsError::rpc(self.what, &st))?
                .into_inner()
                .with_progress_deadline(self.silence, self.what);
            loop {
                match pieces.next_or_stall().await? {
                    Read::Message(piece) => {
                        if piece.first_row != next {
                            return Err(PsError::BadRequest(format!(
                                "{}: a piece starts at row {}, expected {next}",
                                self.what, piece.first_row
                            )));
                        }
                        let rows = take(&piece)? as u32;
                        next += rows;
                        // Only rows count as progress: a sender that answers each ask
                        // with an empty piece and stalls again is given up.
                        if rows > 0 {
                            stalls = 0;
                        }
                    }
                    Read::End => return Ok(()),
                    Read::Stalled(e) if stalls >= STALLS_RESUMED => return Err(e),
                    Read::Stalled(e) => {
                        stalls += 1;
                        tracing::warn!("{e}; asking again from row {next}");
                        break;
                    }
                }
            }
        }
    }

    /// The whole table's bytes, in row order; `row_bytes` is the width of one row.
    pub async fn read_all(
        &self,
        client: &mut ServerClient,
        row_bytes: usize,
    ) -> Result<Vec<u8>, PsError> {
        let mut out = Vec::new();
        self.read(client, |piece| {
            if row_bytes == 0 || piece.rows.len() % row_bytes != 0 {
                return Err(PsError::BadRequest(format!(
                    "{}: a piece of {} bytes is not whole rows of {row_bytes}",
                    self.what,
                    piece.rows.len()
                )));
            }
            out.extend_from_slice(&piece.rows);
            Ok(piece.rows.len() / row_bytes)
        })
        .await?;
        Ok(out)
    }
}
