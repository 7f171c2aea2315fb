//! A whole-model snapshot file (`train --save`, `eval --model`): config, progress and all
//! state, every section CRC32C-checked, written to a temporary name, fsynced and renamed.
//! The checkpoint engine (incremental/delta checkpoints) builds on the row byte view
//! instead; this is the simple full format.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use ftrec_model::{ModelConfig, ModelState};
use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::trainer::Progress;

const MAGIC: &[u8; 8] = b"FTRECSNP";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Meta {
    model: ModelConfig,
    progress: Progress,
    dense_step: u64,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Io {
        path: path.to_path_buf(),
        error: e,
    }
}

fn write_section(out: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(&(bytes.len() as u64).to_le_bytes())?;
    out.write_all(&crc32c::crc32c(bytes).to_le_bytes())?;
    out.write_all(bytes)
}

pub fn save(path: &Path, state: &ModelState, progress: Progress) -> Result<(), TrainError> {
    let tmp = ftrec_fsio::temp_path(path);
    let err = io_err(&tmp);
    // Any failure below (a full disk) removes the partial file.
    let guard = ftrec_fsio::RemoveOnDrop::new(&tmp);
    let file = File::create(&tmp).map_err(&err)?;
    let mut out = BufWriter::with_capacity(1 << 22, file);
    let meta = serde_json::to_vec(&Meta {
        model: state.config().clone(),
        progress,
        dense_step: state.dense.step,
    })
    .map_err(|e| TrainError::Config(e.to_string()))?;
    out.write_all(MAGIC).map_err(&err)?;
    out.write_all(&VERSION.to_le_bytes()).map_err(&err)?;
    write_section(&mut out, &meta).map_err(&err)?;
    for table in state.tables() {
        write_section(&mut out, table.as_bytes()).map_err(&err)?;
    }
    write_section(&mut out, bytemuck::cast_slice(&state.dense.params)).map_err(&err)?;
    write_section(&mut out, bytemuck::cast_slice(&state.dense.optimizer_state)).map_err(&err)?;
    let file = out.into_inner().map_err(|e| err(e.into_error()))?;
    // `publish` removes the file itself if it cannot complete.
    guard.disarm();
    ftrec_fsio::publish(file, &tmp, path).map_err(|e| TrainError::Io {
        path: e.path,
        error: e.error,
    })
}

struct Reader<'a, R> {
    path: &'a Path,
    inner: R,
    offset: u64,
}

impl<R: Read> Reader<'_, R> {
    fn fail(&self, message: String) -> TrainError {
        TrainError::Snapshot {
            path: self.path.to_path_buf(),
            message: format!("{message} (at offset {})", self.offset),
        }
    }

    fn exact(&mut self, buf: &mut [u8]) -> Result<(), TrainError> {
        self.inner
            .read_exact(buf)
            .map_err(|_| self.fail(format!("truncated: could not read {} bytes", buf.len())))?;
        self.offset += buf.len() as u64;
        Ok(())
    }

    /// Reads one section into `dst`, whose length must match the stored length.
    fn section_into(&mut self, what: &str, dst: &mut [u8]) -> Result<(), TrainError> {
        let mut head = [0u8; 12];
        self.exact(&mut head)?;
        let len = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        let crc = u32::from_le_bytes(head[8..].try_into().unwrap_or_default());
        if len != dst.len() as u64 {
            return Err(self.fail(format!(
                "{what}: {len} bytes stored, model needs {}",
                dst.len()
            )));
        }
        let start = self.offset;
        self.exact(dst)?;
        if crc32c::crc32c(dst) != crc {
            return Err(TrainError::Snapshot {
                path: self.path.to_path_buf(),
                message: format!(
                    "{what}: checksum mismatch in bytes {start}..{}",
                    self.offset
                ),
            });
        }
        Ok(())
    }
}

/// Loads a snapshot: the state and the training progress it was saved at.
pub fn load(path: &Path) -> Result<(ModelState, Progress), TrainError> {
    let file = File::open(path).map_err(io_err(path))?;
    let mut r = Reader {
        path,
        inner: BufReader::with_capacity(1 << 22, file),
        offset: 0,
    };
    let mut head = [0u8; 12];
    r.exact(&mut head)?;
    if &head[..8] != MAGIC {
        return Err(r.fail("not an ftrec snapshot (bad magic)".into()));
    }
    let version = u32::from_le_bytes(head[8..12].try_into().unwrap_or_default());
    if version != VERSION {
        return Err(r.fail(format!("unsupported snapshot version {version}")));
    }
    let mut len_crc = [0u8; 12];
    r.exact(&mut len_crc)?;
    let len = u64::from_le_bytes(len_crc[..8].try_into().unwrap_or_default());
    if len > 1 << 24 {
        return Err(r.fail(format!("implausible metadata length {len}")));
    }
    let mut meta_bytes = vec![0u8; len as usize];
    r.exact(&mut meta_bytes)?;
    if crc32c::crc32c(&meta_bytes)
        != u32::from_le_bytes(len_crc[8..].try_into().unwrap_or_default())
    {
        return Err(r.fail("metadata checksum mismatch".into()));
    }
    let meta: Meta =
        serde_json::from_slice(&meta_bytes).map_err(|e| r.fail(format!("metadata: {e}")))?;
    let mut state = ModelState::zeroed(&meta.model)?;
    for (t, table) in state.tables_mut().iter_mut().enumerate() {
        r.section_into(
            &format!("table {t}"),
            bytemuck::cast_slice_mut(table.as_mut_slice()),
        )?;
    }
    r.section_into(
        "dense parameters",
        bytemuck::cast_slice_mut(&mut state.dense.params),
    )?;
    r.section_into(
        "dense optimizer state",
        bytemuck::cast_slice_mut(&mut state.dense.optimizer_state),
    )?;
    let mut extra = [0u8; 1];
    if r.inner.read(&mut extra).map_err(io_err(path))? != 0 {
        return Err(r.fail("trailing bytes after the last section".into()));
    }
    state.dense.step = meta.dense_step;
    Ok((state, meta.progress))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_model::{ModelConfig, Optimizer};

    #[test]
    fn a_save_onto_a_full_disk_leaves_no_temporary_file() {
        let config = ModelConfig {
            num_dense: 2,
            table_rows: vec![50_000],
            dim: 8,
            bottom: vec![8],
            top: vec![4, 1],
            sparse_optimizer: Optimizer::Sgd { lr: 0.1 },
            dense_optimizer: Optimizer::Sgd { lr: 0.1 },
        };
        let state = ModelState::new(&config, 1).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.ftm");
        let tmp = ftrec_fsio::temp_path(&path);
        // /dev/full fails every write with ENOSPC, as a full disk does.
        std::os::unix::fs::symlink("/dev/full", &tmp).unwrap();
        let e = save(&path, &state, Progress::default()).unwrap_err();
        assert!(e.to_string().contains("m.ftm.tmp"), "{e}");
        assert!(
            std::fs::symlink_metadata(&tmp).is_err(),
            "{} left",
            tmp.display()
        );
        assert!(!path.exists());
    }
}
