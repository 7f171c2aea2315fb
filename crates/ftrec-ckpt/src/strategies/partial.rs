//! Restoring part of a checkpoint: a range of one table's rows, written into a table the
//! caller already has, without building a whole new model state. CPR reloads one failed
//! server's shard this way, and an ECRec rebuild falls back to it.

use std::ops::Range;

use ftrec_model::EmbeddingTable;

use crate::engine::{check_named_chunk, store_row};
use crate::manifest::{CheckpointKind, Manifest};
use crate::{Checkpoints, CkptError, chunk};

impl Checkpoints {
    /// Writes rows `rows` of table `table`, as checkpoint `id` holds them (embedding and
    /// optimizer state), into `into`, which must have that table's shape; every other row of
    /// `into` stays as it is. Reads only the chunks that can hold rows of the range where the
    /// format says which (full checkpoints, IncrCP chunks); every chunk read is checked as
    /// a full restore checks it. Returns the bytes read.
    pub fn restore_rows(
        &self,
        id: &str,
        table: usize,
        rows: Range<u32>,
        into: &mut EmbeddingTable,
    ) -> Result<u64, CkptError> {
        let target = self.manifest(id)?;
        let shape = target.model.table_rows.get(table).copied();
        if shape != Some(into.rows()) || target.model.row_stride() != into.stride() {
            return Err(CkptError::Invalid(format!(
                "checkpoint {id}: table {table} is {shape:?} rows of {} words; the table to restore into is {} of {}",
                target.model.row_stride(),
                into.rows(),
                into.stride()
            )));
        }
        // A DECK merger may replace planned deltas meanwhile; planning again finds the
        // merged checkpoint (as a full restore does).
        let mut attempts = 0;
        loop {
            let result = self.lineage(id).and_then(|chain| {
                chain.iter().try_fold(0, |read, m| {
                    Ok(read + self.apply_row_range(m, table, &rows, into)?)
                })
            });
            match result {
                Err(CkptError::NotFound(_)) if attempts < 3 && target.deck.is_some() => {
                    attempts += 1
                }
                other => return other,
            }
        }
    }

    /// One checkpoint's rows of the range, written over `into`.
    fn apply_row_range(
        &self,
        manifest: &Manifest,
        table: usize,
        rows: &Range<u32>,
        into: &mut EmbeddingTable,
    ) -> Result<u64, CkptError> {
        let mut store_in_range = |where_: &str, quant, row: u32, payload: &[u8]| {
            if !rows.contains(&row) {
                return Ok(());
            }
            store_row(into, table, where_, quant, row, payload)
        };
        let mut read = 0;
        if manifest.kind == CheckpointKind::Incrcp {
            let (list, column) = self.incrcp_list(manifest)?;
            for c in list.rectangle(column) {
                let overlaps =
                    c.table as usize == table && c.min_row < rows.end && c.max_row >= rows.start;
                if !overlaps {
                    continue;
                }
                let bytes = self.store().get_range(&c.key, c.offset, c.len as usize)?;
                read += bytes.len() as u64;
                let where_ = self.store().describe(&c.key);
                let quant = chunk::header(&where_, &bytes)?.quant;
                let (_, crc) = chunk::decode_with_crc(&where_, &bytes, |row, payload| {
                    store_in_range(&where_, quant, row, payload)
                })?;
                if crc != c.crc32c {
                    return Err(c.mismatch(self.store()));
                }
            }
            return Ok(read);
        }
        // A full checkpoint's chunks hold consecutive rows (the manifest's counts), so the
        // chunks outside the range are not read; a delta's chunks say nothing of their rows.
        let mut first = 0u64;
        let mut bytes = Vec::new();
        for entry in manifest
            .chunks
            .iter()
            .filter(|c| c.table == Some(table as u32))
        {
            let span = first..first + entry.rows;
            first = span.end;
            let full = manifest.kind == CheckpointKind::Full;
            if full && (span.end <= rows.start as u64 || span.start >= rows.end as u64) {
                continue;
            }
            self.fetch_unchecked(entry, &mut bytes)?;
            read += bytes.len() as u64;
            let where_ = self.store().describe(&entry.key);
            let quant = chunk::header(&where_, &bytes)?.quant;
            let (header, crc) = chunk::decode_with_crc(&where_, &bytes, |row, payload| {
                store_in_range(&where_, quant, row, payload)
            })?;
            check_named_chunk(&where_, entry, table, &header, crc)?;
        }
        Ok(read)
    }
}
