//! The recovery planner: a pure function from what the coordinator knows to what the
//! servers do. No I/O, no clock, no lock, so every case is a unit test; `tasks.rs`
//! executes the plan. Partial recovery (CPR: reload one shard from its own checkpoint) and
//! erasure coding (rebuild a shard from parity while reads degrade) add their plans here.

use ftrec_config::FaultTolerance;

use crate::summary::RecoveryMode;

/// Why a recovery is needed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// These server slots died (their replacements have joined).
    ServersLost(Vec<usize>),
    /// A dead worker's step reached only some servers, and regranting it would not be
    /// exact ([`regrant_partly_applied`]).
    StepPartlyApplied,
}

/// What the planner decides from.
#[derive(Clone, Debug)]
pub struct Situation {
    pub ft: FaultTolerance,
    pub deterministic: bool,
    pub cause: Cause,
    /// The newest cut every server committed, if any.
    pub last_cut: Option<u64>,
    /// The newest checkpoint of any kind every server committed: the last cut, or a CPR
    /// prioritised save after it (what a partial restore reloads; never a rollback target,
    /// since a prioritised save is not a consistent state).
    pub last_save: Option<u64>,
    /// Steps granted but not known to be applied everywhere (in flight, orphaned, to be
    /// granted again).
    pub unsettled: Vec<u64>,
    /// The first step never granted.
    pub next_step: u64,
    /// The stripe layout, when rows are erasure coded.
    pub ec: Option<ftrec_ec::StripeLayout>,
    /// Dense ranges replicated (`ec.replicate_dense`): a range is lost with its replica
    /// holder. Coded, they are lost only beyond `r` per group, like rows.
    pub replicate_dense: bool,
    /// Servers still rebuilding in the background from an earlier failure: their pending
    /// rows cannot be read, so for the code they count as lost.
    pub rebuilding: Vec<usize>,
    /// `cluster.ft = "partial"` and the full-or-partial comparison (CPR Eq. 1 against
    /// Eq. 2) chose partial recovery; `false` falls back to a full rollback.
    pub partial: bool,
    /// `cpr.uncoordinated`: each server's newest own save, by slot, which its
    /// replacement reloads instead of `last_save`.
    pub own_saves: Option<Vec<Option<u64>>>,
}

/// How the servers come back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecoveryAction {
    /// Every server restores the cut of this step (`None`: no cut yet, back to the initial
    /// state), and training continues from it.
    Rollback { cut: Option<u64> },
    /// Every server keeps its state and adopts the new epoch; training goes on from
    /// `next_step`, after the `unsettled` steps. Every other step below `next_step` is
    /// applied on every survivor, and a replacement's fresh shard counts it as applied.
    KeepState { next_step: u64, unsettled: Vec<u64> },
    /// Erasure coding: the survivors keep their state (as in `KeepState`), and each of
    /// the `servers` (replacements) rebuilds its data rows, parity rows and dense replica
    /// from the survivors of its group before training goes on. Nothing rolls back.
    Rebuild {
        servers: Vec<usize>,
        next_step: u64,
        unsettled: Vec<u64>,
        /// Servers still rebuilding from an earlier failure: not to be read from.
        unreadable: Vec<usize>,
    },
    /// CPR: each of the `servers` (replacements) reloads its own shard from its save of
    /// the step in `cuts` (same order; the last cut or prioritised save, or with
    /// uncoordinated saves the server's own newest; `None`: no save yet, its initial
    /// shard), then, like the survivors, counts every step below `next_step` but the
    /// `unsettled` ones as applied. Nobody rolls back; the lost shards' updates since
    /// their saves are lost (PLS).
    PartialRestore {
        servers: Vec<usize>,
        cuts: Vec<Option<u64>>,
        next_step: u64,
        unsettled: Vec<u64>,
    },
    /// The state cannot be recovered (more servers of a group lost than the code
    /// rebuilds, and no checkpoint to fall back on): the run ends with this reason.
    Abandon { why: String },
}

impl RecoveryAction {
    /// How the run report says the servers came back.
    pub fn mode(&self) -> RecoveryMode {
        match self {
            Self::Rollback { .. } => RecoveryMode::Rollback,
            Self::KeepState { .. } => RecoveryMode::Keep,
            Self::Rebuild { .. } => RecoveryMode::Rebuild,
            Self::PartialRestore { .. } => RecoveryMode::Partial,
            Self::Abandon { .. } => RecoveryMode::Abandon,
        }
    }

    /// Whether some server reads a checkpoint for it (its calls need the checkpoint I/O
    /// deadline, not the control plane's). A rebuild's calls carry its whole stream, so
    /// they get that bound too; the survivors bound each transfer by its progress.
    pub fn restores(&self) -> bool {
        matches!(
            self,
            Self::Rollback { .. } | Self::PartialRestore { .. } | Self::Rebuild { .. }
        )
    }

    /// The step training continues from.
    pub fn resume_step(&self) -> u64 {
        match self {
            Self::Rollback { cut } => cut.unwrap_or(0),
            Self::KeepState { next_step, .. }
            | Self::Rebuild { next_step, .. }
            | Self::PartialRestore { next_step, .. } => *next_step,
            Self::Abandon { .. } => 0,
        }
    }
}

/// Why the lost servers cannot be rebuilt, if they cannot: more of a group lost than its
/// code rebuilds, or a server lost together with the one keeping its dense replica (the
/// dense range has one copy elsewhere, whatever `r`).
fn beyond_the_code(
    layout: &ftrec_ec::StripeLayout,
    lost: &[usize],
    rebuilding: &[usize],
    replicate_dense: bool,
) -> Option<String> {
    let mut per_group = vec![0usize; layout.params.groups];
    let mut unreadable: Vec<usize> = lost.iter().chain(rebuilding).copied().collect();
    unreadable.sort_unstable();
    unreadable.dedup();
    for &server in &unreadable {
        per_group[layout.group_of_server(server).0] += 1;
    }
    if let Some((group, n)) = per_group
        .into_iter()
        .enumerate()
        .find(|&(_, n)| n > layout.params.r)
    {
        return Some(format!(
            "{n} servers of erasure-coding group {group} lost at once (servers {lost:?}, \
             still rebuilding {rebuilding:?}); ec.r = {} rebuilds at most {} per group",
            layout.params.r, layout.params.r
        ));
    }
    lost.iter()
        .filter(|_| replicate_dense)
        .find(|&&s| lost.contains(&layout.dense_replica(s)))
        .map(|&s| {
            format!(
                "server {s} and server {}, which keeps the only replica of its dense \
                 parameters, lost at once (servers {lost:?})",
                layout.dense_replica(s)
            )
        })
}

pub fn plan(s: &Situation) -> RecoveryAction {
    let keep = || RecoveryAction::KeepState {
        next_step: s.next_step,
        unsettled: s.unsettled.clone(),
    };
    if let (Some(layout), Cause::ServersLost(lost)) = (&s.ec, &s.cause) {
        // A slot whose replacement died too was lost once, not twice.
        let mut lost = lost.clone();
        lost.sort_unstable();
        lost.dedup();
        let lost = &lost;
        let rebuilding: Vec<usize> = s
            .rebuilding
            .iter()
            .copied()
            .filter(|r| !lost.contains(r))
            .collect();
        return match (
            beyond_the_code(layout, lost, &rebuilding, s.replicate_dense),
            s.ft,
        ) {
            (None, _) => RecoveryAction::Rebuild {
                servers: lost.clone(),
                next_step: s.next_step,
                unsettled: s.unsettled.clone(),
                unreadable: rebuilding,
            },
            // The second layer (ECRec §4): back to the last cut.
            (Some(_), FaultTolerance::EcCheckpoint) => RecoveryAction::Rollback { cut: s.last_cut },
            (Some(why), _) => RecoveryAction::Abandon {
                why: format!(
                    "{why}; without checkpoints (cluster.ft = \"ec+checkpoint\") the state \
                     cannot be recovered"
                ),
            },
        };
    }
    match (s.ft, &s.cause) {
        (FaultTolerance::Partial, Cause::ServersLost(lost)) if s.partial => {
            let mut servers = lost.clone();
            servers.sort_unstable();
            servers.dedup();
            let cuts = servers
                .iter()
                .map(|&j| match &s.own_saves {
                    Some(own) => own.get(j).copied().flatten(),
                    None => s.last_save,
                })
                .collect();
            RecoveryAction::PartialRestore {
                servers,
                cuts,
                next_step: s.next_step,
                unsettled: s.unsettled.clone(),
            }
        }
        // CPR found partial recovery not worth its lost updates: a full rollback.
        (FaultTolerance::Partial, Cause::ServersLost(_)) => {
            RecoveryAction::Rollback { cut: s.last_cut }
        }
        // Checkpoints: back to the last consistent cut, whatever the cause; in
        // deterministic mode the run then ends bit-identical to an uninterrupted one.
        (FaultTolerance::Checkpoint, _) => RecoveryAction::Rollback { cut: s.last_cut },
        // A step applied on some servers only (its worker died in phase 2): with
        // checkpoints, back to the last cut, as for `checkpoint`.
        (FaultTolerance::EcCheckpoint, Cause::StepPartlyApplied) => {
            RecoveryAction::Rollback { cut: s.last_cut }
        }
        // No fault tolerance: the lost shards start over, everyone else goes on. Erasure
        // coding without lost servers (a partly applied step) likewise keeps the state, as
        // does partial recovery (nothing exact was promised).
        (
            FaultTolerance::None
            | FaultTolerance::Ec
            | FaultTolerance::EcCheckpoint
            | FaultTolerance::Partial,
            _,
        ) => keep(),
    }
}

/// Whether a dead worker's step that reached only some servers may be granted again
/// (the servers that have it ignore the second push). Exact only where nobody promised
/// bit-exact results: in deterministic mode with checkpoints, the run rolls back instead.
pub fn regrant_partly_applied(ft: FaultTolerance, deterministic: bool) -> bool {
    !(deterministic && ft.exact_recovery())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn situation(ft: FaultTolerance, cause: Cause, last_cut: Option<u64>) -> Situation {
        Situation {
            ft,
            deterministic: true,
            cause,
            last_cut,
            last_save: last_cut,
            unsettled: vec![37, 39],
            next_step: 41,
            ec: None,
            rebuilding: Vec::new(),
            replicate_dense: true,
            partial: true,
            own_saves: None,
        }
    }

    #[test]
    fn partial_recovery_reloads_only_the_lost_shards_unless_it_fell_back() {
        let mut s = situation(
            FaultTolerance::Partial,
            Cause::ServersLost(vec![2, 1, 2]),
            Some(30),
        );
        assert_eq!(
            plan(&s),
            RecoveryAction::PartialRestore {
                servers: vec![1, 2],
                cuts: vec![Some(30), Some(30)],
                next_step: 41,
                unsettled: vec![37, 39],
            }
        );
        assert_eq!(plan(&s).resume_step(), 41, "the workers do not rewind");
        // A prioritised save after the cut is what a partial restore reloads, never what a
        // rollback goes back to.
        s.last_save = Some(35);
        assert!(matches!(
            plan(&s),
            RecoveryAction::PartialRestore { cuts, .. } if cuts == vec![Some(35), Some(35)]
        ));
        // Uncoordinated saves: each replacement reloads its own newest save.
        s.own_saves = Some(vec![Some(36), None, Some(33)]);
        assert!(matches!(
            plan(&s),
            RecoveryAction::PartialRestore { cuts, .. } if cuts == vec![None, Some(33)]
        ));
        s.own_saves = None;
        s.partial = false;
        assert_eq!(plan(&s), RecoveryAction::Rollback { cut: Some(30) });
        s.cause = Cause::StepPartlyApplied;
        assert!(matches!(plan(&s), RecoveryAction::KeepState { .. }));
        assert!(regrant_partly_applied(FaultTolerance::Partial, true));
        assert!(!regrant_partly_applied(FaultTolerance::Checkpoint, true));
    }

    #[test]
    fn checkpoints_roll_back_to_the_last_committed_cut_for_any_cause() {
        for cause in [Cause::ServersLost(vec![1]), Cause::StepPartlyApplied] {
            let s = situation(FaultTolerance::Checkpoint, cause, Some(30));
            assert_eq!(plan(&s), RecoveryAction::Rollback { cut: Some(30) });
            assert_eq!(plan(&s).resume_step(), 30);
        }
        let s = situation(
            FaultTolerance::Checkpoint,
            Cause::ServersLost(vec![0]),
            None,
        );
        assert_eq!(plan(&s).resume_step(), 0, "no cut yet: the initial state");
    }

    #[test]
    fn without_fault_tolerance_the_survivors_keep_their_state() {
        let s = situation(
            FaultTolerance::None,
            Cause::ServersLost(vec![0, 2]),
            Some(30),
        );
        assert_eq!(
            plan(&s),
            RecoveryAction::KeepState {
                next_step: 41,
                unsettled: vec![37, 39]
            }
        );
        assert_eq!(plan(&s).resume_step(), 41);
    }

    #[test]
    fn only_deterministic_checkpointed_runs_refuse_partial_regrants() {
        assert!(!regrant_partly_applied(FaultTolerance::Checkpoint, true));
        assert!(regrant_partly_applied(FaultTolerance::Checkpoint, false));
        assert!(regrant_partly_applied(FaultTolerance::None, true));
        assert!(regrant_partly_applied(FaultTolerance::None, false));
    }

    #[test]
    fn erasure_coding_rebuilds_what_the_code_covers_and_says_when_it_cannot() {
        let params = ftrec_ec::EcParams {
            k: 2,
            r: 1,
            groups: 2,
        };
        let layout = ftrec_ec::StripeLayout::new(params, 6).unwrap();
        let mut s = situation(FaultTolerance::Ec, Cause::ServersLost(vec![1, 4]), None);
        s.ec = Some(layout);
        assert_eq!(
            plan(&s),
            RecoveryAction::Rebuild {
                servers: vec![1, 4],
                next_step: 41,
                unsettled: vec![37, 39],
                unreadable: vec![]
            },
            "one server in each group: both rebuild, nothing rolls back"
        );
        s.cause = Cause::ServersLost(vec![4, 1, 1]);
        assert_eq!(
            plan(&s),
            RecoveryAction::Rebuild {
                servers: vec![1, 4],
                next_step: 41,
                unsettled: vec![37, 39],
                unreadable: vec![]
            },
            "a slot whose replacement died too counts once"
        );
        s.cause = Cause::ServersLost(vec![0, 2]);
        match plan(&s) {
            RecoveryAction::Abandon { why } => assert!(why.contains("group 0"), "{why}"),
            other => panic!("two losses in group 0 with r = 1: {other:?}"),
        }
        // A server still rebuilding in the background cannot serve its rows to a decode.
        s.cause = Cause::ServersLost(vec![2]);
        s.rebuilding = vec![0];
        match plan(&s) {
            RecoveryAction::Abandon { why } => assert!(why.contains("rebuilding [0]"), "{why}"),
            other => panic!("server 0 still rebuilding, server 2 lost, r = 1: {other:?}"),
        }
        s.cause = Cause::ServersLost(vec![4]);
        assert_eq!(
            plan(&s),
            RecoveryAction::Rebuild {
                servers: vec![4],
                next_step: 41,
                unsettled: vec![37, 39],
                unreadable: vec![0]
            },
            "another group rebuilds beside it"
        );
        s.cause = Cause::ServersLost(vec![0]);
        assert!(
            matches!(plan(&s), RecoveryAction::Rebuild { ref unreadable, .. } if unreadable.is_empty()),
            "the rebuilding server itself died: rebuilt afresh"
        );
        s.cause = Cause::ServersLost(vec![0, 2]);
        s.rebuilding.clear();
        s.ft = FaultTolerance::EcCheckpoint;
        s.last_cut = Some(30);
        assert_eq!(plan(&s), RecoveryAction::Rollback { cut: Some(30) });
        s.cause = Cause::StepPartlyApplied;
        assert_eq!(
            plan(&s),
            RecoveryAction::Rollback { cut: Some(30) },
            "else it loops"
        );

        // r = 2 survives any two losses of rows, but not of a dense range and its replica.
        let wide = ftrec_ec::EcParams {
            k: 2,
            r: 2,
            groups: 1,
        };
        let layout = ftrec_ec::StripeLayout::new(wide, 4).unwrap();
        let mut s = situation(FaultTolerance::Ec, Cause::ServersLost(vec![0, 2]), None);
        s.ec = Some(layout);
        assert!(matches!(plan(&s), RecoveryAction::Rebuild { .. }));
        s.cause = Cause::ServersLost(vec![1, 2]);
        match plan(&s) {
            RecoveryAction::Abandon { why } => assert!(why.contains("dense"), "{why}"),
            other => panic!("server 1's dense replica lives on server 2: {other:?}"),
        }
        // Dense ranges coded instead: any two of the group, like rows.
        s.replicate_dense = false;
        assert!(matches!(plan(&s), RecoveryAction::Rebuild { .. }));
    }
}
