//! `ftrec cluster verify-parity`: a live scrub of a running erasure-coded cluster, and the
//! named mismatches it (and the end-of-run check) prints.

use anyhow::{Result, bail};
use ftrec_rpc::Job;

use super::{VerifyParityArgs, runtime};
use crate::output::print_json;

/// Mismatches printed one per line; the rest are in `--json`.
const PRINTED_MISMATCHES: usize = 20;

/// Prints the first named mismatches of `total`.
pub(super) fn print_mismatches(
    details: &[ftrec_cluster::parity_check::Mismatch],
    total: u64,
) -> Result<()> {
    for m in details.iter().take(PRINTED_MISMATCHES) {
        outln!("  mismatch: {m}");
    }
    let shown = details.len().min(PRINTED_MISMATCHES) as u64;
    if total > shown {
        outln!(
            "  ... and {} more ({} named in --json)",
            total - shown,
            details.len()
        );
    }
    Ok(())
}

/// `cluster verify-parity`: a live scrub of a running cluster.
pub fn verify_parity(a: VerifyParityArgs) -> Result<()> {
    let job = Job::load(&a.job)?;
    let options = ftrec_cluster::scrub::ScrubOptions {
        stripes_per_range: a.range.max(1),
        attempts: a.attempts.max(1),
        ..Default::default()
    };
    let report =
        runtime()?.block_on(ftrec_cluster::scrub::scrub(&job, &a.coordinator, &options))?;
    let p = &report.parity;
    let failed = if p.mismatches + p.replica_mismatches > 0 {
        Some(format!(
            "the scrub found {} stripes with a wrong parity row and {} dense replicas that \
             differ from their primary",
            p.mismatches, p.replica_mismatches
        ))
    } else if report.unsettled > 0 {
        Some(format!(
            "the scrub could not check {} ranges: their servers never answered at the same \
             applied steps (first: {})",
            report.unsettled,
            report
                .unsettled_details
                .first()
                .map(|u| format!("{}: {}", u.what, u.why))
                .unwrap_or_default()
        ))
    } else {
        None
    };
    if a.json {
        print_json(serde_json::to_value(&report)?)?;
    } else {
        outln!(
            "scrubbed {} stripes in epoch {} in {:.2}s ({} ranges, {} read again): {} stripe \
             mismatches, {} dense replica mismatches, {} ranges unsettled",
            p.stripes,
            report.epoch,
            report.seconds,
            report.ranges,
            report.rereads,
            p.mismatches,
            p.replica_mismatches,
            report.unsettled
        );
        print_mismatches(&p.details, p.mismatches + p.replica_mismatches)?;
        for u in report.unsettled_details.iter().take(PRINTED_MISMATCHES) {
            outln!("  unsettled: {}: {}", u.what, u.why);
        }
    }
    if let Some(why) = failed {
        bail!("{why}");
    }
    Ok(())
}
