//! `ftrec ckpt` on a cluster's checkpoint location: `<dir>/server-<i>` per server, each an
//! ordinary location. `ls`, `verify` and `merge` go through every server; `export`
//! reassembles one global model from the servers' parts of a cut, with the same tensor
//! names as a single-process export.

use std::path::Path;

use anyhow::{Context, Result, bail};
use ftrec_ckpt::{Checkpoints, Manifest, open_store};
use ftrec_model::ModelState;

/// The server locations under `dir` when it is a cluster's checkpoint location (no
/// manifests of its own, `server-0` and on beside each other), else `None`.
pub fn servers_of(dir: &Path) -> Result<Option<Vec<String>>> {
    let root = dir.to_string_lossy().trim_end_matches('/').to_string();
    let remote = root.contains("://");
    if !remote && (dir.join("manifests").is_dir() || !dir.join("server-0").is_dir()) {
        return Ok(None);
    }
    let mut servers = Vec::new();
    loop {
        let location = format!("{root}/server-{}", servers.len());
        let present = if remote {
            !open_store(&location)?.list("manifests/")?.is_empty()
        } else {
            Path::new(&location).is_dir()
        };
        if !present {
            break;
        }
        servers.push(location);
    }
    Ok((!servers.is_empty()).then_some(servers))
}

/// Runs `f` on every server's location, each under a header; fails, after all ran, if
/// any failed.
pub fn each_server(servers: &[String], f: impl Fn(&Path) -> Result<()>) -> Result<()> {
    let mut failed = Vec::new();
    for (i, location) in servers.iter().enumerate() {
        eprintln!("server {i}: {location}");
        if let Err(e) = f(Path::new(location)) {
            eprintln!("server {i}: {e:#}");
            failed.push(i);
        }
    }
    if !failed.is_empty() {
        bail!("servers {failed:?} of {} failed", servers.len());
    }
    Ok(())
}

/// The global model at a cut: `step` (a number, optionally `step:N`), or the newest cut
/// every server of its job committed. Each server's part is its checkpoint at that step
/// committed last (by fencing token, not clock), as a cluster rollback picks it; a
/// location that also holds a job of another size (one resumed from it) is read by the
/// server count each part names ([`ftrec_cluster::resume::cuts_of`]). Returns a name for
/// the cut, the state and the step.
pub fn restore_cut(servers: &[String], step: Option<&str>) -> Result<(String, ModelState, u64)> {
    let cks: Vec<Checkpoints> = servers
        .iter()
        .map(|l| Ok(Checkpoints::new(open_store(l)?)))
        .collect::<Result<_>>()?;
    let listed: Vec<Vec<Manifest>> = cks
        .iter()
        .map(|c| c.list_readable())
        .collect::<Result<_, _>>()?;
    let cuts = ftrec_cluster::resume::cuts_of(&listed);
    let cut = match step {
        Some(s) => {
            let step = s
                .trim_start_matches("step:")
                .parse::<u64>()
                .with_context(|| format!("--id {s:?}: a cluster location takes a cut's step"))?;
            let at: Vec<_> = cuts.iter().filter(|c| c.step == step).collect();
            match (at.iter().rev().find(|c| c.complete()), at.last()) {
                (Some(c), _) => *c,
                (None, Some(c)) => bail!(
                    "the cut at step {step} is incomplete: servers {:?} of its {} hold no part",
                    c.missing(),
                    c.servers
                ),
                (None, None) => bail!("no server holds a checkpoint of step {step}"),
            }
        }
        None => cuts
            .iter()
            .rev()
            .find(|c| c.complete())
            .context("no step has a checkpoint on every server of its job")?,
    };
    let step = cut.step;
    let mut shards = Vec::with_capacity(cut.servers);
    let mut striped: Option<(ftrec_ec::EcParams, Vec<usize>)> = None;
    for (i, ck) in cks.iter().enumerate().take(cut.servers) {
        let Some(part) = cut.parts.get(&i) else {
            bail!(
                "server {i} ({}) has no checkpoint of step {step}",
                servers[i]
            );
        };
        let (state, manifest) = ck.restore(&part.id)?;
        let placement = manifest.trainer.get("placement").and_then(|v| v.as_str());
        match placement {
            None => {}
            Some(s) if s.starts_with("row-modulo") => {}
            Some(s) if s.starts_with(ftrec_ec::SCHEME) => {
                striped = Some(stripe_identity(&manifest.trainer).with_context(|| {
                    format!(
                        "{}: {} was written under placement {s:?} without the code's \
                         parameters (an older ftrec); it cannot be reassembled",
                        servers[i], part.id
                    )
                })?);
            }
            Some(s) => bail!(
                "{}: {} was written under placement {s:?}, which this ftrec does not know",
                servers[i],
                part.id
            ),
        }
        let owner = manifest.trainer.get("server").and_then(|v| v.as_u64());
        if owner != Some(i as u64) {
            bail!(
                "{}: {} is server {owner:?}'s shard, not server {i}'s",
                servers[i],
                part.id
            );
        }
        shards.push(state);
    }
    let state = match striped {
        // Erasure-coded cuts hold each server's data slots (padding included) under the
        // rotating-stripe layout: invert that layout, with the global table sizes the
        // checkpoints carry.
        Some((params, table_rows)) => {
            let stripes = ftrec_ec::StripeLayout::new(params, shards.len())?;
            let mut config = shards[0].config().clone();
            config.table_rows = table_rows;
            ftrec_proto::assemble::assemble_with(
                &shards,
                ftrec_proto::placement::Layout::striped(stripes),
                &config,
            )?
        }
        None => ftrec_proto::assemble::assemble(&shards)?,
    };
    Ok((format!("cut at step {step}"), state, step))
}

/// The code's parameters and the global table sizes an erasure-coded shard checkpoint
/// records in its identity.
fn stripe_identity(identity: &serde_json::Value) -> Option<(ftrec_ec::EcParams, Vec<usize>)> {
    let identity = ftrec_proto::identity::ShardIdentity::from_json(identity, "").ok()?;
    let ec = identity.ec?;
    let params = ftrec_ec::EcParams {
        k: ec.k,
        r: ec.r,
        groups: ec.groups,
    };
    Some((params, identity.global_table_rows))
}
