/// The ids of one sparse feature for every sample of a batch, already hashed into the
/// table's row range, in CSR form: sample `b` owns `rows[offsets[b]..offsets[b + 1]]`.
/// Multi-hot bags are sum-pooled.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bags {
    pub offsets: Vec<u32>,
    pub rows: Vec<u32>,
}

impl Bags {
    pub fn clear(&mut self) {
        self.offsets.clear();
        self.offsets.push(0);
        self.rows.clear();
    }

    /// Appends one sample's bag.
    pub fn push_bag(&mut self, rows: impl IntoIterator<Item = u32>) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.rows.extend(rows);
        self.offsets.push(self.rows.len() as u32);
    }

    pub fn bag(&self, sample: usize) -> &[u32] {
        &self.rows[self.offsets[sample] as usize..self.offsets[sample + 1] as usize]
    }

    pub fn samples(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
}

/// One mini-batch: `size` samples with labels in {0, 1}, `size x num_dense` dense
/// features (row-major) and one [`Bags`] per embedding table. Buffers are reused between
/// batches to avoid allocation in the training loop.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    pub size: usize,
    pub labels: Vec<f32>,
    pub dense: Vec<f32>,
    pub sparse: Vec<Bags>,
}

impl Batch {
    pub fn with_tables(tables: usize) -> Self {
        let mut batch = Self {
            sparse: vec![Bags::default(); tables],
            ..Self::default()
        };
        batch.clear();
        batch
    }

    pub fn clear(&mut self) {
        self.size = 0;
        self.labels.clear();
        self.dense.clear();
        for bags in &mut self.sparse {
            bags.clear();
        }
    }
}
