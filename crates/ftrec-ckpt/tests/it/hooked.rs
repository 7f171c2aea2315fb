//! A store whose writes pass through a hook first (a full disk, a lost reply, a writer
//! frozen before its PUT); every other call goes straight to the store beneath.

use std::sync::Arc;

use ftrec_ckpt::{CkptError, ObjectReader, Store};

/// What a test does to the writes: each method gets the store beneath, and by default
/// passes the write through.
pub trait WriteHook: Send + Sync {
    fn put(&self, inner: &dyn Store, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        inner.put(key, bytes)
    }
    fn put_part(&self, inner: &dyn Store, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        inner.put_part(key, bytes)
    }
}

pub struct Hooked<H> {
    pub inner: Arc<dyn Store>,
    pub hook: H,
}

impl<H: WriteHook> Store for Hooked<H> {
    fn put(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        self.hook.put(self.inner.as_ref(), key, bytes)
    }
    fn put_part(&self, key: &str, bytes: &[u8]) -> Result<(), CkptError> {
        self.hook.put_part(self.inner.as_ref(), key, bytes)
    }
    fn sync_parts(&self, prefix: &str) -> Result<(), CkptError> {
        self.inner.sync_parts(prefix)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>, CkptError> {
        self.inner.get(key)
    }
    fn open_reader(&self, key: &str) -> Result<Option<ObjectReader>, CkptError> {
        self.inner.open_reader(key)
    }
    fn get_range(&self, key: &str, offset: u64, len: usize) -> Result<Vec<u8>, CkptError> {
        self.inner.get_range(key, offset, len)
    }
    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, String)>, CkptError> {
        self.inner.get_versioned(key)
    }
    fn put_versioned(
        &self,
        key: &str,
        bytes: &[u8],
        expected: Option<&str>,
    ) -> Result<String, CkptError> {
        self.inner.put_versioned(key, bytes, expected)
    }
    fn modified_unix_ms(&self, key: &str) -> Result<Option<u64>, CkptError> {
        self.inner.modified_unix_ms(key)
    }
    fn list(&self, prefix: &str) -> Result<Vec<String>, CkptError> {
        self.inner.list(prefix)
    }
    fn delete(&self, key: &str) -> Result<(), CkptError> {
        self.inner.delete(key)
    }
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }
}
