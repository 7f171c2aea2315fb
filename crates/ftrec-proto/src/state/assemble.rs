//! From shards to one global model: the inverse of the placement (`placement.rs`), for
//! shard states restored from a cluster's checkpoints (`ftrec ckpt export` of a cut) and
//! for the dense ranges the servers stream at the end of a run (`gather.rs`).

use ftrec_model::{DenseState, ModelConfig, ModelState};

use crate::error::{BadPlacement, Malformed, ProtoError};
use crate::placement::{Layout, LocalRow};

/// The global configuration of shards' configurations (each table's rows summed).
pub fn global_config(shards: &[&ModelConfig]) -> Result<ModelConfig, ProtoError> {
    let Some(first) = shards.first() else {
        return Err(BadPlacement::NoShards.into());
    };
    let mut global = (*first).clone();
    for (t, rows) in global.table_rows.iter_mut().enumerate() {
        *rows = shards
            .iter()
            .map(|c| c.table_rows.get(t).copied().unwrap_or(0))
            .sum();
    }
    Ok(global)
}

/// Writes server `s`'s dense range into the global dense state: its parameters, and each
/// optimizer state vector (Adam: `m`, then `v`) laid out like the parameters.
pub fn place_dense(
    global: &mut DenseState,
    layout: Layout,
    s: usize,
    params: &[f32],
    state: &[f32],
    per_param: usize,
) -> Result<(), ProtoError> {
    let total = global.params.len();
    let range = layout.dense_range(s, total);
    let len = range.len();
    if params.len() < len || state.len() < per_param * len {
        return Err(Malformed::ShortDenseRange { server: s, len }.into());
    }
    global.params[range.clone()].copy_from_slice(&params[..len]);
    for j in 0..per_param {
        global.optimizer_state[j * total + range.start..j * total + range.end]
            .copy_from_slice(&state[j * len..(j + 1) * len]);
    }
    Ok(())
}

/// The global model whose shards (server order) these are, under row-modulo placement.
pub fn assemble(shards: &[ModelState]) -> Result<ModelState, ProtoError> {
    let configs: Vec<&ModelConfig> = shards.iter().map(ModelState::config).collect();
    let config = global_config(&configs)?;
    assemble_with(shards, Layout::new(shards.len())?, &config)
}

/// The global model `config` whose shards (server order) these are under `layout` (a
/// striped layout's shards hold padding slots, so the global table sizes are given, not
/// summed).
pub fn assemble_with(
    shards: &[ModelState],
    layout: Layout,
    config: &ModelConfig,
) -> Result<ModelState, ProtoError> {
    if shards.len() != layout.servers() {
        return Err(BadPlacement::ShardCount {
            shards: shards.len(),
            servers: layout.servers(),
        }
        .into());
    }
    let config = config.clone();
    let mut global = ModelState::zeroed(&config)?;
    for (s, shard) in shards.iter().enumerate() {
        for (t, (rows, stored)) in config.table_rows.iter().zip(shard.tables()).enumerate() {
            if stored.rows() != layout.local_rows(t, s, *rows) {
                return Err(BadPlacement::TableRows {
                    server: s,
                    table: t,
                    rows: stored.rows(),
                    placed: layout.local_rows(t, s, *rows),
                }
                .into());
            }
            for local in 0..stored.rows() {
                if let Some(g) = layout.global_row(t, s, LocalRow(local as u32), *rows) {
                    global.tables_mut()[t]
                        .row_mut(g.0 as usize)
                        .copy_from_slice(stored.row(local));
                }
            }
        }
        let per_param = config.dense_optimizer.dense_state_len(1)?;
        place_dense(
            &mut global.dense,
            layout,
            s,
            &shard.dense.params,
            &shard.dense.optimizer_state,
            per_param,
        )?;
    }
    global.dense.step = shards[0].dense.step;
    Ok(global)
}
