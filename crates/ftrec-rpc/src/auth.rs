//! The cluster is closed: every RPC carries the job secret, and every service refuses a
//! call without it before the handler runs. Optionally, TLS encrypts every connection
//! (needed when the secret crosses a network someone else can read).
//!
//! The secret comes from `FTREC_JOB_SECRET` or the file `security.secret_file`; `cluster
//! run` generates one per run (mode 0600, in the run directory) when neither is set.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ftrec_config::{JobConfig, SECRET_ENV};
use subtle::ConstantTimeEq;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

use crate::PsError;

/// The gRPC metadata key that carries the secret.
pub const SECRET_METADATA: &str = "x-ftrec-job-secret";

/// A secret shorter than this is guessable; generated ones are 64 hex digits.
const MIN_SECRET_LEN: usize = 16;

#[derive(Clone)]
pub struct JobSecret(Arc<str>);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl JobSecret {
    /// 32 bytes from the operating system's generator, as hex.
    pub fn generate() -> Self {
        use rand::RngCore;
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(hex.into())
    }

    /// The job's public name, derived from the secret: 16 hex digits of a keyed hash, the
    /// same for every process of the job and different for every other job, from which
    /// the secret cannot be recovered. etcd keys are claimed under it.
    pub fn job_id(&self) -> String {
        let mut input = b"ftrec job id\0".to_vec();
        input.extend_from_slice(self.0.as_bytes());
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&input))
    }

    /// A secret given by a person; `origin` names where it came from for the error.
    pub fn parse(text: &str, origin: &str) -> Result<Self, PsError> {
        let secret = text.trim();
        if secret.len() < MIN_SECRET_LEN {
            return Err(PsError::Config(format!(
                "{origin}: the job secret must be at least {MIN_SECRET_LEN} characters \
                 (got {})",
                secret.len()
            )));
        }
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(PsError::Config(format!(
                "{origin}: the job secret must be printable ASCII without spaces"
            )));
        }
        Ok(Self(secret.into()))
    }

    /// The secret this process was given: `FTREC_JOB_SECRET`, else `security.secret_file`
    /// (relative to `job_dir`), else none.
    pub fn configured(config: &JobConfig, job_dir: Option<&Path>) -> Result<Option<Self>, PsError> {
        if let Some(secret) = Self::from_env()? {
            return Ok(Some(secret));
        }
        let Some(file) = &config.security.secret_file else {
            return Ok(None);
        };
        let path = resolve(file, job_dir);
        let text = std::fs::read_to_string(&path).map_err(|error| PsError::Io {
            path: format!("security.secret_file {}", path.display()),
            error,
        })?;
        Self::parse(&text, &format!("security.secret_file {}", path.display())).map(Some)
    }

    /// The secret in `FTREC_JOB_SECRET`, if it is set.
    pub fn from_env() -> Result<Option<Self>, PsError> {
        match std::env::var(SECRET_ENV) {
            Ok(value) => Self::parse(&value, SECRET_ENV).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Writes the secret to a new file readable by its owner only (atomically: a crash
    /// leaves no half-written secret behind).
    pub fn write(&self, path: &Path) -> Result<(), PsError> {
        use std::os::unix::fs::OpenOptionsExt;
        let tmp = ftrec_fsio::temp_path(path);
        let io = |p: &Path| {
            let p = p.display().to_string();
            move |error| PsError::Io { path: p, error }
        };
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?;
        file.write_all(self.0.as_bytes()).map_err(io(&tmp))?;
        ftrec_fsio::publish(file, &tmp, path)?;
        Ok(())
    }

    /// The server side: refuses a call whose secret is missing or wrong.
    pub fn checker(&self) -> CheckSecret {
        CheckSecret {
            expected: self.0.clone(),
        }
    }

    /// The client side: adds the secret to every call.
    pub fn attacher(&self) -> Result<AttachSecret, PsError> {
        let value: AsciiMetadataValue = MetadataValue::try_from(&*self.0)
            .map_err(|e| PsError::Config(format!("the job secret is not valid metadata: {e}")))?;
        Ok(AttachSecret { value })
    }
}

fn resolve(file: &Path, job_dir: Option<&Path>) -> PathBuf {
    match job_dir {
        Some(dir) if file.is_relative() => dir.join(file),
        _ => file.to_path_buf(),
    }
}

#[derive(Clone)]
pub struct CheckSecret {
    expected: Arc<str>,
}

impl Interceptor for CheckSecret {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let given = request
            .metadata()
            .get(SECRET_METADATA)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        // Constant time: a caller cannot learn the secret byte by byte from timings. (A
        // different length is refused at once; that reveals only the length.)
        if bool::from(given.ct_eq(self.expected.as_bytes())) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(if given.is_empty() {
                "no job secret: this cluster admits only its own job's processes"
            } else {
                "wrong job secret: this cluster admits only its own job's processes"
            }))
        }
    }
}

#[derive(Clone)]
pub struct AttachSecret {
    value: AsciiMetadataValue,
}

impl Interceptor for AttachSecret {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert(SECRET_METADATA, self.value.clone());
        Ok(request)
    }
}

/// The PEM files of `[security]`, read once when the job is loaded.
#[derive(Clone)]
pub struct TlsMaterial {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    server_name: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The private key must never reach a log through a `{:?}` of the job.
        write!(
            f,
            "TlsMaterial(server name {:?}, <key redacted>)",
            self.server_name
        )
    }
}

impl TlsMaterial {
    pub fn configured(config: &JobConfig, job_dir: Option<&Path>) -> Result<Option<Self>, PsError> {
        let s = &config.security;
        let (Some(cert), Some(key), Some(ca)) = (&s.tls_cert, &s.tls_key, &s.tls_ca) else {
            return Ok(None);
        };
        // rustls picks its crypto per process: name it (ring, the one provider the build
        // links) before any TLS config is built. A provider installed already (by an
        // object store, or an earlier job in this process) is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let read = |key: &str, file: &Path| {
            let path = resolve(file, job_dir);
            std::fs::read(&path).map_err(|error| PsError::Io {
                path: format!("security.{key} {}", path.display()),
                error,
            })
        };
        Ok(Some(Self {
            cert: read("tls_cert", cert)?,
            key: read("tls_key", key)?,
            ca: read("tls_ca", ca)?,
            server_name: s.server_name().to_string(),
        }))
    }

    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key))
    }

    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .domain_name(self.server_name.clone())
    }
}

/// Streams a caller may cancel before this server took them up, per connection, before
/// h2 closes the connection (`ENHANCE_YOUR_CALM`, its guard against "rapid reset" floods,
/// CVE-2023-44487; 20 by default). A hedged call cancels its slower copy, and on a lossy
/// link a retransmitted segment releases a queue of held-back frames at once: requests and
/// the cancellations of their copies arrive together, before the server's accept loop
/// runs. With the default, 10 of 25 runs with 5% loss on one server saw that server drop
/// a connection and every call on it, and each time a step was lost and settled by the
/// coordinator, 1.2 to 2.5 s of training. The bound still caps what one connection can
/// queue (hyper's own default for streams this end resets is 1024).
pub const MAX_PENDING_ACCEPT_RESETS: usize = 1024;

/// The RPC server every member runs: TLS when the job configures it.
pub fn server_builder(job: &crate::Job) -> Result<tonic::transport::Server, PsError> {
    let liveness = job.liveness();
    let builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(crate::client::HTTP2_STREAM_WINDOW)
        .initial_connection_window_size(crate::client::HTTP2_CONNECTION_WINDOW)
        .max_frame_size(crate::client::HTTP2_MAX_FRAME)
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        // A caller that froze or lost its link is let go: the streams it held open (a
        // rebuild's progress, whose sender would otherwise wait on it with the commit
        // turn held) end, and their work with them.
        .http2_keepalive_interval(Some(liveness.ping_after))
        .http2_keepalive_timeout(Some(liveness.give_up_after));
    match job.tls() {
        Some(tls) => builder
            .tls_config(tls.server())
            .map_err(|e| PsError::Config(format!("security.tls_cert / tls_key: {e}"))),
        None => Ok(builder),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(check: &mut CheckSecret, secret: Option<&str>) -> Result<(), Status> {
        let mut request = Request::new(());
        if let Some(s) = secret {
            request
                .metadata_mut()
                .insert(SECRET_METADATA, MetadataValue::try_from(s).unwrap());
        }
        check.call(request).map(|_| ())
    }

    #[test]
    fn only_the_exact_secret_passes() {
        let secret = JobSecret::generate();
        let mut check = secret.checker();
        assert!(call(&mut check, Some(&secret.0)).is_ok());
        let missing = call(&mut check, None).unwrap_err();
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(missing.message().contains("no job secret"));
        let mut wrong = secret.0.to_string();
        wrong.replace_range(63.., if wrong.ends_with('0') { "1" } else { "0" });
        let e = call(&mut check, Some(&wrong)).unwrap_err();
        assert!(e.message().contains("wrong job secret"));
        assert!(call(&mut check, Some(&secret.0[..63])).is_err());
        assert!(call(&mut check, Some(&format!("{}0", secret.0))).is_err());
        // What the client interceptor attaches is what the server expects.
        let request = secret.attacher().unwrap().call(Request::new(())).unwrap();
        assert!(check.call(request).is_ok());
    }

    #[test]
    fn generated_secrets_differ_and_debug_hides_them() {
        let (a, b) = (JobSecret::generate(), JobSecret::generate());
        assert_ne!(a.0, b.0);
        assert_eq!(a.0.len(), 64);
        assert!(!format!("{a:?}").contains(&*a.0));
    }

    #[test]
    fn short_or_unprintable_secrets_are_refused_with_their_origin() {
        let e = JobSecret::parse("short", "FTREC_JOB_SECRET")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FTREC_JOB_SECRET") && e.contains("at least 16"),
            "{e}"
        );
        let e = JobSecret::parse("sixteen chars with spaces", "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("printable"), "{e}");
        assert!(JobSecret::parse("  0123456789abcdef\n", "f").is_ok());
    }

    #[test]
    fn the_written_secret_is_private_and_reads_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("job.secret");
        let secret = JobSecret::generate();
        secret.write(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let mut config = JobConfig::preset("tiny").unwrap();
        config.security.secret_file = Some("job.secret".into());
        if std::env::var(SECRET_ENV).is_err() {
            let read = JobSecret::configured(&config, Some(dir.path()))
                .unwrap()
                .unwrap();
            assert_eq!(read.0, secret.0);
        }
    }
}
