//! [`AdapterHarness`]: a whole [`Harness`] built from an [`Adapter`] and a
//! URL, so that an adapter's conformance entry is a few lines.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::url::StoreUrl;
use dlock_core::{Adapter, Backend, Capabilities, Error, Registry};
use futures::future::BoxFuture;

use crate::harness::connect_over_proxies;
use crate::servers::{SERVICES_VAR, Servers, ServicesCommand};
use crate::wire::{Link, proxy_link};
use crate::{Harness, Profile};

type Connector =
    Arc<dyn Fn(StoreUrl) -> BoxFuture<'static, Result<Arc<dyn Backend>, Error>> + Send + Sync>;
type Ready = Arc<dyn Fn(Arc<dyn Backend>) -> BoxFuture<'static, Result<(), Error>> + Send + Sync>;
type Leftovers =
    Arc<dyn Fn(StoreUrl, String) -> BoxFuture<'static, Result<usize, Error>> + Send + Sync>;
type Tweak = Arc<dyn Fn(&mut Profile) + Send + Sync>;

type LinkConnector =
    Arc<dyn Fn(&dyn Link) -> BoxFuture<'static, Result<Arc<dyn Backend>, Error>> + Send + Sync>;

/// Links of the harness's own kind (see [`AdapterHarness::links`]).
struct Links {
    make: Arc<dyn Fn() -> Arc<dyn Link> + Send + Sync>,
    connect: LinkConnector,
}

/// A [`Harness`] for any [`Adapter`]: the store under test is a URL (from an
/// environment variable, with a default), every client is the adapter's
/// [`connect`](Adapter::connect) of it, and the [`Profile`] is the TTL given
/// plus the [`Capabilities`] the connected backend declares
/// ([`Backend::capabilities`]).
///
/// What it gives the suite, and the builder calls that change it:
///
/// | harness part | default | change it with |
/// |---|---|---|
/// | a client ([`Harness::connect`]) | the adapter on the URL, then `ping()` and [`Backend::wait_ready`] | [`connect_with`](Self::connect_with), [`ready`](Self::ready) |
/// | the profile | TTL 1 s + what the backend declares at the first connect (every later client must declare the same) | [`ttl`](Self::ttl), [`tweak`](Self::tweak) |
/// | wire faults | one TCP proxy per host of the URL; clients use `url.with_hosts(proxies)` | [`proxied_option`](Self::proxied_option), [`proxy_map_option`](Self::proxy_map_option), [`no_proxies`](Self::no_proxies), [`links`](Self::links) |
/// | server faults | none (those cases say `SKIPPED`) | [`services`](Self::services) (+ [`group`](Self::group)), [`servers`](Self::servers) |
/// | bad-URL checks | the adapter, through a [`Registry`] of its own | [`bad_urls`](Self::bad_urls) |
/// | leak checks | none | [`leftovers`](Self::leftovers) |
/// | hint when the server is down | the URL, its variable and the supervisor command | [`start_hint`](Self::start_hint) |
///
/// A URL without hosts (`sqlite:///tmp/x.db`), or one whose hosts are DNS
/// SRV names (a scheme ending in `+srv`), gets no proxies: the wire-fault
/// cases then say `SKIPPED`.
///
/// ```no_run
/// use std::time::Duration;
/// use dlock_conformance::{AdapterHarness, conformance_tests};
/// use dlock_core::memory::MemoryAdapter;
///
/// fn scratch(instance: &str) -> AdapterHarness {
///     AdapterHarness::new("scratch", MemoryAdapter)
///         .default_url(format!("memory://{instance}")) // or $DLOCK_TEST_SCRATCH_URL
///         .ttl(Duration::from_millis(300))
///         .bad_urls(["memory://a b", "memory://x?fair=1"])
/// }
///
/// conformance_tests!(mod scratch, scratch("one"));
/// ```
pub struct AdapterHarness {
    store: String,
    adapter: Arc<dyn Adapter>,
    url: Result<StoreUrl, String>,
    url_var: Option<String>,
    proxied_options: Vec<(String, String)>,
    /// The option that tells a proxied client which proxy stands for
    /// which server (see [`proxy_map_option`](Self::proxy_map_option)).
    proxy_map_option: Option<String>,
    ttl: Duration,
    tweak: Option<Tweak>,
    connector: Option<Connector>,
    ready: Option<Ready>,
    proxies: bool,
    links: Option<Links>,
    service_names: Vec<String>,
    services: Option<ServicesCommand>,
    servers: Option<Arc<dyn Servers>>,
    bad_urls: Vec<String>,
    leftovers: Option<Leftovers>,
    start_hint: Option<String>,
    declared: OnceLock<Capabilities>,
    registry: OnceLock<Result<Registry, String>>,
}

impl fmt::Debug for AdapterHarness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdapterHarness")
            .field("store", &self.store)
            .field("adapter", &self.adapter.name())
            .field("url", &self.url)
            .field("ttl", &self.ttl)
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

impl AdapterHarness {
    /// The harness of `store` (its short name, as `DLOCK_TEST_SKIP` and the
    /// `SKIPPED` lines name it) on `adapter`. Give it a URL next.
    pub fn new(store: impl Into<String>, adapter: impl Adapter) -> Self {
        Self {
            store: store.into(),
            adapter: Arc::new(adapter),
            url: Err("no URL: call .url(...) or .url_from_env(...)".into()),
            url_var: None,
            proxied_options: Vec::new(),
            proxy_map_option: None,
            ttl: Duration::from_secs(1),
            tweak: None,
            connector: None,
            ready: None,
            proxies: true,
            links: None,
            service_names: Vec::new(),
            services: None,
            servers: None,
            bad_urls: Vec::new(),
            leftovers: None,
            start_hint: None,
            declared: OnceLock::new(),
            registry: OnceLock::new(),
        }
    }

    /// The store's URL. One that does not parse fails every case with the
    /// reason (the password never shown).
    pub fn url(mut self, url: impl AsRef<str>) -> Self {
        self.url = StoreUrl::parse(url.as_ref()).map_err(|e| e.to_string());
        self
    }

    /// The URL in the environment variable `var`, else `default`.
    pub fn url_from_env(mut self, var: &str, default: impl AsRef<str>) -> Self {
        self.url_var = Some(var.to_owned());
        match std::env::var(var) {
            Ok(url) => self.url(url),
            Err(_) => self.url(default),
        }
    }

    /// The URL in `DLOCK_TEST_<STORE>_URL` (the store name upper-cased, every
    /// other character than a letter or digit as `_`: `etcd-cluster` reads
    /// `DLOCK_TEST_ETCD_CLUSTER_URL`), else `default`.
    pub fn default_url(self, default: impl AsRef<str>) -> Self {
        let store: String = self
            .store
            .chars()
            .map(|c| match c.is_ascii_alphanumeric() {
                true => c.to_ascii_uppercase(),
                false => '_',
            })
            .collect();
        self.url_from_env(&format!("DLOCK_TEST_{store}_URL"), default)
    }

    /// Sets the query option `key=value` on the URL (replacing a `key`
    /// already there), as test settings: `.url_option("max_ttl", "2s")`.
    /// Both are written as given (percent-encode them yourself).
    pub fn url_option(mut self, key: &str, value: &str) -> Self {
        self.url = self
            .url
            .and_then(|u| u.with_option(key, value).map_err(|e| e.to_string()));
        self
    }

    /// Replaces the URL's path (`"/dlock-test"`: a root, a database, a
    /// key prefix, as the store reads it).
    pub fn url_path(mut self, path: &str) -> Self {
        self.url = self
            .url
            .and_then(|u| with_path(&u, path).map_err(|e| e.to_string()));
        self
    }

    /// Sets `key=value` on the URLs of clients that reach the store through
    /// the wire-fault proxies only (`directConnection=true`, so that a
    /// driver does not discover the servers behind the proxies).
    pub fn proxied_option(mut self, key: &str, value: &str) -> Self {
        self.proxied_options
            .push((key.to_owned(), value.to_owned()));
        self
    }

    /// Sets `key=H1:P1>X1:Q1,H2:P2>X2:Q2,...` on the URLs of clients that
    /// reach the store through the wire-fault proxies: each host of the URL
    /// and the proxy in front of it. For a driver that discovers the
    /// servers and connects to the addresses they announce (Redis Cluster's
    /// `address_map`), so that every connection crosses its proxy.
    pub fn proxy_map_option(mut self, key: &str) -> Self {
        self.proxy_map_option = Some(key.to_owned());
        self
    }

    /// The TTL the cases use (default 1 s): the smallest the store supports
    /// well.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Adjusts the profile after the store's declared capabilities are read:
    /// test-only slack on a bound, or a capability this test deployment
    /// lacks. `.tweak(|p| p.recovery_bound += Duration::from_millis(500))`.
    pub fn tweak(mut self, tweak: impl Fn(&mut Profile) + Send + Sync + 'static) -> Self {
        self.tweak = Some(Arc::new(tweak));
        self
    }

    /// Opens every client (plain or through proxies) with `connect` instead
    /// of the adapter: for a backend built with more than its URL, or that
    /// must wait on one of its own (inherent) methods before it serves.
    /// The bad-URL checks still go to the adapter.
    ///
    /// ```no_run
    /// # use dlock_conformance::AdapterHarness;
    /// # use dlock_core::memory::{MemoryAdapter, MemoryBackend};
    /// let server = MemoryBackend::new().session_leases();
    /// AdapterHarness::new("memory-leases", MemoryAdapter).connect_with(move |_url| {
    ///     let backend = server.linked().0;
    ///     async move { Ok(backend) }
    /// });
    /// ```
    pub fn connect_with<F, Fut, B>(mut self, connect: F) -> Self
    where
        F: Fn(StoreUrl) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<B, Error>> + Send + 'static,
        B: Backend + 'static,
    {
        self.connector = Some(Arc::new(move |url| {
            let fut = connect(url);
            Box::pin(async move { Ok(Arc::new(fut.await?) as Arc<dyn Backend>) })
        }));
        self
    }

    /// Extra readiness, run on every new client after it connected (and,
    /// for plain clients, answered `ping()`):
    /// `.ready(|backend| async move { backend.ping().await })`.
    pub fn ready<F, Fut>(mut self, ready: F) -> Self
    where
        F: Fn(Arc<dyn Backend>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        self.ready = Some(Arc::new(move |b| Box::pin(ready(b))));
        self
    }

    /// No wire-fault proxies (the wire-fault cases say `SKIPPED`): for a
    /// store whose clients cannot be routed through a TCP proxy.
    pub fn no_proxies(mut self) -> Self {
        self.proxies = false;
        self
    }

    /// Links of the harness's own kind instead of TCP proxies: `make` gives
    /// a new one, `connect` a client whose traffic crosses it (the memory
    /// backend's in-process [`MemoryLink`](crate::wire::MemoryLink)).
    pub fn links<L, M, C, Fut, B>(mut self, make: M, connect: C) -> Self
    where
        L: Link + Clone + 'static,
        M: Fn() -> L + Send + Sync + 'static,
        C: Fn(L) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<B, Error>> + Send + 'static,
        B: Backend + 'static,
    {
        self.links = Some(Links {
            make: Arc::new(move || Arc::new(make()) as Arc<dyn Link>),
            connect: Arc::new(move |link| {
                let fut = link.as_any().downcast_ref::<L>().cloned().map(&connect);
                Box::pin(async move {
                    match fut {
                        Some(fut) => Ok(Arc::new(fut.await?) as Arc<dyn Backend>),
                        None => Err(Error::Config("a link of another harness".into())),
                    }
                })
            }),
        });
        self
    }

    /// Process control through the supervisor command in `DLOCK_SERVICES`
    /// ([`ServicesCommand::from_env`]), for nodes `names` in the URL's host
    /// order. When the variable is unset, the server-fault cases say
    /// `SKIPPED`.
    pub fn services(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.service_names = names.into_iter().map(Into::into).collect();
        self.services = ServicesCommand::from_env(self.service_names.clone());
        self
    }

    /// The cluster group of the [`services`](Self::services) nodes, for
    /// finding the leader (`etcd-cluster`).
    pub fn group(mut self, group: &str) -> Self {
        self.services = self.services.map(|s| s.group(group));
        self
    }

    /// Process control of the store's servers by any [`Servers`] (`None`:
    /// none, the server-fault cases say `SKIPPED`).
    pub fn servers(mut self, servers: Option<impl Servers + 'static>) -> Self {
        self.servers = servers.map(|s| Arc::new(s) as Arc<dyn Servers>);
        self
    }

    /// URLs the adapter must refuse with [`Error::InvalidUrl`] or
    /// [`Error::Config`].
    pub fn bad_urls(mut self, urls: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.bad_urls = urls.into_iter().map(Into::into).collect();
        self
    }

    /// Counts the store objects (keys, nodes, rows, queue entries) left under
    /// a prefix, from the URL and the prefix: the leak checks use it.
    pub fn leftovers<F, Fut>(mut self, count: F) -> Self
    where
        F: Fn(StoreUrl, String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<usize, Error>> + Send + 'static,
    {
        self.leftovers = Some(Arc::new(move |url, prefix| Box::pin(count(url, prefix))));
        self
    }

    /// What to tell a reader whose server is down, instead of the default
    /// (the URL, its variable and the supervisor's start command).
    pub fn start_hint(mut self, hint: impl Into<String>) -> Self {
        self.start_hint = Some(hint.into());
        self
    }

    fn store_url(&self) -> Result<StoreUrl, Error> {
        self.url.clone().map_err(|why| {
            Error::Config(format!("the {} test URL is not usable: {why}", self.store))
        })
    }

    async fn open(&self, url: StoreUrl) -> Result<Arc<dyn Backend>, Error> {
        match &self.connector {
            Some(connect) => connect(url).await,
            None => self.adapter.connect(&url).await,
        }
    }

    async fn readied(&self, backend: Arc<dyn Backend>) -> Result<Arc<dyn Backend>, Error> {
        // A store that may not grant yet (a Redis restart guard) is waited
        // out, as a user who wants to test at once would.
        backend.wait_ready(Duration::from_secs(10)).await?;
        if let Some(ready) = &self.ready {
            ready(backend.clone()).await?;
        }
        Ok(backend)
    }

    fn registry(&self) -> Result<&Registry, Error> {
        self.registry
            .get_or_init(|| {
                let registry = Registry::new();
                registry
                    .register_arc(self.adapter.clone())
                    .map_err(|e| e.to_string())?;
                Ok(registry)
            })
            .as_ref()
            .map_err(|why| Error::Config(why.clone()))
    }
}

#[async_trait]
impl Harness for AdapterHarness {
    fn store(&self) -> &str {
        &self.store
    }

    /// The TTL given, the capabilities the backend declared at the first
    /// [`connect`](Harness::connect), then the [`tweak`](Self::tweak).
    ///
    /// # Panics
    /// Before the first successful `connect` ([`run`](crate::run) connects
    /// before every case).
    fn profile(&self) -> Profile {
        let declared = self.declared.get().cloned().unwrap_or_else(|| {
            panic!(
                "AdapterHarness {}: profile() before the first connect(); run the cases \
                 through dlock_conformance::run or conformance_tests!",
                self.store
            )
        });
        let mut profile = Profile::new(self.ttl, declared);
        if let Some(tweak) = &self.tweak {
            tweak(&mut profile);
        }
        profile
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = self.open(self.store_url()?).await?;
        backend.ping().await?;
        let backend = self.readied(backend).await?;
        let declared = backend.capabilities();
        let first = self.declared.get_or_init(|| declared.clone());
        if *first != declared {
            return Err(Error::Config(format!(
                "the {} backend declares {declared:?} now but {first:?} at the first connect: \
                 the cases would expect what it no longer promises",
                self.store
            )));
        }
        Ok(backend)
    }

    fn start_hint(&self) -> String {
        if let Some(hint) = &self.start_hint {
            return hint.clone();
        }
        let mut hint = format!("start the {} server", self.store);
        if let Ok(url) = &self.url {
            hint.push_str(&format!(" at {url}"));
        }
        if let Some(var) = &self.url_var {
            hint.push_str(&format!(" (or point {var} at one)"));
        }
        if let Some(services) = &self.services {
            hint = format!("`{}`, or {hint}", services.start_command());
        } else if !self.service_names.is_empty() {
            hint.push_str(&format!(
                "; with a supervisor command in {SERVICES_VAR}: `${SERVICES_VAR} up {}`",
                self.service_names.join(" ")
            ));
        }
        hint
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(match self.registry() {
            Ok(registry) => registry.connect(url).await,
            Err(e) => Err(e),
        })
    }

    fn bad_urls(&self) -> Vec<String> {
        self.bad_urls.clone()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        let count = self.leftovers.as_ref()?;
        Some(match self.store_url() {
            Ok(url) => count(url, prefix.to_owned()).await,
            Err(e) => Err(e),
        })
    }

    fn endpoints(&self) -> Vec<String> {
        match &self.url {
            Ok(url) if self.proxies && !url.scheme().ends_with("+srv") => {
                url.hosts().iter().map(ToString::to_string).collect()
            }
            _ => Vec::new(),
        }
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        let mut url = self.store_url()?.with_hosts(via)?;
        for (key, value) in &self.proxied_options {
            url = url.with_option(key, value)?;
        }
        if let Some(key) = &self.proxy_map_option {
            url = url.with_option(key, &crate::wire::proxy_map(&self.endpoints(), via))?;
        }
        let backend = self.open(url).await?;
        self.readied(backend).await
    }

    async fn link(&self) -> Option<Result<Arc<dyn Link>, Error>> {
        match &self.links {
            Some(links) => Some(Ok((links.make)())),
            None => proxy_link(&self.endpoints()).await,
        }
    }

    async fn connect_over(&self, link: &dyn Link) -> Result<Arc<dyn Backend>, Error> {
        match &self.links {
            Some(links) => {
                let backend = (links.connect)(link).await?;
                self.readied(backend).await
            }
            None => connect_over_proxies(self, link).await,
        }
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        self.servers.clone().or_else(|| {
            self.services
                .clone()
                .map(|s| Arc::new(s) as Arc<dyn Servers>)
        })
    }
}

/// `url` with its path replaced by `path` (empty, or starting with `/`).
fn with_path(url: &StoreUrl, path: &str) -> Result<StoreUrl, Error> {
    if !url.has_authority() || !(path.is_empty() || path.starts_with('/')) {
        return Err(url.invalid(format!(
            "cannot set the path {path:?} (an opaque URL, or a path without its leading /)"
        )));
    }
    let text = url.expose();
    let end = text.find(['?', '#']).unwrap_or(text.len());
    let head = text[..end]
        .strip_suffix(url.path())
        .ok_or_else(|| url.invalid("the path is not where it was parsed"))?;
    StoreUrl::parse(&format!("{head}{path}{}", &text[end..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> StoreUrl {
        StoreUrl::parse(text).unwrap()
    }

    #[test]
    fn options_are_set_once() {
        let set = |u: &str, k, v| url(u).with_option(k, v).unwrap().expose().to_owned();
        assert_eq!(
            set("mongodb://h:1/?replicaSet=rs0", "a", "1"),
            "mongodb://h:1/?replicaSet=rs0&a=1"
        );
        assert_eq!(set("mongodb://h:1/", "a", "1"), "mongodb://h:1/?a=1");
        assert_eq!(set("mongodb://h:1/?", "a", "1"), "mongodb://h:1/?a=1");
        assert_eq!(
            set("mongodb://h:1/admin", "a", "1"),
            "mongodb://h:1/admin?a=1"
        );
        assert_eq!(
            set("mongodb://h:1/?a=2&b=3", "a", "1"),
            "mongodb://h:1/?b=3&a=1"
        );
        assert_eq!(
            set("postgres://u:s%40cret@h:1/db?x=1", "dlock_table", "t"),
            "postgres://u:s%40cret@h:1/db?x=1&dlock_table=t"
        );
    }

    #[test]
    fn paths_are_replaced() {
        let set = |u: &str, p| with_path(&url(u), p).map(|u| u.expose().to_owned());
        assert_eq!(
            set("zk://h:1/old?x=1#f", "/new").unwrap(),
            "zk://h:1/new?x=1#f"
        );
        assert_eq!(set("zk://h:1", "/new").unwrap(), "zk://h:1/new");
        assert!(set("sqlite::memory:", "/x").is_err());
        assert!(set("zk://h:1", "x").is_err());
    }

    #[test]
    fn endpoints_come_from_the_url() {
        let h = |u: &str| AdapterHarness::new("t", dlock_core::memory::MemoryAdapter).url(u);
        let named = AdapterHarness::new("etcd-cluster", dlock_core::memory::MemoryAdapter);
        let hint = Harness::start_hint(&named.default_url("etcd://h:1"));
        assert!(hint.contains("DLOCK_TEST_ETCD_CLUSTER_URL"), "{hint}");
        assert_eq!(h("etcd://u:p@a:1,b:2/pre?x=1").endpoints(), ["a:1", "b:2"]);
        assert!(h("sqlite:///tmp/x.db").endpoints().is_empty());
        assert!(h("mongodb+srv://c.example.net/").endpoints().is_empty());
        assert!(h("redis://h:1").no_proxies().endpoints().is_empty());
        let bad = h("redis://a b").url_option("x", "1");
        assert!(bad.endpoints().is_empty());
        let hint = Harness::start_hint(&bad);
        assert!(hint.starts_with("start the t server"), "{hint}");
    }
}
