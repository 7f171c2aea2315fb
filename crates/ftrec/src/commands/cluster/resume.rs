//! `cluster run --resume CKDIR[@STEP]`: the cut, resolved and checked before anything
//! starts (`ftrec_cluster::resume`), and where the resumed job's own cuts go.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::absolute;

/// `--resume`: the cut it names, resolved and checked, recorded in the job as
/// `CKDIR@STEP` so that every member (and a standby coordinator) starts from the same
/// one; new cuts go to CKDIR when no checkpoint directory is set.
pub(super) fn resume_point(
    config: &mut ftrec_config::JobConfig,
    resume: Option<&str>,
    fallback: bool,
) -> Result<Option<ftrec_proto::proto::ResumePoint>> {
    if let Some(spec) = resume {
        let (location, step) = ftrec_cluster::resume::parse(spec);
        let location = if location.contains("://") {
            location
        } else {
            absolute(Path::new(&location))?
                .to_string_lossy()
                .into_owned()
        };
        config.cluster.resume_from = Some(match step {
            Some(step) => format!("{location}@{step}"),
            None => location,
        });
    }
    let Some(point) = ftrec_cluster::resume::resolve(config, fallback)? else {
        return Ok(None);
    };
    // Refused here, before any process starts (the coordinator refuses it too, but a
    // standby under etcd would only die of it).
    let steps = config.train.steps;
    if steps > 0 && point.step >= steps {
        anyhow::bail!(
            "--resume {}: its cut is at step {}, and the job trains {steps} steps \
             (--steps counts from step 0, as in the first run): nothing is left to train",
            point.location,
            point.step
        );
    }
    config.cluster.resume_from = Some(format!("{}@{}", point.location, point.step));
    if config.cluster.ft.checkpoints() && config.checkpoint.dir.is_none() {
        config.checkpoint.dir = Some(PathBuf::from(&point.location));
    }
    eprintln!(
        "resuming from the cut at step {} of {} ({} servers)",
        point.step, point.location, point.servers
    );
    Ok(Some(point))
}
