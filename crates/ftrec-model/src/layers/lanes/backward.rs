//! The backward: `dz_i = sum_j S_ij z_j` (plus the pass-through gradient for row 0) for
//! 16 samples at once, each sum over `j` ascending as in the portable kernel.

use std::arch::x86_64::*;

use super::simd::{from_lanes, from_lanes_streaming, load, store, to_lanes};
use super::{LANES, LanesScratch};

/// Dimensions of `dz` computed together: with four rows, 16 independent add chains and
/// eight loads per 16 multiplies.
const DIMS: usize = 4;

/// Rows `i0..i0 + R`, dimensions `d0..d0 + DIMS` of `dz` in lanes. `dout_t` is the output gradient in lanes: the
/// pass-through part, then one register per pair in the DLRM order, so `S_ij` (`j < i`) is
/// `dout_t[dim + i (i - 1) / 2 + j]`, `S` is symmetric and its diagonal is zero (and is
/// still multiplied, as the portable kernel does, so infinities give the same NaNs).
#[inline]
#[target_feature(enable = "avx512f")]
fn rows<const R: usize>(
    i0: usize,
    d0: usize,
    vectors: usize,
    dim: usize,
    z_t: &[[f32; LANES]],
    dout_t: &[[f32; LANES]],
    dz_t: &mut [[f32; LANES]],
) {
    let zero = _mm512_setzero_ps();
    let pair = |i: usize, j: usize| {
        let (hi, lo) = if i > j { (i, j) } else { (j, i) };
        dim + hi * (hi - 1) / 2 + lo
    };
    {
        let mut acc = [[zero; DIMS]; R];
        if i0 == 0 {
            for (b, acc) in acc[0].iter_mut().enumerate() {
                *acc = load(&dout_t[d0 + b]);
            }
        }
        for j in 0..vectors {
            let mut s = [zero; R];
            for (a, s) in s.iter_mut().enumerate() {
                if i0 + a != j {
                    *s = load(&dout_t[pair(i0 + a, j)]);
                }
            }
            let mut zj = [zero; DIMS];
            for (b, zj) in zj.iter_mut().enumerate() {
                *zj = load(&z_t[j * dim + d0 + b]);
            }
            for (acc, s) in acc.iter_mut().zip(s) {
                for (acc, zj) in acc.iter_mut().zip(zj) {
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(s, zj));
                }
            }
        }
        for (a, acc) in acc.into_iter().enumerate() {
            for (b, acc) in acc.into_iter().enumerate() {
                store(&mut dz_t[(i0 + a) * dim + d0 + b], acc);
            }
        }
    }
}

/// One block of 16 samples: `z` and `dout` into lanes, `dz` in lanes four rows at a time,
/// and back into the rows of `dz`; its row 0 (16 x `dim`) also into `first_rows`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) fn block(
    z: &[f32],
    vectors: usize,
    dim: usize,
    stride: usize,
    dout: &[f32],
    dz: &mut [f32],
    first_rows: &mut [f32],
    scratch: &mut LanesScratch,
) {
    let sample = vectors * dim;
    let width = dim + vectors * (vectors - 1) / 2;
    let (z_t, _) = scratch.z_t.as_chunks_mut::<LANES>();
    to_lanes(z, sample, sample, z_t);
    let (dout_t, _) = scratch.out_t.as_chunks_mut::<LANES>();
    to_lanes(dout, stride, width, dout_t);
    let (dz_t, _) = scratch.dz_t.as_chunks_mut::<LANES>();
    let (z_t, dout_t) = (&*z_t, &*dout_t);
    // Dimensions outer, rows inner: the `DIMS` registers of every `z_j` that a group of
    // dimensions reads (7 KB on `tiny`) stay in L1 across all the rows, where the whole
    // block in lanes (110 KB) would not.
    let blocks = vectors / 4 * 4;
    for d0 in (0..dim).step_by(DIMS) {
        for i0 in (0..blocks).step_by(4) {
            rows::<4>(i0, d0, vectors, dim, z_t, dout_t, dz_t);
        }
        match vectors - blocks {
            3 => rows::<3>(blocks, d0, vectors, dim, z_t, dout_t, dz_t),
            2 => rows::<2>(blocks, d0, vectors, dim, z_t, dout_t, dz_t),
            1 => rows::<1>(blocks, d0, vectors, dim, z_t, dout_t, dz_t),
            _ => {}
        }
    }
    from_lanes_streaming(dz_t, sample, dz, sample, 0);
    // Row 0 of dz again, with ordinary stores: the bottom MLP's backward reads it next,
    // and `dz` itself has just gone to memory.
    from_lanes(&dz_t[..dim], dim, first_rows, dim, 0);
}
