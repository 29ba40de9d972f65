//! The floor of a Redis lock for `dlock bench` ([`dlock_core::floor`]): the
//! textbook single-instance lock, `SET key owner NX PX ttl` and a
//! compare-and-`DEL` script, on the first node's connection (for Redlock,
//! one node: what three-node fan-out and token logic cost on top of it).
//! Redis has no lock of its own.

use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::floor::Floor;
use dlock_core::url::StoreUrl;
use dlock_core::{Error, LockName};
use redis::Script;

use crate::{ADMIN_TIMEOUT, RedisBackend};

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

/// [`Floor`] of `redis://` and `redlock://` URLs: a backend of its own, of
/// which only the first node is used.
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
        "SET NX PX + compare-and-DEL script (first node)"
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let node =
            self.backend.inner.nodes.first().ok_or_else(|| {
                Error::Config(format!("{BACKEND}: no node to measure the floor on"))
            })?;
        let key = format!("{}:floor:{{{key}}}", node.prefix);
        let ttl_ms = u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX);
        let taken: Option<String> = node
            .request(ADMIN_TIMEOUT, |mut c| {
                let set = redis::cmd("SET")
                    .arg(&key)
                    .arg(OWNER)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms)
                    .to_owned();
                async move { set.query_async(&mut c).await }
            })
            .await?;
        if taken.is_none() {
            return Err(Error::protocol(
                BACKEND,
                format!("floor: {key} was not free"),
            ));
        }
        let _: i64 = node
            .request(ADMIN_TIMEOUT, |mut c| {
                let mut release = RELEASE.prepare_invoke();
                release.key(&key).arg(OWNER);
                async move { release.invoke_async(&mut c).await }
            })
            .await?;
        Ok(())
    }
}
