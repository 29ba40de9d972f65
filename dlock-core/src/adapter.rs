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

use async_trait::async_trait;

use crate::backend::Backend;
pub use crate::capabilities::Capabilities;
use crate::error::Error;
use crate::floor::Floor;
use crate::url::StoreUrl;

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

    /// Opens the store's [`Floor`] (the raw operations a lock needs, and its
    /// own lock if any) on a connection of its own, for `dlock bench` to
    /// measure dlock against. `None`, the default, for an adapter without
    /// one. The URL is read as [`Adapter::connect`] reads it.
    ///
    /// # Cancel safety
    /// As [`Adapter::connect`].
    async fn floor(&self, url: &StoreUrl) -> Result<Option<Arc<dyn Floor>>, Error> {
        let _ = url;
        Ok(None)
    }
}

/// Implements [`Adapter`] for a unit struct whose backend type has an
/// async `connect(&StoreUrl)`: every adapter crate's `impl Adapter` is the
/// same three lines, so it is written once, here. An optional
/// `floor: path` names an async `fn(&StoreUrl) -> Result<impl Floor, Error>`
/// for [`Adapter::floor`].
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
    ($adapter:ty, name: $name:expr, schemes: $schemes:expr, connect: $($connect:ident)::+ $(, floor: $($floor:ident)::+)? $(,)?) => {
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

            $(
            async fn floor(
                &self,
                url: &$crate::url::StoreUrl,
            ) -> ::std::result::Result<
                ::std::option::Option<::std::sync::Arc<dyn $crate::floor::Floor>>,
                $crate::Error,
            > {
                ::std::result::Result::Ok(::std::option::Option::Some(::std::sync::Arc::new(
                    $($floor)::+(url).await?,
                )))
            }
            )?
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
    /// An alias of a store whose scheme `alias` the adapter `other` took
    /// (see [`Registry::register_free`]).
    Split {
        alias: &'static str,
        other: &'static str,
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
        check_schemes(&*adapter)?;
        let mut schemes = self.schemes.write().unwrap_or_else(|e| e.into_inner());
        for &scheme in adapter.schemes() {
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

    /// Registers `adapter` store by store, for the stores no other adapter
    /// serves yet, and returns the schemes it left alone. For adapters
    /// filled in by default (the facade's built-in ones): an application's
    /// adapter registered earlier keeps its store, and the built-in one
    /// still gets its other stores (a taken `sqlite://` does not cost
    /// `postgres://`).
    ///
    /// `stores` groups `adapter`'s schemes by store: the aliases of one
    /// store (`["redis", "rediss", "redlock"]`) go to one adapter or none;
    /// a scheme in no group is a store of its own. If another adapter has
    /// any alias of a store, the store's other aliases get no adapter and
    /// refuse their URLs with an [`Error::Config`] naming that adapter:
    /// served by two adapters (say an application's wrapper with its own
    /// key layout on `redis://`, the built-in one on `rediss://`), one lock
    /// name would be two locks on one server.
    ///
    /// ```
    /// use dlock_core::{Registry, memory::MemoryAdapter};
    /// let registry = Registry::new();
    /// assert!(registry.register_free(MemoryAdapter, &[])?.is_empty());
    /// assert_eq!(registry.register_free(MemoryAdapter, &[])?, ["memory"]);
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    pub fn register_free(
        &self,
        adapter: impl Adapter,
        stores: &[&[&'static str]],
    ) -> Result<Vec<&'static str>, Error> {
        check_schemes(&adapter)?;
        let adapter: Arc<dyn Adapter> = Arc::new(adapter);
        let mut schemes = self.schemes.write().unwrap_or_else(|e| e.into_inner());
        let mut left = Vec::new();
        for &scheme in adapter.schemes() {
            let store = stores
                .iter()
                .find(|store| store.contains(&scheme))
                .map_or(std::slice::from_ref(&scheme), |store| *store);
            let taken_by = store.iter().find_map(|alias| match schemes.get(*alias) {
                Some(Entry::Adapter(other)) if !Arc::ptr_eq(other, &adapter) => {
                    Some((*alias, other.name()))
                }
                _ => None,
            });
            match taken_by {
                None => {
                    schemes.insert(scheme.to_owned(), Entry::Adapter(adapter.clone()));
                }
                Some((alias, other)) => {
                    if alias != scheme {
                        schemes.insert(scheme.to_owned(), Entry::Split { alias, other });
                    }
                    left.push(scheme);
                }
            }
        }
        Ok(left)
    }

    /// Registers `adapter` for each of its schemes, replacing whatever
    /// adapter had them (say, a built-in one, to wrap it with metrics or a
    /// tenant prefix), and returns the names of the other adapters it
    /// replaced (an adapter of the same name replacing itself is not listed).
    /// Explicit where [`Registry::register`] refuses a taken scheme, so that
    /// taking a built-in scheme works whether the defaults were filled in
    /// before or after. Backends already open keep the adapter that opened
    /// them.
    ///
    /// ```
    /// use dlock_core::{Registry, memory::MemoryAdapter};
    /// let registry = Registry::new();
    /// registry.register(MemoryAdapter)?;
    /// assert!(registry.replace(MemoryAdapter)?.is_empty(), "the same adapter again");
    /// # Ok::<(), dlock_core::Error>(())
    /// ```
    pub fn replace(&self, adapter: impl Adapter) -> Result<Vec<&'static str>, Error> {
        check_schemes(&adapter)?;
        let adapter: Arc<dyn Adapter> = Arc::new(adapter);
        let mut schemes = self.schemes.write().unwrap_or_else(|e| e.into_inner());
        let mut replaced = Vec::new();
        for &scheme in adapter.schemes() {
            let old = schemes.insert(scheme.to_owned(), Entry::Adapter(adapter.clone()));
            if let Some(Entry::Adapter(old)) = old
                && old.name() != adapter.name()
                && !replaced.contains(&old.name())
            {
                replaced.push(old.name());
            }
        }
        Ok(replaced)
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
        self.resolve(url)?.connect(url).await
    }

    /// Opens the [`Floor`] of `url`'s store with the adapter of its scheme
    /// ([`Adapter::floor`]); `None` if that adapter has none. Errors as
    /// [`Registry::connect`].
    ///
    /// # Cancel safety
    /// As the adapter's [`Adapter::floor`].
    pub async fn floor(&self, url: &StoreUrl) -> Result<Option<Arc<dyn Floor>>, Error> {
        self.resolve(url)?.floor(url).await
    }

    /// The adapter for `url`'s scheme, or why there is none.
    fn resolve(&self, url: &StoreUrl) -> Result<Arc<dyn Adapter>, Error> {
        let entry = {
            let schemes = self.schemes.read().unwrap_or_else(|e| e.into_inner());
            schemes.get(url.scheme()).cloned()
        };
        match entry {
            Some(Entry::Adapter(adapter)) => Ok(adapter),
            Some(Entry::Disabled { feature }) => Err(Error::FeatureDisabled {
                scheme: url.scheme().to_owned(),
                feature,
            }),
            Some(Entry::Split { alias, other }) => Err(Error::Config(format!(
                "{}:// names the same store as {alias}://, which the {other} adapter serves: \
                 register {other} for {}:// too (or replace the built-in adapter), so that \
                 one lock is not two",
                url.scheme(),
                url.scheme()
            ))),
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

/// Refuses an adapter whose schemes a URL could not name (a registered
/// scheme is matched against a parsed, lower-cased one).
fn check_schemes(adapter: &dyn Adapter) -> Result<(), Error> {
    match adapter
        .schemes()
        .iter()
        .find(|s| s.is_empty() || **s != s.to_ascii_lowercase())
    {
        Some(scheme) => Err(Error::Config(format!(
            "adapter {}: scheme {scheme:?} must be non-empty lower case",
            adapter.name()
        ))),
        None => Ok(()),
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
    async fn floors_resolve_like_connections() {
        let r = Registry::new();
        r.register(MemoryAdapter).unwrap();
        r.mark_disabled(&["mongodb"], "mongo");
        let url = |u: &str| StoreUrl::parse(u).unwrap();
        assert!(r.floor(&url("memory://")).await.unwrap().is_none());
        let e = r.floor(&url("mongodb://h")).await.unwrap_err();
        assert!(matches!(e, Error::FeatureDisabled { .. }), "{e:?}");
        let e = r.floor(&url("gopher://u:s3cret@h")).await.unwrap_err();
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
    }

    /// A default adapter takes the schemes still free and leaves the taken
    /// one to the adapter that has it; a replacement takes them all.
    #[tokio::test]
    async fn defaults_fill_free_schemes_and_replace_is_explicit() {
        let r = Registry::new();
        r.register(MemoryAdapter).unwrap();
        assert_eq!(r.register_free(Other, &[]).unwrap(), ["memory"]);
        assert_eq!(r.adapter("memory").unwrap().name(), "memory");
        assert_eq!(r.adapter("other").unwrap().name(), "other");
        assert_eq!(r.replace(Other).unwrap(), ["memory"]);
        assert_eq!(r.adapter("memory").unwrap().name(), "other");
        assert!(r.connect("memory://x").await.is_ok());
    }

    /// One store's aliases go to one adapter: with `memory` taken, its
    /// alias `other` gets no adapter and says which adapter has the store
    /// (red before: the default adapter took `other`, so one store had two
    /// adapters).
    #[tokio::test]
    async fn a_store_taken_by_one_alias_is_not_split() {
        let r = Registry::new();
        r.register(MemoryAdapter).unwrap();
        let left = r.register_free(Other, &[&["memory", "other"]]).unwrap();
        assert_eq!(left, ["memory", "other"]);
        assert!(r.adapter("other").is_none());
        assert_eq!(r.schemes(), ["memory"]);
        let e = r.connect("other://x").await.unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e:?}");
        assert!(
            e.to_string().contains("memory://") && e.to_string().contains("memory adapter"),
            "{e}"
        );
        // Registering the alias's store explicitly takes it.
        assert_eq!(r.replace(Other).unwrap(), ["memory"]);
        assert_eq!(r.adapter("other").unwrap().name(), "other");
    }

    #[test]
    fn schemes_are_checked_before_anything_is_registered() {
        #[derive(Debug)]
        struct Upper;
        #[async_trait]
        impl Adapter for Upper {
            fn name(&self) -> &'static str {
                "upper"
            }
            fn schemes(&self) -> &'static [&'static str] {
                &["fine", "Bad"]
            }
            async fn connect(&self, url: &StoreUrl) -> Result<Arc<dyn Backend>, Error> {
                MemoryAdapter.connect(url).await
            }
        }
        let r = Registry::new();
        for result in [
            r.register(Upper),
            r.register_free(Upper, &[]).map(drop),
            r.replace(Upper).map(drop),
        ] {
            assert!(matches!(result, Err(Error::Config(_))), "{result:?}");
        }
        assert!(r.schemes().is_empty(), "{:?}", r.schemes());
    }

    #[tokio::test]
    async fn a_disabled_scheme_can_be_taken_by_a_third_party() {
        let r = Registry::new();
        r.mark_disabled(&["other", "memory"], "x");
        r.register(Other).unwrap();
        assert!(r.connect("other://y").await.is_ok());
    }
}
