//! DLRM dot interaction. Per sample, `z` holds `vectors` rows of `dim` values: row 0 is the
//! bottom-MLP output and rows 1.. the pooled embeddings. The output is row 0 followed by
//! the dot products of all pairs `(i, j)` with `j < i`, in the DLRM reference's order
//! `(1,0), (2,0), (2,1), (3,0), ...`.

/// A dot product with 16 independent accumulators: vectorises without `-ffast-math`
/// and always adds in the same order, so it is deterministic.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let chunks = a.len() / LANES * LANES;
    for (ca, cb) in a[..chunks]
        .chunks_exact(LANES)
        .zip(b[..chunks].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a[chunks..].iter().zip(&b[chunks..]) {
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
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
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
/// `dout`, the gradient of the interaction output.
pub(crate) fn backward(z: &[f32], vectors: usize, dim: usize, dout: &[f32], dz: &mut [f32]) {
    dz.fill(0.0);
    dz[..dim].copy_from_slice(&dout[..dim]);
    let mut k = dim;
    for i in 1..vectors {
        for j in 0..i {
            let g = dout[k];
            k += 1;
            if g == 0.0 {
                continue;
            }
            let (lo, hi) = dz.split_at_mut(i * dim);
            axpy(&mut hi[..dim], g, &z[j * dim..(j + 1) * dim]);
            axpy(
                &mut lo[j * dim..(j + 1) * dim],
                g,
                &z[i * dim..(i + 1) * dim],
            );
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
) {
    let width = dout.len() / (z.len() / (vectors * dim)).max(1);
    for ((zs, d), dzs) in z
        .chunks_exact(vectors * dim)
        .zip(dout.chunks_exact(width))
        .zip(dz.chunks_exact_mut(vectors * dim))
    {
        backward(zs, vectors, dim, d, dzs);
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
