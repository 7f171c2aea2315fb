//! `verify-parity`: recomputes every stripe's parity from the data rows of the gathered
//! model and compares it, byte for byte, with what the parity holders store; and checks
//! each dense replica against its primary. Run at the end of every erasure-coded run.

use ftrec_ec::Codec;
use ftrec_model::ModelState;

use ftrec_proto::PsError;
use ftrec_proto::job::Job;
use ftrec_proto::proto::*;

/// What the check found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ParityReport {
    /// Stripes checked, over every table.
    pub stripes: u64,
    /// Stripes where a stored parity row differs from the one encoded from the data rows.
    pub mismatches: u64,
    /// Dense replicas that differ from their primary range.
    pub replica_mismatches: u64,
}

/// Checks the parity and replicas of the servers at `addresses` against `state`, the
/// model gathered from their data rows (padding rows of a partial last stripe are zero).
pub async fn verify_parity(
    job: &Job,
    addresses: &[String],
    epoch: u64,
    state: &ModelState,
) -> Result<ParityReport, PsError> {
    let layout = job.layout()?;
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
    let mut clients = addresses
        .iter()
        .map(|a| connector.server(a))
        .collect::<Result<Vec<_>, _>>()?;
    let mut report = ParityReport::default();
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
            let what = format!("verify-parity: table {t} parity of server {s}");
            let bytes = ftrec_proto::gather::fetch_all(client, epoch, t, true, &what).await?;
            stored.push(bytes);
        }
        let mut expected = vec![0u8; row_bytes];
        for j in 0..stripes.stripes(rows) {
            report.stripes += 1;
            let data: Vec<&[u8]> = (0..k).map(|i| row(j * k + i)).collect();
            let mut bad = false;
            for p in 0..r {
                codec
                    .encode_parity(p, &data, &mut expected)
                    .map_err(|e| PsError::ec("parity check: re-encode", e))?;
                let slot = stripes.parity_slot(t, j, p);
                let held =
                    stored[slot.server].get(slot.local * row_bytes..(slot.local + 1) * row_bytes);
                bad |= held != Some(&expected[..]);
            }
            report.mismatches += u64::from(bad);
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
            let mut client = clients[server].clone();
            async move {
                client
                    .fetch_dense(FetchDenseRequest {
                        epoch,
                        replica,
                        ..Default::default()
                    })
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(|st| {
                        PsError::rpc(
                            format!("verify-parity: dense range of server {server}"),
                            &st,
                        )
                    })
            }
        };
        let replica = fetch(s, true).await?;
        let primary = fetch(of, false).await?;
        let same = (&replica.params, &replica.state, replica.step)
            == (&primary.params, &primary.state, primary.step);
        report.replica_mismatches += u64::from(!same);
    }
    Ok(report)
}

/// Dense ranges coded: every dense stripe's parity rows against those encoded from its
/// members' ranges, byte for byte.
async fn check_dense_stripes(
    job: &Job,
    clients: &[ftrec_proto::client::ServerClient],
    epoch: u64,
    codec: &Codec,
    report: &mut ParityReport,
) -> Result<(), PsError> {
    use ftrec_server::shard::dense_code;
    let layout = job.layout()?;
    let Some(stripes) = layout.stripes() else {
        return Ok(());
    };
    let global = job.config.model_config()?;
    let fetch = |server: usize, stripe: Option<u32>| {
        let mut client = clients[server].clone();
        async move {
            client
                .fetch_dense(FetchDenseRequest {
                    epoch,
                    replica: false,
                    dense_parity_stripe: stripe,
                })
                .await
                .map(tonic::Response::into_inner)
                .map_err(|st| {
                    PsError::rpc(
                        format!("verify-parity: dense stripe on server {server}"),
                        &st,
                    )
                })
        }
    };
    for g in 0..stripes.params.groups {
        let (first, _) = stripes.group(g);
        let len = dense_code::row_len(&global, layout, first)?;
        for j in 0..stripes.dense_stripes(g) {
            report.stripes += 1;
            let mut rows = Vec::new();
            for member in stripes.dense_members(g, j) {
                rows.push(match member {
                    Some(m) => {
                        let d = fetch(m, None).await?;
                        let params = ftrec_proto::wire::bytes_to_f32s(&d.params, "dense range")?;
                        let state = ftrec_proto::wire::bytes_to_f32s(&d.state, "dense state")?;
                        Some(dense_code::pack(&params, &state, d.step, len))
                    }
                    None => None,
                });
            }
            let mut bad = false;
            for p in 0..stripes.params.r {
                let slot = ftrec_ec::DenseParitySlot {
                    group: g,
                    stripe: j,
                    p,
                };
                let expected = dense_code::encode(codec, slot, &rows, len)?;
                let holder = stripes.dense_parity_holder(g, j, p);
                let held = fetch(holder, Some(j as u32)).await?.dense_parity;
                bad |= held[..] != expected[..];
            }
            report.mismatches += u64::from(bad);
        }
    }
    Ok(())
}
