//! dlocks: distributed locks with fencing tokens that work the same on every
//! store. This crate is the library's front door: [`connect`] opens any
//! backend by URL, and the store adapters are re-exported behind Cargo
//! features.
//!
//! | feature | URLs | adapter |
//! |---|---|---|
//! | `sqlite` (default) | `sqlite://path` | [`sql`] |
//! | `postgres` | `postgres://user:pass@host/db` | [`sql`] |
//! | `mysql` | `mysql://user:pass@host/db` (MariaDB too) | [`sql`] |
//! | `redis` | `redis://`, `rediss://`, `redlock://h1:p1,h2:p2,h3:p3` | [`redis`] |
//! | `etcd` | `etcd://h1:p1,h2:p2[/prefix]`, `etcds://` | [`etcd`] |
//! | `zk` | `zk://[user:pass@]h1:p1,h2:p2[/root]` | [`zk`] |
//! | `mongo` | `mongodb://…`, `mongodb+srv://…` | [`mongo`] |
//! | always | `memory://[name]` | [`memory`] (in-process) |
//!
//! `all` enables every backend.
//!
//! ```
//! # async fn demo() -> Result<(), dlocks::Error> {
//! use std::time::Duration;
//! use dlocks::SessionOptions;
//!
//! let backend = dlocks::connect("memory://").await?;
//! let session = backend.session(SessionOptions::new().ttl(Duration::from_secs(10))).await?;
//! let guard = session.lock("billing/invoice-run")?
//!     .acquire_timeout(Duration::from_secs(30))
//!     .await?;
//! tokio::select! {
//!     reason = guard.lost() => eprintln!("lock lost: {reason}"),
//!     _ = run_job(guard.token().get()) => {}
//! }
//! guard.release().await?;
//! # Ok(()) }
//! # async fn run_job(_: u64) {}
//! ```
//!
//! The `dlock` command (`cargo install dlock-cli`) runs a command under a lock:
//! see `dlock --help`.

use std::sync::Arc;

#[doc(inline)]
pub use dlock_core::{
    Backend, Error, FenceGate, FencingToken, Lock, LockGuard, LockInfo, LockName, LostReason,
    Result, Session, SessionId, SessionOptions, StaleToken, backend, memory,
};

/// SQL databases: PostgreSQL, MySQL/MariaDB, SQLite.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[doc(inline)]
pub use dlock_sql as sql;

/// Redis and Redlock.
#[cfg(feature = "redis")]
#[doc(inline)]
pub use dlock_redis as redis;

/// etcd.
#[cfg(feature = "etcd")]
#[doc(inline)]
pub use dlock_etcd as etcd;

/// ZooKeeper.
#[cfg(feature = "zk")]
#[doc(inline)]
pub use dlock_zk as zk;

/// MongoDB.
#[cfg(feature = "mongo")]
#[doc(inline)]
pub use dlock_mongo as mongo;

/// The URL used when none is given: an SQLite file in the current directory.
pub const DEFAULT_URL: &str = "sqlite://dlock.db";

/// Opens the backend a URL names.
///
/// A URL whose backend is known but not compiled in gives
/// [`Error::FeatureDisabled`] naming the feature to enable; an unknown or
/// malformed URL gives [`Error::InvalidUrl`] (without its password).
///
/// # Cancel safety
/// Cancel safe: nothing is left behind but idempotently created tables.
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>> {
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or("");
    let disabled = |feature: &'static str| Error::FeatureDisabled {
        scheme: scheme.to_owned(),
        feature,
    };
    match scheme {
        "memory" => Ok(Arc::new(memory::MemoryBackend::connect(url)?)),
        "sqlite" if cfg!(feature = "sqlite") => sql_connect(url).await,
        "postgres" | "postgresql" if cfg!(feature = "postgres") => sql_connect(url).await,
        "mysql" | "mariadb" if cfg!(feature = "mysql") => sql_connect(url).await,
        "sqlite" => Err(disabled("sqlite")),
        "postgres" | "postgresql" => Err(disabled("postgres")),
        "mysql" | "mariadb" => Err(disabled("mysql")),
        #[cfg(feature = "redis")]
        "redis" | "rediss" | "redlock" => Ok(Arc::new(redis::RedisBackend::connect(url).await?)),
        #[cfg(not(feature = "redis"))]
        "redis" | "rediss" | "redlock" => Err(disabled("redis")),
        #[cfg(feature = "etcd")]
        "etcd" | "etcds" => Ok(Arc::new(etcd::EtcdBackend::connect(url).await?)),
        #[cfg(not(feature = "etcd"))]
        "etcd" | "etcds" => Err(disabled("etcd")),
        #[cfg(feature = "zk")]
        "zk" => Ok(Arc::new(zk::ZkBackend::connect(url).await?)),
        #[cfg(not(feature = "zk"))]
        "zk" => Err(disabled("zk")),
        #[cfg(feature = "mongo")]
        "mongodb" | "mongodb+srv" => Ok(Arc::new(mongo::MongoBackend::connect(url).await?)),
        #[cfg(not(feature = "mongo"))]
        "mongodb" | "mongodb+srv" => Err(disabled("mongo")),
        _ => Err(Error::invalid_url(
            url,
            "unknown scheme; expected memory://, sqlite://, postgres://, mysql://, redis://, \
             redlock://, etcd://, zk:// or mongodb://",
        )),
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn sql_connect(url: &str) -> Result<Arc<dyn Backend>> {
    Ok(Arc::new(sql::SqlBackend::connect(url).await?))
}

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
async fn sql_connect(url: &str) -> Result<Arc<dyn Backend>> {
    Err(Error::invalid_url(url, "no SQL backend compiled in"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn unknown_and_disabled_schemes_are_typed_errors() {
        let e = connect("gopher://u:secret@h").await.unwrap_err();
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
        assert!(!e.to_string().contains("secret"));
        if cfg!(feature = "mongo") {
            return; // every backend is compiled in: nothing is disabled
        }
        let e = connect("mongodb://127.0.0.1:27017").await.unwrap_err();
        assert!(
            matches!(
                e,
                Error::FeatureDisabled {
                    feature: "mongo",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("enable the `mongo` feature"), "{e}");
    }

    #[tokio::test]
    async fn memory_works_without_features() {
        let b = connect("memory://facade-test").await.unwrap();
        assert_eq!(b.scheme(), "memory");
    }
}
