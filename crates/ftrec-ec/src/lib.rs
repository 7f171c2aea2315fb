//! Erasure coding for ECRec (`../shared/papers/ecrec.txt` §3.2, §4), with no network: the
//! stripe layout (which server holds which data and parity row, parity rotating RAID-5
//! style) and the codec over a row's *bytes*.
//!
//! ECRec's published code keeps parity as a float sum of the rows, so a decoded row drifts
//! from the lost one by rounding. Here the code works on the bit patterns: `r = 1` is XOR,
//! `r >= 2` a systematic Reed–Solomon code over GF(2^8). A decoded row is bit-identical to
//! the lost row, and a row change folds into parity as `coef · (old XOR new)`, which
//! commutes: differences from concurrent updates may arrive in any order.

mod codec;
mod dense;
mod error;
mod layout;

pub use codec::{Codec, fold_with, xor_into};
pub use dense::DenseParitySlot;
pub use error::EcError;
pub use layout::{CycleRow, CycleStripe, EcParams, SCHEME, StripeLayout, StripeSlot};
