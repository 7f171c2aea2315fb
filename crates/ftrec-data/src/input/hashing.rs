//! How raw categorical values become table rows.

/// The raw value that stands for a missing categorical feature.
pub const MISSING: u32 = u32::MAX;

/// A real value that would collide with [`MISSING`] is stored as this instead (a one-in-
/// 2^32 merge of two ids, documented in FORMAT.md).
pub const MISSING_ALIAS: u32 = u32::MAX - 1;

/// Stores a parsed raw value, keeping [`MISSING`] reserved.
pub fn raw(value: u32) -> u32 {
    if value == MISSING {
        MISSING_ALIAS
    } else {
        value
    }
}

/// A token's raw value: the low 32 bits of its xxh3 hash.
pub fn raw_from_token(token: &[u8]) -> u32 {
    raw(xxhash_rust::xxh3::xxh3_64(token) as u32)
}

/// Row of `raw` in a table of `rows` rows: row 0 is reserved for missing values, others
/// are spread over `1..rows` by a 64-bit mix (splitmix64's finaliser) so that sequential
/// raw values do not land on sequential rows.
#[inline]
pub fn row_for(raw: u32, rows: u32) -> u32 {
    if raw == MISSING || rows < 2 {
        return 0;
    }
    let mut z = (raw as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    1 + (z % (rows as u64 - 1)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn rows_stay_in_range_and_missing_is_row_zero(v in any::<u32>(), rows in 2u32..) {
            let r = row_for(raw(v), rows);
            prop_assert!(r >= 1 && r < rows);
            prop_assert_eq!(row_for(MISSING, rows), 0);
        }
    }
}
