//! What a finished run reports: the gathered model's digests, the parity check, the
//! evaluation, and each kill's time to resume, read from the typed timeline.

use std::path::Path;

use ftrec_coordinator::Shared;
use ftrec_model::ModelState;
use ftrec_proto::timeline::{EventKind, Subject, TimelineData};
use ftrec_rpc::{Job, PsError};
use ftrec_train::{Progress, TrainError};

use super::{Evaluator, LaunchReport};

/// The report of a finished run: the summary, the gathered model's digests, the parity
/// check (erasure coding), the evaluation; the model is saved to `save` first. The servers
/// must still serve.
pub async fn final_report(
    job: &Job,
    shared: &Shared,
    mut kill_times: Vec<f64>,
    evaluate: Option<Evaluator>,
    run_dir: &Path,
    save: Option<&Path>,
) -> Result<LaunchReport, PsError> {
    let mut summary = shared.summary();
    let timeline = shared.timeline();
    for r in &mut summary.recoveries {
        let killed = last_kill_before(&timeline, r.server, r.detected_at);
        r.kill_to_resume_seconds = killed.map(|killed| r.resumed_at - killed);
        r.kill_to_first_step_seconds = killed.zip(r.first_step_at).map(|(k, f)| f - k);
    }
    // Kills at a step are fired by the coordinator; timed ones by the launcher.
    kill_times.extend(
        timeline
            .injected_failures()
            .filter(|e| e.step.is_some())
            .map(|e| e.t),
    );
    let kill_to_resume: Vec<f64> = kill_times
        .iter()
        .filter_map(|&k| {
            timeline
                .of(EventKind::RecoveryEnd)
                .find(|e| e.t >= k)
                .map(|e| e.t - k)
        })
        .collect();
    let epoch = summary.epoch;
    let addresses = shared.server_addresses();
    let (state, shard_digests) = ftrec_rpc::gather::gather_state(job, &addresses, epoch).await?;
    let (mut parity_mismatches, mut replica_mismatches) = (None, None);
    let mut parity_mismatch_details = None;
    if job.config.cluster.ft.erasure_coded() {
        let report = crate::parity_check::verify_parity(job, &addresses, epoch, &state).await?;
        parity_mismatches = Some(report.mismatches);
        replica_mismatches = Some(report.replica_mismatches);
        parity_mismatch_details = Some(report.details);
    }
    let digest = state.digest().to_string();
    if let Some(path) = save {
        save_model(path, &state, summary.steps)?;
    }
    let (mut auc, mut logloss, mut eval_samples) = (None, None, None);
    if let Some(evaluate) = evaluate {
        let metrics = evaluate(job, state).map_err(PsError::Fatal)?;
        auc = Some(metrics.auc);
        logloss = Some(metrics.logloss);
        eval_samples = Some(metrics.samples);
    }
    let cluster = &job.config.cluster;
    let servers = summary.servers;
    Ok(LaunchReport {
        summary,
        state_digest: digest,
        shard_digests,
        parity_mismatches,
        replica_mismatches,
        parity_mismatch_details,
        // The servers the job ended on: a move (`--scale-at`, `cluster scale`) may have
        // left the job file's count.
        servers,
        workers: cluster.workers,
        kill_to_resume_seconds: kill_to_resume,
        // The launcher samples `/proc` as the run goes; it fills these in.
        server_peak_rss_bytes: Vec::new(),
        waiting_spare_peak_rss_bytes: None,
        cpu_training: None,
        cpu_rebuilds: Vec::new(),
        auc,
        logloss,
        eval_samples,
        saved_model: save.map(Path::to_path_buf),
        run_dir: run_dir.to_path_buf(),
        run_dir_removed: false,
        coordinator_kills: Vec::new(),
    })
}

/// Refuses a `--save` path that cannot be written, before a run whose end it would keep:
/// its folder must exist, and the path must not name a folder.
pub fn check_save_path(path: &Path) -> Result<(), PsError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(PsError::Config(format!(
            "--save {}: the folder {} does not exist",
            path.display(),
            parent.display()
        )));
    }
    if path.is_dir() {
        return Err(PsError::Config(format!(
            "--save {}: a folder, not a file",
            path.display()
        )));
    }
    Ok(())
}

/// Writes the gathered model as a snapshot, as `train --save` does. The progress holds
/// the step: the workers' data positions are theirs (the cut keeps them), and a snapshot
/// serves `eval` and export, not a resume.
fn save_model(path: &Path, state: &ModelState, steps: u64) -> Result<(), PsError> {
    let progress = Progress {
        step: steps,
        ..Progress::default()
    };
    ftrec_train::snapshot::save(path, state, progress).map_err(|e| match e {
        TrainError::Io { path, error } => PsError::Io {
            path: path.display().to_string(),
            error,
        },
        other => PsError::Fatal(format!("saving the model to {}: {other}", path.display())),
    })
}

/// A recovery's own failure: the last SIGKILL or freeze of its server before the failure
/// was detected.
fn last_kill_before(timeline: &TimelineData, server: usize, detected_at: f64) -> Option<f64> {
    let subject = Some(Subject::Server(server as u32));
    timeline
        .injected_failures()
        .filter(|e| e.subject == subject && e.t <= detected_at)
        .map(|e| e.t)
        .reduce(f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_proto::timeline::Timeline;

    #[test]
    fn a_recovery_is_timed_from_its_own_servers_last_kill() {
        let mut timeline = Timeline::new();
        timeline.event_about(EventKind::Killed, Subject::Server(1), None, "server 1");
        timeline.event_about(EventKind::Killed, Subject::Server(0), Some(9), "server 0");
        timeline.event_about(
            EventKind::Killed,
            Subject::Server(1),
            Some(12),
            "server 1 again",
        );
        let data = &timeline.data;
        let times: Vec<f64> = data.events.iter().map(|e| e.t).collect();
        assert_eq!(last_kill_before(data, 1, f64::MAX), Some(times[2]));
        assert_eq!(last_kill_before(data, 1, times[1]), Some(times[0]));
        assert_eq!(last_kill_before(data, 0, f64::MAX), Some(times[1]));
        assert_eq!(last_kill_before(data, 2, f64::MAX), None);
        // A worker's kill is no server's.
        let mut timeline = Timeline::new();
        timeline.event_about(EventKind::Killed, Subject::Worker(1), None, "worker 1");
        assert_eq!(last_kill_before(&timeline.data, 1, f64::MAX), None);
    }
}
