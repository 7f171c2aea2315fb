//! A server's dense range as one data row of a dense stripe (`ec.replicate_dense =
//! false`): its parameters, optimizer state and dense step as bytes, zero-padded to the
//! longest range of its group, so that parity over them is byte arithmetic like any row's.

use ftrec_ec::{Codec, DenseParitySlot, StripeLayout};
use ftrec_model::{DenseState, ModelConfig};

use ftrec_proto::placement::Layout;
use ftrec_rpc::PsError;

/// The `table` of a parity difference that belongs to a dense stripe (`locals` then
/// names the stripe).
pub const DENSE_TABLE: u32 = u32::MAX;

/// Parameters and optimizer-state values of `server`'s dense range.
pub fn range_lens(
    global: &ModelConfig,
    layout: Layout,
    server: usize,
) -> Result<(usize, usize), PsError> {
    let total = ftrec_model::MlpSpec::dlrm_pair(global).1.end();
    let params = layout.dense_range(server, total).len();
    Ok((params, global.dense_optimizer.dense_state_len(params)?))
}

/// Bytes of every dense row of `server`'s group: the longest member's.
pub fn row_len(global: &ModelConfig, layout: Layout, server: usize) -> Result<usize, PsError> {
    let Some(stripes) = layout.stripes() else {
        return Err(PsError::Config(
            "dense stripes without erasure coding".into(),
        ));
    };
    let (first, n) = stripes.group(stripes.group_of_server(server).0);
    let mut longest = 0;
    for m in first..first + n {
        let (params, state) = range_lens(global, layout, m)?;
        longest = longest.max((params + state) * 4 + 8);
    }
    Ok(longest)
}

/// The dense row: parameters, state, step (u64 LE), zeros up to `len`.
pub fn pack(params: &[f32], state: &[f32], step: u64, len: usize) -> Vec<u8> {
    let mut row = Vec::with_capacity(len);
    row.extend_from_slice(bytemuck::cast_slice(params));
    row.extend_from_slice(bytemuck::cast_slice(state));
    row.extend_from_slice(&step.to_le_bytes());
    row.resize(len.max(row.len()), 0);
    row
}

/// The inverse of [`pack`] for a range of `params` parameters and `state` state values.
pub fn unpack(
    row: &[u8],
    params: usize,
    state: usize,
) -> Result<(Vec<f32>, Vec<f32>, u64), PsError> {
    let need = (params + state) * 4 + 8;
    if row.len() < need {
        return Err(PsError::BadRequest(format!(
            "a dense row of {} bytes for a range needing {need}",
            row.len()
        )));
    }
    let floats = |bytes: &[u8]| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut step = [0u8; 8];
    step.copy_from_slice(&row[(params + state) * 4..need]);
    Ok((
        floats(&row[..params * 4]),
        floats(&row[params * 4..(params + state) * 4]),
        u64::from_le_bytes(step),
    ))
}

/// Encodes parity row `slot.p` of a dense stripe from its members' rows (`None`: padding).
pub fn encode(
    codec: &Codec,
    slot: DenseParitySlot,
    rows: &[Option<Vec<u8>>],
    len: usize,
) -> Result<Vec<u8>, PsError> {
    let zero = vec![0u8; len];
    let data: Vec<&[u8]> = rows.iter().map(|r| r.as_deref().unwrap_or(&zero)).collect();
    let mut out = vec![0u8; len];
    codec
        .encode_parity(slot.p, &data, &mut out)
        .map_err(|e| PsError::ec("dense stripes", e))?;
    Ok(out)
}

/// The initial dense rows of the members of dense stripe `j` of group `g`.
pub fn initial_rows(
    global: &ModelConfig,
    layout: Layout,
    stripes: &StripeLayout,
    g: usize,
    j: usize,
    full: &DenseState,
    len: usize,
) -> Result<Vec<Option<Vec<u8>>>, PsError> {
    let total = full.params.len();
    stripes
        .dense_members(g, j)
        .into_iter()
        .map(|m| {
            m.map(|m| {
                let range = layout.dense_range(m, total);
                let (_, state_len) = range_lens(global, layout, m)?;
                let mut state = vec![0.0f32; state_len];
                global.dense_optimizer.init_dense_state(&mut state);
                Ok(pack(&full.params[range], &state, full.step, len))
            })
            .transpose()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pack_and_unpack_round_trip_bit_for_bit(
            params in proptest::collection::vec(any::<u32>(), 0..50),
            state in proptest::collection::vec(any::<u32>(), 0..100),
            step in any::<u64>(),
            pad in 0usize..40,
        ) {
            let params: Vec<f32> = params.into_iter().map(f32::from_bits).collect();
            let state: Vec<f32> = state.into_iter().map(f32::from_bits).collect();
            let len = (params.len() + state.len()) * 4 + 8 + pad;
            let row = pack(&params, &state, step, len);
            prop_assert_eq!(row.len(), len);
            let (p, s, t) = unpack(&row, params.len(), state.len()).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&p), bits(&params));
            prop_assert_eq!(bits(&s), bits(&state));
            prop_assert_eq!(t, step);
            prop_assert!(unpack(&row[..row.len() - pad - 1], params.len(), state.len()).is_err());
        }
    }
}
