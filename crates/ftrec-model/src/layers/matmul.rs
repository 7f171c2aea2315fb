//! The one dense kernel the model needs, behind a small trait so the backend can change
//! (and so tests can run the same layer code on a plain reference implementation).

/// A read-only strided view of a row-major or transposed matrix.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// A mutable row-major matrix view (destinations are always row-major in this crate).
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
}

fn span(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * row_stride + (cols - 1) * col_stride + 1
    }
}

impl<'a> MatRef<'a> {
    /// A `rows x cols` row-major matrix stored at the start of `data`.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// Shapes come from the model definition, never from user data, so a mismatch is a
    /// programming error and panics here rather than corrupting memory in the kernel.
    pub fn strided(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        assert!(
            span(rows, cols, row_stride, col_stride) <= data.len(),
            "matrix view {rows}x{cols} (strides {row_stride},{col_stride}) exceeds buffer of {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// Rows `first..first + rows` of this view (of a transposed view too: its rows are
    /// the columns of the matrix underneath); no data moves.
    pub fn rows_sub(self, first: usize, rows: usize) -> Self {
        assert!(
            first + rows <= self.rows,
            "rows {first}..{} of a {}-row view",
            first + rows,
            self.rows
        );
        let offset = (first * self.row_stride).min(self.data.len());
        Self::strided(
            &self.data[offset..],
            rows,
            self.cols,
            self.row_stride,
            self.col_stride,
        )
    }

    /// The transposed view; no data moves.
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The buffer the view reads.
    pub fn data(&self) -> &'a [f32] {
        self.data
    }
    pub fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.row_stride + c * self.col_stride]
    }
}

impl<'a> MatMut<'a> {
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        assert!(
            rows * cols <= data.len(),
            "matrix {rows}x{cols} exceeds buffer of {}",
            data.len()
        );
        Self { data, rows, cols }
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// `dst = lhs · rhs` (or `dst += lhs · rhs` when `accumulate`).
///
/// Implementations must be deterministic for a fixed thread count: the same inputs give
/// the same bits, because every equivalence test in ftrec compares states bit for bit.
pub trait MatMul: Send + Sync {
    fn matmul(&self, dst: &mut MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool);
}

fn check_shapes(dst: &MatMut<'_>, lhs: &MatRef<'_>, rhs: &MatRef<'_>) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    assert_eq!(dst.rows, lhs.rows, "output rows differ");
    assert_eq!(dst.cols, rhs.cols, "output cols differ");
}

/// The production backend: the `gemm` crate (runtime-dispatched AVX2/AVX-512 kernels), one
/// call on the calling thread. The layers split a product over the pool themselves, by
/// output rows (`MatRef::rows_sub`): gemm's own rayon split forks and joins once per depth
/// block and per packing pass, and on a two-core host the idle thread falls asleep between
/// them. gemm's depth loop is sequential and its depth blocking depends on the depth alone,
/// so each output element is reduced in the same order whichever block of rows it is
/// computed in.
#[derive(Clone, Copy, Debug, Default)]
pub struct GemmMatMul;

impl MatMul for GemmMatMul {
    fn matmul(&self, dst: &mut MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool) {
        check_shapes(dst, &lhs, &rhs);
        let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            if !accumulate {
                dst.data[..m * n].fill(0.0);
            }
            return;
        }
        // SAFETY: every pointer/stride triple was bounds-checked when its view was built
        // (`MatRef::strided`, `MatMut::row_major`): the largest offset the kernel can touch,
        // (rows-1)*row_stride + (cols-1)*col_stride, lies inside the borrowed slice, and
        // check_shapes ties m, n, k to those views. `dst` is borrowed mutably while `lhs`
        // and `rhs` are shared borrows, so the output cannot alias an input. Strides fit in
        // isize because they index allocated slices.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.data.as_mut_ptr(),
                1,
                n as isize,
                accumulate,
                lhs.data.as_ptr(),
                lhs.col_stride as isize,
                lhs.row_stride as isize,
                rhs.data.as_ptr(),
                rhs.col_stride as isize,
                rhs.row_stride as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// A plain triple loop: the reference the gemm backend and the layers are tested against.
#[derive(Clone, Copy, Debug, Default)]
pub struct NaiveMatMul;

impl MatMul for NaiveMatMul {
    fn matmul(&self, dst: &mut MatMut<'_>, lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool) {
        check_shapes(dst, &lhs, &rhs);
        let n = dst.cols;
        for i in 0..dst.rows {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..lhs.cols {
                    acc += lhs.at(i, p) * rhs.at(p, j);
                }
                let out = &mut dst.data[i * n + j];
                *out = if accumulate { *out + acc } else { acc };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reference(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f64> {
        let mut out = vec![0.0f64; a.rows() * b.cols()];
        for i in 0..a.rows() {
            for j in 0..b.cols() {
                out[i * b.cols() + j] = (0..a.cols())
                    .map(|p| a.at(i, p) as f64 * b.at(p, j) as f64)
                    .sum();
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn gemm_matches_f64_reference_for_all_transpositions(
            m in 1usize..40, n in 1usize..40, k in 1usize..70,
            ta in any::<bool>(), tb in any::<bool>(), acc in any::<bool>(), seed in any::<u64>(),
        ) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5 };
            let a: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let b: Vec<f32> = (0..k * n).map(|_| next()).collect();
            let init: Vec<f32> = (0..m * n).map(|_| next()).collect();
            let av = if ta { MatRef::row_major(&a, k, m).t() } else { MatRef::row_major(&a, m, k) };
            let bv = if tb { MatRef::row_major(&b, n, k).t() } else { MatRef::row_major(&b, k, n) };
            let mut out = init.clone();
            GemmMatMul.matmul(&mut MatMut::row_major(&mut out, m, n), av, bv, acc);
            let want = reference(av, bv);
            for i in 0..m * n {
                let w = want[i] + if acc { init[i] as f64 } else { 0.0 };
                prop_assert!((out[i] as f64 - w).abs() <= 1e-5 * (1.0 + w.abs() + k as f64 * 0.25),
                    "element {i}: got {} want {w}", out[i]);
            }
        }
    }

    #[test]
    #[should_panic(expected = "exceeds buffer")]
    fn oversized_view_is_rejected_before_the_kernel() {
        let data = vec![0.0f32; 5];
        let _ = MatRef::row_major(&data, 2, 3);
    }
}
