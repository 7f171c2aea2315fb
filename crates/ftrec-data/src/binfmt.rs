//! The `.ftrd` binary dataset: a checksummed header, fixed-layout records, and for
//! multi-hot data an index of record offsets. Memory-mapped for fast epochs; see FORMAT.md.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use ftrec_model::Batch;
use memmap2::Mmap;

use crate::hashing::row_for;
use crate::{DataError, Record};

const MAGIC: &[u8; 8] = b"FTRECDS\0";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 64;
const FLAG_MULTI_HOT: u32 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    num_dense: u32,
    num_sparse: u32,
    multi_hot: bool,
    samples: u64,
    records_bytes: u64,
    records_crc: u32,
    index_crc: u32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.num_dense.to_le_bytes());
        h[16..20].copy_from_slice(&self.num_sparse.to_le_bytes());
        let flags = if self.multi_hot { FLAG_MULTI_HOT } else { 0 };
        h[20..24].copy_from_slice(&flags.to_le_bytes());
        h[24..32].copy_from_slice(&self.samples.to_le_bytes());
        h[32..40].copy_from_slice(&self.records_bytes.to_le_bytes());
        h[40..44].copy_from_slice(&self.records_crc.to_le_bytes());
        h[44..48].copy_from_slice(&self.index_crc.to_le_bytes());
        let crc = crc32c::crc32c(&h[..60]);
        h[60..64].copy_from_slice(&crc.to_le_bytes());
        h
    }

    fn decode(path: &Path, h: &[u8]) -> Result<Self, DataError> {
        let bad = |m: String| Err(DataError::format(path, m));
        if h.len() < HEADER_LEN {
            return bad(format!(
                "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
                h.len()
            ));
        }
        if &h[0..8] != MAGIC {
            return bad("not an ftrec dataset (bad magic at offset 0)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        if crc32c::crc32c(&h[..60]) != u32_at(60) {
            return bad("header checksum mismatch (bytes 0..64)".into());
        }
        let version = u32_at(8);
        if version != VERSION {
            return bad(format!(
                "unsupported format version {version} (this build reads {VERSION})"
            ));
        }
        Ok(Self {
            num_dense: u32_at(12),
            num_sparse: u32_at(16),
            multi_hot: u32_at(20) & FLAG_MULTI_HOT != 0,
            samples: u64_at(24),
            records_bytes: u64_at(32),
            records_crc: u32_at(40),
            index_crc: u32_at(44),
        })
    }

    fn single_hot_record_words(&self) -> usize {
        1 + self.num_dense as usize + self.num_sparse as usize
    }

    /// Where the multi-hot index starts. Only called once [`Header::file_len`] matched the
    /// file, so it cannot overflow then.
    fn index_start(&self) -> usize {
        self.checked_index_start().unwrap_or(usize::MAX)
    }

    fn checked_index_start(&self) -> Option<usize> {
        usize::try_from(self.records_bytes)
            .ok()?
            .checked_next_multiple_of(8)?
            .checked_add(HEADER_LEN)
    }

    /// The length the header describes; `None` when it overflows (a crafted header: the
    /// fuzzer found one whose sizes wrapped past the checksum).
    fn file_len(&self) -> Option<usize> {
        if self.multi_hot {
            let index = usize::try_from(self.samples).ok()?.checked_mul(8)?;
            self.checked_index_start()?.checked_add(index)
        } else {
            usize::try_from(self.records_bytes)
                .ok()?
                .checked_add(HEADER_LEN)
        }
    }
}

/// Writes a dataset to `<path>.tmp`, then fsyncs and renames it into place on `finish`, so
/// a crash never leaves a half-written file under the final name.
pub struct DatasetWriter {
    path: PathBuf,
    tmp: PathBuf,
    /// Removes `tmp` if the writer is dropped unfinished (a failed convert).
    cleanup: ftrec_fsio::RemoveOnDrop,
    out: BufWriter<File>,
    header: Header,
    records_crc: u32,
    index: Vec<u64>,
    scratch: Vec<u8>,
}

impl DatasetWriter {
    pub fn create(
        path: &Path,
        num_dense: usize,
        num_sparse: usize,
        multi_hot: bool,
    ) -> Result<Self, DataError> {
        let tmp = ftrec_fsio::temp_path(path);
        let cleanup = ftrec_fsio::RemoveOnDrop::new(&tmp);
        let file = File::create(&tmp).map_err(|e| DataError::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&[0u8; HEADER_LEN])
            .map_err(|e| DataError::io(&tmp, e))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            cleanup,
            out,
            header: Header {
                num_dense: num_dense as u32,
                num_sparse: num_sparse as u32,
                multi_hot,
                samples: 0,
                records_bytes: 0,
                records_crc: 0,
                index_crc: 0,
            },
            records_crc: 0,
            index: Vec::new(),
            scratch: Vec::with_capacity(1024),
        })
    }

    pub fn samples(&self) -> u64 {
        self.header.samples
    }

    pub fn push(&mut self, rec: &Record) -> Result<(), DataError> {
        let h = &self.header;
        if rec.dense.len() != h.num_dense as usize || rec.num_sparse() != h.num_sparse as usize {
            return Err(DataError::Invalid(format!(
                "record has {} dense and {} sparse features, dataset {} has {} and {}",
                rec.dense.len(),
                rec.num_sparse(),
                self.path.display(),
                h.num_dense,
                h.num_sparse
            )));
        }
        if !h.multi_hot && !rec.is_single_hot() {
            return Err(DataError::Invalid(format!(
                "multi-hot record written to single-hot dataset {}",
                self.path.display()
            )));
        }
        let s = &mut self.scratch;
        s.clear();
        s.extend_from_slice(&rec.label.to_le_bytes());
        for v in &rec.dense {
            s.extend_from_slice(&v.to_le_bytes());
        }
        if h.multi_hot {
            self.index.push(h.records_bytes);
            for f in 0..rec.num_sparse() {
                s.extend_from_slice(&(rec.feature(f).len() as u32).to_le_bytes());
            }
        }
        for id in &rec.ids {
            s.extend_from_slice(&id.to_le_bytes());
        }
        self.records_crc = crc32c::crc32c_append(self.records_crc, s);
        self.out
            .write_all(s)
            .map_err(|e| DataError::io(&self.tmp, e))?;
        self.header.records_bytes += s.len() as u64;
        self.header.samples += 1;
        Ok(())
    }

    /// Completes the file: index, header, fsync, atomic rename.
    pub fn finish(mut self) -> Result<u64, DataError> {
        let io = |e| DataError::io(&self.tmp, e);
        self.header.records_crc = self.records_crc;
        if self.header.multi_hot {
            let pad = (self.header.records_bytes as usize).next_multiple_of(8)
                - self.header.records_bytes as usize;
            self.out.write_all(&[0u8; 8][..pad]).map_err(io)?;
            let bytes: &[u8] = bytemuck::cast_slice(&self.index);
            self.header.index_crc = crc32c::crc32c(bytes);
            self.out.write_all(bytes).map_err(io)?;
        }
        let mut file = self
            .out
            .into_inner()
            .map_err(|e| DataError::io(&self.tmp, e.into_error()))?;
        file.seek(SeekFrom::Start(0))
            .map_err(|e| DataError::io(&self.tmp, e))?;
        file.write_all(&self.header.encode())
            .map_err(|e| DataError::io(&self.tmp, e))?;
        // `publish` removes the file itself if it cannot complete.
        self.cleanup.disarm();
        ftrec_fsio::publish(file, &self.tmp, &self.path)?;
        Ok(self.header.samples)
    }
}

/// A memory-mapped dataset file, validated on open (header checksum, exact length, and
/// the checksums of the records and index).
pub struct Dataset {
    path: PathBuf,
    map: Mmap,
    header: Header,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("path", &self.path)
            .field("samples", &self.header.samples)
            .finish()
    }
}

impl Dataset {
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        // SAFETY: the map is read-only and private to this process. ftrec writes datasets
        // under a temporary name and renames them, so a file is never modified in place
        // while mapped by ftrec; a foreign process truncating it is outside our contract
        // (as for every mmap-based reader) and is why all lengths are validated up front.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
        let header = Header::decode(path, &map)?;
        let bad = |m: String| Err(DataError::format(path, m));
        let Some(expected) = header.file_len() else {
            return bad(format!(
                "the header describes more than any file can hold ({} samples, {} record bytes)",
                header.samples, header.records_bytes
            ));
        };
        if map.len() != expected {
            return bad(format!(
                "length is {} bytes but the header describes {expected} (truncated or extended file)",
                map.len()
            ));
        }
        let single_hot_bytes = header
            .samples
            .checked_mul(4 * header.single_hot_record_words() as u64);
        if !header.multi_hot && single_hot_bytes != Some(header.records_bytes) {
            return bad("record section size does not match sample count".into());
        }
        let records = &map[HEADER_LEN..HEADER_LEN + header.records_bytes as usize];
        if crc32c::crc32c(records) != header.records_crc {
            return bad(format!(
                "records checksum mismatch (bytes {HEADER_LEN}..{})",
                HEADER_LEN as u64 + header.records_bytes
            ));
        }
        if header.multi_hot {
            let index = &map[header.index_start()..];
            if crc32c::crc32c(index) != header.index_crc {
                return bad(format!(
                    "index checksum mismatch (bytes {}..{})",
                    header.index_start(),
                    map.len()
                ));
            }
        }
        let ds = Self {
            path: path.to_path_buf(),
            map,
            header,
        };
        if ds.header.multi_hot {
            ds.check_index()?;
        }
        Ok(ds)
    }

    /// Checks that every multi-hot record lies inside the records section, so later reads
    /// cannot go out of bounds even on a file with a forged checksum.
    fn check_index(&self) -> Result<(), DataError> {
        let words = self.record_words();
        let fixed = 1 + self.header.num_dense as usize + self.header.num_sparse as usize;
        let index = self.index();
        for (i, &off) in index.iter().enumerate() {
            let start = off as usize / 4;
            let end = index.get(i + 1).map_or(words.len(), |&o| o as usize / 4);
            let ok = off % 4 == 0 && start + fixed <= end && end <= words.len() && {
                let counts = &words[start + 1 + self.header.num_dense as usize..start + fixed];
                start + fixed + counts.iter().map(|&c| c as usize).sum::<usize>() == end
            };
            if !ok {
                return Err(DataError::format(
                    &self.path,
                    format!(
                        "record {i} at offset {} is inconsistent with the index",
                        HEADER_LEN as u64 + off
                    ),
                ));
            }
        }
        Ok(())
    }

    fn record_words(&self) -> &[u32] {
        bytemuck::cast_slice(&self.map[HEADER_LEN..HEADER_LEN + self.header.records_bytes as usize])
    }

    fn index(&self) -> &[u64] {
        if self.header.multi_hot {
            bytemuck::cast_slice(&self.map[self.header.index_start()..])
        } else {
            &[]
        }
    }

    /// Opens split `file` (`TRAIN_FILE`, `TEST_FILE`) of dataset directory `dir`, or `dir`
    /// itself when it is a file.
    pub fn open_split(dir: &Path, file: &str) -> Result<Self, DataError> {
        if dir.is_file() {
            Self::open(dir)
        } else {
            Self::open(&dir.join(file))
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn len(&self) -> usize {
        self.header.samples as usize
    }
    pub fn is_empty(&self) -> bool {
        self.header.samples == 0
    }
    pub fn num_dense(&self) -> usize {
        self.header.num_dense as usize
    }
    pub fn num_sparse(&self) -> usize {
        self.header.num_sparse as usize
    }
    pub fn multi_hot(&self) -> bool {
        self.header.multi_hot
    }

    /// The words of sample `i`: `[label, dense.., (counts..), ids..]`.
    fn sample_words(&self, i: usize) -> &[u32] {
        let words = self.record_words();
        if self.header.multi_hot {
            let index = self.index();
            let start = index[i] as usize / 4;
            let end = index.get(i + 1).map_or(words.len(), |&o| o as usize / 4);
            &words[start..end]
        } else {
            let n = self.header.single_hot_record_words();
            &words[i * n..(i + 1) * n]
        }
    }

    /// Reads sample `i` into `rec` (raw ids).
    pub fn record(&self, i: usize, rec: &mut Record) {
        rec.clear();
        let w = self.sample_words(i);
        let nd = self.num_dense();
        let ns = self.num_sparse();
        rec.label = f32::from_bits(w[0]);
        rec.dense
            .extend(w[1..1 + nd].iter().map(|&b| f32::from_bits(b)));
        if self.header.multi_hot {
            let counts = &w[1 + nd..1 + nd + ns];
            let mut at = 1 + nd + ns;
            for &c in counts {
                rec.ids.extend_from_slice(&w[at..at + c as usize]);
                at += c as usize;
                rec.end_feature();
            }
        } else {
            for &id in &w[1 + nd..1 + nd + ns] {
                rec.ids.push(id);
                rec.end_feature();
            }
        }
    }

    /// Fills `batch` with samples `start..start + count`, hashing raw ids into each
    /// table's rows. `table_rows` must have one entry per sparse feature.
    pub fn fill_batch(
        &self,
        start: usize,
        count: usize,
        table_rows: &[u32],
        batch: &mut Batch,
    ) -> Result<(), DataError> {
        let nd = self.num_dense();
        let ns = self.num_sparse();
        if table_rows.len() != ns || batch.sparse.len() != ns {
            return Err(DataError::Invalid(format!(
                "{}: dataset has {ns} sparse features but the model has {} tables",
                self.path.display(),
                table_rows.len()
            )));
        }
        if start + count > self.len() {
            return Err(DataError::Invalid(format!(
                "{}: samples {start}..{} requested from {} samples",
                self.path.display(),
                start + count,
                self.len()
            )));
        }
        batch.clear();
        for i in start..start + count {
            let w = self.sample_words(i);
            batch.labels.push(f32::from_bits(w[0]));
            batch
                .dense
                .extend(w[1..1 + nd].iter().map(|&b| f32::from_bits(b)));
            if self.header.multi_hot {
                let mut at = 1 + nd + ns;
                for (t, &c) in w[1 + nd..1 + nd + ns].iter().enumerate() {
                    let rows = table_rows[t];
                    batch.sparse[t]
                        .push_bag(w[at..at + c as usize].iter().map(|&id| row_for(id, rows)));
                    at += c as usize;
                }
            } else {
                for (t, &id) in w[1 + nd..1 + nd + ns].iter().enumerate() {
                    let bags = &mut batch.sparse[t];
                    bags.rows.push(row_for(id, table_rows[t]));
                    bags.offsets.push(bags.rows.len() as u32);
                }
            }
        }
        batch.size = count;
        Ok(())
    }
}
