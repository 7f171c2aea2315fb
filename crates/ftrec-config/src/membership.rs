//! Where a cluster keeps its membership, epoch and cuts: in the coordinator's memory
//! (`embedded`, the default: nothing else to run) or in etcd (`etcd`: a standby
//! coordinator takes over when the leader dies).

use serde::{Deserialize, Serialize};

use crate::ConfigError;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Membership {
    /// One coordinator holds everything in memory; its death ends the job.
    #[default]
    Embedded,
    /// Membership, epoch, layout, step ledger, cuts and recovery in etcd, under
    /// `cluster.etcd_prefix`; coordinators elected with a lease of
    /// `cluster.etcd_lease_ttl_s`.
    Etcd,
}

impl std::str::FromStr for Membership {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "embedded" => Ok(Self::Embedded),
            "etcd" => Ok(Self::Etcd),
            _ => Err(format!("unknown membership {s:?}: one of embedded, etcd")),
        }
    }
}

/// etcd refuses leases shorter than this (its minimum TTL for the default election timeout
/// of 1 s).
pub const MIN_LEASE_TTL_S: u64 = 2;

pub(crate) fn default_lease_ttl_s() -> u64 {
    3
}

pub(crate) fn default_flush_ms() -> u64 {
    100
}

/// Checks the etcd keys of `[cluster]`; errors name them.
pub(crate) fn validate(
    membership: Membership,
    endpoints: &[String],
    prefix: Option<&str>,
    lease_ttl_s: u64,
    flush_ms: u64,
) -> Result<(), ConfigError> {
    if membership == Membership::Embedded {
        return Ok(());
    }
    if let Some(e) = endpoints
        .iter()
        .find(|e| e.trim().is_empty() || e.contains(' '))
    {
        return Err(ConfigError::Invalid(format!(
            "cluster.etcd_endpoints holds {e:?}: each is host:port or http://host:port"
        )));
    }
    if let Some(p) = prefix {
        let ok = p.starts_with('/')
            && p.len() > 1
            && !p.ends_with('/')
            && !p.contains("//")
            && p.chars().all(|c| c.is_ascii_graphic());
        if !ok {
            return Err(ConfigError::Invalid(format!(
                "cluster.etcd_prefix = {p:?}: an absolute key path without a trailing slash \
                 or spaces, such as \"/ftrec/my-job\""
            )));
        }
    }
    if lease_ttl_s < MIN_LEASE_TTL_S {
        return Err(ConfigError::Invalid(format!(
            "cluster.etcd_lease_ttl_s = {lease_ttl_s}: etcd grants leases of at least \
             {MIN_LEASE_TTL_S} s"
        )));
    }
    if flush_ms == 0 || flush_ms >= lease_ttl_s * 1000 {
        return Err(ConfigError::Invalid(format!(
            "cluster.etcd_flush_ms = {flush_ms} must be above 0 and below the lease TTL \
             ({} ms)",
            lease_ttl_s * 1000
        )));
    }
    Ok(())
}
