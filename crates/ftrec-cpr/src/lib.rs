//! CPR (cpr.txt): checkpointing with partial recovery for recommendation training.
//!
//! Pure building blocks, shared by the one-process emulation study (`ftrec bench cpr`)
//! and the parameter-server cluster: the overhead model and PLS accounting
//! ([`formulas`]), which embedding rows a prioritised partial checkpoint saves
//! ([`priority`]), and which tables prioritisation applies to ([`tables`]).

mod error;
pub mod formulas;
pub mod priority;
pub mod tables;

pub use error::CprError;
pub use formulas::{CostInputs, Decision, Pls, PrioritizedCosts, Recovery};
pub use priority::{CprPriority, Prioritizer, build_prioritizer};
