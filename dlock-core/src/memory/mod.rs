//! `memory://` — an in-process backend that implements the store primitives
//! for real: its own server clock, per-hold expiry (or session leases),
//! sessions, a FIFO queue per lock and per-waiter notifications.
//!
//! It is the reference the conformance suite pins the semantics with (it
//! passes every case), and a handy backend for tests of code that uses dlock.
//! Locks are shared between all backends that name the same instance
//! (`memory://jobs` twice is one lock service); `memory://` is the instance
//! `default`. Nothing survives the process.
//!
//! For fault tests it has what a network and a server host can do to a real
//! store: each client reaches the server over its own [`Link`] (delays,
//! partitions, resets, lost replies: [`MemoryBackend::linked`]), the server's
//! [`ServerClock`] can be stepped, skewed and frozen, the server can be
//! paused ([`MemoryBackend::pause`]) and restarted with or without its data.
//!
//! ```
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions, memory::MemoryBackend};
//! let a = MemoryBackend::connect("memory://demo")?.session(SessionOptions::new()).await?;
//! let b = MemoryBackend::connect("memory://demo")?.session(SessionOptions::new()).await?;
//! let held = a.lock("x")?.acquire().await?;
//! assert!(b.lock("x")?.try_acquire().await?.is_none());
//! held.release().await?;
//! assert!(b.lock("x")?.try_acquire().await?.is_some());
//! # Ok(()) }
//! ```

mod clock;
mod link;
mod server;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

use crate::backend::Doubtful;
use crate::backend::primitives::{Claim, ExpiryModel, Hold, RawSession, Take};
use crate::url::StoreUrl;
use crate::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
pub use clock::ServerClock;
pub use link::{Fault, FaultSwitch, Flow, Link, LinkState};
use server::{BACKEND, Leases, Run, Server, TakeArgs};

/// The smallest TTL of the memory backend.
pub const MIN_TTL: Duration = Duration::from_millis(20);

/// The `memory://` [`Adapter`](crate::Adapter): registered in [`registry()`](crate::registry)
/// from the start.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryAdapter;

crate::impl_adapter!(MemoryAdapter, name: BACKEND, schemes: &["memory"], connect: MemoryBackend::connect_url);

/// An in-memory lock service (see the [module docs](self)).
#[derive(Clone)]
pub struct MemoryBackend {
    server: Arc<Server>,
    instance: Option<String>,
    fair: bool,
    leases: Leases,
    link: Link,
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Server>>> {
    static SERVERS: OnceLock<Mutex<HashMap<String, Arc<Server>>>> = OnceLock::new();
    SERVERS.get_or_init(Default::default)
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// A private lock service, shared only with clones of this value.
    pub fn new() -> Self {
        Self::on(Arc::new(Server::new()), None)
    }

    fn on(server: Arc<Server>, instance: Option<String>) -> Self {
        Self {
            server,
            instance,
            fair: true,
            leases: Leases::PerHold,
            link: Link::new(),
        }
    }

    /// Opens `memory://` (instance `default`) or `memory://NAME`, where NAME is
    /// 1–64 of `[A-Za-z0-9-_.]`.
    pub fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url = url.try_into()?;
        if url.scheme() != "memory" {
            return Err(url.invalid("expected memory:// or memory://NAME"));
        }
        url.options().finish()?;
        let instance = match url.hosts() {
            [] if url.has_authority() && url.path().is_empty() => "default",
            [one] if one.port.is_none() && url.path().is_empty() => one.host.as_str(),
            _ => "",
        };
        let valid = !instance.is_empty()
            && instance.len() <= 64
            && instance
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && url.username().is_empty()
            && url.password().is_none()
            && url.fragment().is_none();
        if !valid {
            return Err(url.invalid(
                "the instance name must be 1-64 of [A-Za-z0-9-_.] (no path, port, user or query)",
            ));
        }
        let server = registry()
            .lock()
            .unwrap()
            .entry(instance.to_owned())
            .or_insert_with(|| Arc::new(Server::new()))
            .clone();
        Ok(Self::on(server, Some(instance.to_owned())))
    }

    /// [`MemoryBackend::connect`], async as adapters are.
    async fn connect_url(url: &StoreUrl) -> Result<Self, Error> {
        Self::connect(url)
    }

    /// Grants to whoever asks first after a release instead of in arrival
    /// order (fair is the default). Waiters are still woken one at a time.
    pub fn unfair(mut self) -> Self {
        self.fair = false;
        self
    }

    /// Holds and queue entries live as long as their session's lease, which
    /// only renewals extend ([`ExpiryModel::Session`], as etcd and ZooKeeper
    /// work), instead of each having its own expiry.
    pub fn session_leases(mut self) -> Self {
        self.leases = Leases::Session;
        self
    }

    /// Another client of the same server with a link of its own: what the
    /// [`Link`] does affects only this client's requests, replies and
    /// notifications.
    pub fn linked(&self) -> (MemoryBackend, Link) {
        let link = Link::new();
        (self.with_link(link.clone()), link)
    }

    /// Another client of the same server that reaches it over `link`.
    pub fn with_link(&self, link: Link) -> MemoryBackend {
        Self {
            link,
            ..self.clone()
        }
    }

    /// The server's clock, which a test can step, skew or freeze.
    pub fn clock(&self) -> &ServerClock {
        &self.server.clock
    }

    /// Pauses the server (a SIGSTOP): requests wait until [`resume`](Self::resume);
    /// its clock runs on, so leases expire meanwhile.
    pub fn pause(&self) {
        self.server.set_run(Run::Paused);
    }

    /// Resumes a paused server.
    pub fn resume(&self) {
        self.server.set_run(Run::Running);
    }

    /// Kills the server: every session, lock and queue is gone, and requests
    /// fail as refused connections until [`start`](Self::start). The token
    /// counter is its only durable state (see [`wipe`](Self::wipe)).
    pub fn stop(&self) {
        self.server.set_run(Run::Down);
        self.server.restart(true);
    }

    /// Starts a stopped server.
    pub fn start(&self) {
        self.server.set_run(Run::Running);
    }

    /// Forgets the token counter too, as a server restarted without its data
    /// would (tokens start again at 1).
    pub fn wipe(&self) {
        self.server.restart(false);
    }

    /// Lock and queue entries under `prefix` that the service still keeps,
    /// after expiring what is due; zero when nothing leaked.
    pub fn objects(&self, prefix: &str) -> usize {
        self.server.objects(prefix)
    }

    /// Simulates a restart from durable storage: every session, lock and queue
    /// is gone, but tokens keep increasing.
    pub fn restart(&self) {
        self.server.restart(true);
    }

    /// One request over this client's link to a running server.
    async fn request<T: Send + 'static>(
        &self,
        apply: impl FnOnce(&Server) -> T + Send + 'static,
    ) -> Result<T, Error> {
        request(&self.link, &self.server, apply).await
    }
}

/// Sends `apply` across `link` to `server`, waiting out a server pause.
async fn request<T: Send + 'static>(
    link: &Link,
    server: &Arc<Server>,
    apply: impl FnOnce(&Server) -> T + Send + 'static,
) -> Result<T, Error> {
    let (gate, server) = (server.clone(), server.clone());
    link.call(async move { gate.admit().await }, move || apply(&server))
        .await
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("instance", &self.instance)
            .field("fair", &self.fair)
            .field("leases", &self.leases)
            .finish()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn scheme(&self) -> &'static str {
        BACKEND
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            fair: self.fair,
            // The token counter is what a killed server keeps ("on disk").
            durable_tokens: true,
            notify_wakeup: true,
            no_herd: true,
            survives_reconnect: true,
            // A killed server forgets its holds.
            restart_loses_locks: true,
            sharded: false,
            // A doubtful attempt's end leaves a tombstone (`Server::release`).
            refuses_late_takes: true,
            wakeup_bound: Duration::from_millis(50),
            recovery_bound: Duration::from_millis(300),
        }
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        let ttl = options.ttl_value();
        let id = self
            .request(move |s| s.open_session(id.as_str(), ttl))
            .await?;
        Ok(Arc::new(MemorySession {
            server: self.server.clone(),
            link: self.link.clone(),
            id,
            ttl,
            fair: self.fair,
            leases: self.leases,
            doubtful: Doubtful::default(),
        }))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let name = name.clone();
        self.request(move |s| s.inspect(&name)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let prefix = prefix.to_owned();
        self.request(move |s| s.list(&prefix)).await
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        let name = name.clone();
        self.request(move |s| s.validate(&name, token)).await
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let name = name.clone();
        self.request(move |s| s.force_release(&name)).await
    }
}

#[derive(Debug)]
struct MemorySession {
    server: Arc<Server>,
    link: Link,
    id: Arc<str>,
    ttl: Duration,
    fair: bool,
    leases: Leases,
    /// This session's claims (by ticket) with a take that was sent and not
    /// answered: ending the claim or its hold must also refuse that take in
    /// the server (a tombstone).
    doubtful: Doubtful,
}

/// Hold keys are `session#ticket`; the ticket identifies the attempt.
fn ticket_of(hold: &Hold) -> Option<u64> {
    hold.key.rsplit_once('#')?.1.parse().ok()
}

#[async_trait]
impl RawSession for MemorySession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        match self.leases {
            Leases::PerHold => ExpiryModel::PerHold,
            Leases::Session => ExpiryModel::Session,
        }
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(MemoryClaim {
            server: self.server.clone(),
            link: self.link.clone(),
            session: self.id.clone(),
            name: name.clone(),
            ticket: self.server.new_ticket(),
            why: why.map(str::to_owned),
            notify: Arc::new(Notify::new()),
            fair: self.fair,
            leases: self.leases,
            doubtful: self.doubtful.clone(),
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        let keyed: Vec<_> = holds
            .iter()
            .map(|h| (h.clone(), ticket_of(h).unwrap_or(0)))
            .collect();
        let id = self.id.clone();
        request(&self.link, &self.server, move |s| s.renew(&id, &keyed)).await?
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let ticket = ticket_of(hold).ok_or_else(|| Error::NotHeld {
            name: hold.name.to_string(),
        })?;
        let (id, hold) = (self.id.clone(), hold.clone());
        let (link, server) = (&self.link, &self.server);
        self.doubtful
            .end_with(&ticket.to_string(), |doubtful| {
                request(link, server, move |s| {
                    s.release(&id, &hold, ticket, doubtful)
                })
            })
            .await?
    }

    async fn close(&self, _holds: &[Hold]) -> Result<(), Error> {
        let id = self.id.clone();
        request(&self.link, &self.server, move |s| s.close_session(&id)).await
    }
}

#[derive(Debug)]
struct MemoryClaim {
    server: Arc<Server>,
    link: Link,
    session: Arc<str>,
    name: LockName,
    ticket: u64,
    why: Option<String>,
    notify: Arc<Notify>,
    fair: bool,
    leases: Leases,
    /// The session's doubtful tickets (see [`MemorySession::doubtful`]).
    doubtful: Doubtful,
}

#[async_trait]
impl Claim for MemoryClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        let (name, session, why, notify) = (
            self.name.clone(),
            self.session.clone(),
            self.why.clone(),
            self.notify.clone(),
        );
        let (ticket, fair, leases) = (self.ticket, self.fair, self.leases);
        // Doubtful until answered: if this future is dropped or the reply
        // is lost, the take may still arrive.
        let sending = self.doubtful.sending(&ticket.to_string());
        let answer = request(&self.link, &self.server, move |s| {
            s.try_take(TakeArgs {
                name: &name,
                session: &session,
                ticket,
                why: why.as_deref(),
                notify: &notify,
                fair,
                leases,
            })
        })
        .await;
        if answer.is_ok() {
            sending.answered();
        }
        answer?
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        // A notification sent before we got here is kept as a permit, so a
        // release between `try_take` and `wait` is not missed. It reaches us
        // over the link: late, or not at all.
        let deadline = sleep_until(until);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = self.notify.notified() => {
                    if self.link.notification().await? {
                        return Ok(());
                    }
                }
                _ = &mut deadline => return Ok(()),
            }
        }
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        let (name, session, ticket) = (self.name.clone(), self.session.clone(), self.ticket);
        let (link, server) = (&self.link, &self.server);
        self.doubtful
            .end_with(&ticket.to_string(), |doubtful| {
                request(link, server, move |s| {
                    s.abandon(&name, &session, ticket, doubtful)
                })
            })
            .await
    }
}

/// A session with a 2 s TTL on `backend`, for the core's unit tests.
#[cfg(test)]
pub(crate) async fn test_session(backend: &MemoryBackend) -> crate::Session {
    backend
        .session(SessionOptions::new().ttl(std::time::Duration::from_secs(2)))
        .await
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A take sent before its claim's abandon but overtaken by it (held on
    /// the way to the server, its future dropped) grants nothing when it
    /// arrives: on a session lease that hold would outlive its claim until
    /// the session ends (S5). Found by the read-write lock's claims on
    /// every permit. The same for a late first try of a take whose retry
    /// was granted and released.
    #[tokio::test]
    async fn a_take_after_its_abandon_or_release_grants_nothing() {
        for server in [MemoryBackend::new(), MemoryBackend::new().session_leases()] {
            let (backend, link) = server.linked();
            let raw = backend
                .open(SessionId::generate(None), &SessionOptions::new())
                .await
                .unwrap();
            let name = LockName::new("late/take").unwrap();
            let held_to_server = Fault::Flows {
                to_server: link::Flow::Hold,
                to_client: link::Flow::Pass,
            };
            // Abandoned while its take is held on the way.
            let mut claim = raw.claim(&name, None).await.unwrap();
            link.set(held_to_server);
            let take = tokio::time::timeout(Duration::from_millis(20), claim.try_take()).await;
            assert!(take.is_err(), "the held take was answered");
            link.set(Fault::Pass);
            claim.abandon().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(
                server.inspect(&name).await.unwrap().is_none(),
                "a late take held the lock"
            );

            // Released after a retried take was granted; the first try,
            // delayed on the way, lands after the release.
            let name = LockName::new("late/retry").unwrap();
            let mut claim = raw.claim(&name, None).await.unwrap();
            link.set(Fault::Flows {
                to_server: link::Flow::Delay(Duration::from_millis(200)),
                to_client: link::Flow::Pass,
            });
            let first = tokio::time::timeout(Duration::from_millis(20), claim.try_take()).await;
            assert!(first.is_err(), "the delayed take was answered");
            link.set(Fault::Pass);
            let Ok(Take::Granted(hold)) = claim.try_take().await else {
                panic!("the retried take was not granted");
            };
            raw.release(&hold).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (other, _) = server.linked();
            let other = other
                .open(SessionId::generate(None), &SessionOptions::new())
                .await
                .unwrap();
            let mut probe = other.claim(&name, None).await.unwrap();
            assert!(
                matches!(probe.try_take().await, Ok(Take::Granted(_))),
                "the late first try took the lock again after its release"
            );
        }
    }
}
