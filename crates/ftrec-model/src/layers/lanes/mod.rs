//! The dot interaction with sixteen samples in the lanes of one AVX-512 register.
//!
//! [`super::interaction::dot`] puts a vector's dimensions in the lanes, so every one of a
//! sample's 351 dot products (on `tiny`) ends in a horizontal reduction: extracts and
//! narrow adds that a profile showed to take about half the forward's time. Here a block
//! of 16 samples is transposed so that lane `s` holds sample `s`: every product is a
//! vertical multiply of two loaded registers and every sum a chain of vertical adds.
//!
//! The adds follow the portable kernels' order exactly, so the bits are theirs:
//! - forward: lane `l` of `dot` sums the products of dimensions `l, l + 16, ...` in that
//!   order, then the lanes reduce by halving widths, then the empty tail is added;
//! - backward: row `i` of `dz` starts at the pass-through gradient (row 0) or zero and adds
//!   `S_ij z_j` for `j` ascending, the zero diagonal of `S` included.
//!
//! `lanes_and_portable_give_the_same_bits` checks both, signed zeros and infinities
//! included. Only AVX-512 hosts take this path, and only for `dim` a multiple of 16;
//! elsewhere (and for the last `samples % 16` samples of a chunk) the portable kernels run.
//!
//! The backward's arithmetic runs twice as fast here as in the portable kernel, but in a
//! training step the phase is bound by memory: it reads `z` and writes `dz`, 14 MB each
//! on `tiny`. What it gains in the step comes from writing `dz` with streaming stores
//! (no read of each line before it is written), and from leaving the cache to the
//! aggregation that follows.

#[cfg(target_arch = "x86_64")]
mod backward;
#[cfg(target_arch = "x86_64")]
mod forward;
#[cfg(target_arch = "x86_64")]
mod simd;

use super::interaction;

const LANES: usize = 16;

/// Per-thread scratch of one transposed block, each value one register of 16 samples:
/// `z`, the interaction's output (forward) or its gradient (backward), and `dz`.
#[derive(Clone, Debug, Default)]
pub(crate) struct LanesScratch {
    z_t: Vec<f32>,
    out_t: Vec<f32>,
    dz_t: Vec<f32>,
}

impl LanesScratch {
    /// Sized for samples of `vectors x dim`, so that a step allocates nothing.
    pub(crate) fn new(vectors: usize, dim: usize) -> Self {
        let mut scratch = Self::default();
        scratch.fit(vectors, dim);
        scratch
    }

    fn fit(&mut self, vectors: usize, dim: usize) {
        let width = dim + vectors * vectors.saturating_sub(1) / 2;
        self.z_t.resize(vectors * dim * LANES, 0.0);
        self.out_t.resize(width * LANES, 0.0);
        self.dz_t.resize(vectors * dim * LANES, 0.0);
    }
}

/// Whether this CPU and shape take the lanes path.
fn lanes_apply(dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        dim > 0 && dim.is_multiple_of(LANES) && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dim;
        false
    }
}

/// Forward over consecutive samples, as [`interaction::forward_samples`]: `z` holds whole
/// samples of `vectors x dim`, `out` one row of `stride` values per sample, of which the
/// first `dim + pairs` are written.
pub(crate) fn forward_samples(
    z: &[f32],
    vectors: usize,
    dim: usize,
    out: &mut [f32],
    scratch: &mut LanesScratch,
) {
    let samples = z.len() / (vectors * dim).max(1);
    let stride = out.len() / samples.max(1);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if lanes_apply(dim) {
        scratch.fit(vectors, dim);
        let blocks = samples / LANES;
        for b in 0..blocks {
            let zb = &z[b * LANES * vectors * dim..(b + 1) * LANES * vectors * dim];
            let ob = &mut out[b * LANES * stride..(b + 1) * LANES * stride];
            // SAFETY: `lanes_apply` detected avx512f on this CPU.
            unsafe { forward::block(zb, vectors, dim, stride, ob, scratch) };
        }
        done = blocks * LANES;
    }
    if done < samples {
        interaction::forward_samples(
            &z[done * vectors * dim..],
            vectors,
            dim,
            &mut out[done * stride..],
        );
    }
}

/// Backward over consecutive samples, as [`interaction::backward_samples`]: `dout` holds
/// one row of `stride` values per sample, `dz` is overwritten, and each sample's row 0
/// of `dz` (the bottom MLP's output gradient) is also written to `first_rows`
/// (`samples x dim`); `pair_scratch` is the portable kernel's `vectors x vectors` scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_samples(
    z: &[f32],
    vectors: usize,
    dim: usize,
    dout: &[f32],
    dz: &mut [f32],
    first_rows: &mut [f32],
    pair_scratch: &mut [f32],
    scratch: &mut LanesScratch,
) {
    let sample = vectors * dim;
    let samples = z.len() / sample.max(1);
    let stride = dout.len() / samples.max(1);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if lanes_apply(dim) {
        scratch.fit(vectors, dim);
        let blocks = samples / LANES;
        for b in 0..blocks {
            let span = b * LANES * sample..(b + 1) * LANES * sample;
            let db = &dout[b * LANES * stride..(b + 1) * LANES * stride];
            let first = &mut first_rows[b * LANES * dim..(b + 1) * LANES * dim];
            // SAFETY: `lanes_apply` detected avx512f on this CPU.
            unsafe {
                backward::block(
                    &z[span.clone()],
                    vectors,
                    dim,
                    stride,
                    db,
                    &mut dz[span],
                    first,
                    scratch,
                )
            };
        }
        done = blocks * LANES;
        // SAFETY: sse is part of x86_64. The fence orders the streaming stores of `dz`
        // before whatever this thread does next (its join with the other threads).
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    if done < samples {
        interaction::backward_samples(
            &z[done * sample..],
            vectors,
            dim,
            &dout[done * stride..],
            &mut dz[done * sample..],
            pair_scratch,
        );
        for (dst, src) in first_rows[done * dim..samples * dim]
            .chunks_exact_mut(dim)
            .zip(dz[done * sample..].chunks_exact(sample))
        {
            dst.copy_from_slice(&src[..dim]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: f32) -> Vec<f32> {
        let specials = [0.0, -0.0, 1e-40, -3.0e38, f32::INFINITY, 7.0, -7.0];
        (0..n)
            .map(|i| {
                if i % 37 == 5 {
                    specials[(i / 37) % specials.len()]
                } else {
                    ((i as f32 + seed) * 0.913).sin() * 3.0
                }
            })
            .collect()
    }

    /// The lanes path against the portable one, bit for bit, over
    /// block counts with and without a remainder, and sample rows wider than the output
    /// (padding neither written nor read as output).
    #[test]
    fn lanes_and_portable_give_the_same_bits() {
        for (vectors, dim, samples) in [
            (27usize, 64usize, 37usize),
            (5, 32, 16),
            (3, 16, 33),
            (6, 48, 5),
            (4, 16, 32),
        ] {
            let pairs = vectors * (vectors - 1) / 2;
            let stride = dim + pairs + 3;
            let mut z = values(samples * vectors * dim, vectors as f32);
            // A sample whose products are all zeros, some of them negative.
            for (d, v) in z[..vectors * dim].iter_mut().enumerate() {
                *v = if d % 2 == 0 { -0.0 } else { 0.0 };
            }
            let mut want = vec![f32::NAN; samples * stride];
            interaction::forward_samples(&z, vectors, dim, &mut want);
            let mut got = vec![f32::NAN; samples * stride];
            let mut scratch = LanesScratch::default();
            forward_samples(&z, vectors, dim, &mut got, &mut scratch);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let (s, c) = (i / stride, i % stride);
                if c < dim + pairs {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "forward v{vectors} d{dim} sample {s} col {c}: {g} vs {w}"
                    );
                } else {
                    assert!(g.is_nan(), "padding written at sample {s} col {c}");
                }
            }
            let mut dout = values(samples * stride, 0.5);
            for (i, v) in dout[..stride].iter_mut().enumerate() {
                *v = if i % 3 == 0 { -0.0 } else { 0.0 };
            }
            for s in 0..samples {
                for v in &mut dout[s * stride + dim + pairs..(s + 1) * stride] {
                    *v = f32::NAN;
                }
            }
            let mut want = vec![1.0; samples * vectors * dim];
            let mut pair_scratch = vec![0.0; vectors * vectors];
            interaction::backward_samples(&z, vectors, dim, &dout, &mut want, &mut pair_scratch);
            // Offset by one float, so that the streaming stores meet an unaligned buffer too.
            for shift in [0, 1] {
                let mut buf = vec![2.0; samples * vectors * dim + shift];
                let got = &mut buf[shift..];
                let mut first = vec![3.0; samples * dim];
                backward_samples(
                    &z,
                    vectors,
                    dim,
                    &dout,
                    got,
                    &mut first,
                    &mut pair_scratch,
                    &mut scratch,
                );
                for (s, row) in first.chunks_exact(dim).enumerate() {
                    let want_row = &want[s * vectors * dim..s * vectors * dim + dim];
                    assert!(
                        row.iter()
                            .zip(want_row)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "first row of sample {s}"
                    );
                }
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "backward v{vectors} d{dim} shift {shift} at {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
