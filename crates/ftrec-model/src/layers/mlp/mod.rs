//! Fully connected layers over the [`MatMul`] trait. Weights are stored PyTorch-style as
//! `W [out x in]`, so `y = x W^T + b`; activations are kept (post-ReLU) for backward.

use rayon::prelude::*;

mod split;

use crate::ModelConfig;
use crate::matmul::{MatMul, MatRef};
use split::{
    MIN_ROWS_PER_PART, add_bias, product_by_rows, relu_mask, rows_per_part, weight_gradients,
};

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

/// The gemm kernels tile a product whose inner or output width is a whole number of
/// 16-lane vectors well, and one that is not badly: on the Zen 4 host the top layer's
/// three products at width 415 take 14.7 ms and at width 416 13.4 ms (bench-results/HISTORY.md).
const KERNEL_WIDTH: usize = 16;

/// An MLP: consecutive layers laid out back to back in the dense buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpSpec {
    layers: Vec<LayerSpec>,
    /// Row stride of the input the caller passes: `inputs`, or `inputs` rounded up to
    /// [`KERNEL_WIDTH`] with zero padding when the caller lays out its input that way.
    input_stride: usize,
}

/// Scratch for an MLP whose input is padded: the first layer's weights and weight
/// gradient, widened to the input stride with a zero column block. Empty otherwise.
#[derive(Clone, Debug, Default)]
pub struct MlpWorkspace {
    weight: Vec<f32>,
    grad: Vec<f32>,
    /// The transposed weight gradient of a layer too narrow to split by output features.
    transposed: Vec<f32>,
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
        Self {
            layers,
            input_stride: inputs,
        }
    }

    /// The same MLP, taking its input in rows padded to a whole number of kernel vectors
    /// ([`MlpSpec::input_stride`]); the padding columns must hold zeros. The parameters
    /// keep their layout: only the products see the padded width, through the workspace.
    pub fn with_padded_input(mut self) -> Self {
        self.input_stride = self.inputs().next_multiple_of(KERNEL_WIDTH);
        self
    }

    /// The input's width: the first layer's fan-in.
    pub fn inputs(&self) -> usize {
        self.layers.first().map_or(0, |l| l.inputs)
    }

    /// The row stride of the input (and of the input gradient) this MLP takes.
    pub fn input_stride(&self) -> usize {
        self.input_stride
    }

    fn padded(&self) -> bool {
        self.input_stride != self.inputs()
    }

    /// Scratch for [`MlpSpec::forward`] and [`MlpSpec::backward`].
    pub fn workspace(&self) -> MlpWorkspace {
        // Room for the transposed weight gradient of any layer narrow enough to need it
        // on a small pool, so that the step allocates nothing (a larger pool may find a
        // wider layer unsplittable by outputs; the buffer then grows once).
        let narrow = self
            .layers
            .iter()
            .filter(|l| l.outputs <= 4 * MIN_ROWS_PER_PART)
            .map(|l| l.inputs * l.outputs)
            .max()
            .unwrap_or(0);
        let (weight, grad) = match self.layers.first() {
            Some(first) if self.padded() => (
                vec![0.0; first.outputs * self.input_stride],
                vec![0.0; first.outputs * self.input_stride],
            ),
            _ => (Vec::new(), Vec::new()),
        };
        MlpWorkspace {
            weight,
            grad,
            transposed: vec![0.0; narrow],
        }
    }

    /// The first layer's weights widened to the input stride (padding columns stay zero,
    /// as the workspace was built), so that its products run at the padded width. The
    /// padding only adds `0 * 0 = +0` terms, which change no sum's value (at most, in
    /// principle, the sign of an exact zero).
    fn widen_first_weight<'w>(
        &self,
        params: &[f32],
        wide_weight: &'w mut [f32],
    ) -> Option<&'w [f32]> {
        let first = self.layers.first().filter(|_| self.padded())?;
        let weight = &params[first.weight..first.weight + first.outputs * first.inputs];
        for (wide, row) in wide_weight
            .chunks_exact_mut(self.input_stride)
            .zip(weight.chunks_exact(first.inputs))
        {
            wide[..first.inputs].copy_from_slice(row);
        }
        Some(wide_weight)
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

    /// Forward over `batch` samples of `input [batch x input_stride]`; `acts[l]` receives
    /// layer `l`'s output. Each layer is one task per pool thread over a block of samples:
    /// the block's product, then its bias and ReLU while the rows are still in cache.
    pub fn forward(
        &self,
        mm: &dyn MatMul,
        params: &[f32],
        input: &[f32],
        acts: &mut [Vec<f32>],
        workspace: &mut MlpWorkspace,
        batch: usize,
    ) {
        let wide_first = self.widen_first_weight(params, &mut workspace.weight);
        for (l, layer) in self.layers.iter().enumerate() {
            let rows = rows_per_part(batch, layer.outputs);
            let (before, after) = acts.split_at_mut(l);
            let out = &mut after[0][..batch * layer.outputs];
            let bias = &params[layer.bias..layer.bias + layer.outputs];
            let (x, w) = match (l, wide_first) {
                (0, Some(wide)) => (
                    MatRef::row_major(input, batch, self.input_stride),
                    MatRef::row_major(wide, layer.outputs, self.input_stride),
                ),
                _ => (
                    MatRef::row_major(
                        if l == 0 { input } else { &before[l - 1] },
                        batch,
                        layer.inputs,
                    ),
                    MatRef::row_major(&params[layer.weight..], layer.outputs, layer.inputs),
                ),
            };
            product_by_rows(mm, out, layer.outputs, rows, x, w.t(), |_, out| {
                add_bias(out, bias, layer.relu)
            });
        }
    }

    /// Backward. On entry the last buffer of `dacts` holds dLoss/d(output) `[batch x
    /// outputs]`; the others are scratch shaped like the activations. Parameter gradients are
    /// written (not accumulated) to `grads` at the same offsets as `params`; the input
    /// gradient `[batch x input_stride]` is written to `grad_input` when given (its padding
    /// columns get zeros).
    ///
    /// Each layer is two rounds of one task per pool thread: the weight and bias gradients
    /// of a block of output features, then the input gradient of a block of samples with
    /// the ReLU mask of the layer below applied to it in cache.
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
        workspace: &mut MlpWorkspace,
        batch: usize,
    ) {
        let MlpWorkspace {
            weight: wide_weight,
            grad: wide_grad,
            transposed,
        } = workspace;
        // Widened again rather than trusting the forward's copy: `params` is the caller's
        // to pass, and 0.85 MB a step on `tiny` is not worth a stale-weights hazard.
        let wide_first = self.widen_first_weight(params, wide_weight);
        let mut grad_input = grad_input;
        if let Some(last) = self.layers.last().filter(|l| l.relu) {
            let dz = &mut dacts[self.layers.len() - 1][..batch * last.outputs];
            let chunk = batch.div_ceil(rayon::current_num_threads().max(1)).max(1) * last.outputs;
            dz.par_chunks_mut(chunk)
                .zip(acts[self.layers.len() - 1][..batch * last.outputs].par_chunks(chunk))
                .for_each(|(dz, act)| relu_mask(dz, act));
        }
        for l in (0..self.layers.len()).rev() {
            let layer = self.layers[l];
            let (before, after) = dacts.split_at_mut(l);
            let dz = &after[0][..batch * layer.outputs];
            let dz_ref = MatRef::row_major(dz, batch, layer.outputs);
            // The bias follows the weights in the dense buffer (`MlpSpec::new`).
            let (weight_grad, rest) =
                grads[layer.weight..].split_at_mut(layer.outputs * layer.inputs);
            let db = &mut rest[..layer.outputs];
            let x = if l == 0 { input } else { &acts[l - 1][..] };
            let w = match (l, wide_first) {
                (0, Some(wide)) => {
                    let stride = self.input_stride;
                    weight_gradients(
                        mm,
                        wide_grad,
                        transposed,
                        db,
                        dz_ref,
                        MatRef::row_major(input, batch, stride),
                    );
                    for (dst, wide) in weight_grad
                        .chunks_exact_mut(layer.inputs)
                        .zip(wide_grad.chunks_exact(stride))
                    {
                        dst.copy_from_slice(&wide[..layer.inputs]);
                    }
                    MatRef::row_major(wide, layer.outputs, stride)
                }
                _ => {
                    weight_gradients(
                        mm,
                        weight_grad,
                        transposed,
                        db,
                        dz_ref,
                        MatRef::row_major(x, batch, layer.inputs),
                    );
                    MatRef::row_major(&params[layer.weight..], layer.outputs, layer.inputs)
                }
            };
            let dx: Option<&mut [f32]> = if l > 0 {
                Some(&mut before[l - 1][..])
            } else {
                grad_input.take()
            };
            let Some(dx) = dx else { continue };
            let width = w.cols();
            let sample_rows = rows_per_part(batch, width);
            // The layer below's ReLU, applied to this input gradient while it is in cache.
            let mask = (l > 0 && self.layers[l - 1].relu).then(|| &acts[l - 1][..batch * width]);
            let dx = &mut dx[..batch * width];
            product_by_rows(mm, dx, width, sample_rows, dz_ref, w, |first_row, dx| {
                if let Some(mask) = mask {
                    let first = first_row * width;
                    relu_mask(dx, &mask[first..first + dx.len()]);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{GemmMatMul, MatMut};

    pub(super) fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * seed).sin() * 2.0).collect()
    }

    pub(super) use crate::testing::in_pool;

    /// The one-pass epilogue against the form it replaced (the bias copied into the
    /// output, the product accumulated onto it, then the ReLU): equal bits, in pools of
    /// any size.
    #[test]
    fn forward_gives_the_bits_of_the_bias_accumulated_form() {
        let spec = MlpSpec::new(13, &[48, 24, 1], 0, false);
        let batch = 70;
        let params = values(spec.end(), 0.731);
        let input = values(batch * 13, 0.377);
        let mm = GemmMatMul;
        let mut want = spec.activation_buffers(batch);
        in_pool(2, || {
            for (l, layer) in spec.layers().iter().enumerate() {
                let (before, after) = want.split_at_mut(l);
                let x = if l == 0 {
                    &input[..]
                } else {
                    &before[l - 1][..]
                };
                let out = &mut after[0][..];
                for row in out.chunks_exact_mut(layer.outputs) {
                    row.copy_from_slice(&params[layer.bias..layer.bias + layer.outputs]);
                }
                let w = MatRef::row_major(&params[layer.weight..], layer.outputs, layer.inputs);
                mm.matmul(
                    &mut MatMut::row_major(out, batch, layer.outputs),
                    MatRef::row_major(x, batch, layer.inputs),
                    w.t(),
                    true,
                );
                if layer.relu {
                    out.iter_mut().for_each(|v| *v = v.max(0.0));
                }
            }
        });
        for threads in [1, 2, 3] {
            let mut acts = spec.activation_buffers(batch);
            let mut workspace = spec.workspace();
            in_pool(threads, || {
                spec.forward(&mm, &params, &input, &mut acts, &mut workspace, batch)
            });
            for (l, (got, want)) in acts.iter().zip(&want).enumerate() {
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "layer {l}, a pool of {threads}");
            }
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// One forward and backward of `spec` on a pool of `threads`, with `dout` as the
    /// output gradient: every layer's output, the parameter gradients (NaN where never
    /// written) and the input gradient.
    fn forward_backward(
        spec: &MlpSpec,
        params: &[f32],
        input: &[f32],
        dout: &[f32],
        batch: usize,
        threads: usize,
    ) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
        let mut acts = spec.activation_buffers(batch);
        let mut dacts = spec.activation_buffers(batch);
        let mut workspace = spec.workspace();
        let mut grads = vec![f32::NAN; spec.end()];
        let mut grad_input = vec![f32::NAN; batch * spec.input_stride()];
        in_pool(threads, || {
            spec.forward(&GemmMatMul, params, input, &mut acts, &mut workspace, batch);
            if let Some(last) = dacts.last_mut() {
                last.copy_from_slice(dout);
            }
            spec.backward(
                &GemmMatMul,
                params,
                input,
                &acts,
                &mut dacts,
                &mut grads,
                Some(&mut grad_input),
                &mut workspace,
                batch,
            );
        });
        (acts, grads, grad_input)
    }

    /// An MLP fed rows padded to whole kernel vectors computes what it computes on the
    /// unpadded rows, bit for bit: activations, every parameter gradient and the input
    /// gradient (whose padding comes back zero). Widths around a multiple of 16, in pools
    /// of one and two threads.
    #[test]
    fn padded_input_gives_the_bits_of_the_unpadded_one() {
        for inputs in [13usize, 31, 32, 33, 415] {
            let plain = MlpSpec::new(inputs, &[48, 24, 1], 0, false);
            let padded = plain.clone().with_padded_input();
            let stride = padded.input_stride();
            assert_eq!(stride, inputs.next_multiple_of(16));
            assert_eq!(padded.workspace().weight.is_empty(), stride == inputs);
            let batch = 37;
            let params = values(plain.end(), 0.731);
            let input = values(batch * inputs, 0.377);
            let mut wide_input = vec![0.0; batch * stride];
            for (wide, row) in wide_input
                .chunks_exact_mut(stride)
                .zip(input.chunks_exact(inputs))
            {
                wide[..inputs].copy_from_slice(row);
            }
            let dout = values(batch, 0.29);
            for threads in [1, 2] {
                let run = |spec: &MlpSpec, input: &[f32]| {
                    forward_backward(spec, &params, input, &dout, batch, threads)
                };
                let (acts, grads, grad_input) = run(&plain, &input);
                let (wide_acts, wide_grads, wide_grad_input) = run(&padded, &wide_input);
                for (l, (a, b)) in acts.iter().zip(&wide_acts).enumerate() {
                    assert!(same_bits(a, b), "inputs {inputs}, layer {l} output");
                }
                assert!(
                    same_bits(&grads, &wide_grads),
                    "inputs {inputs}, parameter gradients"
                );
                for (row, wide) in grad_input
                    .chunks_exact(inputs)
                    .zip(wide_grad_input.chunks_exact(stride))
                {
                    assert!(
                        same_bits(row, &wide[..inputs]),
                        "inputs {inputs}, input gradient"
                    );
                    assert!(
                        wide[inputs..].iter().all(|&g| g == 0.0),
                        "inputs {inputs}, padding"
                    );
                }
            }
        }
    }

    /// Forward and backward split over pools of 1, 2 and 3 threads give the same bits:
    /// the layers cover every way a product is split (weight gradients by output features,
    /// by inputs through the transpose, and not at all; input gradients by samples, with
    /// the ReLU mask of the layer below applied in each block).
    #[test]
    fn every_split_gives_the_bits_of_one_thread() {
        let spec = MlpSpec::new(200, &[256, 64, 8, 1], 0, false);
        let batch = 300;
        let params = values(spec.end(), 0.731);
        let input = values(batch * 200, 0.377);
        let dout = values(batch, 0.29);
        let run = |threads| forward_backward(&spec, &params, &input, &dout, batch, threads);
        let (acts, grads, grad_input) = run(1);
        assert!(
            grads.iter().all(|g| g.is_finite()),
            "every gradient written"
        );
        for threads in [2, 3] {
            let (a, g, gi) = run(threads);
            for (l, (x, y)) in acts.iter().zip(&a).enumerate() {
                assert!(same_bits(x, y), "layer {l} output, a pool of {threads}");
            }
            assert!(
                same_bits(&grads, &g),
                "parameter gradients, a pool of {threads}"
            );
            assert!(
                same_bits(&grad_input, &gi),
                "input gradient, a pool of {threads}"
            );
        }
    }
}
