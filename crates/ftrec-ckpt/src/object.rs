//! Checkpoints in object storage (S3 and S3-compatible servers) through the `object_store`
//! crate. A single PUT is atomic, and the manifest is written after every file it names,
//! so the commit rule is the same as on a local disk.

use std::sync::Arc;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::{CkptError, LocalStore, Store};

pub struct ObjectStoreBackend {
    inner: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    runtime: tokio::runtime::Runtime,
}

impl ObjectStoreBackend {
    /// `s3://bucket/prefix`. Credentials, region and endpoint come from the usual
    /// environment variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT` and `AWS_ALLOW_HTTP` for S3-compatible servers).
    pub fn open(url: &str) -> Result<Self, CkptError> {
        Self::open_with(url, |b| b)
    }

    /// Like [`ObjectStoreBackend::open`], with the builder adjusted by `configure` after
    /// the environment is read (tests point it at a loopback server this way).
    pub fn open_with(
        url: &str,
        configure: impl FnOnce(AmazonS3Builder) -> AmazonS3Builder,
    ) -> Result<Self, CkptError> {
        let bad = |m: String| CkptError::Invalid(format!("{url}: {m}"));
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("only s3:// URLs are supported".into()))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(bad("missing bucket name".into()));
        }
        let store = configure(AmazonS3Builder::from_env().with_bucket_name(bucket))
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| bad(format!("async runtime: {e}")))?;
        Ok(Self {
            inner: Arc::new(store),
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
            other => CkptError::Io {
                path: self.describe(key).into(),
                error: std::io::Error::other(other.to_string()),
            },
        }
    }
}

impl Store for ObjectStoreBackend {
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        let path = self.path(key)?;
        let payload = PutPayload::from(bytes.to_vec());
        self.runtime
            .block_on(self.inner.put(&path, payload))
            .map(|_| ())
            .map_err(|e| self.error(key, e))
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

/// A store for a location given by the user: an `s3://` URL or a local directory.
pub fn open_store(location: &str) -> Result<Box<dyn Store>, CkptError> {
    if location.contains("://") {
        Ok(Box::new(ObjectStoreBackend::open(location)?))
    } else {
        Ok(Box::new(LocalStore::open(std::path::Path::new(location))?))
    }
}
