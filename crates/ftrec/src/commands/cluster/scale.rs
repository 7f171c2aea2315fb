//! `ftrec cluster scale`: asks a running job's coordinator to move the job to another
//! number of servers. The coordinator answers once the move is accepted; the move itself
//! happens at the next step boundary (the run's timeline says `scale-switched` and
//! `scale-end`, and `cluster run --json` reports it under `summary.moves`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use ftrec_proto::proto::ScaleRequest;

use super::{admin_connector, runtime};

#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// The coordinator's address (printed by `cluster run`).
    #[arg(long)]
    pub coordinator: String,
    /// The job file (`RUN_DIR/job.toml`, printed by `cluster run`): its secret admits the
    /// call. Not needed when `FTREC_JOB_SECRET` is set.
    #[arg(long)]
    pub job: Option<PathBuf>,
    /// The server count to move to.
    #[arg(long)]
    pub servers: u32,
}

pub fn scale(a: ScaleArgs) -> Result<()> {
    let connector = admin_connector(a.job.as_deref())?;
    let reply = runtime()?.block_on(async {
        let mut c = connector.coordinator(&a.coordinator).await?;
        c.scale(ScaleRequest { servers: a.servers })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| ftrec_rpc::PsError::rpc(format!("scale to {} servers", a.servers), &s))
    })?;
    outln!(
        "moving from {} to {} servers through a cut at step {} or later",
        reply.from_servers,
        a.servers,
        reply.from_step
    );
    Ok(())
}

/// `STEP:SERVERS` of `--scale-at`.
pub(super) fn parse_scale_at(text: &str) -> Result<(u64, usize), String> {
    let bad = || format!("--scale-at {text}: expected STEP:SERVERS, e.g. 80:5");
    let (step, servers) = text.split_once(':').ok_or_else(bad)?;
    let step = step.trim().parse().map_err(|_| bad())?;
    let servers: usize = servers.trim().parse().map_err(|_| bad())?;
    if servers == 0 {
        return Err(format!("--scale-at {text}: a job needs at least 1 server"));
    }
    Ok((step, servers))
}
