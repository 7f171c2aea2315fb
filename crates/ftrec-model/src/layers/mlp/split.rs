//! How the MLP shares a product between the pool's threads: blocks of output rows, each
//! one serial kernel call followed by its epilogue, and the epilogues themselves.

use rayon::prelude::*;

use super::KERNEL_WIDTH;
use crate::matmul::{MatMul, MatMut, MatRef};

/// `row + bias`, then the ReLU where `relu`: the layer's epilogue, one pass over rows the
/// product wrote. `bias + product` is the same IEEE sum as the product accumulated onto a
/// copy of the bias, so the bits are those of that older two-pass form.
#[multiversion::multiversion(targets = "simd")]
pub(super) fn add_bias(rows: &mut [f32], bias: &[f32], relu: bool) {
    for row in rows.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            let sum = *v + b;
            *v = if relu { sum.max(0.0) } else { sum };
        }
    }
}

/// Zeroes gradients where the ReLU output was not positive.
#[multiversion::multiversion(targets = "simd")]
pub(super) fn relu_mask(grads: &mut [f32], outputs: &[f32]) {
    for (g, a) in grads.iter_mut().zip(outputs) {
        if *a <= 0.0 {
            *g = 0.0;
        }
    }
}

/// `sums[j] = sum_i rows[i][j]` over columns `first..first + sums.len()` of rows `width`
/// wide, rows added in order: a fixed reduction order, whatever the column split.
#[multiversion::multiversion(targets = "simd")]
fn column_sums(rows: &[f32], width: usize, first: usize, sums: &mut [f32]) {
    sums.fill(0.0);
    for row in rows.chunks_exact(width) {
        for (d, g) in sums.iter_mut().zip(&row[first..]) {
            *d += g;
        }
    }
}

/// A part of a split product has more rows than this: gemm takes a different path, with
/// a different depth blocking, for products of at most 64 rows and 64 columns.
pub(super) const MIN_ROWS_PER_PART: usize = 64;

/// Rows per task when a product's `rows` output rows, `cols` wide, are shared by the
/// pool's threads: about one block per thread, a whole number of 16-row tiles, every block
/// more than [`MIN_ROWS_PER_PART`] rows; all rows in one task when that cannot be met or
/// when the output is narrower than a kernel vector (gemm's matrix-vector paths reduce in
/// an order that depends on the row count). So each output element is reduced by the same
/// kernel, in the same order, whatever the pool: the split changes no bit.
pub(super) fn rows_per_part(rows: usize, cols: usize) -> usize {
    if cols >= KERNEL_WIDTH {
        for parts in (2..=rayon::current_num_threads()).rev() {
            let per = rows.div_ceil(parts).next_multiple_of(16);
            let last = rows - per * (rows.div_ceil(per) - 1);
            if per > MIN_ROWS_PER_PART && last > MIN_ROWS_PER_PART {
                return per;
            }
        }
    }
    rows.max(1)
}

/// Bias gradients, one column block per thread; each column still sums its rows in order.
fn bias_gradients(dz: &[f32], width: usize, db: &mut [f32]) {
    // Whole 8-lane vectors per block, and no split of a narrow layer.
    let block = width
        .div_ceil(rayon::current_num_threads().max(1))
        .div_ceil(8)
        .max(1)
        * 8;
    db.par_chunks_mut(block)
        .enumerate()
        .for_each(|(b, sums)| column_sums(dz, width, b * block, sums));
}

/// `dst [rows of lhs x width] = lhs rhs`, one task per block of `rows` output rows, each
/// followed by `then(first row, block)` while the block is still in cache.
pub(super) fn product_by_rows(
    mm: &dyn MatMul,
    dst: &mut [f32],
    width: usize,
    rows: usize,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    then: impl Fn(usize, &mut [f32]) + Sync,
) {
    dst.par_chunks_mut(rows * width)
        .enumerate()
        .for_each(|(part, block)| {
            let count = block.len() / width;
            mm.matmul(
                &mut MatMut::row_major(block, count, width),
                lhs.rows_sub(part * rows, count),
                rhs,
                false,
            );
            then(part * rows, block);
        });
}

/// `weight_grad [outputs x inputs] = dz^T x` and `db = column sums of dz`, one task per
/// pool thread over a block of output features (rows of the weight gradient). A layer with
/// too few outputs to split computes the transpose, `x^T dz`, split over its inputs, and
/// transposes it back: each element is still one kernel's sum over the samples.
pub(super) fn weight_gradients(
    mm: &dyn MatMul,
    weight_grad: &mut [f32],
    transposed: &mut Vec<f32>,
    db: &mut [f32],
    dz: MatRef<'_>,
    x: MatRef<'_>,
) {
    let (outputs, inputs) = (dz.cols(), x.cols());
    let weight_grad = &mut weight_grad[..outputs * inputs];
    let dz_t = dz.t();
    let dz_data = &dz.data()[..dz.rows() * outputs];
    let rows = rows_per_part(outputs, inputs);
    if rows < outputs {
        weight_grad
            .par_chunks_mut(rows * inputs)
            .zip(db.par_chunks_mut(rows))
            .enumerate()
            .for_each(|(part, (weight_grad, db))| {
                let count = db.len();
                mm.matmul(
                    &mut MatMut::row_major(weight_grad, count, inputs),
                    dz_t.rows_sub(part * rows, count),
                    x,
                    false,
                );
                column_sums(dz_data, outputs, part * rows, db);
            });
        return;
    }
    let input_rows = rows_per_part(inputs, outputs);
    if input_rows >= inputs {
        mm.matmul(
            &mut MatMut::row_major(weight_grad, outputs, inputs),
            dz_t,
            x,
            false,
        );
        bias_gradients(dz_data, outputs, db);
        return;
    }
    transposed.resize(inputs * outputs, 0.0);
    let transposed = &mut transposed[..inputs * outputs];
    product_by_rows(mm, transposed, outputs, input_rows, x.t(), dz, |_, _| {});
    for (i, row) in transposed.chunks_exact(outputs).enumerate() {
        for (o, &g) in row.iter().enumerate() {
            weight_grad[o * inputs + i] = g;
        }
    }
    bias_gradients(dz_data, outputs, db);
}

#[cfg(test)]
mod tests {
    use super::super::tests::{in_pool, values};
    use super::*;

    /// Bias gradients split by columns over the pool: each column's rows still add in
    /// order, so the bits match one thread's sums.
    #[test]
    fn bias_gradients_do_not_depend_on_the_pool() {
        for width in [1usize, 7, 64, 100, 512] {
            let rows = 33;
            let dz = values(rows * width, 0.913);
            let mut serial = vec![0.0; width];
            for row in dz.chunks_exact(width) {
                for (s, g) in serial.iter_mut().zip(row) {
                    *s += g;
                }
            }
            for threads in [1, 2, 3] {
                let mut db = vec![f32::NAN; width];
                in_pool(threads, || bias_gradients(&dz, width, &mut db));
                let same = db
                    .iter()
                    .zip(&serial)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "width {width}, a pool of {threads}");
            }
        }
    }
}
