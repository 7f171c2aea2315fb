//! The dense file of a checkpoint: MLP parameters, their optimizer state and the dense step.

use crate::CkptError;

const MAGIC: &[u8; 8] = b"FTRECDNS";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 40;

pub fn encode(params: &[f32], state: &[f32], step: u64) -> Vec<u8> {
    let payload_len = 4 * (params.len() + state.len());
    let mut out = Vec::with_capacity(HEADER_LEN + payload_len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(params.len() as u64).to_le_bytes());
    out.extend_from_slice(&(state.len() as u64).to_le_bytes());
    out.extend_from_slice(&step.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(bytemuck::cast_slice(params));
    out.extend_from_slice(bytemuck::cast_slice(state));
    let crc = crc32c::crc32c(&out[..36]);
    let crc = crc32c::crc32c_append(crc, &out[HEADER_LEN..]);
    out[36..40].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Fills `params` and `state` (whose lengths must match) and returns the dense step.
pub fn decode(
    key: &str,
    b: &[u8],
    params: &mut [f32],
    state: &mut [f32],
) -> Result<u64, CkptError> {
    if b.len() < HEADER_LEN || &b[..8] != MAGIC {
        return Err(CkptError::corrupt(
            key,
            "not a dense file (bad magic or short header)",
        ));
    }
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    let stored = u32::from_le_bytes(b[36..40].try_into().unwrap_or_default());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&b[..36]), &b[HEADER_LEN..]);
    if crc != stored {
        return Err(CkptError::corrupt(
            key,
            format!("checksum mismatch in bytes 0..{}", b.len()),
        ));
    }
    let (np, ns) = (u64_at(12) as usize, u64_at(20) as usize);
    if np != params.len() || ns != state.len() || b.len() != HEADER_LEN + 4 * (np + ns) {
        return Err(CkptError::corrupt(
            key,
            format!(
                "holds {np} parameters and {ns} state words, model needs {} and {}",
                params.len(),
                state.len()
            ),
        ));
    }
    for (d, c) in params
        .iter_mut()
        .chain(state.iter_mut())
        .zip(b[HEADER_LEN..].chunks_exact(4))
    {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(u64_at(28))
}
