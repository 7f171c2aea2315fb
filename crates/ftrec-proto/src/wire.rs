//! Raw little-endian payloads: row ids as u32, values as f32. Bytes from the network have
//! no alignment guarantee, so decoding copies (`pod_collect_to_vec`) rather than casting.

use bytes::Bytes;

use crate::error::{Malformed, ProtoError};

pub fn u32s_to_bytes(v: &[u32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

pub fn f32s_to_bytes(v: &[f32]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

fn check_len(b: &[u8], what: &str) -> Result<(), ProtoError> {
    if !b.len().is_multiple_of(4) {
        return Err(Malformed::Ragged {
            what: what.into(),
            len: b.len(),
        }
        .into());
    }
    Ok(())
}

pub fn bytes_to_u32s(b: &[u8], what: &str) -> Result<Vec<u32>, ProtoError> {
    check_len(b, what)?;
    Ok(bytemuck::pod_collect_to_vec(b))
}

pub fn bytes_to_f32s(b: &[u8], what: &str) -> Result<Vec<f32>, ProtoError> {
    // Not `pod_collect_to_vec`: it zeroes the vector before copying into it, a second
    // pass over every pushed gradient.
    let mut out = Vec::with_capacity(b.len() / 4);
    extend_f32s(&mut out, b, what)?;
    Ok(out)
}

/// Appends f32 LE bytes to `out` without an intermediate vector.
pub fn extend_f32s(out: &mut Vec<f32>, b: &[u8], what: &str) -> Result<(), ProtoError> {
    check_len(b, what)?;
    out.extend(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn values_round_trip_bit_exactly(v in proptest::collection::vec(any::<u32>(), 0..64)) {
            let floats: Vec<f32> = v.iter().map(|&b| f32::from_bits(b)).collect();
            let back = bytes_to_f32s(&f32s_to_bytes(&floats), "t").unwrap();
            prop_assert_eq!(back.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), v.clone());
            prop_assert_eq!(bytes_to_u32s(&u32s_to_bytes(&v), "t").unwrap(), v.clone());
            let mut ext = Vec::new();
            extend_f32s(&mut ext, &f32s_to_bytes(&floats), "t").unwrap();
            prop_assert_eq!(ext.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), v);
        }

        #[test]
        fn ragged_payloads_are_rejected(n in 0usize..40) {
            let b = vec![0u8; n];
            prop_assert_eq!(bytes_to_f32s(&b, "t").is_ok(), n % 4 == 0);
        }
    }
}
