//! The forward dot interaction with sixteen samples in the lanes of one AVX-512 register.
//!
//! [`super::interaction::dot`] puts a vector's dimensions in the lanes, so every one of a
//! sample's 351 dot products (on `tiny`) ends in a horizontal reduction: extracts and
//! narrow adds that a profile showed to take about half the forward's time. Here a block
//! of 16 samples is transposed so that lane `s` holds sample `s`; a dot product is then
//! only vertical multiplies and adds, and the horizontal tree becomes adds between
//! registers. The adds follow `dot`'s order exactly (lane `l` of `dot` sums the products
//! of dimensions `l, l + 16, l + 32, ...` in that order, then the lanes reduce by halving
//! widths, then the empty tail is added), so the bits are those of the portable path:
//! `forward_and_lanes_give_the_same_bits` checks it, signed zeros and infinities included.
//!
//! Only AVX-512 hosts take this path, and only for `dim` a multiple of 16; everything
//! else (and the last `samples % 16` samples of a chunk) uses the portable forward.

use super::interaction;

const LANES: usize = 16;

/// Per-thread scratch of the transposed block: `vectors * dim` registers' worth of `z`,
/// and one register per pair of the output.
#[derive(Clone, Debug, Default)]
pub(crate) struct LanesScratch {
    z_t: Vec<f32>,
    out_t: Vec<f32>,
}

impl LanesScratch {
    /// Sized for samples of `vectors x dim`, so that a step allocates nothing.
    pub(crate) fn new(vectors: usize, dim: usize) -> Self {
        Self {
            z_t: vec![0.0; vectors * dim * LANES],
            out_t: vec![0.0; vectors * vectors.saturating_sub(1) / 2 * LANES],
        }
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
    if dim.is_multiple_of(LANES) && dim > 0 && std::arch::is_x86_feature_detected!("avx512f") {
        let pairs = vectors * (vectors - 1) / 2;
        scratch.z_t.resize(vectors * dim * LANES, 0.0);
        scratch.out_t.resize(pairs * LANES, 0.0);
        let blocks = samples / LANES;
        for b in 0..blocks {
            let zb = &z[b * LANES * vectors * dim..(b + 1) * LANES * vectors * dim];
            let ob = &mut out[b * LANES * stride..(b + 1) * LANES * stride];
            // SAFETY: avx512f was detected on this CPU just above.
            unsafe { avx512::block(zb, vectors, dim, stride, ob, scratch) };
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{LANES, LanesScratch};

    /// One vector of a block in the transposed layout: `dim / 16` chunks of 16 dimensions,
    /// each dimension one register of 16 samples.
    type Row<'a> = &'a [[[f32; LANES]; LANES]];

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn load(v: &[f32; LANES]) -> __m512 {
        // SAFETY: `v` is 16 readable floats, and the unaligned load has no alignment
        // requirement.
        unsafe { _mm512_loadu_ps(v.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn store(v: &mut [f32; LANES], x: __m512) {
        // SAFETY: `v` is 16 writable floats, exclusively borrowed; unaligned store.
        unsafe { _mm512_storeu_ps(v.as_mut_ptr(), x) }
    }

    /// Transposes 16 registers in place: afterwards `r[i]` lane `j` is the old `r[j]` lane
    /// `i`. Interleave pairs of rows, then pairs of pairs, then 128-bit quarters twice.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose(r: &mut [__m512; 16]) {
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for i in 0..4 {
            let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
            r[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
            r[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
            r[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
            r[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
        }
        for h in 0..2 {
            for i in 0..4 {
                t[8 * h + i] = _mm512_shuffle_f32x4::<0x88>(r[8 * h + i], r[8 * h + i + 4]);
                t[8 * h + i + 4] = _mm512_shuffle_f32x4::<0xDD>(r[8 * h + i], r[8 * h + i + 4]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[i + 8]);
            r[i + 8] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[i + 8]);
        }
    }

    /// Lane `l` of `dot`'s accumulator, for `I x J` pairs `(is[a], js[b])` of 16 samples
    /// each: the products of dimensions `l, l + 16, ...` added in that order. One load of
    /// `z_i` feeds `J` products and one of `z_j` feeds `I`: loads, not arithmetic, bound
    /// a pair alone (two 512-bit loads per multiply, one per cycle). `0 + p` is left out:
    /// it changes only the sign of a zero, and the final `+ 0.0` of `dot` makes every zero
    /// positive either way.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn leaf<const I: usize, const J: usize>(
        zi: [Row; I],
        zj: [Row; J],
        l: usize,
    ) -> [[__m512; J]; I] {
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
    fn r8<const I: usize, const J: usize>(
        zi: [Row; I],
        zj: [Row; J],
        l: usize,
    ) -> [[__m512; J]; I] {
        add(leaf(zi, zj, l), leaf(zi, zj, l + 8))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn r4<const I: usize, const J: usize>(
        zi: [Row; I],
        zj: [Row; J],
        l: usize,
    ) -> [[__m512; J]; I] {
        add(r8(zi, zj, l), r8(zi, zj, l + 4))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn r2<const I: usize, const J: usize>(
        zi: [Row; I],
        zj: [Row; J],
        l: usize,
    ) -> [[__m512; J]; I] {
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

    /// One block of 16 samples: transpose `z` into `z_t` (`[vector][dim]` registers of 16
    /// samples), every pair's dot products into `out_t`, and back into the rows of `out`.
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
        for v in 0..vectors {
            for c in (0..dim).step_by(LANES) {
                let mut r = [_mm512_setzero_ps(); 16];
                for (s, r) in r.iter_mut().enumerate() {
                    let at = s * sample + v * dim + c;
                    *r = load(&z[at..at + LANES].as_chunks::<LANES>().0[0]);
                }
                transpose(&mut r);
                for (k, r) in r.into_iter().enumerate() {
                    store(&mut z_t[v * dim + c + k], r);
                }
            }
        }
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
        let k = vectors * (vectors - 1) / 2;
        // Back to rows: whole 16-pair groups through the register transpose, the rest one
        // value at a time.
        let whole = k / LANES * LANES;
        for g in (0..whole).step_by(LANES) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (p, r) in r.iter_mut().enumerate() {
                *r = load(&out_t[g + p]);
            }
            transpose(&mut r);
            for (s, r) in r.into_iter().enumerate() {
                let at = s * stride + dim + g;
                store(&mut out[at..at + LANES].as_chunks_mut::<LANES>().0[0], r);
            }
        }
        for (p, pair) in out_t.iter().enumerate().take(k).skip(whole) {
            for (s, &v) in pair.iter().enumerate() {
                out[s * stride + dim + p] = v;
            }
        }
        for s in 0..LANES {
            out[s * stride..s * stride + dim].copy_from_slice(&z[s * sample..s * sample + dim]);
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

    /// The lanes path against the portable one, bit for bit, over block counts with and
    /// without a remainder, and sample rows wider than the output (padding left alone).
    #[test]
    fn forward_and_lanes_give_the_same_bits() {
        for (vectors, dim, samples) in [
            (27usize, 64usize, 37usize),
            (5, 32, 16),
            (3, 16, 33),
            (6, 48, 5),
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
            forward_samples(&z, vectors, dim, &mut got, &mut LanesScratch::default());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let (s, c) = (i / stride, i % stride);
                if c < dim + pairs {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "v{vectors} d{dim} sample {s} col {c}: {g} vs {w}"
                    );
                } else {
                    assert!(g.is_nan(), "padding written at sample {s} col {c}");
                }
            }
        }
    }
}
