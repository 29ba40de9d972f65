//! Adapters as pluggable units: an [`Adapter`] names its URL schemes and
//! opens a [`Backend`] from a [`StoreUrl`]; a [`Registry`] maps schemes to
//! adapters, so that an application can `connect` a third-party store's URLs
//! exactly like a built-in one.
//!
//! ```
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use std::sync::Arc;
//! use async_trait::async_trait;
//! use dlock_core::{Adapter, Backend, Error, memory::MemoryBackend, url::StoreUrl};
//!
//! /// `scratch://NAME`: an in-process store under another scheme.
//! #[derive(Debug)]
//! struct Scratch;
//!
//! #[async_trait]
//! impl Adapter for Scratch {
//!     fn name(&self) -> &'static str { "scratch" }
//!     fn schemes(&self) -> &'static [&'static str] { &["scratch"] }
//!     async fn connect(&self, url: &StoreUrl) -> Result<Arc<dyn Backend>, Error> {
//!         url.options().finish()?;
//!         let name = url.hosts().first().map_or("default", |h| h.host.as_str());
//!         Ok(Arc::new(MemoryBackend::connect(&format!("memory://scratch-{name}"))?))
//!     }
//! }
//!
//! dlock_core::registry().register(Scratch)?;
//! let backend = dlock_core::registry().connect("scratch://jobs").await?;
//! assert_eq!(backend.scheme(), "memory");
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use crate::url::StoreUrl;
use crate::{Backend, Error};

/// What a backend promises beyond the safety invariants every backend keeps
/// (S1–S9): ordering, wake-ups, what survives which fault. Applications read
/// it to choose a store; the conformance suite reads it to decide which
/// cases apply and how long to wait.
///
/// Adapters declare the worst case over the deployments their URL allows
/// (plain Redis without persistence loses locks in a restart, even if a
/// given server has an append-only file).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Waiters are granted in arrival order (L4).
    pub fair: bool,
    /// Tokens keep increasing across a restart of every server (S2).
    pub durable_tokens: bool,
    /// A release wakes a waiter through a store notification, not a poll (L2).
    pub notify_wakeup: bool,
    /// One release wakes O(1) waiters, not all of them (L6).
    pub no_herd: bool,
    /// A session survives a dropped connection re-established within its
    /// TTL.
    pub survives_reconnect: bool,
    /// A server restart can lose held locks before their holders hear of it
    /// (a store without persistence): a holder learns at its next renewal,
    /// but another client may be granted first; fencing still refuses the
    /// old holder.
    pub restart_loses_locks: bool,
    /// Bound on release → a waiting client's grant, from the store's
    /// notification or poll period (generous: it catches a fixed slow poll).
    pub wakeup_bound: Duration,
    /// Time after the TTL within which a crashed holder's lock can be taken
    /// (L1): how late the store may judge expiry.
    pub recovery_bound: Duration,
}

impl Default for Capabilities {
    /// The weakest promises: unfair, polled, nothing survives a restart (not
    /// even held locks), so an adapter claims each strength explicitly.
    fn default() -> Self {
        Self {
            fair: false,
            durable_tokens: false,
            notify_wakeup: false,
            no_herd: false,
            survives_reconnect: false,
            restart_loses_locks: true,
            wakeup_bound: Duration::from_millis(250),
            recovery_bound: Duration::from_secs(1),
        }
    }
}

impl Capabilities {
    /// What a FIFO queue of keys in a replicated store that persists every
    /// write before acknowledging it promises, when each waiter watches only
    /// the key ahead of it and a session outlives its connection (etcd,
    /// ZooKeeper): held locks and tokens survive restarts, waiters are
    /// granted in order, one release wakes one waiter within 150 ms.
    /// `recovery_bound` is how late the store judges a session's expiry.
    pub fn watched_queue(recovery_bound: Duration) -> Self {
        Self {
            fair: true,
            durable_tokens: true,
            notify_wakeup: true,
            no_herd: true,
            survives_reconnect: true,
            restart_loses_locks: false,
            wakeup_bound: Duration::from_millis(150),
            recovery_bound,
        }
    }
}

/// A store adapter: the URL schemes it answers to and how to open one.
///
/// Implemented once per adapter crate (`dlock_redis::RedisAdapter`, ...)
/// and registered in a [`Registry`]; see the [module docs](self).
#[async_trait]
pub trait Adapter: Send + Sync + Debug + 'static {
    /// A short name for messages (`"redis"`).
    fn name(&self) -> &'static str;

    /// The URL schemes it opens, lower-case, without `://`.
    fn schemes(&self) -> &'static [&'static str];

    /// Opens a backend. Unknown query options are an
    /// [`Error::InvalidUrl`] (read them with [`StoreUrl::options`] and end
    /// with `finish()`).
    ///
    /// # Cancel safety
    /// Must be cancel safe: dropping it leaves nothing behind but
    /// idempotently created schema.
    async fn connect(&self, url: &StoreUrl) -> Result<Arc<dyn Backend>, Error>;
}

/// Implements [`Adapter`] for a unit struct whose backend type has an
/// async `connect(&StoreUrl)`: every adapter crate's `impl Adapter` is the
/// same three lines, so it is written once, here.
///
/// ```
/// use dlock_core::{Error, memory::MemoryBackend, url::StoreUrl};
///
/// /// `memory://` under a second name.
/// #[derive(Debug, Clone, Copy, Default)]
/// pub struct Scratch;
///
/// struct ScratchBackend;
/// impl ScratchBackend {
///     async fn connect(url: &StoreUrl) -> Result<MemoryBackend, Error> {
///         MemoryBackend::connect(&url.with_scheme("memory")?)
///     }
/// }
///
/// dlock_core::impl_adapter!(Scratch, name: "scratch", schemes: &["scratch"], connect: ScratchBackend::connect);
/// ```
#[macro_export]
macro_rules! impl_adapter {
    ($adapter:ty, name: $name:expr, schemes: $schemes:expr, connect: $($connect:ident)::+ $(,)?) => {
        #[$crate::__async_trait]
        impl $crate::Adapter for $adapter {
            fn name(&self) -> &'static str {
                $name
            }

            fn schemes(&self) -> &'static [&'static str] {
                $schemes
            }

            async fn connect(
                &self,
                url: &$crate::url::StoreUrl,
            ) -> ::std::result::Result<::std::sync::Arc<dyn $crate::Backend>, $crate::Error> {
                ::std::result::Result::Ok(::std::sync::Arc::new($($connect)::+(url).await?))
            }
        }
    };
}

/// What a scheme maps to.
#[derive(Debug, Clone)]
enum Entry {
    Adapter(Arc<dyn Adapter>),
    /// Known, but its adapter is not compiled in.
    Disabled {
        feature: &'static str,
    },
}

/// Maps URL schemes to adapters.
///
/// [`registry()`] is the process-wide one that `dlocks::connect` uses;
/// tests and embedders may keep their own.
#[derive(Debug, Default)]
pub struct Registry {
    schemes: RwLock<BTreeMap<String, Entry>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `adapter` for each of its schemes. A scheme another adapter
    /// already has is an [`Error::Config`] (nothing is registered then); a
    /// scheme only marked [disabled](Registry::mark_disabled) is taken over.
    pub fn register(&self, adapter: impl Adapter) -> Result<(), Error> {
        self.register_arc(Arc::new(adapter))
    }

    /// [`Registry::register`] for an adapter already in an `Arc`.
    pub fn register_arc(&self, adapter: Arc<dyn Adapter>) -> Result<(), Error> {
        let mut schemes = self.schemes.write().unwrap_or_else(|e| e.into_inner());
        for &scheme in adapter.schemes() {
            if scheme.is_empty() || scheme != scheme.to_ascii_lowercase() {
                return Err(Error::Config(format!(
                    "adapter {}: scheme {scheme:?} must be non-empty lower case",
                    adapter.name()
                )));
            }
            if let Some(Entry::Adapter(other)) = schemes.get(scheme) {
                return Err(Error::Config(format!(
                    "the {scheme}:// scheme is already registered by the {} adapter",
                    other.name()
                )));
            }
        }
        for &scheme in adapter.schemes() {
            schemes.insert(scheme.to_owned(), Entry::Adapter(adapter.clone()));
        }
        Ok(())
    }

    /// Marks `schemes` as known but not compiled in: connecting gives
    /// [`Error::FeatureDisabled`] naming `feature`. A scheme that already has
    /// an adapter keeps it.
    pub fn mark_disabled(&self, schemes: &[&str], feature: &'static str) {
        let mut map = self.schemes.write().unwrap_or_else(|e| e.into_inner());
        for &scheme in schemes {
            map.entry(scheme.to_owned())
                .or_insert(Entry::Disabled { feature });
        }
    }

    /// The adapter for `scheme`, if one is registered.
    pub fn adapter(&self, scheme: &str) -> Option<Arc<dyn Adapter>> {
        let schemes = self.schemes.read().unwrap_or_else(|e| e.into_inner());
        match schemes.get(&scheme.to_ascii_lowercase()) {
            Some(Entry::Adapter(a)) => Some(a.clone()),
            _ => None,
        }
    }

    /// The schemes that have an adapter, sorted.
    pub fn schemes(&self) -> Vec<String> {
        let schemes = self.schemes.read().unwrap_or_else(|e| e.into_inner());
        schemes
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Adapter(_)))
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Parses `url` and opens it with the adapter of its scheme.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a malformed URL or an unknown scheme,
    /// [`Error::FeatureDisabled`] for a known scheme not compiled in, and
    /// whatever the adapter returns; never with the password.
    ///
    /// # Cancel safety
    /// As the adapter's [`Adapter::connect`].
    pub async fn connect(&self, url: &str) -> Result<Arc<dyn Backend>, Error> {
        self.connect_url(&StoreUrl::parse(url)?).await
    }

    /// [`Registry::connect`] for a parsed URL.
    pub async fn connect_url(&self, url: &StoreUrl) -> Result<Arc<dyn Backend>, Error> {
        let entry = {
            let schemes = self.schemes.read().unwrap_or_else(|e| e.into_inner());
            schemes.get(url.scheme()).cloned()
        };
        match entry {
            Some(Entry::Adapter(adapter)) => adapter.connect(url).await,
            Some(Entry::Disabled { feature }) => Err(Error::FeatureDisabled {
                scheme: url.scheme().to_owned(),
                feature,
            }),
            None => {
                let known: Vec<String> = self.schemes().iter().map(|s| format!("{s}://")).collect();
                Err(url.invalid(format!(
                    "unknown scheme {:?}; registered: {}",
                    url.scheme(),
                    known.join(", ")
                )))
            }
        }
    }
}

/// The process-wide registry; it starts with the in-process
/// [`memory`](crate::memory) adapter.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry = Registry::new();
        registry
            .register(crate::memory::MemoryAdapter)
            .expect("an empty registry takes memory://");
        registry
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryAdapter;

    /// What etcd and ZooKeeper backends promise (their harnesses take it
    /// from there): a change here is a change of both.
    #[test]
    fn a_watched_queue_promises_every_strength() {
        let c = Capabilities::watched_queue(Duration::from_millis(1500));
        assert!(c.fair && c.durable_tokens && c.notify_wakeup && c.no_herd);
        assert!(c.survives_reconnect && !c.restart_loses_locks);
        assert_eq!(c.wakeup_bound, Duration::from_millis(150));
        assert_eq!(c.recovery_bound, Duration::from_millis(1500));
    }

    #[derive(Debug)]
    struct Other;

    #[async_trait]
    impl Adapter for Other {
        fn name(&self) -> &'static str {
            "other"
        }
        fn schemes(&self) -> &'static [&'static str] {
            &["memory", "other"]
        }
        async fn connect(&self, url: &StoreUrl) -> Result<Arc<dyn Backend>, Error> {
            MemoryAdapter.connect(&url.with_scheme("memory")?).await
        }
    }

    #[tokio::test]
    async fn schemes_map_to_adapters_once() {
        let r = Registry::new();
        r.register(MemoryAdapter).unwrap();
        let e = r.register(Other).unwrap_err();
        assert!(
            e.to_string().contains("already registered by the memory"),
            "{e}"
        );
        assert!(
            r.adapter("other").is_none(),
            "a refused adapter left a scheme"
        );
        assert_eq!(r.schemes(), ["memory"]);
        assert_eq!(r.connect("MEMORY://x").await.unwrap().scheme(), "memory");
    }

    #[tokio::test]
    async fn unknown_and_disabled_schemes_are_typed() {
        let r = Registry::new();
        r.register(MemoryAdapter).unwrap();
        r.mark_disabled(&["mongodb"], "mongo");
        let e = r.connect("gopher://u:s3cret@h").await.unwrap_err();
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
        assert!(e.to_string().contains("registered: memory://"), "{e}");
        assert!(!format!("{e:?}").contains("s3cret"));
        let e = r.connect("mongodb://h").await.unwrap_err();
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
        r.mark_disabled(&["memory"], "nope");
        assert!(
            r.connect("memory://").await.is_ok(),
            "disabled hid an adapter"
        );
    }

    #[tokio::test]
    async fn a_disabled_scheme_can_be_taken_by_a_third_party() {
        let r = Registry::new();
        r.mark_disabled(&["other", "memory"], "x");
        r.register(Other).unwrap();
        assert!(r.connect("other://y").await.is_ok());
    }
}
