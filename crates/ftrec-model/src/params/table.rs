use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::Optimizer;
use crate::pages::{HugeBlock, TablePages};

/// A fixed-size arena of rows, each `[embedding (dim) | optimizer state]` stored
/// contiguously, so the row is the unit of checkpointing, coding and restore. No per-row
/// allocation: row `r` lives at `data[r * stride..(r + 1) * stride]`.
pub struct EmbeddingTable {
    rows: usize,
    dim: usize,
    stride: usize,
    data: Rows,
}

/// Where the rows live: an ordinary `Vec`, or a block of whole huge pages.
enum Rows {
    Heap(Vec<f32>),
    Huge(HugeBlock),
}

impl Rows {
    fn as_slice(&self) -> &[f32] {
        match self {
            Rows::Heap(v) => v,
            Rows::Huge(b) => b,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Rows::Heap(v) => v,
            Rows::Huge(b) => b,
        }
    }
}

impl std::fmt::Debug for EmbeddingTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingTable")
            .field("rows", &self.rows)
            .field("dim", &self.dim)
            .field("stride", &self.stride)
            .field("huge_pages", &matches!(self.data, Rows::Huge(_)))
            .finish_non_exhaustive()
    }
}

/// Equal shapes and equal values; the pages they live on do not matter.
impl PartialEq for EmbeddingTable {
    fn eq(&self, other: &Self) -> bool {
        (self.rows, self.dim, self.stride) == (other.rows, other.dim, other.stride)
            && self.as_slice() == other.as_slice()
    }
}

/// A clone lives on ordinary pages. `clone_from` reuses the rows' buffer, whichever
/// pages it is on, when the sizes match (see `ModelState`'s `Clone`).
impl Clone for EmbeddingTable {
    fn clone(&self) -> Self {
        Self {
            rows: self.rows,
            dim: self.dim,
            stride: self.stride,
            data: Rows::Heap(self.as_slice().to_vec()),
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.rows = source.rows;
        self.dim = source.dim;
        self.stride = source.stride;
        match &mut self.data {
            Rows::Huge(b) if b.len() == source.as_slice().len() => {
                b.copy_from_slice(source.as_slice())
            }
            Rows::Heap(v) => {
                v.clear();
                v.extend_from_slice(source.as_slice());
            }
            data => *data = Rows::Heap(source.as_slice().to_vec()),
        }
    }
}

impl EmbeddingTable {
    /// Rows start uniform in `[-sqrt(1/rows), sqrt(1/rows)]` as in the DLRM reference, drawn
    /// from a generator seeded by `(seed, table)` so tables can initialise in parallel and
    /// still give the same bits.
    pub fn new_initialized(
        rows: usize,
        dim: usize,
        optimizer: &Optimizer,
        seed: u64,
        table: usize,
    ) -> Self {
        Self::new_initialized_on(rows, dim, optimizer, seed, table, TablePages::Default)
    }

    /// [`EmbeddingTable::new_initialized`] on the given pages: the same values.
    pub fn new_initialized_on(
        rows: usize,
        dim: usize,
        optimizer: &Optimizer,
        seed: u64,
        table: usize,
        pages: TablePages,
    ) -> Self {
        let stride = dim + optimizer.row_state_len(dim);
        let huge = match pages {
            TablePages::Huge => HugeBlock::zeroed(rows * stride),
            TablePages::Default => None,
        };
        // A zeroed `Vec` of this size comes from the allocator as fresh zero pages, so
        // writing the rows into it is the only pass over its memory.
        let mut data = match huge {
            Some(block) => Rows::Huge(block),
            None => Rows::Heap(vec![0.0; rows * stride]),
        };
        let slots = data.as_mut_slice();
        Self::initial_rows(rows, dim, optimizer, seed, table, |r, row| {
            slots[r * stride..(r + 1) * stride].copy_from_slice(row)
        });
        Self {
            rows,
            dim,
            stride,
            data,
        }
    }

    /// Generates the initial value of every row of a table in row order and hands each to
    /// `sink` as `(row, [embedding | optimizer state])`. A parameter server keeps only the
    /// rows it owns and still gets the bits a single process would.
    pub fn initial_rows(
        rows: usize,
        dim: usize,
        optimizer: &Optimizer,
        seed: u64,
        table: usize,
        mut sink: impl FnMut(usize, &[f32]),
    ) {
        let stride = dim + optimizer.row_state_len(dim);
        let mut row = vec![0.0f32; stride];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(
            seed ^ (table as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let bound = (1.0 / rows as f64).sqrt() as f32;
        for r in 0..rows {
            let (emb, state) = row.split_at_mut(dim);
            for v in emb.iter_mut() {
                *v = rng.gen_range(-bound..bound);
            }
            optimizer.init_row_state(state);
            sink(r, &row);
        }
    }

    /// A table built from its parts (a shard's rows, a received copy).
    pub fn from_data(rows: usize, dim: usize, stride: usize, data: Vec<f32>) -> Option<Self> {
        (stride >= dim && data.len() == rows * stride).then_some(Self {
            rows,
            dim,
            stride,
            data: Rows::Heap(data),
        })
    }

    /// An all-zero table (for restore targets).
    pub fn zeroed(rows: usize, dim: usize, stride: usize) -> Self {
        Self {
            rows,
            dim,
            stride,
            data: Rows::Heap(vec![0.0; rows * stride]),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// f32 words per row (embedding + optimizer state).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The full row: embedding then optimizer state. Panics on an out-of-range row, which
    /// only a bug can produce: ids are hashed into range by the data layer.
    pub fn row(&self, row: usize) -> &[f32] {
        &self.data.as_slice()[row * self.stride..(row + 1) * self.stride]
    }

    pub fn row_mut(&mut self, row: usize) -> &mut [f32] {
        &mut self.data.as_mut_slice()[row * self.stride..(row + 1) * self.stride]
    }

    pub fn embedding(&self, row: usize) -> &[f32] {
        &self.data.as_slice()[row * self.stride..row * self.stride + self.dim]
    }

    /// The whole arena as little-endian bytes (the crate refuses to build on big-endian).
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.data.as_slice())
    }

    pub fn as_slice(&self) -> &[f32] {
        self.data.as_slice()
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.data.as_mut_slice()
    }
}
