//! Checkpoints in object storage (S3 and S3-compatible servers, Google Cloud Storage,
//! Azure Blob Storage) through the `object_store` crate. A single PUT is atomic, and the
//! manifest is written after every file it names, so the commit rule is the same as on a
//! local disk.

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

use crate::{CkptError, LocalStore, Store};

pub struct ObjectStoreBackend {
    inner: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    runtime: tokio::runtime::Runtime,
}

impl ObjectStoreBackend {
    /// `s3://bucket/prefix`, `gs://bucket/prefix` or `az://container/prefix`. Credentials
    /// and endpoints come from each service's usual environment variables: for S3
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, and `AWS_ENDPOINT` with
    /// `AWS_ALLOW_HTTP` for S3-compatible servers; for GCS `GOOGLE_SERVICE_ACCOUNT` (a key
    /// file) or `GOOGLE_SERVICE_ACCOUNT_KEY`; for Azure `AZURE_STORAGE_ACCOUNT_NAME` and
    /// `AZURE_STORAGE_ACCOUNT_KEY` (or `AZURE_STORAGE_USE_EMULATOR=true` for Azurite).
    pub fn open(url: &str) -> Result<Self, CkptError> {
        Self::open_with_options(url, &[])
    }

    /// Like [`ObjectStoreBackend::open`], with `options` applied after the environment:
    /// `object_store`'s configuration keys for the URL's service, e.g.
    /// `("aws_endpoint", "http://127.0.0.1:9000")` for S3, `("google_service_account",
    /// path)` for GCS, `("azure_storage_endpoint", url)` for Azure; `allow_http` for all.
    /// An unknown key or a bad value is an error naming it.
    pub fn open_with_options(url: &str, options: &[(&str, &str)]) -> Result<Self, CkptError> {
        // The HTTP client's TLS takes the process's rustls provider, and this build links
        // ring's only (the workspace's `object_store` line): it is named before any client
        // is built. One installed already (by `ftrec-rpc`'s TLS, or an earlier store) is
        // kept, which is why the result is ignored.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bad = |m: String| CkptError::Invalid(format!("{url}: {m}"));
        let (scheme, bucket, prefix) = split_url(url)?;
        let store: Arc<dyn ObjectStore> = match scheme {
            "s3" => {
                let b = AmazonS3Builder::from_env().with_bucket_name(bucket);
                let b = configure(b, options, url, |b, k, v| b.with_config(k, v))?;
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            "gs" => {
                let b = GoogleCloudStorageBuilder::from_env().with_bucket_name(bucket);
                let b = configure(b, options, url, |b, k, v| b.with_config(k, v))?;
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
            _ => {
                let b = MicrosoftAzureBuilder::from_env().with_container_name(bucket);
                let b = configure(b, options, url, |b, k, v| b.with_config(k, v))?;
                Arc::new(b.build().map_err(|e| bad(e.to_string()))?)
            }
        };
        Self::with_store(url, store, prefix)
    }

    fn with_store(url: &str, inner: Arc<dyn ObjectStore>, prefix: &str) -> Result<Self, CkptError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| CkptError::Invalid(format!("{url}: async runtime: {e}")))?;
        Ok(Self {
            inner,
            prefix: prefix.trim_matches('/').to_string(),
            url: url.trim_end_matches('/').to_string(),
            runtime,
        })
    }

    fn path(&self, key: &str) -> Result<ObjectPath, CkptError> {
        crate::store::check_key(key)?;
        let full = if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        };
        ObjectPath::parse(&full).map_err(|e| CkptError::Invalid(format!("{key}: {e}")))
    }

    fn error(&self, key: &str, e: object_store::Error) -> CkptError {
        match e {
            object_store::Error::NotFound { .. } => {
                CkptError::NotFound(format!("{} does not exist", self.describe(key)))
            }
            object_store::Error::AlreadyExists { .. } => CkptError::AlreadyExists {
                key: self.describe(key),
            },
            object_store::Error::Precondition { .. } => {
                CkptError::Conflict(format!("{} changed under us", self.describe(key)))
            }
            other => CkptError::Io {
                path: self.describe(key).into(),
                error: std::io::Error::other(other.to_string()),
            },
        }
    }

    /// One PUT with `mode` (a conditional create or update); returns the new version tag.
    fn put_mode(&self, key: &str, bytes: &[u8], mode: PutMode) -> Result<String, CkptError> {
        let path = self.path(key)?;
        let payload = PutPayload::from(bytes.to_vec());
        let result = self
            .runtime
            .block_on(self.inner.put_opts(&path, payload, PutOptions::from(mode)))
            .map_err(|e| self.error(key, e))?;
        Ok(version_tag(result.e_tag, result.version))
    }
}

/// Separates the ETag from the version in a [`Store::get_versioned`] tag.
const TAG_SEPARATOR: char = '\u{1f}';

/// The opaque tag of one version of an object: its ETag and its version both, as
/// `object_store` asks callers to keep. Services condition an update on different ones:
/// S3 and Azure on the ETag (`If-Match`), GCS on the generation
/// (`x-goog-if-generation-match`); an update with the ETag alone fails on GCS.
fn version_tag(e_tag: Option<String>, version: Option<String>) -> String {
    format!(
        "{}{TAG_SEPARATOR}{}",
        e_tag.unwrap_or_default(),
        version.unwrap_or_default()
    )
}

/// The update condition a [`version_tag`] names.
fn update_version(tag: &str) -> UpdateVersion {
    let (e_tag, version) = tag.split_once(TAG_SEPARATOR).unwrap_or((tag, ""));
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    UpdateVersion {
        e_tag: some(e_tag),
        version: some(version),
    }
}

impl Store for ObjectStoreBackend {
    /// A conditional create (`If-None-Match: *`), so a name clash fails on the server
    /// instead of replacing a committed object.
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        self.put_mode(key, bytes, PutMode::Create).map(|_| ())
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, String)>, CkptError> {
        let path = self.path(key)?;
        let got = self.runtime.block_on(async {
            let r = self.inner.get(&path).await?;
            let tag = version_tag(r.meta.e_tag.clone(), r.meta.version.clone());
            Ok::<_, object_store::Error>((r.bytes().await?.to_vec(), tag))
        });
        match got {
            Ok(v) => Ok(Some(v)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn put_versioned(
        &self,
        key: &str,
        bytes: &[u8],
        expected: Option<&str>,
    ) -> Result<String, CkptError> {
        let mode = match expected {
            None => PutMode::Create,
            Some(tag) => PutMode::Update(update_version(tag)),
        };
        self.put_mode(key, bytes, mode).map_err(|e| match e {
            CkptError::AlreadyExists { key } => {
                CkptError::Conflict(format!("{key} was created by someone else"))
            }
            other => other,
        })
    }

    fn modified_unix_ms(&self, key: &str) -> Result<Option<u64>, CkptError> {
        let path = self.path(key)?;
        match self.runtime.block_on(self.inner.head(&path)) {
            Ok(meta) => Ok(Some(meta.last_modified.timestamp_millis().max(0) as u64)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, CkptError> {
        let path = self.path(key)?;
        self.runtime
            .block_on(async { self.inner.get(&path).await?.bytes().await })
            .map(|b| b.to_vec())
            .map_err(|e| self.error(key, e))
    }

    fn get_range(&self, key: &str, offset: u64, len: usize) -> Result<Vec<u8>, CkptError> {
        let path = self.path(key)?;
        let bytes = self
            .runtime
            .block_on(self.inner.get_range(&path, offset..offset + len as u64))
            .map_err(|e| self.error(key, e))?;
        if bytes.len() != len {
            return Err(CkptError::corrupt(
                &self.describe(key),
                format!("truncated: cannot read {len} bytes at offset {offset}"),
            ));
        }
        Ok(bytes.to_vec())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>, CkptError> {
        let sub = prefix.trim_end_matches('/');
        let root = match (self.prefix.is_empty(), sub.is_empty()) {
            (true, true) => None,
            (true, false) => Some(sub.to_string()),
            (false, true) => Some(self.prefix.clone()),
            (false, false) => Some(format!("{}/{sub}", self.prefix)),
        };
        let root = root
            .map(|r| ObjectPath::parse(&r).map_err(|e| CkptError::Invalid(e.to_string())))
            .transpose()?;
        let metas: Vec<_> = self
            .runtime
            .block_on(self.inner.list(root.as_ref()).try_collect::<Vec<_>>())
            .map_err(|e| self.error(prefix, e))?;
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let mut keys: Vec<String> = metas
            .into_iter()
            .filter_map(|m| m.location.as_ref().strip_prefix(&strip).map(str::to_string))
            .collect();
        keys.sort();
        Ok(keys)
    }

    fn delete(&self, key: &str) -> Result<(), CkptError> {
        let path = self.path(key)?;
        match self.runtime.block_on(self.inner.delete(&path)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn describe(&self, key: &str) -> String {
        format!("{}/{key}", self.url)
    }
}

/// Applies `object_store` configuration `options` to a service's builder through its
/// `with_config`; a key the service does not know is an error naming it and the URL.
fn configure<B, K>(
    builder: B,
    options: &[(&str, &str)],
    url: &str,
    with_config: impl Fn(B, K, &str) -> B,
) -> Result<B, CkptError>
where
    K: std::str::FromStr<Err = object_store::Error>,
{
    options.iter().try_fold(builder, |b, (key, value)| {
        let k = key
            .parse()
            .map_err(|e| CkptError::Invalid(format!("{url}: option {key:?}: {e}")))?;
        Ok(with_config(b, k, value))
    })
}

/// `scheme://bucket/prefix` split into its parts; the scheme must be one we build.
fn split_url(url: &str) -> Result<(&str, &str, &str), CkptError> {
    let bad = |m: &str| CkptError::Invalid(format!("{url}: {m}"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("not a URL (expected s3://, gs:// or az://)"))?;
    let scheme = match scheme {
        "s3" => "s3",
        "gs" => "gs",
        "az" | "azure" => "az",
        other => {
            return Err(bad(&format!(
                "unsupported scheme {other}:// (supported: s3://, gs://, az://)"
            )));
        }
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(bad("missing bucket or container name"));
    }
    Ok((scheme, bucket, prefix))
}

/// A store for a location given by the user: an `s3://`, `gs://` or `az://` URL, or a
/// local directory.
pub fn open_store(location: &str) -> Result<Box<dyn Store>, CkptError> {
    if location.contains("://") {
        Ok(Box::new(ObjectStoreBackend::open(location)?))
    } else {
        Ok(Box::new(LocalStore::open(std::path::Path::new(location))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_scheme_bucket_and_prefix_or_get_a_clear_error() {
        assert_eq!(split_url("s3://b/p/q").unwrap(), ("s3", "b", "p/q"));
        assert_eq!(split_url("gs://b").unwrap(), ("gs", "b", ""));
        assert_eq!(split_url("azure://c/x").unwrap(), ("az", "c", "x"));
        let e = split_url("ftp://b/p").unwrap_err().to_string();
        assert!(e.contains("unsupported scheme ftp://"), "{e}");
        let e = split_url("s3:///p").unwrap_err().to_string();
        assert!(e.contains("missing bucket"), "{e}");
    }

    proptest::proptest! {
        /// An update is conditioned on exactly the ETag and version the read returned,
        /// whichever of them the service gave.
        #[test]
        fn a_version_tag_gives_back_the_etag_and_version_it_was_made_of(
            e_tag in proptest::option::of("[!-~]{1,40}"),
            version in proptest::option::of("[0-9]{1,20}"),
        ) {
            let back = update_version(&version_tag(e_tag.clone(), version.clone()));
            proptest::prop_assert_eq!(back.e_tag, e_tag);
            proptest::prop_assert_eq!(back.version, version);
        }
    }
}
