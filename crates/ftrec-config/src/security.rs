//! The `[security]` section: how the processes of one cluster job recognise each other
//! (a shared job secret) and, optionally, encrypt what they say (TLS).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// Environment variable that carries the job secret; it takes precedence over
/// `security.secret_file`.
pub const SECRET_ENV: &str = "FTREC_JOB_SECRET";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecuritySection {
    /// A file holding the job secret (one line). `cluster run` generates one in its run
    /// directory when neither this nor `FTREC_JOB_SECRET` is set. Relative paths: in a job
    /// file, relative to that file; given to `cluster run`, to the working directory (the
    /// launcher writes them absolute into the run's job file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// PEM certificate chain this process presents as a server (TLS on every RPC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for `tls_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate of the authority that signed every member's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
    /// Name the members' certificates are issued for (checked by every client).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
}

impl SecuritySection {
    pub fn tls_enabled(&self) -> bool {
        self.tls_cert.is_some() || self.tls_key.is_some() || self.tls_ca.is_some()
    }

    /// The name clients expect in the servers' certificates.
    pub fn server_name(&self) -> &str {
        self.tls_server_name.as_deref().unwrap_or("localhost")
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tls_enabled()
            && (self.tls_cert.is_none() || self.tls_key.is_none() || self.tls_ca.is_none())
        {
            return Err(ConfigError::Invalid(format!(
                "security: TLS needs all of tls_cert, tls_key and tls_ca (missing: {})",
                [
                    ("tls_cert", self.tls_cert.is_none()),
                    ("tls_key", self.tls_key.is_none()),
                    ("tls_ca", self.tls_ca.is_none()),
                ]
                .iter()
                .filter(|(_, missing)| *missing)
                .map(|(k, _)| format!("security.{k}"))
                .collect::<Vec<_>>()
                .join(", ")
            )));
        }
        if self.tls_server_name.as_deref() == Some("") {
            return Err(ConfigError::Invalid(
                "security.tls_server_name must not be empty".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_tls_settings_name_what_is_missing() {
        let s = SecuritySection {
            tls_cert: Some("c.pem".into()),
            ..Default::default()
        };
        let e = s.validate().unwrap_err().to_string();
        assert!(
            e.contains("security.tls_key") && e.contains("security.tls_ca"),
            "{e}"
        );
        assert!(!e.contains("security.tls_cert"), "{e}");
        assert!(SecuritySection::default().validate().is_ok());
    }
}
