//! The envelope of the JSON records (manifests, chunk lists): an 8-byte magic, a version,
//! the CRC32C and length of the JSON, then the JSON. See FORMAT.md.

use crate::CkptError;

const HEADER_LEN: usize = 20;

pub(crate) fn wrap(magic: &[u8; 8], version: u32, json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len() + HEADER_LEN);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(json).to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(json);
    out
}

/// The JSON of a record `what` stored under `key`, after checking magic, version, length
/// and checksum.
pub(crate) fn unwrap<'a>(
    key: &str,
    what: &str,
    magic: &[u8; 8],
    version: u32,
    b: &'a [u8],
) -> Result<&'a [u8], CkptError> {
    if b.len() < HEADER_LEN || &b[..8] != magic {
        return Err(CkptError::corrupt(
            key,
            format!("not a {what} (bad magic or shorter than {HEADER_LEN} bytes)"),
        ));
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    if u32_at(8) != version {
        return Err(CkptError::corrupt(
            key,
            format!("unsupported {what} version {}", u32_at(8)),
        ));
    }
    let len = u32_at(16) as usize;
    if b.len() != HEADER_LEN + len {
        return Err(CkptError::corrupt(
            key,
            format!("length {} but header says {}", b.len(), HEADER_LEN + len),
        ));
    }
    let json = &b[HEADER_LEN..];
    if crc32c::crc32c(json) != u32_at(12) {
        return Err(CkptError::corrupt(key, "checksum mismatch in bytes 20.."));
    }
    Ok(json)
}
