//! `memory://` — an in-process backend that implements the store primitives
//! for real: its own server clock, per-hold expiry, sessions, a FIFO queue per
//! lock and per-waiter notifications.
//!
//! It is the reference the conformance suite pins the semantics with (it
//! passes every case), and a handy backend for tests of code that uses dlock.
//! Locks are shared between all backends that name the same instance
//! (`memory://jobs` twice is one lock service); `memory://` is the instance
//! `default`. Nothing survives the process.
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

mod server;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

use crate::backend::{Attempt, ExpiryModel, Hold, RawSession, Take};
use crate::{Backend, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name};
use server::{BACKEND, Server};

/// The smallest TTL of the memory backend.
pub const MIN_TTL: Duration = Duration::from_millis(20);

/// An in-memory lock service (see the [module docs](self)).
#[derive(Clone)]
pub struct MemoryBackend {
    server: Arc<Server>,
    instance: Option<String>,
    fair: bool,
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
        Self {
            server: Arc::new(Server::new()),
            instance: None,
            fair: true,
        }
    }

    /// Opens `memory://` (instance `default`) or `memory://NAME`, where NAME is
    /// 1–64 of `[A-Za-z0-9-_.]`.
    pub fn connect(url: &str) -> Result<Self, Error> {
        let rest = url
            .strip_prefix("memory://")
            .ok_or_else(|| Error::invalid_url(url, "expected memory:// or memory://NAME"))?;
        let instance = if rest.is_empty() { "default" } else { rest };
        let valid = instance.len() <= 64
            && instance
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !valid {
            return Err(Error::invalid_url(
                url,
                "the instance name must be 1-64 of [A-Za-z0-9-_.] (no path, port, user or query)",
            ));
        }
        let server = registry()
            .lock()
            .unwrap()
            .entry(instance.to_owned())
            .or_insert_with(|| Arc::new(Server::new()))
            .clone();
        Ok(Self {
            server,
            instance: Some(instance.to_owned()),
            fair: true,
        })
    }

    /// Grants to whoever asks first after a release instead of in arrival
    /// order (fair is the default).
    pub fn unfair(mut self) -> Self {
        self.fair = false;
        self
    }

    /// Lock and queue entries under `prefix` that the service still keeps,
    /// after expiring what is due; zero when nothing leaked.
    pub fn objects(&self, prefix: &str) -> usize {
        self.server.objects(prefix)
    }

    /// Simulates a restart from durable storage: every session, lock and queue
    /// is gone, but tokens keep increasing.
    pub fn restart(&self) {
        self.server.restart();
    }
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("instance", &self.instance)
            .field("fair", &self.fair)
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

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        let ttl = options.ttl_value();
        let id = self.server.open_session(id.as_str(), ttl);
        Ok(Arc::new(MemorySession {
            server: self.server.clone(),
            id,
            ttl,
            fair: self.fair,
        }))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        Ok(self.server.inspect(name))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        Ok(self.server.list(prefix))
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        Ok(self.server.validate(name, token))
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        Ok(self.server.force_release(name))
    }
}

#[derive(Debug)]
struct MemorySession {
    server: Arc<Server>,
    id: Arc<str>,
    ttl: Duration,
    fair: bool,
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
        ExpiryModel::PerHold
    }

    async fn attempt(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Attempt>, Error> {
        Ok(Box::new(MemoryAttempt {
            server: self.server.clone(),
            session: self.id.clone(),
            name: name.clone(),
            ticket: self.server.new_ticket(),
            why: why.map(str::to_owned),
            notify: Arc::new(Notify::new()),
            fair: self.fair,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        let keyed: Vec<_> = holds
            .iter()
            .map(|h| (h.clone(), ticket_of(h).unwrap_or(0)))
            .collect();
        self.server.renew(&self.id, &keyed)
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let ticket = ticket_of(hold).ok_or_else(|| Error::NotHeld {
            name: hold.name.to_string(),
        })?;
        self.server.release(&self.id, hold, ticket)
    }

    async fn close(&self, _holds: &[Hold]) -> Result<(), Error> {
        self.server.close_session(&self.id);
        Ok(())
    }
}

#[derive(Debug)]
struct MemoryAttempt {
    server: Arc<Server>,
    session: Arc<str>,
    name: LockName,
    ticket: u64,
    why: Option<String>,
    notify: Arc<Notify>,
    fair: bool,
}

#[async_trait]
impl Attempt for MemoryAttempt {
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.server.try_take(
            &self.name,
            &self.session,
            self.ticket,
            self.why.as_deref(),
            &self.notify,
            self.fair,
        )
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        // A notification sent before we got here is kept as a permit, so a
        // release between `try_take` and `wait` is not missed.
        tokio::select! {
            _ = self.notify.notified() => {}
            _ = sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(self: Box<Self>) -> Result<(), Error> {
        self.server.abandon(&self.name, self.ticket);
        Ok(())
    }
}
