//! DLRM dot interaction. Per sample, `z` holds `vectors` rows of `dim` values: row 0 is the
//! bottom-MLP output and rows 1.. the pooled embeddings. The output is row 0 followed by
//! the dot products of all pairs `(i, j)` with `j < i`, in the DLRM reference's order
//! `(1,0), (2,0), (2,1), (3,0), ...`.

/// A dot product with 16 independent accumulators: vectorises without `-ffast-math`
/// and always adds in the same order, so it is deterministic.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    // Fixed-size chunks let LLVM keep the 16 accumulators in whole vector registers.
    let (a_chunks, a_tail) = a.as_chunks::<LANES>();
    let (b_chunks, b_tail) = b.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for (ca, cb) in a_chunks.iter().zip(b_chunks) {
        for i in 0..LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a_tail.iter().zip(b_tail) {
        tail += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0] + tail
}

#[inline(always)]
/// Forward for one sample: `out` gets `dim + vectors*(vectors-1)/2` values.
pub(crate) fn forward(z: &[f32], vectors: usize, dim: usize, out: &mut [f32]) {
    out[..dim].copy_from_slice(&z[..dim]);
    let mut k = dim;
    for i in 1..vectors {
        let zi = &z[i * dim..(i + 1) * dim];
        for j in 0..i {
            out[k] = dot(zi, &z[j * dim..(j + 1) * dim]);
            k += 1;
        }
    }
}

#[inline(always)]
/// Backward for one sample: `dz` (same shape as `z`) is overwritten with dLoss/dz given
/// `dout`, the gradient of the interaction output. Row `i` of `dz` is `sum_j S_ij z_j`,
/// where `S` is the symmetric matrix of pair gradients with a zero diagonal (built in
/// `s`, `vectors x vectors` scratch), plus the pass-through gradient for row 0. Each
/// output chunk of 16 lanes is accumulated in registers over `j` in ascending order, so
/// the reduction order is fixed.
pub(crate) fn backward(
    z: &[f32],
    vectors: usize,
    dim: usize,
    dout: &[f32],
    dz: &mut [f32],
    s: &mut [f32],
) {
    const LANES: usize = 16;
    let mut k = dim;
    for i in 0..vectors {
        s[i * vectors + i] = 0.0;
        for j in 0..i {
            s[i * vectors + j] = dout[k];
            s[j * vectors + i] = dout[k];
            k += 1;
        }
    }
    if dim.is_multiple_of(LANES) {
        let per_row = dim / LANES;
        let (zc, _) = z[..vectors * dim].as_chunks::<LANES>();
        let (dzc, _) = dz[..vectors * dim].as_chunks_mut::<LANES>();
        let (doc, _) = dout[..dim].as_chunks::<LANES>();
        // Four rows of dz at a time share each load of z_j. The last `vectors % 4` rows go
        // together through the same kernel: one at a time, each of their sums would be one
        // chain of dependent additions, three cycles each (for 27 vectors, by a count of
        // cycles, a sixth of the kernel's time).
        let blocks = vectors / 4 * 4;
        for i0 in (0..blocks).step_by(4) {
            rows_of_dz::<4>(i0, vectors, per_row, zc, doc, s, dzc);
        }
        match vectors - blocks {
            3 => rows_of_dz::<3>(blocks, vectors, per_row, zc, doc, s, dzc),
            2 => rows_of_dz::<2>(blocks, vectors, per_row, zc, doc, s, dzc),
            1 => rows_of_dz::<1>(blocks, vectors, per_row, zc, doc, s, dzc),
            _ => {}
        }
    } else {
        for i in 0..vectors {
            let srow = &s[i * vectors..(i + 1) * vectors];
            for d in 0..dim {
                let mut acc = if i == 0 { dout[d] } else { 0.0 };
                for (j, &sij) in srow.iter().enumerate() {
                    acc += sij * z[j * dim + d];
                }
                dz[i * dim + d] = acc;
            }
        }
    }
}

/// Rows `i0..i0 + R` of dZ, 16 lanes at a time: `sum_j S_ij z_j` (plus the pass-through
/// gradient for row 0). S is symmetric, so the R values of S each `z_j` is scaled by are
/// contiguous in S's row `j`, and one load of `z_j` feeds R rows; each lane still adds
/// over `j` in ascending order, so the bits do not depend on R.
#[inline(always)]
fn rows_of_dz<const R: usize>(
    i0: usize,
    vectors: usize,
    per_row: usize,
    zc: &[[f32; 16]],
    doc: &[[f32; 16]],
    s: &[f32],
    dzc: &mut [[f32; 16]],
) {
    for c in 0..per_row {
        let mut acc = [[0.0f32; 16]; R];
        if i0 == 0 {
            acc[0] = doc[c];
        }
        for j in 0..vectors {
            let zj = &zc[j * per_row + c];
            let sj = &s[j * vectors + i0..j * vectors + i0 + R];
            for (acc, &sij) in acc.iter_mut().zip(sj) {
                for l in 0..16 {
                    acc[l] += sij * zj[l];
                }
            }
        }
        for (r, acc) in acc.into_iter().enumerate() {
            dzc[(i0 + r) * per_row + c] = acc;
        }
    }
}

/// Forward over consecutive samples (`z` and `out` hold whole samples), compiled for the
/// best SIMD level of the running CPU. No fast-math, so every level gives the same bits.
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn forward_samples(z: &[f32], vectors: usize, dim: usize, out: &mut [f32]) {
    let width = out.len() / (z.len() / (vectors * dim)).max(1);
    for (zs, o) in z
        .chunks_exact(vectors * dim)
        .zip(out.chunks_exact_mut(width))
    {
        forward(zs, vectors, dim, o);
    }
}

/// Backward over consecutive samples; see [`forward_samples`].
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn backward_samples(
    z: &[f32],
    vectors: usize,
    dim: usize,
    dout: &[f32],
    dz: &mut [f32],
    scratch: &mut [f32],
) {
    let width = dout.len() / (z.len() / (vectors * dim)).max(1);
    for ((zs, d), dzs) in z
        .chunks_exact(vectors * dim)
        .zip(dout.chunks_exact(width))
        .zip(dz.chunks_exact_mut(vectors * dim))
    {
        backward(zs, vectors, dim, d, dzs, scratch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_order_and_values_follow_the_reference() {
        // z0 = (1,0), z1 = (0,2), z2 = (3,1)
        let z = [1.0, 0.0, 0.0, 2.0, 3.0, 1.0];
        let mut out = [0.0; 5];
        forward(&z, 3, 2, &mut out);
        // bottom copy, then (1,0)=0, (2,0)=3, (2,1)=2
        assert_eq!(out, [1.0, 0.0, 0.0, 3.0, 2.0]);
    }

    /// Both backward paths (16-lane chunks and the scalar fallback) against the pairwise
    /// definition in float64.
    #[test]
    fn backward_matches_pairwise_definition() {
        for (vectors, dim) in [(5usize, 32usize), (4, 20), (27, 64)] {
            let z: Vec<f32> = (0..vectors * dim)
                .map(|i| (i as f32 * 0.731).sin())
                .collect();
            let width = dim + vectors * (vectors - 1) / 2;
            let dout: Vec<f32> = (0..width).map(|i| (i as f32 * 0.377).cos()).collect();
            let mut dz = vec![f32::NAN; vectors * dim];
            let mut scratch = vec![f32::NAN; vectors * vectors];
            backward(&z, vectors, dim, &dout, &mut dz, &mut scratch);
            let mut want = vec![0.0f64; vectors * dim];
            for d in 0..dim {
                want[d] = dout[d] as f64;
            }
            let mut k = dim;
            for i in 1..vectors {
                for j in 0..i {
                    for d in 0..dim {
                        want[i * dim + d] += dout[k] as f64 * z[j * dim + d] as f64;
                        want[j * dim + d] += dout[k] as f64 * z[i * dim + d] as f64;
                    }
                    k += 1;
                }
            }
            for (idx, (g, w)) in dz.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() < 1e-4,
                    "v{vectors} d{dim} [{idx}]: {g} vs {w}"
                );
            }
            let mut out = vec![0.0; width];
            forward(&z, vectors, dim, &mut out);
            let mut k = dim;
            for i in 1..vectors {
                for j in 0..i {
                    let w: f64 = (0..dim)
                        .map(|d| z[i * dim + d] as f64 * z[j * dim + d] as f64)
                        .sum();
                    assert!((out[k] as f64 - w).abs() < 1e-4, "pair ({i},{j})");
                    k += 1;
                }
            }
        }
    }

    /// Backward's four-row blocks against one row at a time, in the same lane order (and
    /// forward against `dot`): equal bits, so a model's digest does not depend on the
    /// blocking.
    #[test]
    fn blocked_kernels_give_the_bits_of_one_at_a_time() {
        for (vectors, dim) in [(5usize, 32usize), (8, 16), (27, 64), (3, 48), (6, 16)] {
            let z: Vec<f32> = (0..vectors * dim)
                .map(|i| (i as f32 * 0.913).sin() * 3.0)
                .collect();
            let width = dim + vectors * (vectors - 1) / 2;
            let mut out = vec![0.0; width];
            forward(&z, vectors, dim, &mut out);
            let mut k = dim;
            for i in 1..vectors {
                for j in 0..i {
                    let want = dot(&z[i * dim..(i + 1) * dim], &z[j * dim..(j + 1) * dim]);
                    assert_eq!(
                        out[k].to_bits(),
                        want.to_bits(),
                        "v{vectors} pair ({i},{j})"
                    );
                    k += 1;
                }
            }
            let dout: Vec<f32> = (0..width).map(|i| (i as f32 * 0.291).cos()).collect();
            let mut dz = vec![f32::NAN; vectors * dim];
            let mut s = vec![f32::NAN; vectors * vectors];
            backward(&z, vectors, dim, &dout, &mut dz, &mut s);
            for i in 0..vectors {
                for d in 0..dim {
                    let mut want = if i == 0 { dout[d] } else { 0.0 };
                    for j in 0..vectors {
                        want += s[i * vectors + j] * z[j * dim + d];
                    }
                    let got = dz[i * dim + d];
                    assert_eq!(got.to_bits(), want.to_bits(), "v{vectors} dz[{i}][{d}]");
                }
            }
        }
    }

    #[test]
    fn dot_matches_f64_for_odd_lengths() {
        for n in [1usize, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }
}
