//! The floor of a ZooKeeper lock for `dlock bench` ([`dlock_core::floor`]):
//! an ephemeral-sequential create and its delete, on a client of its own;
//! and zookeeper-client's lock recipe (Curator-compatible, the same
//! watch-the-predecessor queue as dlock). Both work under one persistent
//! node next to dlock's root (`/dlock-floor` for `/dlock`), so that a run
//! leaves nothing else behind.

use std::time::Duration;

use async_trait::async_trait;
use dlock_core::floor::{FencedWrite, Floor, NativeGuard, NativeLock};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};
use zookeeper_client as zk;

use crate::{Config, ZkFence, map_err};

/// The floor's session timeout.
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// [`Floor`] of `zk://` URLs.
pub struct ZkFloor {
    client: zk::Client,
    /// The persistent node the floor's nodes go under.
    dir: String,
    acls: zk::Acls<'static>,
}

impl std::fmt::Debug for ZkFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkFloor")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl ZkFloor {
    /// Opens the floor of `url` (read as [`ZkBackend::connect`](crate::ZkBackend::connect)
    /// reads it) and creates its node if needed.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is left behind but the floor's node.
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        let config = Config::parse(url)?;
        let client = config.connect(SESSION_TIMEOUT).await?;
        let dir = format!("{}-floor", config.root);
        let acls = config.acls();
        client
            .mkdir(&dir, &zk::CreateMode::Persistent.with_acls(acls))
            .await
            .map_err(map_err)?;
        Ok(Self { client, dir, acls })
    }
}

#[async_trait]
impl Floor for ZkFloor {
    fn operations(&self) -> &'static str {
        "create ephemeral-sequential + delete"
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let prefix = format!("{}/{}-", self.dir, key.flat());
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(self.acls);
        let (_, sequence) =
            (self.client.create(&prefix, b"", &ephemeral).await).map_err(map_err)?;
        let path = format!("{prefix}{sequence}");
        self.client.delete(&path, None).await.map_err(map_err)
    }

    fn native(&self) -> Option<&dyn NativeLock> {
        Some(self)
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

impl ZkFloor {
    /// The data node and the fence znode of the fenced-write measure of
    /// `key`.
    fn fenced_paths(&self, key: &LockName) -> (String, String) {
        let flat = key.flat();
        (
            format!("{}/data-{flat}", self.dir),
            format!("{}/fence-{flat}", self.dir),
        )
    }
}

#[async_trait]
impl FencedWrite for ZkFloor {
    fn operations(&self) -> &'static str {
        "setData, against ZkFence::commit (getData + multi)"
    }

    async fn prepare(&self, key: &LockName) -> Result<(), Error> {
        let (data, _) = self.fenced_paths(key);
        let persistent = zk::CreateMode::Persistent.with_acls(self.acls);
        match self.client.create(&data, b"", &persistent).await {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(e) => Err(map_err(e)),
        }
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        let (data, _) = self.fenced_paths(key);
        let value = value.to_string();
        self.client
            .set_data(&data, value.as_bytes(), None)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        let (data, fence) = self.fenced_paths(key);
        let value = value.to_string();
        ZkFence::new(fence)
            .acls(self.acls)
            .commit(&self.client, token, |multi| {
                multi.add_set_data(&data, value.as_bytes(), None)
            })
            .await
            .map_err(|e| Error::protocol("zk", format!("floor: {e}")))?;
        Ok(())
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        let (data, fence) = self.fenced_paths(key);
        for path in [data, fence] {
            match self.client.delete(&path, None).await {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(())
    }
}

#[async_trait]
impl NativeLock for ZkFloor {
    fn name(&self) -> &'static str {
        "zookeeper-client lock recipe"
    }

    async fn lock(&self, key: &LockName) -> Result<Box<dyn NativeGuard>, Error> {
        let name = format!("{}-", key.flat());
        let prefix = zk::LockPrefix::new_curator(&self.dir, &name).map_err(map_err)?;
        let options = zk::LockOptions::new(self.acls);
        let held = self
            .client
            .lock(prefix, b"", options)
            .await
            .map_err(map_err)?;
        let path = held.lock_path().to_owned();
        // Released explicitly below: the recipe's guard would delete in the
        // background, outside the measured release.
        std::mem::forget(held);
        Ok(Box::new(Held {
            client: self.client.clone(),
            path,
        }))
    }
}

/// A lock of the recipe: its ephemeral node.
struct Held {
    client: zk::Client,
    path: String,
}

#[async_trait]
impl NativeGuard for Held {
    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.client.delete(&self.path, None).await.map_err(map_err)
    }
}
