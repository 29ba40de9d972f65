//! What an adapter provides to be tested: a [`Harness`] and its [`Profile`].

use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::{Backend, Capabilities, Error, LockName, Session, SessionOptions};

use crate::faults::{Faults, FaultyBackend};
use crate::process::Process;
use crate::servers::SERVICES_VAR;
use crate::servers::Servers;
use crate::wire::{Link, proxy_link};

/// What the cases expect of one deployment under test: the TTL they use,
/// whether handles are reentrant, and what the store declares about itself
/// ([`dlock_core::Capabilities`], read through `Deref`: `profile.fair`).
/// Cases read it to decide what to expect or whether they apply. Data, not
/// code paths (OpenDAL's idea).
///
/// ```
/// use std::time::Duration;
/// use dlock_conformance::Profile;
///
/// let mut profile = Profile::new(Duration::from_secs(1), dlock_core::Capabilities::default());
/// profile.recovery_bound = Duration::from_millis(1500); // test-only slack
/// assert!(profile.reentrant && !profile.fair);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Profile {
    /// The TTL the cases use: the smallest the backend supports well.
    pub ttl: Duration,
    /// Acquiring again through the same handle succeeds at once (the core
    /// provides it, so `true` unless a harness says otherwise).
    pub reentrant: bool,
    /// What the store declares ([`Backend::capabilities`]), possibly with
    /// test-only slack on its bounds.
    pub store: Capabilities,
}

impl Profile {
    /// Cases with `ttl` on a store that declares `store`; reentrant.
    pub fn new(ttl: Duration, store: Capabilities) -> Self {
        Self {
            ttl,
            reentrant: true,
            store,
        }
    }
}

impl Deref for Profile {
    type Target = Capabilities;

    fn deref(&self) -> &Capabilities {
        &self.store
    }
}

impl DerefMut for Profile {
    fn deref_mut(&mut self) -> &mut Capabilities {
        &mut self.store
    }
}

/// What a skipped case says, or why a case failed.
pub type Outcome = Result<Verdict, Failure>;

/// A case that ran to the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every check held.
    Passed,
    /// The case does not apply to this backend; the reason is printed.
    Skipped(String),
}

/// A failed check, with what was expected and seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure(pub String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(format!("unexpected error: {e} ({e:?})"))
    }
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure(s)
    }
}

impl From<crate::checker::Violation> for Failure {
    fn from(v: crate::checker::Violation) -> Self {
        Failure(v.to_string())
    }
}

/// Connects the conformance cases to one backend deployment.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use async_trait::async_trait;
/// use dlock_conformance::{Harness, Profile};
/// use dlock_core::{Backend, Error, memory::MemoryBackend};
///
/// struct Memory(MemoryBackend);
///
/// #[async_trait]
/// impl Harness for Memory {
///     fn store(&self) -> &str { "memory" }
///     fn profile(&self) -> Profile {
///         Profile::new(Duration::from_millis(300), self.0.capabilities())
///     }
///     async fn connect(&self) -> Result<Arc<dyn Backend>, Error> { Ok(Arc::new(self.0.clone())) }
/// }
/// ```
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store's short name, as used by `DLOCK_TEST_SKIP` and
    /// `scripts/services` (`redis`, `etcd`, `memory` ...).
    fn store(&self) -> &str;

    /// What the cases may expect: the TTL and what the store declares.
    fn profile(&self) -> Profile;

    /// A new client of the store under test (a new connection where the
    /// backend has one). Cases call it once per simulated process.
    async fn connect(&self) -> Result<Arc<dyn Backend>, Error>;

    /// How to start this store's server (a command or a sentence), shown
    /// when it is down. The default names the supervisor command in
    /// `DLOCK_SERVICES` if it is set.
    fn start_hint(&self) -> String {
        match std::env::var(SERVICES_VAR) {
            Ok(command) if !command.is_empty() => format!("`{command} up {}`", self.store()),
            _ => format!(
                "start a {} server where the harness expects it (a supervisor command \
                 in {SERVICES_VAR} would be named here)",
                self.store()
            ),
        }
    }

    /// Opens a backend from a URL, as `dlocks::connect` would; `None` if the
    /// harness cannot (the bad-URL checks are then skipped).
    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        let _ = url;
        None
    }

    /// URLs this backend must refuse with [`Error::InvalidUrl`] or
    /// [`Error::Config`].
    fn bad_urls(&self) -> Vec<String> {
        Vec::new()
    }

    /// Store objects (keys, nodes, rows, queue entries, channels) left under
    /// `prefix` that a finished workload must not leave behind; `None` if the
    /// harness cannot count them.
    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        let _ = prefix;
        None
    }

    /// The store's client endpoints (`host:port`), one per node: the suite
    /// puts a fault proxy in front of each for the wire-fault cases. Empty
    /// when the harness cannot route clients through proxies (those cases
    /// then say they were skipped).
    fn endpoints(&self) -> Vec<String> {
        Vec::new()
    }

    /// A new client that reaches node `i` at `via[i]` (a proxy) instead of
    /// `endpoints()[i]`, and **cannot bypass it**: no topology discovery, no
    /// advertised addresses of the servers themselves. A node that cannot be
    /// reached while connecting must not make the connect fail where the
    /// store can work without it.
    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        let _ = via;
        Err(Error::Config(format!(
            "the {} harness cannot connect through proxies",
            self.store()
        )))
    }

    /// A new link for one client (see [`wire`](crate::wire)); `None` if the
    /// harness has none. The default puts one TCP proxy in front of each
    /// endpoint.
    async fn link(&self) -> Option<Result<Arc<dyn Link>, Error>> {
        proxy_link(&self.endpoints()).await
    }

    /// A new client whose every connection crosses `link`. The default
    /// connects through the link's proxies ([`Harness::connect_via`]).
    async fn connect_over(&self, link: &dyn Link) -> Result<Arc<dyn Backend>, Error> {
        connect_over_proxies(self, link).await
    }

    /// Process control of the store's servers; `None` if the harness has
    /// none (the server-fault cases then say they were skipped).
    fn servers(&self) -> Option<Arc<dyn Servers>> {
        None
    }
}

/// [`Harness::connect_over`] for a link made of proxies.
pub(crate) async fn connect_over_proxies<H: Harness + ?Sized>(
    harness: &H,
    link: &dyn Link,
) -> Result<Arc<dyn Backend>, Error> {
    match link.addrs() {
        Some(addrs) => harness.connect_via(&addrs).await,
        None => Err(Error::Config("this link has no proxy addresses".into())),
    }
}

/// Per-case helpers: a fresh name prefix and clients with the case TTL.
pub struct Ctx<'a> {
    /// The harness under test.
    pub harness: &'a dyn Harness,
    /// Its profile: the case TTL and what the store declares
    /// (`ctx.caps.fair`, `ctx.caps.ttl`).
    pub caps: Profile,
    /// The random prefix of every name this case uses.
    pub prefix: String,
}

impl<'a> Ctx<'a> {
    /// A context for `case` with a fresh random prefix.
    pub fn new(harness: &'a dyn Harness, case: &str) -> Self {
        let caps = harness.profile();
        let prefix = format!("dlock-test/{case}-{:08x}", rand::random::<u32>());
        Self {
            harness,
            caps,
            prefix,
        }
    }

    /// A name under this case's prefix.
    pub fn name(&self, suffix: &str) -> LockName {
        LockName::new(format!("{}/{suffix}", self.prefix)).expect("valid test name")
    }

    /// Session options with the case TTL.
    pub fn options(&self) -> SessionOptions {
        SessionOptions::new().ttl(self.caps.ttl)
    }

    /// A new client: a new connection and a session on it.
    pub async fn client(&self) -> Result<Session, Failure> {
        self.client_with(self.options()).await
    }

    /// A new client whose session runs with `options` (e.g. the case's
    /// [`options`](Self::options) with a longer TTL).
    pub async fn client_with(&self, options: SessionOptions) -> Result<Session, Failure> {
        let backend = self.harness.connect().await?;
        Ok(backend.session(options).await?)
    }

    /// A new client behind fault switches.
    pub async fn faulty_client(&self) -> Result<(Session, Arc<Faults>), Failure> {
        let (backend, faults) = FaultyBackend::wrap(self.harness.connect().await?);
        Ok((backend.session(self.options()).await?, faults))
    }

    /// A backend handle for admin calls (inspect, validate, force_release).
    pub async fn admin(&self) -> Result<Arc<dyn Backend>, Failure> {
        Ok(self.harness.connect().await?)
    }

    /// A new link, or `None` if the harness has none.
    pub async fn link(&self) -> Result<Option<Arc<dyn Link>>, Failure> {
        Ok(self.harness.link().await.transpose()?)
    }

    /// A new client (connection and session) whose traffic crosses `link`.
    pub async fn client_over(&self, link: &dyn Link) -> Result<Session, Failure> {
        let backend = self.harness.connect_over(link).await?;
        Ok(backend.session(self.options()).await?)
    }

    /// A new client behind a link of its own, or `None` if the harness has
    /// no links.
    pub async fn linked_client(&self) -> Result<Option<(Session, Arc<dyn Link>)>, Failure> {
        let Some(link) = self.link().await? else {
            return Ok(None);
        };
        Ok(Some((self.client_over(&*link).await?, link)))
    }

    /// A new client inside a [`Process`] of its own, which the case can pause
    /// as a whole; its connections cross `link` if one is given.
    pub fn client_in(
        &self,
        process: &Process,
        link: Option<&dyn Link>,
    ) -> Result<Session, Failure> {
        process.enter(async {
            let backend = match link {
                Some(link) => self.harness.connect_over(link).await?,
                None => self.harness.connect().await?,
            };
            Ok(backend.session(self.options()).await?)
        })
    }
}
