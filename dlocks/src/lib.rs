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
//! | `nats` | `nats://h1:p1,h2:p2[/bucket][?max_age=30s]` (JetStream KV) | [`nats`] |
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

use std::sync::{Arc, Once};

#[doc(inline)]
pub use dlock_core::{
    Adapter, Backend, Capabilities, Election, Error, FenceError, FenceGate, FencingToken,
    GateRefused, Leader, LeaderWatch, Leadership, Lock, LockGuard, LockInfo, LockName, LostReason,
    MultiGuard, MultiLock, Permit, ReadGuard, Registry, Result, RwLock, Semaphore, Session,
    SessionId, SessionOptions, StaleToken, WriteGate, WriteGuard, WritePermit, backend, election,
    fence_header, impl_adapter, memory, raw, rwlock, semaphore, url,
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

/// NATS JetStream KV.
#[cfg(feature = "nats")]
#[doc(inline)]
pub use dlock_nats as nats;

pub mod blocking;
#[cfg(feature = "tower")]
pub mod fence_layer;

/// The URL used when none is given: an SQLite file in the current directory.
pub const DEFAULT_URL: &str = "sqlite://dlock.db";

/// Every scheme the facade knows, with the Cargo feature that compiles its
/// adapter in, and whether this build has that feature.
pub const KNOWN_SCHEMES: &[(&[&str], &str, bool)] = &[
    (&["sqlite"], "sqlite", cfg!(feature = "sqlite")),
    (
        &["postgres", "postgresql"],
        "postgres",
        cfg!(feature = "postgres"),
    ),
    (&["mysql", "mariadb"], "mysql", cfg!(feature = "mysql")),
    (
        &["redis", "rediss", "redlock"],
        "redis",
        cfg!(feature = "redis"),
    ),
    (&["etcd", "etcds"], "etcd", cfg!(feature = "etcd")),
    (&["zk"], "zk", cfg!(feature = "zk")),
    (
        &["mongodb", "mongodb+srv"],
        "mongo",
        cfg!(feature = "mongo"),
    ),
    (&["nats"], "nats", cfg!(feature = "nats")),
];

/// The process-wide [`Registry`] with every adapter this build compiles in
/// (and `memory://`); the schemes of the others give
/// [`Error::FeatureDisabled`].
///
/// An adapter registered in [`dlock_core::registry`] before the first call
/// keeps its stores, and the built-in adapter still gets its other stores; an
/// alias of a taken store (`rediss://` when an application took `redis://`)
/// then refuses its URLs rather than reach the same server through another
/// adapter. After the first call, [`register`] refuses a built-in scheme
/// ([`Error::Config`]): [`replace`] takes it, whenever it runs.
pub fn registry() -> &'static Registry {
    static BUILT_IN: Once = Once::new();
    let registry = dlock_core::registry();
    BUILT_IN.call_once(|| {
        #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
        fill_free(registry, sql::SqlAdapter);
        #[cfg(feature = "redis")]
        fill_free(registry, redis::RedisAdapter);
        #[cfg(feature = "etcd")]
        fill_free(registry, etcd::EtcdAdapter);
        #[cfg(feature = "zk")]
        fill_free(registry, zk::ZkAdapter);
        #[cfg(feature = "mongo")]
        fill_free(registry, mongo::MongoAdapter);
        #[cfg(feature = "nats")]
        fill_free(registry, nats::NatsAdapter);
        // Only the features not compiled in: a compiled-in adapter that lost
        // a scheme to an earlier registration must not be reported missing.
        for &(schemes, feature, compiled) in KNOWN_SCHEMES {
            if !compiled {
                registry.mark_disabled(schemes, feature);
            }
        }
    });
    registry
}

/// Registers a built-in adapter for the stores no adapter serves yet, one
/// store's aliases ([`KNOWN_SCHEMES`]) together (see
/// [`Registry::register_free`]).
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis",
    feature = "etcd",
    feature = "zk",
    feature = "mongo",
    feature = "nats"
))]
fn fill_free(registry: &Registry, adapter: impl dlock_core::Adapter) {
    let stores: Vec<&[&'static str]> = KNOWN_SCHEMES.iter().map(|k| k.0).collect();
    // Errors only for malformed schemes, which the built-in ones are not.
    if let Ok(left) = registry.register_free(adapter, &stores)
        && !left.is_empty()
    {
        tracing::info!(
            ?left,
            "a built-in adapter left the stores of these schemes to an adapter registered before it"
        );
    }
}

/// Opens the backend a URL names, with the adapter registered for its
/// scheme (see [`registry`]).
///
/// A URL whose backend is known but not compiled in gives
/// [`Error::FeatureDisabled`] naming the feature to enable; an unknown or
/// malformed URL gives [`Error::InvalidUrl`] (without its password).
///
/// # Cancel safety
/// Cancel safe: nothing is left behind but idempotently created tables.
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>> {
    registry().connect(url).await
}

/// Registers a third-party adapter: afterwards [`connect`] opens its URLs
/// like any built-in one's. A scheme that already has an adapter is an
/// [`Error::Config`].
///
/// ```
/// # async fn demo() -> Result<(), dlocks::Error> {
/// use std::sync::Arc;
/// use dlocks::{Error, memory::MemoryBackend, url::StoreUrl};
///
/// /// `scratch://NAME`: an in-process store under its own scheme.
/// #[derive(Debug, Clone, Copy)]
/// struct Scratch;
/// struct ScratchBackend;
/// impl ScratchBackend {
///     async fn connect(url: &StoreUrl) -> Result<MemoryBackend, Error> {
///         MemoryBackend::connect(&url.with_scheme("memory")?)
///     }
/// }
/// dlocks::impl_adapter!(Scratch, name: "scratch", schemes: &["scratch"], connect: ScratchBackend::connect);
///
/// dlocks::register(Scratch)?;
/// let backend = dlocks::connect("scratch://jobs").await?;
/// # Ok(()) }
/// ```
pub fn register(adapter: impl Adapter) -> Result<()> {
    registry().register(adapter)
}

/// Registers `adapter` for all its schemes in place of whatever adapter had
/// them, built-in ones included, and returns the names of the other adapters
/// it replaced:
/// for an application that wraps a built-in backend (metrics, a tenant
/// prefix) under the built-in scheme, whether the registry was filled
/// before or not. Backends opened before keep the adapter that opened them:
/// replace before the first `connect`, or a wrapper with another key layout
/// and the backends opened earlier see one lock name as two locks.
///
/// # Errors
/// [`Error::Config`] if one of its schemes is empty or not lower case
/// (nothing is registered then).
pub fn replace(adapter: impl Adapter) -> Result<Vec<&'static str>> {
    registry().replace(adapter)
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
    async fn every_known_scheme_is_compiled_in_or_names_its_feature() {
        for &(schemes, feature, compiled) in KNOWN_SCHEMES {
            for scheme in schemes {
                if compiled {
                    continue; // needs its server: the adapter crates test it
                }
                let e = connect(&format!("{scheme}://127.0.0.1:1/x"))
                    .await
                    .unwrap_err();
                assert!(
                    matches!(&e, Error::FeatureDisabled { feature: f, .. } if *f == feature),
                    "{scheme}: {e:?}"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_third_party_adapter_is_connected_like_a_built_in_one() {
        #[derive(Debug)]
        struct Twin;
        struct TwinBackend;
        impl TwinBackend {
            async fn connect(url: &url::StoreUrl) -> Result<memory::MemoryBackend> {
                memory::MemoryBackend::connect(&url.with_scheme("memory")?)
            }
        }
        impl_adapter!(Twin, name: "twin", schemes: &["twin"], connect: TwinBackend::connect);
        register(Twin).unwrap();
        assert!(registry().schemes().contains(&"twin".to_owned()));
        let a = connect("twin://facade").await.unwrap();
        let b = connect("memory://facade").await.unwrap();
        let session = a.session(SessionOptions::new()).await.unwrap();
        let held = session.lock("x").unwrap().try_acquire().await.unwrap();
        assert!(held.is_some());
        let other = b.session(SessionOptions::new()).await.unwrap();
        assert!(
            other
                .lock("x")
                .unwrap()
                .try_acquire()
                .await
                .unwrap()
                .is_none()
        );
        let e = register(Twin).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e:?}");
    }

    #[tokio::test]
    async fn memory_works_without_features() {
        let b = connect("memory://facade-test").await.unwrap();
        assert_eq!(b.scheme(), "memory");
    }
}
