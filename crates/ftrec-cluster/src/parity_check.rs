//! `verify-parity`: recomputes every stripe's parity from the gathered model's data rows and
//! compares it, byte for byte, with what the parity holders store; and checks each dense
//! replica against its primary. Run at the end of every erasure-coded run. Each mismatch
//! is named ([`Mismatch`]): the stripe, the parity rows that differ, and the stripe's data
//! rows. The per-stripe comparison ([`check_stripe`], [`check_dense_stripe`],
//! [`check_replica`]) is shared with the live scrub (`scrub.rs`).

use std::fmt;

use ftrec_ec::{Codec, DenseParitySlot, StripeLayout};
use ftrec_model::ModelState;

use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

/// Mismatches named in a report beyond the counts; the counts stay exact.
pub const MAX_DETAILS: usize = 1000;

/// A parity row whose stored bytes differ from the encoding of its stripe's data rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParityRow {
    pub server: usize,
    /// Its local parity slot on that server.
    pub local: usize,
    /// Its parity index in the stripe (`p < r`).
    pub p: usize,
}

/// A data row of a stripe: the global row, the server holding it and its local slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataRow {
    pub row: usize,
    pub server: usize,
    pub local: usize,
}

/// A parity row of a dense stripe that differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DenseParityRow {
    pub server: usize,
    pub p: usize,
}

/// One mismatch, named. A stripe's code tells *that* it is broken, not always *where*:
/// with `r = 1` a wrong parity row and a wrong data row look the same, so an entry names
/// the parity rows that differ and every data row of the stripe, and any of them may be
/// the wrong one. (With `r >= 2` a wrong data row breaks every parity row of its stripe,
/// a wrong parity row only itself.)
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Mismatch {
    /// A stripe of an embedding table.
    Stripe {
        table: usize,
        stripe: usize,
        /// The stored parity rows that differ from the re-encoded ones.
        parity: Vec<ParityRow>,
        /// The stripe's data rows (padding rows of a partial last stripe left out).
        data: Vec<DataRow>,
    },
    /// A dense stripe (`ec.replicate_dense = false`): the members' dense ranges are its
    /// data rows.
    DenseStripe {
        group: usize,
        stripe: usize,
        parity: Vec<DenseParityRow>,
        /// The servers whose dense ranges are the stripe's data rows.
        members: Vec<usize>,
    },
    /// A dense replica that differs from its primary range.
    DenseReplica {
        /// The server keeping the replica.
        server: usize,
        /// The server whose range it replicates.
        of: usize,
        /// What differs.
        what: String,
    },
}

impl Mismatch {
    /// The servers this mismatch names, parity holders first.
    pub fn servers(&self) -> Vec<usize> {
        match self {
            Self::Stripe { parity, data, .. } => parity
                .iter()
                .map(|p| p.server)
                .chain(data.iter().map(|d| d.server))
                .collect(),
            Self::DenseStripe {
                parity, members, ..
            } => parity
                .iter()
                .map(|p| p.server)
                .chain(members.iter().copied())
                .collect(),
            Self::DenseReplica { server, of, .. } => vec![*server, *of],
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stripe {
                table,
                stripe,
                parity,
                data,
            } => {
                write!(f, "table {table} stripe {stripe}: parity")?;
                for (n, p) in parity.iter().enumerate() {
                    let sep = if n == 0 { " " } else { ", " };
                    write!(
                        f,
                        "{sep}p{} on server {} (parity slot {})",
                        p.p, p.server, p.local
                    )?;
                }
                write!(f, " differs from the encoding of data rows")?;
                for (n, d) in data.iter().enumerate() {
                    let sep = if n == 0 { " " } else { ", " };
                    write!(
                        f,
                        "{sep}{} on server {} (slot {})",
                        d.row, d.server, d.local
                    )?;
                }
                write!(f, ": one of them is wrong")
            }
            Self::DenseStripe {
                group,
                stripe,
                parity,
                members,
            } => {
                write!(f, "dense stripe {stripe} of group {group}: parity")?;
                for (n, p) in parity.iter().enumerate() {
                    let sep = if n == 0 { " " } else { ", " };
                    write!(f, "{sep}p{} on server {}", p.p, p.server)?;
                }
                let members: Vec<String> = members.iter().map(usize::to_string).collect();
                write!(
                    f,
                    " differs from the encoding of the dense ranges of servers {}",
                    members.join(", ")
                )
            }
            Self::DenseReplica { server, of, what } => {
                write!(
                    f,
                    "server {server}'s dense replica of server {of}'s range: {what}"
                )
            }
        }
    }
}

/// What the check found.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ParityReport {
    /// Stripes checked, over every table (dense stripes included).
    pub stripes: u64,
    /// Stripes where a stored parity row differs from the one encoded from the data rows.
    #[serde(rename = "parity_mismatches")]
    pub mismatches: u64,
    /// Dense replicas that differ from their primary range.
    pub replica_mismatches: u64,
    /// Each mismatch named, the first [`MAX_DETAILS`] of them.
    #[serde(rename = "parity_mismatch_details")]
    pub details: Vec<Mismatch>,
}

impl ParityReport {
    /// Counts `m` (a stripe or a replica) and names it while the list has room.
    pub fn record(&mut self, m: Mismatch) {
        match m {
            Mismatch::DenseReplica { .. } => self.replica_mismatches += 1,
            Mismatch::Stripe { .. } | Mismatch::DenseStripe { .. } => self.mismatches += 1,
        }
        if self.details.len() < MAX_DETAILS {
            self.details.push(m);
        }
    }
}

/// Re-encodes stripe `stripe` of `table` (a `rows`-row table) from `data`, its `k` data
/// rows by position (padding rows zero), and compares each parity row with `stored(p)`,
/// what its holder keeps (`None`: it sent nothing for it, which counts as differing).
/// Returns the stripe named, or `None` when every parity row matches. `scratch` is
/// reused across calls.
#[allow(clippy::too_many_arguments)]
pub fn check_stripe<'a>(
    codec: &Codec,
    stripes: &StripeLayout,
    table: usize,
    stripe: usize,
    rows: usize,
    data: &[&[u8]],
    stored: impl Fn(usize) -> Option<&'a [u8]>,
    scratch: &mut Vec<u8>,
) -> Result<Option<Mismatch>, PsError> {
    let len = data.first().map_or(0, |d| d.len());
    scratch.resize(len, 0);
    let mut parity = Vec::new();
    for p in 0..codec.r() {
        codec
            .encode_parity(p, data, scratch)
            .map_err(|e| PsError::ec("parity check: re-encode", e))?;
        if stored(p) != Some(&scratch[..]) {
            let slot = stripes.parity_slot(table, stripe, p);
            parity.push(ParityRow {
                server: slot.server,
                local: slot.local,
                p,
            });
        }
    }
    if parity.is_empty() {
        return Ok(None);
    }
    let k = codec.k();
    let data = (0..k)
        .map(|i| (stripe * k + i, stripes.data_slot(table, stripe, i)))
        .filter(|&(row, _)| row < rows)
        .map(|(row, slot)| DataRow {
            row,
            server: slot.server,
            local: slot.local,
        })
        .collect();
    Ok(Some(Mismatch::Stripe {
        table,
        stripe,
        parity,
        data,
    }))
}

/// Re-encodes dense stripe `stripe` of group `group` from its members' dense rows
/// (`rows`, by position, `None`: padding; each `len` bytes, as `dense_code::pack` makes
/// them) and compares each parity row with `held(p)`.
pub fn check_dense_stripe<'a>(
    codec: &Codec,
    stripes: &StripeLayout,
    group: usize,
    stripe: usize,
    rows: &[Option<Vec<u8>>],
    len: usize,
    held: impl Fn(usize) -> Option<&'a [u8]>,
) -> Result<Option<Mismatch>, PsError> {
    use ftrec_server::shard::dense_code;
    let mut parity = Vec::new();
    for p in 0..codec.r() {
        let slot = DenseParitySlot { group, stripe, p };
        let expected = dense_code::encode(codec, slot, rows, len)?;
        if held(p) != Some(&expected[..]) {
            parity.push(DenseParityRow {
                server: stripes.dense_parity_holder(group, stripe, p),
                p,
            });
        }
    }
    Ok((!parity.is_empty()).then(|| Mismatch::DenseStripe {
        group,
        stripe,
        parity,
        members: stripes
            .dense_members(group, stripe)
            .into_iter()
            .flatten()
            .collect(),
    }))
}

/// Compares server `server`'s dense replica with server `of`'s range.
pub fn check_replica(
    server: usize,
    of: usize,
    replica: &FetchDenseReply,
    primary: &FetchDenseReply,
) -> Option<Mismatch> {
    let mut differs = Vec::new();
    if replica.params != primary.params {
        differs.push("parameters differ".to_string());
    }
    if replica.state != primary.state {
        differs.push("optimizer state differs".to_string());
    }
    if replica.step != primary.step {
        differs.push(format!(
            "step {} against the primary's {}",
            replica.step, primary.step
        ));
    }
    (!differs.is_empty()).then(|| Mismatch::DenseReplica {
        server,
        of,
        what: differs.join(", "),
    })
}

/// Checks the parity and replicas of the servers at `addresses` against `state`, the
/// model gathered from their data rows (padding rows of a partial last stripe are zero).
pub async fn verify_parity(
    job: &Job,
    addresses: &[String],
    epoch: u64,
    state: &ModelState,
) -> Result<ParityReport, PsError> {
    let layout = job.layout_for(addresses.len())?;
    let Some(stripes) = layout.stripes() else {
        return Ok(ParityReport::default());
    };
    if addresses.len() != layout.servers() {
        return Err(PsError::BadRequest(format!(
            "verify-parity: {} server addresses for a layout of {} servers",
            addresses.len(),
            layout.servers()
        )));
    }
    let (k, r) = (stripes.params.k, stripes.params.r);
    let codec = Codec::new(k, r).map_err(|e| PsError::Config(e.to_string()))?;
    let config = state.config();
    let row_bytes = config.row_stride() * 4;
    let zero = vec![0u8; row_bytes];
    let connector = job.connector()?;
    let silence = job.deadlines().stream_progress;
    let mut clients = addresses
        .iter()
        .map(|a| connector.server(a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut report = ParityReport::default();
    let mut scratch = Vec::new();
    for (t, &rows) in config.table_rows.iter().enumerate() {
        let table = &state.tables()[t];
        let row = |g: usize| -> &[u8] {
            if g < rows {
                bytemuck::cast_slice(table.row(g))
            } else {
                &zero
            }
        };
        let mut stored = Vec::with_capacity(addresses.len());
        for (s, client) in clients.iter_mut().enumerate() {
            let what = format!(
                "verify-parity: table {t} parity of server {s} ({})",
                addresses[s]
            );
            let stream = ftrec_rpc::gather::TableStream {
                epoch,
                table: t,
                parity: true,
                what: &what,
                silence,
            };
            let bytes = stream.read_all(client, row_bytes).await?;
            stored.push(bytes);
        }
        for j in 0..stripes.stripes(rows) {
            report.stripes += 1;
            let data: Vec<&[u8]> = (0..k).map(|i| row(j * k + i)).collect();
            let held = |p: usize| {
                let slot = stripes.parity_slot(t, j, p);
                stored[slot.server].get(slot.local * row_bytes..(slot.local + 1) * row_bytes)
            };
            if let Some(m) = check_stripe(&codec, &stripes, t, j, rows, &data, held, &mut scratch)?
            {
                report.record(m);
            }
        }
    }
    if layout.dense_coded() {
        check_dense_stripes(job, &clients, epoch, &codec, &mut report).await?;
    }
    for s in 0..clients.len() {
        let Some(of) = layout.replicates(s) else {
            continue;
        };
        let fetch = |server: usize, replica: bool| {
            fetch_dense(clients[server].clone(), server, epoch, replica, None)
        };
        let replica = fetch(s, true).await?;
        let primary = fetch(of, false).await?;
        if let Some(m) = check_replica(s, of, &replica, &primary) {
            report.record(m);
        }
    }
    Ok(report)
}

/// Dense ranges coded: every dense stripe's parity rows against those encoded from its
/// members' ranges, byte for byte.
async fn check_dense_stripes(
    job: &Job,
    clients: &[ftrec_rpc::client::ServerClient],
    epoch: u64,
    codec: &Codec,
    report: &mut ParityReport,
) -> Result<(), PsError> {
    use ftrec_server::shard::dense_code;
    let layout = job.layout_for(clients.len())?;
    let Some(stripes) = layout.stripes() else {
        return Ok(());
    };
    let global = job.config.model_config()?;
    let fetch = |server: usize, stripe: Option<u32>| {
        fetch_dense(clients[server].clone(), server, epoch, false, stripe)
    };
    for g in 0..stripes.params.groups {
        let (first, _) = stripes.group(g);
        let len = dense_code::row_len(&global, layout, first)?;
        for j in 0..stripes.dense_stripes(g) {
            report.stripes += 1;
            let mut rows = Vec::new();
            for member in stripes.dense_members(g, j) {
                rows.push(match member {
                    Some(m) => Some(dense_row(&fetch(m, None).await?, len)?),
                    None => None,
                });
            }
            let mut held = Vec::new();
            for p in 0..stripes.params.r {
                let holder = stripes.dense_parity_holder(g, j, p);
                held.push(fetch(holder, Some(j as u32)).await?.dense_parity);
            }
            let held = |p: usize| held.get(p).map(|b| &b[..]);
            if let Some(m) = check_dense_stripe(codec, &stripes, g, j, &rows, len, held)? {
                report.record(m);
            }
        }
    }
    Ok(())
}

/// A member's dense range as its dense stripe's data row.
pub(crate) fn dense_row(reply: &FetchDenseReply, len: usize) -> Result<Vec<u8>, PsError> {
    let params = ftrec_proto::wire::bytes_to_f32s(&reply.params, "dense range")?;
    let state = ftrec_proto::wire::bytes_to_f32s(&reply.state, "dense state")?;
    Ok(ftrec_server::shard::dense_code::pack(
        &params, &state, reply.step, len,
    ))
}

/// A server's dense range (`replica`: the range it keeps for its primary; `stripe`: a
/// dense parity stripe it holds), as the end-of-run check and the live scrub read it.
pub(crate) async fn fetch_dense(
    mut client: ftrec_rpc::client::ServerClient,
    server: usize,
    epoch: u64,
    replica: bool,
    stripe: Option<u32>,
) -> Result<FetchDenseReply, PsError> {
    client
        .fetch_dense(FetchDenseRequest {
            epoch,
            replica,
            dense_parity_stripe: stripe,
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|st| {
            let what = match stripe {
                Some(_) => format!("verify-parity: dense stripe on server {server}"),
                None => format!("verify-parity: dense range of server {server}"),
            };
            PsError::rpc(what, &st)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_ec::EcParams;
    use proptest::prelude::*;

    /// A layout of one group of `k + r + extra` servers, and a stripe's rows: `k` data
    /// rows and their `r` parity rows, encoded.
    fn stripe(k: usize, r: usize, data: &[Vec<u8>]) -> (Codec, Vec<Vec<u8>>) {
        let codec = Codec::new(k, r).unwrap();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let parity = (0..r)
            .map(|p| {
                let mut out = vec![0u8; data[0].len()];
                codec.encode_parity(p, &refs, &mut out).unwrap();
                out
            })
            .collect();
        (codec, parity)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// A stripe whose parity encodes its data matches; one bit flipped in a parity
        /// row names exactly that parity row (its holder and slot); one bit flipped in a
        /// data row names every parity row (each depends on every data row), and the
        /// entry lists every data row of the stripe with its holder and slot, the
        /// flipped one among them.
        #[test]
        fn a_flipped_bit_is_named_and_a_clean_stripe_is_not(
            k in 1usize..5,
            r in 1usize..4,
            extra in 0usize..3,
            table in 0usize..4,
            stripe_no in 0usize..40,
            len in 1usize..64,
            seed in any::<u64>(),
            which in any::<usize>(),
            bit in 0u8..8,
            at in any::<usize>(),
        ) {
            let stripes = StripeLayout::new(EcParams { k, r, groups: 1 }, k + r + extra).unwrap();
            let rows = 40 * k;
            let mut rng = seed;
            let mut next = || {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (rng >> 33) as u8
            };
            let data: Vec<Vec<u8>> = (0..k).map(|_| (0..len).map(|_| next()).collect()).collect();
            let (codec, parity) = stripe(k, r, &data);
            let mut scratch = Vec::new();
            let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let clean = check_stripe(&codec, &stripes, table, stripe_no, rows, &refs,
                |p| parity.get(p).map(Vec::as_slice), &mut scratch).unwrap();
            prop_assert_eq!(clean, None);

            let named_data: Vec<DataRow> = (0..k).map(|i| {
                let slot = stripes.data_slot(table, stripe_no, i);
                DataRow { row: stripe_no * k + i, server: slot.server, local: slot.local }
            }).collect();
            let holder = |p: usize| {
                let slot = stripes.parity_slot(table, stripe_no, p);
                ParityRow { server: slot.server, local: slot.local, p }
            };
            let mask = 1u8 << bit;
            let index = which % (k + r);
            let byte = at % len;
            if index < k {
                let mut bad = data.clone();
                bad[index][byte] ^= mask;
                let refs: Vec<&[u8]> = bad.iter().map(Vec::as_slice).collect();
                let m = check_stripe(&codec, &stripes, table, stripe_no, rows, &refs,
                    |p| parity.get(p).map(Vec::as_slice), &mut scratch).unwrap();
                prop_assert_eq!(m, Some(Mismatch::Stripe {
                    table,
                    stripe: stripe_no,
                    parity: (0..r).map(holder).collect(),
                    data: named_data,
                }));
            } else {
                let p = index - k;
                let mut bad = parity.clone();
                bad[p][byte] ^= mask;
                let m = check_stripe(&codec, &stripes, table, stripe_no, rows, &refs,
                    |q| bad.get(q).map(Vec::as_slice), &mut scratch).unwrap();
                prop_assert_eq!(m, Some(Mismatch::Stripe {
                    table,
                    stripe: stripe_no,
                    parity: vec![holder(p)],
                    data: named_data,
                }));
            }
        }
    }

    #[test]
    fn padding_rows_are_not_named_and_a_missing_parity_row_differs() {
        let stripes = StripeLayout::new(
            EcParams {
                k: 2,
                r: 1,
                groups: 1,
            },
            3,
        )
        .unwrap();
        let data = vec![vec![7u8; 8], vec![0u8; 8]];
        let (codec, parity) = stripe(2, 1, &data);
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let mut scratch = Vec::new();
        // A 5-row table: stripe 2 holds row 4 and one padding row.
        let m = check_stripe(&codec, &stripes, 0, 2, 5, &refs, |_| None, &mut scratch)
            .unwrap()
            .expect("a parity row not sent differs");
        let Mismatch::Stripe { data: named, .. } = &m else {
            panic!("{m:?}")
        };
        assert_eq!(named.len(), 1);
        assert_eq!(named[0].row, 4);
        assert!(m.to_string().contains("table 0 stripe 2"), "{m}");
        let ok = check_stripe(
            &codec,
            &stripes,
            0,
            2,
            5,
            &refs,
            |p| parity.get(p).map(Vec::as_slice),
            &mut scratch,
        )
        .unwrap();
        assert_eq!(ok, None);
    }

    #[test]
    fn the_list_is_capped_and_the_counts_stay_exact() {
        let mut report = ParityReport::default();
        for n in 0..MAX_DETAILS + 5 {
            report.record(Mismatch::DenseReplica {
                server: n,
                of: 0,
                what: "parameters differ".into(),
            });
        }
        report.record(Mismatch::DenseStripe {
            group: 0,
            stripe: 0,
            parity: vec![],
            members: vec![0, 1],
        });
        assert_eq!(report.replica_mismatches, MAX_DETAILS as u64 + 5);
        assert_eq!(report.mismatches, 1);
        assert_eq!(report.details.len(), MAX_DETAILS);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["parity_mismatches"], 1);
        assert_eq!(json["parity_mismatch_details"][0]["kind"], "dense-replica");
    }
}
