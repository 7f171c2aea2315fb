//! A survivor's side of a degraded read or a rebuild: `FetchSlots` answers slots of one
//! table together with the steps this server has applied, read under one read lock, so
//! that the reader can tell whether its answers from several servers form one snapshot.
//! The bulk port (`bulk.rs`) reads a rebuild's cycle ranges through the same function.

use ftrec_proto::proto::*;
use ftrec_proto::wire::bytes_to_u32s;
use ftrec_rpc::PsError;

use crate::Core;
use crate::bulk::{RangeAsk, RangeRows, RangeSource};
use crate::shard::Shard;

impl Core {
    /// `FetchSlots`: slots of one table (a list, or contiguous ranges) with this server's
    /// applied steps, read together; or a ticket for this server's bulk port.
    pub(crate) fn fetch_slots(&self, req: &FetchSlotsRequest) -> Result<FetchSlotsReply, PsError> {
        self.pipeline.check_epoch(req.epoch)?;
        if req.bulk_session {
            return Ok(match &self.rebuilding.bulk {
                Some(bulk) => FetchSlotsReply {
                    bulk_address: bulk.address().to_string(),
                    bulk_ticket: crate::bulk::ticket_bytes(bulk.issue()),
                    ..Default::default()
                },
                None => FetchSlotsReply::default(),
            });
        }
        if req.ranges {
            if !req.data.is_empty() || !req.parity.is_empty() || !req.more_tables.is_empty() {
                return Err(PsError::BadRequest(
                    "FetchSlots with ranges and slot lists at once".into(),
                ));
            }
            let ask = RangeAsk {
                epoch: req.epoch,
                table: req.table,
                data: req.data_first..req.data_end,
                parity: req.parity_first..req.parity_end,
            };
            // One copy out of the table under the read lock: what lets the lock go before
            // the bytes go out.
            let mut reply = None;
            self.with_slot_ranges(&ask, &mut |rows| {
                reply = Some(FetchSlotsReply {
                    data: bytes::Bytes::copy_from_slice(rows.data),
                    parity: bytes::Bytes::copy_from_slice(rows.parity),
                    applied_below: rows.applied_below,
                    applied_ahead: rows.applied_ahead,
                    ..Default::default()
                });
            })?;
            return reply.ok_or_else(|| PsError::Internal("a range read nothing".into()));
        }
        let shard = self.pipeline.shard_read()?;
        let (data, parity) = slot_lists(&shard, req.table as usize, &req.data, &req.parity)?;
        let more_tables = req
            .more_tables
            .iter()
            .map(|t| {
                let (data, parity) = slot_lists(&shard, t.table as usize, &t.data, &t.parity)?;
                Ok(FetchedSlots {
                    data: data.into(),
                    parity: parity.into(),
                })
            })
            .collect::<Result<_, PsError>>()?;
        // The applied steps change only under the shard's write lock: read under the same
        // read lock as the rows, they are the rows' steps.
        let steps = self.pipeline.steps();
        Ok(FetchSlotsReply {
            data: data.into(),
            parity: parity.into(),
            applied_below: steps.low(),
            applied_ahead: steps.ahead().collect(),
            more_tables,
            ..Default::default()
        })
    }

    /// Data slots `ask.data` and parity slots `ask.parity` of a table, handed to `send`
    /// as the table's own bytes with this server's applied steps, all under one read lock.
    fn with_slot_ranges(
        &self,
        ask: &RangeAsk,
        send: &mut dyn FnMut(RangeRows<'_>),
    ) -> Result<(), PsError> {
        self.pipeline.check_epoch(ask.epoch)?;
        let table = ask.table as usize;
        let span = |r: &std::ops::Range<u64>, what: &str| {
            (r.start <= r.end)
                .then_some(r.start as usize..r.end as usize)
                .ok_or_else(|| PsError::BadRequest(format!("{what} slots {}..{}", r.start, r.end)))
        };
        let data = span(&ask.data, "data")?;
        let parity = span(&ask.parity, "parity")?;
        let shard = self.pipeline.shard_read()?;
        let Some(rows) = shard.state().tables().get(table) else {
            return Err(PsError::BadRequest(format!("table {table} does not exist")));
        };
        let recovering = |range: &std::ops::Range<usize>| PsError::Recovering {
            table: table as u32,
            first_row: range.start as u32,
            end_row: range.end as u32,
        };
        if let Some(pending) = shard.pending()
            && (pending.any_data_in(table, data.clone())
                || pending.any_parity_in(table, parity.clone()))
        {
            return Err(recovering(&data));
        }
        let row_bytes = rows.stride() * 4;
        // Slot numbers come from the request: a product that overflows is out of range.
        let bytes_of = |range: &std::ops::Range<usize>| {
            Some(range.start.checked_mul(row_bytes)?..range.end.checked_mul(row_bytes)?)
        };
        let data_bytes = bytes_of(&data)
            .and_then(|at| rows.as_bytes().get(at))
            .ok_or_else(|| {
                PsError::BadRequest(format!(
                    "data slots {}..{} are outside table {table} ({} slots)",
                    data.start,
                    data.end,
                    rows.rows()
                ))
            })?;
        let parity_bytes: &[u8] = if parity.is_empty() {
            &[]
        } else {
            let Some(red) = shard.redundancy() else {
                return Err(PsError::BadRequest(
                    "this server holds no parity rows".into(),
                ));
            };
            red.parity
                .get(table)
                .zip(bytes_of(&parity))
                .and_then(|(p, at)| p.get(at))
                .ok_or_else(|| {
                    PsError::BadRequest(format!(
                        "parity slots {}..{} are outside table {table}",
                        parity.start, parity.end
                    ))
                })?
        };
        // The applied steps change only under the shard's write lock: read under the same
        // read lock as the rows, they are the rows' steps. Their own mutex is let go before
        // `send`, which may write to a socket.
        let (applied_below, applied_ahead) = {
            let steps = self.pipeline.steps();
            (steps.low(), steps.ahead().collect())
        };
        send(RangeRows {
            applied_below,
            applied_ahead,
            data: data_bytes,
            parity: parity_bytes,
        });
        drop(shard);
        Ok(())
    }
}

/// A survivor's bulk port reads ranges from the shard; its bytes count as sent, like an
/// RPC reply's.
impl RangeSource for Core {
    fn with_range(
        &self,
        ask: &RangeAsk,
        send: &mut dyn FnMut(RangeRows<'_>),
    ) -> Result<(), PsError> {
        let mut bytes = 0;
        self.with_slot_ranges(ask, &mut |rows| {
            bytes = (rows.data.len() + rows.parity.len()) as u64;
            send(rows)
        })?;
        self.metrics.add("ftrec_rpc_bytes_out_total", bytes);
        Ok(())
    }
}

/// Data slots `data` and parity slots `parity` (u32 LE lists) of `table`, row after row,
/// copied out of `shard` (held under the caller's read lock).
fn slot_lists(
    shard: &Shard,
    table: usize,
    data: &[u8],
    parity: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), PsError> {
    let data = bytes_to_u32s(data, "slots asked")?;
    let parity = bytes_to_u32s(parity, "parity slots asked")?;
    let Some(rows) = shard.state().tables().get(table) else {
        return Err(PsError::BadRequest(format!("table {table} does not exist")));
    };
    let recovering = |local: u32| PsError::Recovering {
        table: table as u32,
        first_row: local,
        end_row: local + 1,
    };
    let stored = rows.as_bytes();
    let row_bytes = rows.stride() * 4;
    let mut out = Vec::with_capacity(data.len() * row_bytes);
    for &local in &data {
        if shard
            .pending()
            .is_some_and(|p| p.data(table, local as usize))
        {
            return Err(recovering(local));
        }
        let at = local as usize * row_bytes;
        let row = stored
            .get(at..at + row_bytes)
            .ok_or_else(|| PsError::BadRequest(format!("slot {local} is outside table {table}")))?;
        out.extend_from_slice(row);
    }
    let mut parity_out = Vec::with_capacity(parity.len() * row_bytes);
    if !parity.is_empty() {
        let Some(red) = shard.redundancy() else {
            return Err(PsError::BadRequest(
                "this server holds no parity rows".into(),
            ));
        };
        for &local in &parity {
            if shard.parity_pending(table, local as usize) {
                return Err(recovering(local));
            }
            let at = local as usize * red.row_bytes;
            let row = red
                .parity
                .get(table)
                .and_then(|p| p.get(at..at + red.row_bytes))
                .ok_or_else(|| {
                    PsError::BadRequest(format!("parity slot {local} is outside table {table}"))
                })?;
            parity_out.extend_from_slice(row);
        }
    }
    Ok((out, parity_out))
}
