//! Shard identity: what a server's checkpoint says of itself (whose shard, of which job,
//! under which placement and epoch, at which step), one versioned record instead of ad hoc
//! JSON fields. It travels as the manifest's `trainer` object.

use serde::{Deserialize, Serialize};

use crate::error::{Malformed, ProtoError};

/// The code's parameters, for an erasure-coded shard: what a reader needs to invert the
/// striped placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EcIdentity {
    pub k: usize,
    pub r: usize,
    pub groups: usize,
}

/// One shard checkpoint's identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardIdentity {
    /// The record's format. Records written before it was versioned read as 0; a reader
    /// refuses a newer version than it knows.
    #[serde(default)]
    pub version: u32,
    /// The job's configuration fingerprint.
    pub fingerprint: u64,
    pub server: usize,
    pub servers: usize,
    /// The cluster epoch the shard was written in (0 in records before version 1).
    #[serde(default)]
    pub epoch: u64,
    /// The placement scheme's name and parameters (`row-modulo-v1`, `stripe-rotate-v1 ...`).
    pub placement: String,
    /// Rows of each global table, which the placement arithmetic needs.
    pub global_table_rows: Vec<usize>,
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ec: Option<EcIdentity>,
    /// A CPR prioritised save: the tracker that chose its rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpr_priority: Option<String>,
    /// Steps above `step` whose updates the shard also holds: a save taken while training
    /// went on (`cpr.uncoordinated`) catches asynchronous pushes applied ahead of a gap. A
    /// restore counts them applied, so a re-sent push of one is not applied twice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_ahead: Vec<u64>,
    /// The data position (version 2 on): the global batch size of the schedule that `step`
    /// indexes. A cut at `step` was taken when steps `0..step` were trained, so the next
    /// sample is the first of batch `step` of that schedule; a job resumed from it must
    /// have the same batch size for that to hold (`None` before version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
}

impl ShardIdentity {
    /// 2: the data position (`batch_size`) is recorded.
    pub const VERSION: u32 = 2;

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Reads the identity of the checkpoint `what`; an error names what is missing.
    pub fn from_json(value: &serde_json::Value, what: &str) -> Result<Self, ProtoError> {
        if value.get("server").is_none() {
            return Err(Malformed::NoIdentity { what: what.into() }.into());
        }
        let identity: Self =
            serde_json::from_value(value.clone()).map_err(|error| Malformed::Identity {
                what: what.into(),
                error,
            })?;
        if identity.version > Self::VERSION {
            return Err(Malformed::IdentityVersion {
                what: what.into(),
                version: identity.version,
                reads: Self::VERSION,
            }
            .into());
        }
        Ok(identity)
    }

    /// Refuses a shard of another server.
    pub fn check_owner(&self, server: usize, what: &str) -> Result<(), ProtoError> {
        if self.server != server {
            return Err(Malformed::NotOwner {
                what: what.into(),
                owner: self.server,
                server,
            }
            .into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> ShardIdentity {
        ShardIdentity {
            version: ShardIdentity::VERSION,
            fingerprint: 0xfeed,
            server: 1,
            servers: 3,
            epoch: 2,
            placement: "stripe-rotate-v1 k=2 r=1 groups=1".into(),
            global_table_rows: vec![10, 20],
            step: 40,
            ec: Some(EcIdentity {
                k: 2,
                r: 1,
                groups: 1,
            }),
            cpr_priority: None,
            applied_ahead: Vec::new(),
            batch_size: Some(64),
        }
    }

    #[test]
    fn an_identity_round_trips_and_refuses_another_servers_shard() {
        let id = identity();
        let back = ShardIdentity::from_json(&id.to_json(), "ck").unwrap();
        assert_eq!(back, id);
        assert!(id.to_json().get("applied_ahead").is_none());
        let ahead = ShardIdentity {
            applied_ahead: vec![42, 44],
            ..identity()
        };
        assert_eq!(
            ShardIdentity::from_json(&ahead.to_json(), "ck").unwrap(),
            ahead
        );
        assert!(back.check_owner(1, "ck").is_ok());
        let e = back.check_owner(0, "ck").unwrap_err().to_string();
        assert!(
            e.contains("server 1's shard") && e.contains("server 0 refuses"),
            "{e}"
        );
    }

    #[test]
    fn old_new_and_foreign_records_are_told_apart() {
        // Written before the version and the epoch: read as version 0, epoch 0.
        let old = serde_json::json!({"server": 1, "servers": 2, "placement": "row-modulo-v1",
            "global_table_rows": [5], "fingerprint": 7, "step": 40});
        let read = ShardIdentity::from_json(&old, "ck").unwrap();
        assert_eq!((read.version, read.epoch, read.ec), (0, 0, None));
        let mut newer = identity().to_json();
        newer["version"] = (ShardIdentity::VERSION + 1).into();
        let e = ShardIdentity::from_json(&newer, "ck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("newer than this ftrec reads"), "{e}");
        let e = ShardIdentity::from_json(&serde_json::json!({"step": 3}), "ck").unwrap_err();
        assert!(e.to_string().contains("no server identity"), "{e}");
        let e = ShardIdentity::from_json(&serde_json::json!({"server": "x"}), "ck").unwrap_err();
        assert!(e.to_string().contains("malformed"), "{e}");
    }
}
