//! Row-wise quantized rows (`checkpoint.quantize`), as FBGEMM's fused 8-bit and 4-bit
//! row-wise formats store embeddings: each row segment keeps an fp16 scale and bias and
//! one unsigned code per value, `value ~ code * scale + bias`. The embedding is one
//! segment; the optimizer state stays f32, or (`checkpoint.quantize_optimizer`) is
//! quantized in segments of `dim` values, each with its own scale and bias, since Adam's
//! two moments differ in scale by orders of magnitude.
//!
//! The scale and bias are rounded to fp16 before the codes are computed, so decoding
//! uses exactly the values the codes were chosen against. Quantization is lossy: a
//! restore from a quantized checkpoint is close to, not equal to, the state saved.

use half::f16;
use serde::{Deserialize, Serialize};

/// How a checkpoint's rows are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantKind {
    /// Little-endian f32, exact.
    #[default]
    None,
    /// 8-bit codes: 256 levels per segment.
    Int8,
    /// 4-bit codes, two per byte (the first value in the low nibble): 16 levels.
    Int4,
}

impl QuantKind {
    fn code(self) -> u8 {
        match self {
            QuantKind::None => 0,
            QuantKind::Int8 => 1,
            QuantKind::Int4 => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(QuantKind::None),
            1 => Some(QuantKind::Int8),
            2 => Some(QuantKind::Int4),
            _ => None,
        }
    }

    fn levels(self) -> f32 {
        match self {
            QuantKind::None => 0.0,
            QuantKind::Int8 => 255.0,
            QuantKind::Int4 => 15.0,
        }
    }

    /// Bytes of `n` codes.
    fn code_bytes(self, n: usize) -> usize {
        match self {
            QuantKind::None => 4 * n,
            QuantKind::Int8 => n,
            QuantKind::Int4 => n.div_ceil(2),
        }
    }
}

/// The quantization of one chunk's rows: how, and the embedding width that splits a row
/// into its embedding and its optimizer state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Quant {
    pub kind: QuantKind,
    /// The optimizer state is quantized too (else stored as f32).
    pub optimizer: bool,
    /// Embedding values per row (the model's `dim`).
    pub dim: u16,
}

impl Quant {
    pub const NONE: Quant = Quant {
        kind: QuantKind::None,
        optimizer: false,
        dim: 0,
    };

    pub fn is_none(&self) -> bool {
        self.kind == QuantKind::None
    }

    /// Header bytes 32..36: kind, optimizer flag, dim (u16 LE).
    pub(crate) fn encode(&self) -> [u8; 4] {
        let d = self.dim.to_le_bytes();
        [self.kind.code(), u8::from(self.optimizer), d[0], d[1]]
    }

    pub(crate) fn decode(b: [u8; 4]) -> Result<Self, String> {
        let kind = QuantKind::from_code(b[0])
            .ok_or_else(|| format!("unknown quantization code {}", b[0]))?;
        if b[1] > 1 {
            return Err(format!("bad optimizer quantization flag {}", b[1]));
        }
        Ok(Quant {
            kind,
            optimizer: b[1] == 1,
            dim: u16::from_le_bytes([b[2], b[3]]),
        })
    }

    /// The segments of a `stride`-value row: `(length, quantized)`.
    fn segments(&self, stride: usize) -> impl Iterator<Item = (usize, bool)> + '_ {
        let dim = (self.dim as usize).min(stride);
        let state = stride - dim;
        let state_segments: Vec<(usize, bool)> = if self.optimizer && dim > 0 {
            (0..state.div_ceil(dim))
                .map(|i| ((state - i * dim).min(dim), true))
                .collect()
        } else if state > 0 {
            vec![(state, false)]
        } else {
            Vec::new()
        };
        std::iter::once((dim, true))
            .filter(|(n, _)| *n > 0)
            .chain(state_segments)
    }

    /// Stored bytes of one `stride`-value row.
    pub fn row_bytes(&self, stride: usize) -> usize {
        if self.is_none() {
            return 4 * stride;
        }
        self.segments(stride)
            .map(|(n, q)| {
                if q {
                    4 + self.kind.code_bytes(n)
                } else {
                    4 * n
                }
            })
            .sum()
    }

    /// Appends `row`, stored this way, to `out`. A quantized segment whose bias or scale
    /// fp16 cannot hold (beyond 65504, or not finite) is refused: its values could not
    /// be restored. The error says which value.
    pub fn encode_row(&self, row: &[f32], out: &mut Vec<u8>) -> Result<(), String> {
        if self.is_none() {
            out.extend_from_slice(bytemuck::cast_slice(row));
            return Ok(());
        }
        let mut at = 0;
        for (n, quantized) in self.segments(row.len()) {
            let segment = &row[at..at + n];
            at += n;
            if !quantized {
                out.extend_from_slice(bytemuck::cast_slice(segment));
                continue;
            }
            let (min, max) = segment
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            let bias = f16::from_f32(min);
            let scale = f16::from_f32((max - min) / self.kind.levels());
            if !bias.is_finite() || !scale.is_finite() {
                return Err(format!(
                    "values from {min} to {max} (at value {}) are beyond the range of the \
                     fp16 scale and bias that {:?} rows store",
                    at - n,
                    self.kind
                ));
            }
            out.extend_from_slice(&scale.to_le_bytes());
            out.extend_from_slice(&bias.to_le_bytes());
            let (scale, bias) = (scale.to_f32(), bias.to_f32());
            let levels = self.kind.levels();
            let code = |v: f32| -> u8 {
                if scale > 0.0 && scale.is_finite() {
                    ((v - bias) / scale).round().clamp(0.0, levels) as u8
                } else {
                    0
                }
            };
            match self.kind {
                QuantKind::Int8 => out.extend(segment.iter().map(|&v| code(v))),
                QuantKind::Int4 => out.extend(
                    segment
                        .chunks(2)
                        .map(|p| code(p[0]) | (p.get(1).map_or(0, |&v| code(v)) << 4)),
                ),
                QuantKind::None => {}
            }
        }
        Ok(())
    }

    /// Decodes one stored row (`row_bytes(out.len())` bytes) into `out`.
    pub fn decode_row(&self, stored: &[u8], out: &mut [f32]) {
        if self.is_none() {
            for (d, c) in out.iter_mut().zip(stored.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            return;
        }
        let (mut at, mut value) = (0usize, 0usize);
        for (n, quantized) in self.segments(out.len()) {
            let segment = &mut out[value..value + n];
            value += n;
            if !quantized {
                for (d, c) in segment
                    .iter_mut()
                    .zip(stored[at..at + 4 * n].chunks_exact(4))
                {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
                at += 4 * n;
                continue;
            }
            let scale = f16::from_le_bytes([stored[at], stored[at + 1]]).to_f32();
            let bias = f16::from_le_bytes([stored[at + 2], stored[at + 3]]).to_f32();
            at += 4;
            let codes = &stored[at..at + self.kind.code_bytes(n)];
            at += codes.len();
            for (i, d) in segment.iter_mut().enumerate() {
                let code = match self.kind {
                    QuantKind::Int8 => codes[i],
                    QuantKind::Int4 => (codes[i / 2] >> (4 * (i % 2))) & 0x0f,
                    QuantKind::None => 0,
                };
                *d = f32::from(code) * scale + bias;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A row decodes to within half a step of its segment's range (plus fp16's
        /// rounding of scale and bias), f32 segments exactly, and the stored size is what
        /// `row_bytes` says.
        #[test]
        fn rows_decode_within_half_a_step(
            dim in 1usize..20,
            extra in 0usize..45,
            kind in prop_oneof![Just(QuantKind::Int8), Just(QuantKind::Int4), Just(QuantKind::None)],
            optimizer in any::<bool>(),
            values in proptest::collection::vec(-3.0f32..3.0, 64),
        ) {
            let stride = dim + extra;
            let row = &values[..stride];
            let q = Quant { kind, optimizer, dim: dim as u16 };
            let mut stored = Vec::new();
            q.encode_row(row, &mut stored).unwrap();
            prop_assert_eq!(stored.len(), q.row_bytes(stride));
            let mut back = vec![0.0f32; stride];
            q.decode_row(&stored, &mut back);
            let mut at = 0;
            for (n, quantized) in q.segments(stride) {
                let (orig, got) = (&row[at..at + n], &back[at..at + n]);
                at += n;
                if kind == QuantKind::None || !quantized {
                    prop_assert_eq!(orig, got);
                    continue;
                }
                let lo = orig.iter().cloned().fold(f32::INFINITY, f32::min);
                let hi = orig.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let step = (hi - lo) / kind.levels();
                // fp16 keeps 11 significant bits of scale and bias.
                let slack = 0.5 * step + (hi.abs() + lo.abs()) * 2e-3 + 1e-6;
                for (o, g) in orig.iter().zip(got) {
                    prop_assert!((o - g).abs() <= slack, "{o} vs {g}, step {step}");
                }
            }
        }
    }

    #[test]
    fn int8_rows_take_a_quarter_of_the_bytes_plus_scale_and_bias() {
        let q = Quant {
            kind: QuantKind::Int8,
            optimizer: true,
            dim: 64,
        };
        // Adam: embedding, then two moments of 64 values each.
        assert_eq!(q.row_bytes(192), 3 * (4 + 64));
        let q = Quant {
            optimizer: false,
            ..q
        };
        assert_eq!(q.row_bytes(192), 4 + 64 + 4 * 128);
        let q = Quant {
            kind: QuantKind::Int4,
            ..q
        };
        assert_eq!(q.row_bytes(64), 4 + 32);
        let h = Quant::decode(q.encode()).unwrap();
        assert_eq!(h, q);
        assert!(Quant::decode([9, 0, 0, 0]).is_err());
        // Beyond fp16: refused, not stored as infinities.
        let q = Quant {
            kind: QuantKind::Int8,
            optimizer: false,
            dim: 2,
        };
        let e = q.encode_row(&[1e8, -3.0], &mut Vec::new()).unwrap_err();
        assert!(e.contains("fp16"), "{e}");
    }
}
