//! The forward: every pair's dot product for 16 samples at once, in `dot`'s add order.

use std::arch::x86_64::*;

use super::simd::{from_lanes, load, store, to_lanes};
use super::{LANES, LanesScratch};

/// One vector of a block in the transposed layout: `dim / 16` chunks of 16 dimensions,
/// each dimension one register of 16 samples.
type Row<'a> = &'a [[[f32; LANES]; LANES]];

/// Lane `l` of `dot`'s accumulator, for `I x J` pairs `(is[a], js[b])` of 16 samples
/// each: the products of dimensions `l, l + 16, ...` added in that order. One load of
/// `z_i` feeds `J` products and one of `z_j` feeds `I`: loads, not arithmetic, bound
/// a pair alone (two 512-bit loads per multiply, one per cycle). `0 + p` is left out:
/// it changes only the sign of a zero, and the final `+ 0.0` of `dot` makes every zero
/// positive either way.
#[inline]
#[target_feature(enable = "avx512f")]
fn leaf<const I: usize, const J: usize>(zi: [Row; I], zj: [Row; J], l: usize) -> [[__m512; J]; I] {
    let mut acc = [[_mm512_setzero_ps(); J]; I];
    // Every row has the same number of 16-dimension chunks (checked in `pairs`), so
    // indexing by `c` below needs no bounds checks.
    for c in 0..zi[0].len() {
        let mut a = [_mm512_setzero_ps(); I];
        for (a, row) in a.iter_mut().zip(&zi) {
            *a = load(&row[c][l]);
        }
        let mut b = [_mm512_setzero_ps(); J];
        for (b, row) in b.iter_mut().zip(&zj) {
            *b = load(&row[c][l]);
        }
        for (acc, a) in acc.iter_mut().zip(a) {
            for (acc, b) in acc.iter_mut().zip(b) {
                let p = _mm512_mul_ps(a, b);
                *acc = if c == 0 { p } else { _mm512_add_ps(*acc, p) };
            }
        }
    }
    acc
}

#[inline]
#[target_feature(enable = "avx512f")]
fn add<const I: usize, const J: usize>(
    mut a: [[__m512; J]; I],
    b: [[__m512; J]; I],
) -> [[__m512; J]; I] {
    for (a, b) in a.iter_mut().zip(b) {
        for (a, b) in a.iter_mut().zip(b) {
            *a = _mm512_add_ps(*a, b);
        }
    }
    a
}

/// `dot`'s halving reduction, written out: width 8 adds lane `l + 8` to lane `l`, and so
/// on down to one, each node computed as soon as its two children are, so that few
/// registers are live at once. (Functions, not closures: a closure does not inherit
/// the target feature, so it is not inlined and its registers go through memory.)
#[inline]
#[target_feature(enable = "avx512f")]
fn r8<const I: usize, const J: usize>(zi: [Row; I], zj: [Row; J], l: usize) -> [[__m512; J]; I] {
    add(leaf(zi, zj, l), leaf(zi, zj, l + 8))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn r4<const I: usize, const J: usize>(zi: [Row; I], zj: [Row; J], l: usize) -> [[__m512; J]; I] {
    add(r8(zi, zj, l), r8(zi, zj, l + 4))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn r2<const I: usize, const J: usize>(zi: [Row; I], zj: [Row; J], l: usize) -> [[__m512; J]; I] {
    add(r4(zi, zj, l), r4(zi, zj, l + 2))
}

#[inline]
#[target_feature(enable = "avx512f")]
fn tree<const I: usize, const J: usize>(zi: [Row; I], zj: [Row; J]) -> [[__m512; J]; I] {
    let mut sum = add(r2(zi, zj, 0), r2(zi, zj, 1));
    for row in &mut sum {
        for v in row {
            *v = _mm512_add_ps(*v, _mm512_setzero_ps());
        }
    }
    sum
}

/// The dot products of pairs `(is[a], js[b])` into `out_t`, at the DLRM order's index
/// `i (i - 1) / 2 + j`.
#[inline]
#[target_feature(enable = "avx512f")]
fn pairs<const I: usize, const J: usize>(
    z_t: &[[[f32; LANES]; LANES]],
    dim: usize,
    is: [usize; I],
    js: [usize; J],
    out_t: &mut [[f32; LANES]],
) {
    let row = |v: usize| &z_t[v * dim / LANES..(v + 1) * dim / LANES];
    let (mut zi, mut zj) = ([row(is[0]); I], [row(js[0]); J]);
    for (r, &i) in zi.iter_mut().zip(&is) {
        *r = row(i);
    }
    for (r, &j) in zj.iter_mut().zip(&js) {
        *r = row(j);
    }
    let sums = tree(zi, zj);
    for (row, &i) in sums.iter().zip(&is) {
        for (&v, &j) in row.iter().zip(&js) {
            store(&mut out_t[i * (i - 1) / 2 + j], v);
        }
    }
}

/// One block of 16 samples: `z` into lanes, every pair's dot products into `out_t`, and
/// back into the rows of `out` after the copied bottom output.
#[target_feature(enable = "avx512f")]
pub(super) fn block(
    z: &[f32],
    vectors: usize,
    dim: usize,
    stride: usize,
    out: &mut [f32],
    scratch: &mut LanesScratch,
) {
    let sample = vectors * dim;
    let (z_t, _) = scratch.z_t.as_chunks_mut::<LANES>();
    to_lanes(z, sample, sample, z_t);
    let (out_t, _) = scratch.out_t.as_chunks_mut::<LANES>();
    let (z_t, _) = z_t.as_chunks::<LANES>();
    // Rows i and i + 1 against columns j and j + 1 together where both pairs exist
    // (j + 1 < i); the pairs left over one at a time.
    let mut i = 1;
    while i < vectors {
        let two_rows = i + 1 < vectors;
        let mut j = 0;
        while j + 1 < i {
            if two_rows {
                pairs(z_t, dim, [i, i + 1], [j, j + 1], out_t);
            } else {
                pairs(z_t, dim, [i], [j, j + 1], out_t);
            }
            j += 2;
        }
        for j in j..i {
            pairs(z_t, dim, [i], [j], out_t);
        }
        if two_rows {
            for j in j..i + 1 {
                pairs(z_t, dim, [i + 1], [j], out_t);
            }
        }
        i += if two_rows { 2 } else { 1 };
    }
    from_lanes(out_t, vectors * (vectors - 1) / 2, out, stride, dim);
    for s in 0..LANES {
        out[s * stride..s * stride + dim].copy_from_slice(&z[s * sample..s * sample + dim]);
    }
}
