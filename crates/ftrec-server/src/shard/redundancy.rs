//! What a server holds for *other* servers under erasure coding (ECRec §3.2–3.3): parity
//! rows of the stripes it is a parity holder for, and a replica of one other server's
//! dense range with its optimizer state.
//!
//! Parity rows are raw bytes, never floats: they are XOR and GF(2^8) combinations of row
//! bit patterns, and are only ever folded into or decoded from, byte for byte.

use std::ops::Range;
use std::sync::Arc;

use ftrec_ec::{Codec, StripeLayout};
use ftrec_model::{DenseState, EmbeddingTable, ModelConfig};

use ftrec_proto::placement::Layout;
use ftrec_rpc::PsError;

/// A copy of another server's dense range, updated by the same gradients in the same
/// order as the primary, so it stays bit-identical to it.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseReplica {
    /// The server whose range this is.
    pub of: usize,
    pub range: Range<usize>,
    pub params: Vec<f32>,
    pub state: Vec<f32>,
    /// The primary's dense step count (Adam's bias correction reads it).
    pub step: u64,
}

pub struct Redundancy {
    pub codec: Arc<Codec>,
    /// Per table: parity slots back to back, `row_bytes` each.
    pub parity: Vec<Vec<u8>>,
    pub row_bytes: usize,
    pub replica: Option<DenseReplica>,
    /// `ec.replicate_dense = false`: the dense-stripe parity rows held here.
    pub dense_parity: Vec<(ftrec_ec::DenseParitySlot, Vec<u8>)>,
}

impl Redundancy {
    /// Zeroed parity slots and no replica, for `server` of a striped layout.
    pub fn empty(global: &ModelConfig, layout: Layout, server: usize) -> Result<Self, PsError> {
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config("redundancy without erasure coding".into()));
        };
        let codec = Codec::new(stripes.params.k, stripes.params.r)
            .map_err(|e| PsError::Config(e.to_string()))?;
        let row_bytes = global.row_stride() * 4;
        let parity = global
            .table_rows
            .iter()
            .map(|&rows| vec![0u8; layout.parity_rows(server, rows) * row_bytes])
            .collect();
        let dense_len = if layout.dense_coded() {
            super::dense_code::row_len(global, layout, server)?
        } else {
            0
        };
        let dense_parity = if layout.dense_coded() {
            stripes
                .dense_parity_held(server)
                .into_iter()
                .map(|slot| (slot, vec![0u8; dense_len]))
                .collect()
        } else {
            Vec::new()
        };
        Ok(Self {
            codec: Arc::new(codec),
            parity,
            row_bytes,
            replica: None,
            dense_parity,
        })
    }

    /// The initial dense-stripe parity rows `server` holds (dense ranges coded).
    pub fn init_dense_parity(
        &mut self,
        global: &ModelConfig,
        layout: Layout,
        server: usize,
        full: &DenseState,
    ) -> Result<(), PsError> {
        let Some(stripes) = layout.stripes().filter(|_| layout.dense_coded()) else {
            return Ok(());
        };
        let len = super::dense_code::row_len(global, layout, server)?;
        for (slot, bytes) in &mut self.dense_parity {
            let rows = super::dense_code::initial_rows(
                global,
                layout,
                &stripes,
                slot.group,
                slot.stripe,
                full,
                len,
            )?;
            *bytes = super::dense_code::encode(&self.codec, *slot, &rows, len)?;
        }
        Ok(())
    }

    /// Folds `coef · delta` into the parity row of dense stripe `stripe` held here.
    pub fn fold_dense(&mut self, stripe: usize, coef: u8, delta: &[u8]) -> Result<(), PsError> {
        let Some((_, row)) = self
            .dense_parity
            .iter_mut()
            .find(|(s, _)| s.stripe == stripe)
        else {
            return Err(PsError::BadRequest(format!(
                "this server holds no parity of dense stripe {stripe}"
            )));
        };
        if row.len() != delta.len() {
            return Err(PsError::BadRequest(format!(
                "a dense parity difference of {} bytes for rows of {}",
                delta.len(),
                row.len()
            )));
        }
        ftrec_ec::fold_with(coef, delta, row);
        Ok(())
    }

    /// The parity row of dense stripe `stripe` held here, if any.
    pub fn dense_parity_row(&self, stripe: usize) -> Option<&[u8]> {
        self.dense_parity
            .iter()
            .find(|(s, _)| s.stripe == stripe)
            .map(|(_, r)| r.as_slice())
    }

    /// Folds one initial row of `table` into the parity slots of this server that cover
    /// it (called for every row as the initial tables are generated).
    pub fn fold_initial(
        &mut self,
        stripes: &StripeLayout,
        server: usize,
        table: usize,
        row: usize,
        bytes: &[u8],
    ) {
        let (stripe, position) = stripes.stripe_of(row);
        for p in 0..stripes.params.r {
            let slot = stripes.parity_slot(table, stripe, p);
            if slot.server != server {
                continue;
            }
            let at = slot.local * self.row_bytes;
            self.codec.fold(
                p,
                position,
                bytes,
                &mut self.parity[table][at..at + self.row_bytes],
            );
        }
    }

    /// The initial replica of the dense range `server` keeps for `layout.replicates`.
    pub fn initial_replica(
        global: &ModelConfig,
        layout: Layout,
        server: usize,
        full: &DenseState,
    ) -> Result<Option<DenseReplica>, PsError> {
        let Some(of) = layout.replicates(server) else {
            return Ok(None);
        };
        let range = layout.dense_range(of, full.params.len());
        let mut state = vec![0.0f32; global.dense_optimizer.dense_state_len(range.len())?];
        global.dense_optimizer.init_dense_state(&mut state);
        Ok(Some(DenseReplica {
            of,
            params: full.params[range.clone()].to_vec(),
            range,
            state,
            step: full.step,
        }))
    }

    /// Brings parity slot `local` of `table` into cache ahead of its [`Redundancy::fold`]:
    /// a step's differences land on slots spread over the whole parity table. A slot out
    /// of range is left alone (its fold reports it).
    pub fn prefetch_slot(&self, table: usize, local: usize) {
        let at = local * self.row_bytes;
        if let Some(slot) = self
            .parity
            .get(table)
            .and_then(|s| s.get(at..at + self.row_bytes))
        {
            ftrec_model::prefetch::prefetch_read(slot);
        }
    }

    /// Folds `coef · delta` into parity slot `local` of `table`.
    pub fn fold(
        &mut self,
        table: usize,
        local: usize,
        coef: u8,
        delta: &[u8],
    ) -> Result<(), PsError> {
        let slots = self.parity.get_mut(table).ok_or_else(|| {
            PsError::BadRequest(format!("parity of table {table} does not exist"))
        })?;
        let at = local * self.row_bytes;
        let Some(slot) = slots.get_mut(at..at + self.row_bytes) else {
            return Err(PsError::BadRequest(format!(
                "parity slot {local} of table {table} is outside this server's {} slots",
                slots.len() / self.row_bytes.max(1)
            )));
        };
        if delta.len() != self.row_bytes {
            return Err(PsError::BadRequest(format!(
                "a parity difference of {} bytes for rows of {} bytes",
                delta.len(),
                self.row_bytes
            )));
        }
        ftrec_ec::fold_with(coef, delta, slot);
        Ok(())
    }
}

/// The initial rows of `table`, handed to `sink` with their bytes (a whole table is
/// generated to find one server's rows; the same pass folds that server's parity).
pub fn for_each_initial_row(
    global: &ModelConfig,
    seed: u64,
    table: usize,
    mut sink: impl FnMut(usize, &[f32]),
) {
    EmbeddingTable::initial_rows(
        global.table_rows[table],
        global.dim,
        &global.sparse_optimizer,
        seed,
        table,
        |r, row| sink(r, row),
    );
}
