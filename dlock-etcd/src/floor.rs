//! The floor of an etcd lock for `dlock bench` ([`dlock_core::floor`]): a
//! put-if-absent transaction under a lease and a delete, on a client of its
//! own; and etcd's own lock service (`Lock`/`Unlock` RPCs) under the same
//! lease, kept alive in the background.

use std::time::Duration;

use async_trait::async_trait;
use dlock_core::floor::{FencedWrite, Floor, NativeGuard, NativeLock};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};
use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use tokio::task::JoinHandle;

use crate::{EtcdBackend, EtcdFence, map_err, new_client};

/// The lease's TTL; it is kept alive every third of it.
const LEASE_TTL: Duration = Duration::from_secs(10);

/// How long one request may take: a `Lock` RPC waits for the lock, which
/// under contention takes longer than dlock's usual request timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// [`Floor`] of `etcd://` and `etcds://` URLs.
pub struct EtcdFloor {
    client: Client,
    /// Keys start with it: next to dlock's prefix, not under it.
    prefix: String,
    lease: i64,
    keeper: JoinHandle<()>,
}

impl EtcdFloor {
    /// Opens the floor of `url` (read as [`EtcdBackend::connect`] reads it)
    /// with a lease of its own.
    ///
    /// # Cancel safety
    /// Cancel safe: a lease granted before the drop ends after its TTL.
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        let backend = EtcdBackend::connect(url).await?;
        let inner = &backend.inner;
        let options = inner.options.clone().with_timeout(REQUEST_TIMEOUT);
        let mut client = new_client(&inner.endpoints, &options).await?;
        let ttl = i64::try_from(LEASE_TTL.as_secs()).unwrap_or(i64::MAX);
        let lease = client.lease_grant(ttl, None).await.map_err(map_err)?.id();
        let (mut keeper, mut answers) = client.lease_keep_alive(lease).await.map_err(map_err)?;
        let keeper = tokio::spawn(async move {
            loop {
                tokio::time::sleep(LEASE_TTL / 3).await;
                if keeper.keep_alive().await.is_err()
                    || !matches!(answers.message().await, Ok(Some(_)))
                {
                    tracing::debug!(lease, "the floor's lease keep-alive stopped");
                    return;
                }
            }
        });
        Ok(Self {
            client,
            prefix: format!("{}.floor/", inner.prefix),
            lease,
            keeper,
        })
    }

    /// The floor's key for `key`.
    fn key(&self, key: &LockName) -> String {
        format!("{}{}", self.prefix, key.flat())
    }
}

impl std::fmt::Debug for EtcdFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdFloor")
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdFloor {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

#[async_trait]
impl Floor for EtcdFloor {
    fn operations(&self) -> &'static str {
        "txn(put if absent, leased) + delete"
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let key = self.key(key);
        let mut kv = self.client.kv_client();
        let take = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                "dlock-floor",
                Some(PutOptions::new().with_lease(self.lease)),
            )]);
        let taken = kv.txn(take).await.map_err(map_err)?;
        if !taken.succeeded() {
            return Err(Error::protocol(
                "etcd",
                format!("floor: {key} was not free"),
            ));
        }
        kv.delete(key, None).await.map_err(map_err)?;
        Ok(())
    }

    fn native(&self) -> Option<&dyn NativeLock> {
        Some(self)
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

impl EtcdFloor {
    /// The data key and the fence key of the fenced-write measure of `key`.
    fn fenced_keys(&self, key: &LockName) -> (String, String) {
        let key = self.key(key);
        (format!("{key}/data"), format!("{key}/fence"))
    }
}

#[async_trait]
impl FencedWrite for EtcdFloor {
    fn operations(&self) -> &'static str {
        "put, against EtcdFence::commit (one txn)"
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        let (data, _) = self.fenced_keys(key);
        let mut kv = self.client.kv_client();
        kv.put(data, value.to_string(), None)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        let (data, fence) = self.fenced_keys(key);
        let put = TxnOp::put(data, value.to_string(), None);
        EtcdFence::new(fence)
            .commit(&mut self.client.clone(), token, [put])
            .await
            .map_err(|e| Error::protocol("etcd", format!("floor: {e}")))?;
        Ok(())
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        let (data, fence) = self.fenced_keys(key);
        let mut kv = self.client.kv_client();
        let both = Txn::new().and_then([TxnOp::delete(data, None), TxnOp::delete(fence, None)]);
        kv.txn(both).await.map_err(map_err)?;
        Ok(())
    }
}

#[async_trait]
impl NativeLock for EtcdFloor {
    fn name(&self) -> &'static str {
        "etcd lock service"
    }

    async fn lock(&self, key: &LockName) -> Result<Box<dyn NativeGuard>, Error> {
        let mut client = self.client.lock_client();
        let options = LockOptions::new().with_lease(self.lease);
        let held = client
            .lock(self.key(key), Some(options))
            .await
            .map_err(map_err)?;
        Ok(Box::new(Held {
            client,
            key: held.key().to_vec(),
        }))
    }
}

/// A lock of etcd's lock service: the key its `Lock` call created.
struct Held {
    client: etcd_client::LockClient,
    key: Vec<u8>,
}

#[async_trait]
impl NativeGuard for Held {
    async fn release(mut self: Box<Self>) -> Result<(), Error> {
        let key = std::mem::take(&mut self.key);
        self.client.unlock(key).await.map_err(map_err)?;
        Ok(())
    }
}
