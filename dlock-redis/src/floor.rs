//! The floor of a Redis lock for `dlock bench` ([`dlock_core::floor`]): the
//! textbook lock, `SET key owner NX PX ttl` and a compare-and-`DEL` script;
//! for Redlock, the textbook Redlock: each of the two sent to every node at
//! once, a take granted when a majority set the key. What dlock adds on top
//! (the fencing token, its write-back to the quorum, the holder record) is
//! then what the ratio shows, not the fan-out every Redlock pays. Redis has
//! no lock of its own.

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::floor::{FencedWrite, Floor};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};
use futures::future::join_all;
use redis::Script;

use crate::node::Node;
use crate::{ADMIN_TIMEOUT, RedisBackend, RedisFence};

/// The backend's name in errors.
const BACKEND: &str = "redis";

/// Releases `KEYS[1]` if it still holds `ARGV[1]`.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) \
         else return 0 end",
    )
});

/// The value the raw lock is taken with.
const OWNER: &str = "dlock-floor";

/// The raw lock's expiry: longer than any cycle.
const TTL: Duration = Duration::from_secs(10);

/// How long one node may take to answer one of the floor's requests: both
/// rounds on a silent node fit well within the bench's limit per cycle.
const NODE_LIMIT: Duration = Duration::from_secs(2);

/// [`Floor`] of `redis://` and `redlock://` URLs, on a backend of its own:
/// the lock on every node (Redlock), the fenced write on the first.
#[derive(Debug)]
pub struct RedisFloor {
    backend: RedisBackend,
}

impl RedisFloor {
    /// Opens the floor of `url` (read as [`RedisBackend::connect`] reads it).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        Ok(Self {
            backend: RedisBackend::connect(url).await?,
        })
    }
}

#[async_trait]
impl Floor for RedisFloor {
    fn operations(&self) -> &'static str {
        if self.backend.inner.nodes.len() > 1 {
            "SET NX PX + compare-and-DEL script, each on every node at once (textbook Redlock)"
        } else {
            "SET NX PX + compare-and-DEL script"
        }
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let nodes = &self.backend.inner.nodes;
        let ttl_ms = u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX);
        let keys: Vec<String> = nodes
            .iter()
            .map(|node| format!("{}:floor:{{{key}}}", node.prefix))
            .collect();
        let taken = join_all(nodes.iter().zip(&keys).map(|(node, key)| {
            node.request(NODE_LIMIT, move |mut c| {
                let set = redis::cmd("SET")
                    .arg(key)
                    .arg(OWNER)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .to_owned();
                async move { set.query_async::<Option<String>>(&mut c).await }
            })
        }))
        .await;
        // Released on every node, taken or not, as a Redlock client does:
        // a node that set the key but whose answer was lost holds it too. A
        // minority that fails keeps its key until it expires (the next
        // cycle's take still gets a majority), as a Redlock's would.
        let _ = join_all(nodes.iter().zip(&keys).map(|(node, key)| {
            node.request(NODE_LIMIT, move |mut c| {
                let mut release = RELEASE.prepare_invoke();
                release.key(key).arg(OWNER);
                async move { release.invoke_async::<i64>(&mut c).await }
            })
        }))
        .await;
        // A node that failed counts as one that did not set the key: a
        // Redlock is granted on a majority whatever the minority does.
        let mut set = 0;
        let mut first_error = None;
        for answer in taken {
            match answer {
                Ok(answer) => set += usize::from(answer.is_some()),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if set >= self.backend.inner.quorum() {
            return Ok(());
        }
        Err(first_error.unwrap_or_else(|| {
            Error::protocol(
                BACKEND,
                format!("floor: {key} was not free on a majority of the nodes"),
            )
        }))
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

impl RedisFloor {
    /// The node the floor is measured on.
    fn node(&self) -> Result<&Node, Error> {
        self.backend
            .inner
            .nodes
            .first()
            .ok_or_else(|| Error::Config(format!("{BACKEND}: no node to measure the floor on")))
    }

    /// The data key and the fence key of the fenced-write measure of `key`
    /// (one hash tag, as on a cluster).
    fn fenced_keys(node: &Node, key: &LockName) -> (String, String) {
        let data = format!("{}:floor:data:{{{key}}}", node.prefix);
        let fence = format!("{}:floor:fence:{{{key}}}", node.prefix);
        (data, fence)
    }
}

#[async_trait]
impl FencedWrite for RedisFloor {
    fn operations(&self) -> &'static str {
        "SET, against RedisFence::set (one EVALSHA)"
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        let node = self.node()?;
        let (data, _) = Self::fenced_keys(node, key);
        node.request(ADMIN_TIMEOUT, |mut c| {
            let set = redis::cmd("SET").arg(&data).arg(value).to_owned();
            async move { set.query_async::<()>(&mut c).await }
        })
        .await
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        let node = self.node()?;
        let (data, fence) = Self::fenced_keys(node, key);
        let fence = RedisFence::new(fence);
        node.request(ADMIN_TIMEOUT, |mut c| async move {
            Ok(fence.set(&mut c, token, &data, value).await)
        })
        .await?
        .map_err(|e| Error::protocol(BACKEND, format!("floor: {e}")))
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        let node = self.node()?;
        let (data, fence) = Self::fenced_keys(node, key);
        node.request(ADMIN_TIMEOUT, |mut c| {
            let del = redis::cmd("DEL").arg(&data).arg(&fence).to_owned();
            async move { del.query_async::<()>(&mut c).await }
        })
        .await
    }
}
