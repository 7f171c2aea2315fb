//! Fully connected layers over the [`MatMul`] trait. Weights are stored PyTorch-style as
//! `W [out x in]`, so `y = x W^T + b`; activations are kept (post-ReLU) for backward.

use crate::ModelConfig;
use crate::matmul::{MatMul, MatMut, MatRef};

#[multiversion::multiversion(targets = "simd")]
fn relu(values: &mut [f32]) {
    for v in values {
        *v = v.max(0.0);
    }
}

/// Zeroes gradients where the ReLU output was not positive.
#[multiversion::multiversion(targets = "simd")]
fn relu_mask(grads: &mut [f32], outputs: &[f32]) {
    for (g, a) in grads.iter_mut().zip(outputs) {
        if *a <= 0.0 {
            *g = 0.0;
        }
    }
}

/// `sums[j] = sum_i rows[i][j]`, rows added in order: a fixed reduction order.
#[multiversion::multiversion(targets = "simd")]
fn column_sums(rows: &[f32], sums: &mut [f32]) {
    sums.fill(0.0);
    for row in rows.chunks_exact(sums.len()) {
        for (d, g) in sums.iter_mut().zip(row) {
            *d += g;
        }
    }
}

/// One linear layer's place in the flat dense parameter buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub inputs: usize,
    pub outputs: usize,
    /// Offset of `W [outputs x inputs]` in the dense buffer.
    pub weight: usize,
    /// Offset of `b [outputs]` in the dense buffer.
    pub bias: usize,
    pub relu: bool,
}

/// An MLP: consecutive layers laid out back to back in the dense buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpSpec {
    layers: Vec<LayerSpec>,
}

impl MlpSpec {
    /// Layers `inputs -> widths[0] -> ...`, starting at `offset`; every layer has a ReLU
    /// except the last one when `relu_last` is false.
    pub fn new(inputs: usize, widths: &[usize], offset: usize, relu_last: bool) -> Self {
        let mut layers = Vec::with_capacity(widths.len());
        let (mut fan_in, mut at) = (inputs, offset);
        for (i, &out) in widths.iter().enumerate() {
            layers.push(LayerSpec {
                inputs: fan_in,
                outputs: out,
                weight: at,
                bias: at + out * fan_in,
                relu: relu_last || i + 1 < widths.len(),
            });
            at += out * fan_in + out;
            fan_in = out;
        }
        Self { layers }
    }

    /// The DLRM bottom (ReLU on every layer, as in the reference) and top (last layer is
    /// the raw logit) MLPs, top placed after bottom.
    pub fn dlrm_pair(config: &ModelConfig) -> (Self, Self) {
        let bottom = Self::new(config.num_dense, &config.bottom, 0, true);
        let top = Self::new(config.interaction_width(), &config.top, bottom.end(), false);
        (bottom, top)
    }

    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// One past the last dense word this MLP uses.
    pub fn end(&self) -> usize {
        self.layers.last().map_or(0, |l| l.bias + l.outputs)
    }

    pub fn outputs(&self) -> usize {
        self.layers.last().map_or(0, |l| l.outputs)
    }

    /// Buffers for each layer's activations at batch size `batch`.
    pub fn activation_buffers(&self, batch: usize) -> Vec<Vec<f32>> {
        self.layers
            .iter()
            .map(|l| vec![0.0; batch * l.outputs])
            .collect()
    }

    /// Forward over `batch` samples of `input [batch x inputs]`; `acts[l]` receives layer
    /// `l`'s output.
    pub fn forward(
        &self,
        mm: &dyn MatMul,
        params: &[f32],
        input: &[f32],
        acts: &mut [Vec<f32>],
        batch: usize,
    ) {
        for (l, layer) in self.layers.iter().enumerate() {
            let (before, after) = acts.split_at_mut(l);
            let x = if l == 0 { input } else { &before[l - 1][..] };
            let out = &mut after[0][..batch * layer.outputs];
            let bias = &params[layer.bias..layer.bias + layer.outputs];
            for row in out.chunks_exact_mut(layer.outputs) {
                row.copy_from_slice(bias);
            }
            let w = MatRef::row_major(&params[layer.weight..], layer.outputs, layer.inputs);
            mm.matmul(
                &mut MatMut::row_major(out, batch, layer.outputs),
                MatRef::row_major(x, batch, layer.inputs),
                w.t(),
                true,
            );
            if layer.relu {
                relu(out);
            }
        }
    }

    /// Backward. On entry the last buffer of `dacts` holds dLoss/d(output) `[batch x
    /// outputs]`; the others are scratch shaped like the activations. Parameter gradients are
    /// written (not accumulated) to `grads` at the same offsets as `params`; the input
    /// gradient is written to `grad_input` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        mm: &dyn MatMul,
        params: &[f32],
        input: &[f32],
        acts: &[Vec<f32>],
        dacts: &mut [Vec<f32>],
        grads: &mut [f32],
        grad_input: Option<&mut [f32]>,
        batch: usize,
    ) {
        let mut grad_input = grad_input;
        for l in (0..self.layers.len()).rev() {
            let layer = self.layers[l];
            let (before, after) = dacts.split_at_mut(l);
            let dz = &mut after[0][..batch * layer.outputs];
            if layer.relu {
                relu_mask(dz, &acts[l][..batch * layer.outputs]);
            }
            let x = if l == 0 { input } else { &acts[l - 1][..] };
            let dz_ref = MatRef::row_major(dz, batch, layer.outputs);
            mm.matmul(
                &mut MatMut::row_major(
                    &mut grads[layer.weight..layer.weight + layer.outputs * layer.inputs],
                    layer.outputs,
                    layer.inputs,
                ),
                dz_ref.t(),
                MatRef::row_major(x, batch, layer.inputs),
                false,
            );
            // Column sums in sample order: a fixed reduction order, independent of threads.
            let db = &mut grads[layer.bias..layer.bias + layer.outputs];
            column_sums(dz, db);
            let w = MatRef::row_major(&params[layer.weight..], layer.outputs, layer.inputs);
            let dx: Option<&mut [f32]> = if l > 0 {
                Some(&mut before[l - 1][..])
            } else {
                grad_input.take()
            };
            if let Some(dx) = dx {
                mm.matmul(
                    &mut MatMut::row_major(dx, batch, layer.inputs),
                    dz_ref,
                    w,
                    false,
                );
            }
        }
    }
}
