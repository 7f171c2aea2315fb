//! Which cut a resumed job starts from (`cluster.resume_from = "DIR[@STEP]"`), checked
//! before anything starts: every server of the cut committed its part, the parts read
//! back with good checksums, and the cut is of this job's model and batch schedule.
//! The servers then re-place its rows for this job's layout (`ftrec_server::resume`).
//!
//! A cut is the parts at one step under `DIR/server-<i>`, each naming in its identity
//! the server count that wrote it, so a location that held a job of another size before
//! (the parts of `server-3` left from a 4-server job under a 2-server one) is read right.

use std::collections::BTreeMap;

use ftrec_ckpt::{Checkpoints, Manifest, open_store};
use ftrec_proto::identity::ShardIdentity;
use ftrec_proto::proto::ResumePoint;
use ftrec_rpc::PsError;

/// `DIR` and the step of `DIR@STEP` (`None`: the newest complete cut). A location may
/// hold `@` itself; only a suffix that is a step number is taken as one.
pub fn parse(spec: &str) -> (String, Option<u64>) {
    if let Some((dir, step)) = spec.rsplit_once('@')
        && let Ok(step) = step.trim_start_matches("step:").parse::<u64>()
    {
        return (dir.trim_end_matches('/').to_string(), Some(step));
    }
    (spec.trim_end_matches('/').to_string(), None)
}

/// One cut in a cluster's checkpoint location: the parts at one step of jobs of one
/// size. A location may hold cuts of several sizes (a job resumed on more or fewer
/// servers writes beside the one it resumed from), told apart by the server count each
/// part's identity names.
#[derive(Clone, Debug)]
pub struct Cut {
    pub step: u64,
    /// The server count of the job that wrote it.
    pub servers: usize,
    /// By server slot, that slot's part: its newest commit at this step of a cut of this
    /// size (by fencing token, as a rollback picks it).
    pub parts: BTreeMap<usize, Manifest>,
}

impl Cut {
    /// The slots of the cut's job that hold no part of it.
    pub fn missing(&self) -> Vec<usize> {
        (0..self.servers)
            .filter(|i| !self.parts.contains_key(i))
            .collect()
    }

    /// Every server of the job committed its part: the cut can be restored.
    pub fn complete(&self) -> bool {
        self.missing().is_empty()
    }

    /// The identity of a part: an error names what is wrong with it (none, or a format
    /// version newer than this ftrec reads).
    fn identity(&self, slot: usize) -> Result<ShardIdentity, PsError> {
        let Some(m) = self.parts.get(&slot) else {
            return Err(PsError::Config(format!(
                "server {slot} holds no part of the cut at step {}",
                self.step
            )));
        };
        Ok(ShardIdentity::from_json(&m.trainer, &m.id)?)
    }
}

/// The cuts of a cluster location whose slot `i` listed `listings[i]`, oldest first (at
/// one step, the one committed last at slot 0 last). A part without an identity (written
/// before identities existed) counts as one of a job of `listings.len()` servers.
pub fn cuts_of(listings: &[Vec<Manifest>]) -> Vec<Cut> {
    let mut by_key: BTreeMap<(u64, usize), BTreeMap<usize, Manifest>> = BTreeMap::new();
    for (slot, all) in listings.iter().enumerate() {
        for m in all {
            let (servers, owner) = match ShardIdentity::from_json(&m.trainer, &m.id) {
                Ok(identity) => (identity.servers, identity.server),
                Err(_) => (listings.len(), slot),
            };
            if owner != slot {
                continue;
            }
            let parts = by_key.entry((m.step, servers)).or_default();
            match parts.get(&slot) {
                Some(held) if held.commit_order() >= m.commit_order() => {}
                _ => {
                    parts.insert(slot, m.clone());
                }
            }
        }
    }
    let mut cuts: Vec<Cut> = by_key
        .into_iter()
        .map(|((step, servers), parts)| Cut {
            step,
            servers,
            parts,
        })
        .collect();
    fn newest(c: &Cut) -> Option<(Option<ftrec_ckpt::FenceToken>, u32, &str)> {
        c.parts.values().map(|m| m.commit_order()).max()
    }
    cuts.sort_by(|a, b| (a.step, newest(a)).cmp(&(b.step, newest(b))));
    cuts
}

/// Slot `i`'s readable checkpoints under `location`, for every slot up to the last that
/// holds any (and at least up to the largest job size a part names).
pub fn list_slots(location: &str) -> Result<Vec<Vec<Manifest>>, PsError> {
    let mut listings = Vec::new();
    let mut servers = 0usize;
    loop {
        let i = listings.len();
        let part_location = format!("{location}/server-{i}");
        // A local directory that is not there is not opened: opening would create it.
        let all = if location.contains("://") || std::path::Path::new(&part_location).is_dir() {
            Checkpoints::new(open_store(&part_location)?).list_readable()?
        } else {
            Vec::new()
        };
        if all.is_empty() && i >= servers {
            break;
        }
        for m in &all {
            if let Ok(identity) = ShardIdentity::from_json(&m.trainer, &m.id) {
                servers = servers.max(identity.servers);
            }
        }
        listings.push(all);
    }
    Ok(listings)
}

/// The differences between the cut's model and this job's, each as `key: cut X, job Y`.
fn model_differences(
    cut: &ftrec_model::ModelConfig,
    job: &ftrec_model::ModelConfig,
) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(cut), serde_json::to_value(job))
    else {
        return vec!["the model configurations cannot be compared".into()];
    };
    a.iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, v)| {
            let job_value = b.get(k).map_or("-".to_string(), |x| x.to_string());
            format!("model.{k}: cut {v}, job {job_value}")
        })
        .collect()
}

/// The cut `config.cluster.resume_from` names, checked against this job (`None` for a
/// fresh start). With `fallback`, a cut whose parts do not verify is passed over for the
/// newest older complete one, as `train --resume --fallback` does.
pub fn resolve(
    config: &ftrec_config::JobConfig,
    fallback: bool,
) -> Result<Option<ResumePoint>, PsError> {
    let Some(spec) = config.cluster.resume_from.as_deref() else {
        return Ok(None);
    };
    let (location, step) = parse(spec);
    let cuts = cuts_of(&list_slots(&location)?);
    if cuts.is_empty() {
        return Err(PsError::Config(format!(
            "cluster.resume_from = {spec:?}: {location} holds no cluster checkpoint (no \
             readable part under {location}/server-0)"
        )));
    }
    let candidates: Vec<&Cut> = match step {
        Some(step) => {
            let at: Vec<&Cut> = cuts.iter().filter(|c| c.step == step).collect();
            let Some(newest) = at.last() else {
                let mut held: Vec<u64> = cuts.iter().map(|c| c.step).collect();
                held.dedup();
                return Err(PsError::Config(format!(
                    "cluster.resume_from = {spec:?}: no cut at step {step} in {location} \
                     (it holds steps {held:?})"
                )));
            };
            match at.iter().rev().find(|c| c.complete()) {
                Some(c) => vec![*c],
                None => {
                    return Err(PsError::Config(format!(
                        "cluster.resume_from = {spec:?}: the cut at step {step} is \
                         incomplete: servers {:?} of its {} committed no part of it; resume \
                         from a complete cut (`ftrec ckpt ls {location}` lists them)",
                        newest.missing(),
                        newest.servers
                    )));
                }
            }
        }
        None => cuts.iter().rev().filter(|c| c.complete()).collect(),
    };
    if candidates.is_empty() {
        return Err(PsError::Config(format!(
            "cluster.resume_from = {spec:?}: no cut in {location} was committed by every \
             server; `ftrec ckpt ls {location}` shows which parts exist"
        )));
    }
    let mut damaged = Vec::new();
    for cut in candidates {
        let step = cut.step;
        check_compatible(config, spec, cut)?;
        match verify_parts(&location, cut) {
            Ok(()) => {
                if !damaged.is_empty() {
                    tracing::warn!(
                        "resuming from the cut at step {step}: newer cuts are damaged: {}",
                        damaged.join("; ")
                    );
                }
                return Ok(Some(ResumePoint {
                    location: location.clone(),
                    step,
                    servers: cut.servers as u32,
                }));
            }
            Err(why) if fallback => damaged.push(format!("step {step}: {why}")),
            Err(why) => {
                return Err(PsError::Config(format!(
                    "cluster.resume_from = {spec:?}: the cut at step {step} is damaged: {why} \
                     (--fallback resumes from the newest older cut that is whole)"
                )));
            }
        }
    }
    Err(PsError::Config(format!(
        "cluster.resume_from = {spec:?}: every complete cut is damaged: {}",
        damaged.join("; ")
    )))
}

/// Refuses a cut of another model, or of another batch schedule (its step would then
/// name another data position), naming each difference.
fn check_compatible(
    config: &ftrec_config::JobConfig,
    spec: &str,
    cut: &Cut,
) -> Result<(), PsError> {
    let identity = cut.identity(0).map_err(|e| {
        PsError::Config(format!(
            "cluster.resume_from = {spec:?}: the cut at step {} cannot be re-placed: {e}",
            cut.step
        ))
    })?;
    let Some(part) = cut.parts.get(&0) else {
        return Err(PsError::Config(format!(
            "cluster.resume_from = {spec:?}: server 0 holds no part of the cut at step {}",
            cut.step
        )));
    };
    let job_model = config.model_config()?;
    let mut cut_model = part.model.clone();
    cut_model.table_rows = identity.global_table_rows.clone();
    let mut differences = model_differences(&cut_model, &job_model);
    let batch_size = config.train.batch_size as u64;
    match identity.batch_size {
        Some(b) if b != batch_size => differences.push(format!(
            "train.batch_size: cut {b}, job {batch_size} (the cut's step names a position in \
             its batch schedule)"
        )),
        Some(_) => {}
        None => tracing::warn!(
            "the cut at step {} predates recorded data positions (identity version {}): its \
             data position is taken as batch {} of this job's schedule",
            cut.step,
            identity.version,
            cut.step
        ),
    }
    if !part.quantize.is_none() {
        tracing::warn!(
            "the cut at step {} is stored {:?}-quantized: the resumed job starts close to \
             its state, not bit-identical to it",
            cut.step,
            part.quantize.kind
        );
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(PsError::Config(format!(
        "cluster.resume_from = {spec:?}: the cut at step {} is of another model or job: {} \
         (cluster.servers, the worker count and train.steps may differ)",
        cut.step,
        differences.join("; ")
    )))
}

/// Every part's checkpoint, and what its restore reads, has its checksums right.
fn verify_parts(location: &str, cut: &Cut) -> Result<(), String> {
    for (i, part) in &cut.parts {
        let part_location = format!("{location}/server-{i}");
        let checkpoints = Checkpoints::new(open_store(&part_location).map_err(|e| e.to_string())?);
        checkpoints
            .verify(&part.id)
            .map_err(|e| format!("{part_location}: {}: {e}", part.id))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_ckpt::LocalStore;
    use ftrec_proto::placement::Layout;
    use ftrec_server::shard::Shard;

    fn job() -> ftrec_config::JobConfig {
        let mut c = ftrec_config::JobConfig::preset("micro").unwrap();
        c.model.rows_per_table = 40;
        c
    }

    /// The job's initial model as a cut of `servers` at `step` under `dir`, each part's
    /// identity passed through `edit` first.
    fn write_cut(dir: &Path, servers: usize, step: u64, edit: impl Fn(&mut serde_json::Value)) {
        let c = job();
        let global = c.model_config().unwrap();
        let layout = Layout::new(servers).unwrap();
        for j in 0..servers {
            let shard = Shard::initial(&global, c.seed, layout, j).unwrap();
            let mut identity = ShardIdentity {
                version: ShardIdentity::VERSION,
                fingerprint: 1,
                server: j,
                servers,
                epoch: 1,
                placement: layout.scheme(),
                global_table_rows: global.table_rows.clone(),
                step,
                ec: None,
                cpr_priority: None,
                applied_ahead: Vec::new(),
                batch_size: Some(c.train.batch_size as u64),
            }
            .to_json();
            edit(&mut identity);
            let store = LocalStore::open(&dir.join(format!("server-{j}"))).unwrap();
            Checkpoints::new(Box::new(store))
                .write_full(shard.state(), step, identity)
                .unwrap();
        }
    }

    fn resolve_in(dir: &Path, config: &mut ftrec_config::JobConfig) -> Result<ResumePoint, String> {
        config.cluster.resume_from = Some(dir.display().to_string());
        resolve(config, false)
            .map(|p| p.unwrap())
            .map_err(|e| e.to_string())
    }

    use std::path::Path;

    /// A cut written before data positions were recorded (identity version 1, as 824e953
    /// wrote) still resumes; one of a newer format is refused, naming its version; one of
    /// another batch size is refused, naming the key; and the newest complete cut wins
    /// over a newer incomplete one.
    #[test]
    fn cuts_of_older_and_newer_formats_and_of_another_schedule() {
        let dir = tempfile::tempdir().unwrap();
        write_cut(dir.path(), 3, 20, |id| {
            id["version"] = 1.into();
            id.as_object_mut().unwrap().remove("batch_size");
        });
        let point = resolve_in(dir.path(), &mut job()).unwrap();
        assert_eq!((point.step, point.servers), (20, 3));

        let mut other = job();
        other.train.batch_size = 32;
        let newer = tempfile::tempdir().unwrap();
        write_cut(newer.path(), 2, 30, |id| {
            id["version"] = (ShardIdentity::VERSION + 1).into();
        });
        let e = resolve_in(newer.path(), &mut job()).unwrap_err();
        assert!(e.contains("newer than this ftrec reads"), "{e}");

        let schedule = tempfile::tempdir().unwrap();
        write_cut(schedule.path(), 2, 30, |_| {});
        let e = resolve_in(schedule.path(), &mut other).unwrap_err();
        assert!(e.contains("train.batch_size: cut 64, job 32"), "{e}");

        // A newer cut that only server 0 of 2 committed: the older complete one is taken.
        write_cut(schedule.path(), 1, 40, |id| {
            id["servers"] = 2.into();
        });
        let point = resolve_in(schedule.path(), &mut job()).unwrap();
        assert_eq!(point.step, 30);
    }

    #[test]
    fn a_spec_names_a_location_and_maybe_a_step() {
        assert_eq!(parse("/ck"), ("/ck".into(), None));
        assert_eq!(parse("/ck/@25"), ("/ck".into(), Some(25)));
        assert_eq!(parse("s3://b/p@step:40"), ("s3://b/p".into(), Some(40)));
        assert_eq!(parse("/a@b/ck"), ("/a@b/ck".into(), None));
    }
}
