//! `ckpt export --format safetensors`: the model as named tensors that Python's
//! `safetensors` (and so PyTorch) loads. Names and shapes are documented in FORMAT.md.

use std::collections::HashMap;
use std::path::Path;

use ftrec_model::{MlpSpec, ModelState, Optimizer};
use safetensors::tensor::{Dtype, TensorView};

use crate::{CkptError, LocalStore, Store};

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32_tensor(name: String, shape: Vec<usize>, values: impl Iterator<Item = f32>) -> Tensor {
    Tensor {
        name,
        dtype: Dtype::F32,
        shape,
        bytes: values.flat_map(f32::to_le_bytes).collect(),
    }
}

/// The names of a parameter's optimizer state tensors, as PyTorch's optimizers name them.
fn state_names(opt: &Optimizer) -> &'static [&'static str] {
    match opt {
        Optimizer::Sgd { .. } => &[],
        Optimizer::Momentum { .. } => &["momentum_buffer"],
        Optimizer::Adagrad { .. } | Optimizer::RowwiseAdagrad { .. } => &["sum"],
        Optimizer::Adam { .. } => &["exp_avg", "exp_avg_sq"],
    }
}

fn tensors(state: &ModelState) -> Vec<Tensor> {
    let config = state.config();
    let dim = config.dim;
    let mut out = Vec::new();
    for (t, table) in state.tables().iter().enumerate() {
        let rows = table.rows();
        let column = |from: usize, width: usize| {
            (0..rows).flat_map(move |r| table.row(r)[from..from + width].to_vec())
        };
        out.push(f32_tensor(
            format!("embedding_bags.{t}.weight"),
            vec![rows, dim],
            column(0, dim),
        ));
        let prefix = format!("embedding_bags.{t}");
        match config.sparse_optimizer {
            Optimizer::Sgd { .. } => {}
            Optimizer::Momentum { .. } | Optimizer::Adagrad { .. } => {
                let name = state_names(&config.sparse_optimizer)[0];
                out.push(f32_tensor(
                    format!("{prefix}.{name}"),
                    vec![rows, dim],
                    column(dim, dim),
                ));
            }
            Optimizer::RowwiseAdagrad { .. } => {
                out.push(f32_tensor(
                    format!("{prefix}.sum"),
                    vec![rows],
                    column(dim, 1),
                ));
            }
            Optimizer::Adam { .. } => {
                out.push(f32_tensor(
                    format!("{prefix}.exp_avg"),
                    vec![rows, dim],
                    column(dim, dim),
                ));
                out.push(f32_tensor(
                    format!("{prefix}.exp_avg_sq"),
                    vec![rows, dim],
                    column(2 * dim, dim),
                ));
                out.push(Tensor {
                    name: format!("{prefix}.step"),
                    dtype: Dtype::U32,
                    shape: vec![rows],
                    bytes: (0..rows)
                        .flat_map(|r| table.row(r)[3 * dim].to_bits().to_le_bytes())
                        .collect(),
                });
            }
        }
    }
    let (bottom, top) = MlpSpec::dlrm_pair(config);
    let params = &state.dense.params;
    let opt_state = &state.dense.optimizer_state;
    let names = state_names(&config.dense_optimizer);
    for (mlp, spec) in [("bottom_mlp", &bottom), ("top_mlp", &top)] {
        for (l, layer) in spec.layers().iter().enumerate() {
            let parts = [
                ("weight", layer.weight, vec![layer.outputs, layer.inputs]),
                ("bias", layer.bias, vec![layer.outputs]),
            ];
            for (what, offset, shape) in parts {
                let len: usize = shape.iter().product();
                let name = format!("{mlp}.{l}.{what}");
                out.push(f32_tensor(
                    name.clone(),
                    shape.clone(),
                    params[offset..offset + len].iter().copied(),
                ));
                for (k, state_name) in names.iter().enumerate() {
                    // Adam keeps all m, then all v; the others one block at the param offsets.
                    let at = k * params.len() + offset;
                    out.push(f32_tensor(
                        format!("{name}.{state_name}"),
                        shape.clone(),
                        opt_state[at..at + len].iter().copied(),
                    ));
                }
            }
        }
    }
    out.push(Tensor {
        name: "dense.step".into(),
        dtype: Dtype::U64,
        shape: vec![1],
        bytes: state.dense.step.to_le_bytes().to_vec(),
    });
    out
}

/// Writes `state` as a safetensors file (temporary name, fsync, rename). Returns each
/// tensor's name and shape.
pub fn export_safetensors(
    state: &ModelState,
    step: u64,
    path: &Path,
) -> Result<Vec<(String, Vec<usize>)>, CkptError> {
    let tensors = tensors(state);
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| CkptError::Invalid(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([
        ("format".to_string(), "ftrec".to_string()),
        ("step".to_string(), step.to_string()),
        (
            "model".to_string(),
            serde_json::to_string(state.config()).map_err(|e| CkptError::Invalid(e.to_string()))?,
        ),
    ]);
    let bytes = safetensors::tensor::serialize(views, Some(metadata))
        .map_err(|e| CkptError::Invalid(format!("safetensors: {e}")))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| CkptError::Invalid(format!("{}: not a file name", path.display())))?
        .to_string_lossy()
        .into_owned();
    LocalStore::open(dir)?.put(&name, &bytes)?;
    Ok(tensors.into_iter().map(|t| (t.name, t.shape)).collect())
}
