//! The code over rows' bytes: XOR for `r = 1`, systematic Reed–Solomon over GF(2^8) for
//! `r >= 2` (`reed-solomon-erasure`'s Vandermonde-derived matrix and table-driven field
//! arithmetic). Both are linear over GF(2), so a change to data row `i` changes parity row
//! `p` by `coef[p][i] · (old XOR new)`, whatever the other rows hold.

use reed_solomon_erasure::galois_8::{self, ReedSolomon};

use crate::EcError;

/// Encoder, delta folder and decoder for stripes of `k` data and `r` parity rows.
#[derive(Debug)]
pub struct Codec {
    k: usize,
    r: usize,
    /// `None` for `r = 1`: XOR.
    rs: Option<ReedSolomon>,
    /// `coef[p][i]`: what data row `i` is multiplied by in parity row `p`.
    coef: Vec<Vec<u8>>,
}

/// `out = a XOR b`, for the difference a row change sends to its parity holders.
pub fn xor_into(a: &[u8], b: &[u8], out: &mut [u8]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x ^ y;
    }
}

/// `parity ^= coef · delta` in GF(2^8): how a row change reaches a parity row (`coef` 1 is
/// plain XOR).
pub fn fold_with(coef: u8, delta: &[u8], parity: &mut [u8]) {
    match coef {
        0 => {}
        1 => xor_assign(parity, delta),
        c => galois_8::mul_slice_xor(c, delta, parity),
    }
}

fn xor_assign(acc: &mut [u8], x: &[u8]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a ^= b;
    }
}

impl Codec {
    pub fn new(k: usize, r: usize) -> Result<Self, EcError> {
        if k == 0 || r == 0 || k + r > 255 {
            return Err(EcError::Config(format!(
                "ec.k = {k}, ec.r = {r}: need k >= 1, r >= 1 and k + r <= 255"
            )));
        }
        if r == 1 {
            return Ok(Self {
                k,
                r,
                rs: None,
                coef: vec![vec![1; k]],
            });
        }
        let rs = ReedSolomon::new(k, r).map_err(|e| EcError::Codec(format!("{e:?}")))?;
        // The code is linear and acts on every byte position alike, so encoding the unit
        // vector e_i (one byte) reads column i of the parity matrix.
        let mut coef = vec![vec![0u8; k]; r];
        for i in 0..k {
            let mut unit: Vec<[u8; 1]> = vec![[0]; k + r];
            unit[i] = [1];
            rs.encode(&mut unit)
                .map_err(|e| EcError::Codec(format!("{e:?}")))?;
            for p in 0..r {
                coef[p][i] = unit[k + p][0];
            }
        }
        Ok(Self {
            k,
            r,
            rs: Some(rs),
            coef,
        })
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn r(&self) -> usize {
        self.r
    }

    /// The multiplier of data row `i` in parity row `p`.
    pub fn coefficient(&self, p: usize, i: usize) -> u8 {
        self.coef[p][i]
    }

    /// Parity row `p` of a stripe from its `k` data rows.
    pub fn encode_parity(&self, p: usize, data: &[&[u8]], out: &mut [u8]) -> Result<(), EcError> {
        self.check(data.iter().copied().chain([&*out]))?;
        out.fill(0);
        for (i, row) in data.iter().enumerate() {
            self.fold(p, i, row, out);
        }
        Ok(())
    }

    /// Folds the difference `delta = old XOR new` of data row `i` into parity row `p`.
    pub fn fold(&self, p: usize, i: usize, delta: &[u8], parity: &mut [u8]) {
        fold_with(self.coef[p][i], delta, parity);
    }

    /// Rebuilds the missing rows of a stripe in place: `rows[..k]` data, `rows[k..]`
    /// parity, `None` where lost. At least `k` rows must be present.
    pub fn reconstruct(&self, rows: &mut [Option<Vec<u8>>]) -> Result<(), EcError> {
        let missing = rows.iter().filter(|r| r.is_none()).count();
        if missing == 0 {
            return Ok(());
        }
        if missing > self.r || rows.len() != self.k + self.r {
            return Err(EcError::TooManyLost {
                missing: missing + (self.k + self.r).saturating_sub(rows.len()),
                r: self.r,
            });
        }
        self.check(rows.iter().flatten().map(Vec::as_slice))?;
        match &self.rs {
            None => {
                // XOR of the k present rows is the missing one.
                let len = rows.iter().flatten().next().map_or(0, Vec::len);
                let mut acc = vec![0u8; len];
                for row in rows.iter().flatten() {
                    xor_assign(&mut acc, row);
                }
                if let Some(slot) = rows.iter_mut().find(|r| r.is_none()) {
                    *slot = Some(acc);
                }
                Ok(())
            }
            Some(rs) => rs
                .reconstruct(rows)
                .map_err(|e| EcError::Codec(format!("{e:?}"))),
        }
    }

    fn check<'a>(&self, rows: impl Iterator<Item = &'a [u8]>) -> Result<(), EcError> {
        let mut len = None;
        for row in rows {
            match len {
                None => len = Some(row.len()),
                Some(l) if l != row.len() => return Err(EcError::Ragged(l, row.len())),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn stripe(k: usize, r: usize, len: usize) -> impl Strategy<Value = Vec<Vec<u8>>> {
        vec(vec(any::<u8>(), len), k).prop_map(move |mut data| {
            data.extend((0..r).map(|_| vec![0u8; len]));
            data
        })
    }

    fn encoded(codec: &Codec, mut rows: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        let k = codec.k();
        let (data, parity) = rows.split_at_mut(k);
        let data: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        for (p, out) in parity.iter_mut().enumerate() {
            codec.encode_parity(p, &data, out).unwrap();
        }
        rows
    }

    proptest! {
        /// Any `r` lost rows of a stripe come back bit for bit.
        #[test]
        fn any_r_lost_rows_decode_exactly(
            (k, r, rows, lost) in (1usize..6, 1usize..4, 1usize..40)
                .prop_flat_map(|(k, r, len)| (
                    Just(k), Just(r), stripe(k, r, len * 4),
                    proptest::sample::subsequence((0..k + r).collect::<Vec<_>>(), r),
                )),
        ) {
            let codec = Codec::new(k, r).unwrap();
            let full = encoded(&codec, rows);
            let mut damaged: Vec<Option<Vec<u8>>> = full.iter().cloned().map(Some).collect();
            for &i in &lost {
                damaged[i] = None;
            }
            codec.reconstruct(&mut damaged).unwrap();
            let back: Vec<Vec<u8>> = damaged.into_iter().map(Option::unwrap).collect();
            prop_assert_eq!(back, full);
        }

        /// Parity kept up to date by folding row differences, in any order, equals parity
        /// encoded from scratch.
        #[test]
        fn folded_deltas_equal_encoding_from_scratch(
            (k, r, rows, updates) in (1usize..6, 1usize..4, 1usize..20)
                .prop_flat_map(|(k, r, len)| (
                    Just(k), Just(r), stripe(k, r, len * 4),
                    vec((0..k, vec(any::<u8>(), len * 4)), 0..30),
                )),
        ) {
            let codec = Codec::new(k, r).unwrap();
            let mut live = encoded(&codec, rows);
            let mut delta = vec![0u8; live[0].len()];
            for (i, new) in updates {
                xor_into(&live[i], &new, &mut delta);
                live[i] = new;
                for p in 0..r {
                    codec.fold(p, i, &delta, &mut live[k + p]);
                }
            }
            let scratch = encoded(&codec, live.clone());
            prop_assert_eq!(live, scratch);
        }

        /// An independent Reed–Solomon implementation (`reed-solomon-simd`, GF(2^16), a
        /// different code) agrees on what the rebuilt data rows are: a check on our
        /// wiring of the shards, not on the parity bytes, which differ between the codes.
        #[test]
        fn rebuilt_rows_agree_with_an_independent_codec(
            (k, rows, lost) in (2usize..6, 1usize..20).prop_flat_map(|(k, len)| (
                Just(k), stripe(k, 2, len * 64),
                proptest::sample::subsequence((0..k).collect::<Vec<_>>(), 2),
            )),
        ) {
            let codec = Codec::new(k, 2).unwrap();
            let full = encoded(&codec, rows);
            let mut ours: Vec<Option<Vec<u8>>> = full.iter().cloned().map(Some).collect();
            for &i in &lost {
                ours[i] = None;
            }
            codec.reconstruct(&mut ours).unwrap();

            let recovery = reed_solomon_simd::encode(k, 2, &full[..k]).unwrap();
            let originals = (0..k)
                .filter(|i| !lost.contains(i))
                .map(|i| (i, &full[i]));
            let recoveries = recovery.iter().enumerate();
            let theirs = reed_solomon_simd::decode(k, 2, originals, recoveries).unwrap();
            for &i in &lost {
                prop_assert_eq!(ours[i].as_ref().unwrap(), &theirs[&i]);
            }
        }
    }

    #[test]
    fn r_one_is_xor_and_too_many_losses_are_refused() {
        let codec = Codec::new(3, 1).unwrap();
        assert!((0..3).all(|i| codec.coefficient(0, i) == 1));
        let mut rows = vec![Some(vec![1u8, 2]), None, None, Some(vec![0, 0])];
        assert_eq!(
            codec.reconstruct(&mut rows),
            Err(EcError::TooManyLost { missing: 2, r: 1 })
        );
        let mut ragged = vec![Some(vec![1u8, 2]), None, Some(vec![3]), Some(vec![0, 0])];
        assert!(matches!(
            codec.reconstruct(&mut ragged),
            Err(EcError::Ragged(..))
        ));
    }

    /// The field arithmetic the folds use, checked against a bitwise multiply over the
    /// same polynomial (x^8 + x^4 + x^3 + x^2 + 1).
    #[test]
    fn fold_multiplies_in_gf256() {
        fn gf_mul(mut a: u8, mut b: u8) -> u8 {
            let mut acc = 0u8;
            while b != 0 {
                if b & 1 != 0 {
                    acc ^= a;
                }
                let carry = a & 0x80 != 0;
                a <<= 1;
                if carry {
                    a ^= 0x1d;
                }
                b >>= 1;
            }
            acc
        }
        let codec = Codec::new(4, 3).unwrap();
        let delta: Vec<u8> = (0..=255).collect();
        for p in 0..3 {
            for i in 0..4 {
                let mut parity = vec![0u8; 256];
                codec.fold(p, i, &delta, &mut parity);
                let c = codec.coefficient(p, i);
                for (x, got) in delta.iter().zip(&parity) {
                    assert_eq!(*got, gf_mul(c, *x), "coef {c} times {x}");
                }
            }
        }
    }
}
