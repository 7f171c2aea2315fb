//! A resumed job's shard (`cluster.resume_from`): this server's share, under this job's
//! layout, of another job's cut, which may have had any number of servers and either
//! placement.
//!
//! Each row of the cut is re-placed by this job's placement: the server keeps the rows
//! it owns now, and under erasure coding folds every row of its stripes into its parity
//! and takes its dense replica and parity from the cut's dense state, so no parity or
//! replica is read from the cut (a cut holds data rows only) and none is left to derive
//! after the start. The rows come from [`Shard::from_global_rows`], the same code the
//! seed's initial model goes through, so a resumed shard is laid out exactly as an
//! uninterrupted job's would be.
//!
//! What is read: the parts of the old servers that hold a row this server owns, or a
//! slice of its dense range (under row-modulo placement, `S / gcd(S, S')` of the `S` old
//! parts for each of `S'` new servers), or every part when this job is erasure coded
//! (its parity covers rows owned elsewhere). A part is read whole: a chunk's rows are
//! checksummed per block of 4096, and the rows one new server needs are spread over
//! every block of a part, so ranged reads would fetch the same bytes.

use ftrec_ckpt::{Checkpoints, Manifest, open_store};
use ftrec_model::{DenseState, ModelConfig, ModelState};
use ftrec_proto::assemble::place_dense;
use ftrec_proto::identity::ShardIdentity;
use ftrec_proto::placement::{GlobalRow, Layout, LocalRow};
use ftrec_proto::proto::ResumePoint;
use ftrec_rpc::PsError;

use crate::shard::Shard;

/// The cut a resumed job starts from, as the coordinator resolved it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumeSource {
    /// The old job's checkpoint location; its servers' parts are `server-<i>` beneath.
    pub location: String,
    pub step: u64,
    /// The old job's server count.
    pub servers: usize,
}

impl ResumeSource {
    pub fn from_proto(point: &ResumePoint) -> Self {
        Self {
            location: point.location.trim_end_matches('/').to_string(),
            step: point.step,
            servers: point.servers as usize,
        }
    }

    /// Old server `i`'s checkpoint location.
    pub fn part_location(&self, i: usize) -> String {
        format!("{}/server-{i}", self.location)
    }
}

/// A resumed shard, and what its start read.
pub(crate) struct Resumed {
    pub(crate) shard: Shard,
    /// Old servers whose parts' rows were read (others may have been read for their
    /// dense range only).
    pub(crate) parts_read: Vec<usize>,
    /// This slot's own part of the cut, when the old job had this job's layout and its
    /// location is this server's: the new history continues from it (a branch fork when
    /// newer checkpoints exist there).
    pub(crate) own_part: Option<String>,
}

/// One old server's part of the cut, found: where it is, its id and identity.
struct Part {
    checkpoints: Checkpoints,
    identity: ShardIdentity,
    id: String,
}

impl Part {
    /// The whole shard state the part restores to.
    fn state(&self) -> Result<ModelState, PsError> {
        Ok(self.checkpoints.restore(&self.id)?.0)
    }

    /// Only its dense state (its dense file; none of its rows).
    fn dense(&self) -> Result<DenseState, PsError> {
        Ok(self.checkpoints.restore_dense(&self.id)?.0)
    }
}

fn find_part(source: &ResumeSource, i: usize) -> Result<Part, PsError> {
    let location = source.part_location(i);
    // Opening a local directory that is not there would create it.
    if !location.contains("://") && !std::path::Path::new(&location).is_dir() {
        return Err(PsError::Config(format!(
            "resuming from {}@{}: {location} holds no checkpoint of step {} (no such directory)",
            source.location, source.step, source.step
        )));
    }
    let checkpoints = Checkpoints::new(open_store(&location)?);
    let all = checkpoints.list_readable()?;
    // A location may also hold parts of a job of another size at this step (one resumed
    // from it): only a part of the cut's own job counts.
    let of_cut: Vec<Manifest> = all
        .iter()
        .filter(|m| {
            ShardIdentity::from_json(&m.trainer, &m.id)
                .is_ok_and(|id| id.servers == source.servers && id.server == i)
        })
        .cloned()
        .collect();
    let Some(part) = Manifest::last_at_step(&of_cut, source.step) else {
        return Err(PsError::Config(format!(
            "resuming from {}@{}: {location} holds no checkpoint of step {} (it holds {})",
            source.location,
            source.step,
            source.step,
            steps_held(&all)
        )));
    };
    let id = part.id.clone();
    let what = checkpoints.store().describe(&id);
    let identity = ShardIdentity::from_json(&part.trainer, &what)?;
    identity.check_owner(i, &what)?;
    Ok(Part {
        checkpoints,
        identity,
        id,
    })
}

fn steps_held(all: &[Manifest]) -> String {
    let mut steps: Vec<u64> = all.iter().map(|m| m.step).collect();
    steps.sort_unstable();
    steps.dedup();
    if steps.is_empty() {
        "none".into()
    } else {
        format!("steps {steps:?}")
    }
}

/// The layout the old job placed its rows under, from a part's identity.
fn old_layout(identity: &ShardIdentity, what: &str) -> Result<Layout, PsError> {
    match identity.ec {
        None if identity
            .placement
            .starts_with(ftrec_proto::placement::SCHEME) =>
        {
            Ok(Layout::new(identity.servers)?)
        }
        Some(ec) if identity.placement.starts_with(ftrec_ec::SCHEME) => {
            let params = ftrec_ec::EcParams {
                k: ec.k,
                r: ec.r,
                groups: ec.groups,
            };
            let stripes = ftrec_ec::StripeLayout::new(params, identity.servers)
                .map_err(|e| PsError::Config(format!("{what}: {e}")))?;
            Ok(Layout::striped(stripes))
        }
        _ => Err(PsError::Config(format!(
            "{what} was written under placement {:?}, which this ftrec cannot re-place",
            identity.placement
        ))),
    }
}

/// The old servers whose parts `server`'s shard under `layout` needs, each with whether
/// its rows are needed (else only its dense file, for the dense range).
fn parts_needed(
    global: &ModelConfig,
    layout: Layout,
    server: usize,
    old: Layout,
    dense_len: usize,
) -> Vec<(usize, bool)> {
    let mut rows_needed = vec![layout.stripes().is_some(); old.servers()];
    if layout.stripes().is_none() {
        for (t, &rows) in global.table_rows.iter().enumerate() {
            for local in 0..layout.local_rows(t, server, rows) {
                if let Some(g) = layout.global_row(t, server, LocalRow(local as u32), rows) {
                    rows_needed[old.server_of(t, g)] = true;
                }
            }
        }
    }
    // Under erasure coding the dense replica and parity cover other servers' ranges:
    // every part is read whole then anyway.
    let mine = layout.dense_range(server, dense_len);
    (0..old.servers())
        .filter(|&j| {
            let theirs = old.dense_range(j, dense_len);
            rows_needed[j] || (theirs.start < mine.end && mine.start < theirs.end)
        })
        .map(|j| (j, rows_needed[j]))
        .collect()
}

/// `server`'s shard under `layout` of the cut `source` names, for the job whose global
/// model is `global` (checked against the cut's by the coordinator before the start;
/// the table sizes are checked again here, part by part).
pub(crate) fn load_shard(
    source: &ResumeSource,
    global: &ModelConfig,
    seed: u64,
    layout: Layout,
    server: usize,
    own_location: Option<&str>,
) -> Result<Resumed, PsError> {
    let started = std::time::Instant::now();
    // Part 0's identity gives the old layout, which says what to read.
    let first = find_part(source, 0)?;
    let what = format!("{}@{}", source.location, source.step);
    if first.identity.global_table_rows != global.table_rows {
        return Err(PsError::Config(format!(
            "resuming from {what}: the cut's tables have {:?} rows, this job's model {:?}",
            first.identity.global_table_rows, global.table_rows
        )));
    }
    let old = old_layout(&first.identity, &what)?;
    let mut full = DenseState::initial(global, seed)?;
    let needed = parts_needed(global, layout, server, old, full.params.len());
    let per_param = global.dense_optimizer.dense_state_len(1)?;
    let same_layout = old.scheme() == layout.scheme() && old.servers() == layout.servers();
    let mut own_part = None;
    let mut parts_read = Vec::with_capacity(needed.len());
    let mut first = Some(first);
    // One old part in memory at a time: its rows go to the sink, its dense range into
    // the global dense state, and it is dropped before the next is read.
    let shard = Shard::from_global_rows(global, seed, layout, server, |sink| {
        let mut step = None;
        for &(j, rows) in &needed {
            let part = match first.take() {
                Some(p) if j == 0 => p,
                _ => find_part(source, j)?,
            };
            if same_layout && j == server && own_location == Some(&source.part_location(j)[..]) {
                own_part = Some(part.id.clone());
            }
            let dense = if rows {
                let state = part.state()?;
                walk_rows(&state, &part.id, old, global, j, sink)?;
                parts_read.push(j);
                state.dense
            } else {
                part.dense()?
            };
            place_dense(
                &mut full,
                old,
                j,
                &dense.params,
                &dense.optimizer_state,
                per_param,
            )?;
            if *step.get_or_insert(dense.step) != dense.step {
                return Err(PsError::Config(format!(
                    "resuming from {what}: old server {j}'s part {} counts {} dense steps, \
                     another part {}: the parts are not of one cut",
                    part.id,
                    dense.step,
                    step.unwrap_or_default()
                )));
            }
        }
        full.step = step.unwrap_or(0);
        Ok(full)
    })?;
    tracing::info!(
        "server {server}: resumed from {what} in {:.2}s",
        started.elapsed().as_secs_f64()
    );
    Ok(Resumed {
        shard,
        parts_read,
        own_part,
    })
}

/// Hands every data row of old server `j`'s part to `sink` as `(table, global row, row)`.
fn walk_rows(
    state: &ModelState,
    id: &str,
    old: Layout,
    global: &ModelConfig,
    j: usize,
    sink: &mut dyn FnMut(usize, usize, &[f32]),
) -> Result<(), PsError> {
    for (t, (table, &rows)) in state.tables().iter().zip(&global.table_rows).enumerate() {
        if table.rows() != old.local_rows(t, j, rows) {
            return Err(PsError::Config(format!(
                "old server {j}'s part {id} holds {} rows of table {t}; its placement gives it {}",
                table.rows(),
                old.local_rows(t, j, rows)
            )));
        }
        for local in 0..table.rows() {
            if let Some(GlobalRow(g)) = old.global_row(t, j, LocalRow(local as u32), rows) {
                sink(t, g as usize, table.row(local));
            }
        }
    }
    Ok(())
}

/// The state a slot starts from, and a resumed slot's own part of its cut (see
/// [`Resumed::own_part`]): the seed's initial model, or this slot's share of the cut a
/// resumed job starts from.
pub(crate) fn starting_shard(
    global: &ModelConfig,
    seed: u64,
    layout: Layout,
    server: usize,
    resume: Option<&ResumeSource>,
    own_location: Option<&str>,
) -> Result<(Shard, Option<String>), PsError> {
    match resume {
        None => Ok((Shard::initial(global, seed, layout, server)?, None)),
        Some(source) => {
            let resumed = load_shard(source, global, seed, layout, server, own_location)?;
            tracing::info!(
                "server {server}: the rows of old servers {:?} of {} re-placed",
                resumed.parts_read,
                source.servers
            );
            Ok((resumed.shard, resumed.own_part))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::tests::model;
    use ftrec_ckpt::LocalStore;

    /// Writes the seed's initial model, split by `old`, as a cut at `step` under `dir`.
    fn write_cut(dir: &std::path::Path, global: &ModelConfig, seed: u64, old: Layout, step: u64) {
        for j in 0..old.servers() {
            let shard = Shard::initial(global, seed, old, j).unwrap();
            let identity = ShardIdentity {
                version: ShardIdentity::VERSION,
                fingerprint: 1,
                server: j,
                servers: old.servers(),
                epoch: 1,
                placement: old.scheme(),
                global_table_rows: global.table_rows.clone(),
                step,
                ec: old.stripes().map(|s| ftrec_proto::identity::EcIdentity {
                    k: s.params.k,
                    r: s.params.r,
                    groups: s.params.groups,
                }),
                cpr_priority: None,
                applied_ahead: Vec::new(),
                batch_size: Some(64),
            };
            let location = dir.join(format!("server-{j}"));
            let ck = Checkpoints::new(Box::new(LocalStore::open(&location).unwrap()));
            ck.write_full(shard.state(), step, identity.to_json())
                .unwrap();
        }
    }

    fn striped(k: usize, r: usize, groups: usize, servers: usize) -> Layout {
        let params = ftrec_ec::EcParams { k, r, groups };
        Layout::striped(ftrec_ec::StripeLayout::new(params, servers).unwrap())
    }

    /// Re-placing a cut gives every new server exactly the shard a job of the new
    /// layout starts with (rows, dense range, optimizer state; under erasure coding its
    /// parity and dense replica too), from any old layout to any new one, and reads only
    /// the old parts that hold something of it.
    #[test]
    fn a_cut_re_placed_on_another_layout_is_the_shard_that_layout_starts_with() {
        // Tables of at least 2 rows per server for the 6-server layout.
        let global = ModelConfig {
            table_rows: vec![41, 30, 17],
            ..model()
        };
        let seed = 11;
        let cases = [
            (Layout::new(4).unwrap(), Layout::new(2).unwrap()),
            (Layout::new(3).unwrap(), Layout::new(5).unwrap()),
            (striped(2, 1, 1, 3), striped(2, 1, 2, 6)),
            (striped(2, 2, 1, 4), Layout::new(3).unwrap()),
            (Layout::new(2).unwrap(), striped(2, 1, 1, 3)),
        ];
        for (n, (old, new)) in cases.into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            write_cut(dir.path(), &global, seed, old, 40);
            let source = ResumeSource {
                location: dir.path().to_string_lossy().into_owned(),
                step: 40,
                servers: old.servers(),
            };
            for s in 0..new.servers() {
                let resumed = load_shard(&source, &global, seed, new, s, None).unwrap();
                let fresh = Shard::initial(&global, seed, new, s).unwrap();
                assert_eq!(resumed.shard.state(), fresh.state(), "case {n}, server {s}");
                let redundancy = |shard: &Shard| {
                    shard
                        .redundancy()
                        .map(|r| (r.parity.clone(), r.replica.clone(), r.dense_parity.clone()))
                };
                assert!(
                    redundancy(&resumed.shard) == redundancy(&fresh),
                    "case {n}, server {s}: parity or dense replica differs"
                );
                if n == 0 {
                    // Row-modulo, 4 servers to 2: new server s holds the rows of old
                    // servers s and s + 2 only (old server 2s + 1's dense range is read
                    // from its dense file alone).
                    assert_eq!(resumed.parts_read, [s, s + 2], "server {s}");
                }
                if new.stripes().is_some() {
                    assert_eq!(resumed.parts_read.len(), old.servers(), "case {n}");
                }
            }
        }
    }

    #[test]
    fn a_missing_part_is_named() {
        let global = model();
        let dir = tempfile::tempdir().unwrap();
        write_cut(dir.path(), &global, 3, Layout::new(3).unwrap(), 40);
        std::fs::remove_dir_all(dir.path().join("server-1")).unwrap();
        let source = ResumeSource {
            location: dir.path().to_string_lossy().into_owned(),
            step: 40,
            servers: 3,
        };
        let e = load_shard(&source, &global, 3, Layout::new(2).unwrap(), 1, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("server-1") && e.contains("no checkpoint of step 40"),
            "{e}"
        );
    }
}
