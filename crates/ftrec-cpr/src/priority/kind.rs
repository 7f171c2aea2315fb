//! The kinds of prioritised saving, as `[cpr] priority` names them.

use serde::{Deserialize, Serialize};

/// Which embedding rows a prioritised partial checkpoint saves (cpr.txt §4.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CprPriority {
    /// Every row of every table at each checkpoint (CPR-vanilla).
    #[default]
    None,
    /// Most frequently used rows since their last save (a 4-byte counter per row).
    Mfu,
    /// Sub-sampled used rows, a bounded list with random discard.
    Ssu,
    /// Largest L2 change since the last save (SCAR, Qiao et al. 2019).
    Scar,
}

impl CprPriority {
    pub const ALL: [Self; 4] = [Self::None, Self::Mfu, Self::Ssu, Self::Scar];

    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Mfu => "mfu",
            Self::Ssu => "ssu",
            Self::Scar => "scar",
        }
    }
}
