//! [`Session`]: the user's handle on one client's liveness context, its holds
//! and its background work (run by [`state`](crate::state)).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, timeout};

use crate::backend::primitives::RawSession;
use crate::error::Error;
use crate::info::SessionId;
use crate::lock::Lock;
use crate::name::IntoLockName;
use crate::options::SessionOptions;
use crate::state::{KeepOpen, SessionState, SessionStats, Timing};

/// One client's liveness context on a backend, with a TTL, kept alive in the
/// background. When a session is lost, every lock it holds is lost.
///
/// Cheap to clone (all clones are the same session). A process usually opens
/// one session per backend and takes many locks from it.
///
/// ```
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// use dlock_core::{Backend, SessionOptions, memory::MemoryBackend};
/// let session = MemoryBackend::new()
///     .session(SessionOptions::new().ttl(Duration::from_secs(10)))
///     .await?;
/// let guard = session.lock("jobs/report")?.why("nightly report").try_acquire().await?;
/// assert!(guard.is_some());
/// session.close().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Session {
    pub(crate) keep_open: Arc<KeepOpen>,
}

impl Session {
    /// Starts the session whose store side `raw` was just opened (by a request
    /// sent at `sent`; see [`Backend::session`](crate::Backend::session)):
    /// adopts the TTL the store negotiated and starts renewing.
    pub(crate) async fn start(
        id: SessionId,
        raw: Arc<dyn RawSession>,
        scheme: &'static str,
        options: SessionOptions,
        sent: Instant,
    ) -> Result<Session, Error> {
        let request_timeout = options.open_timeout();
        // The store may have negotiated another TTL; derive the timing from it.
        let options = if raw.ttl() != options.ttl_value() {
            let adjusted = options.ttl(raw.ttl());
            if let Err(e) = adjusted.validate(Duration::ZERO) {
                let _ = timeout(request_timeout, raw.close(&[])).await;
                return Err(e);
            }
            adjusted
        } else {
            options
        };
        let timing = Timing::from(&options);
        let state = SessionState::new(id, raw, scheme, timing, sent);
        let renewal = state.clone();
        state.spawn(async move {
            // Watched, so that a panic cannot leave a zombie session.
            let task = tokio::spawn(crate::renew::run(renewal.clone()));
            if let Err(e) = task.await
                && e.is_panic()
            {
                renewal.renewal_died();
            }
        });
        tracing::debug!(target: crate::state::LOG_TARGET, session = %state.id(), backend = scheme, ttl = ?timing.ttl, "session opened");
        Ok(Session {
            keep_open: Arc::new(KeepOpen { state }),
        })
    }

    pub(crate) fn state(&self) -> &Arc<SessionState> {
        &self.keep_open.state
    }

    /// A handle on the lock `name` (validated here; see [`LockName`](crate::LockName)).
    ///
    /// Each call returns a new, independent owner: two handles for the same
    /// name exclude each other even within one session.
    pub fn lock(&self, name: impl IntoLockName) -> Result<Lock, Error> {
        Ok(Lock::new(self.keep_open.clone(), name.into_lock_name()?))
    }

    /// Handles on several locks, taken all-or-nothing in name order (see
    /// [`MultiLock`](crate::MultiLock)); [`Error::InvalidName`] for a bad
    /// name, [`Error::Config`] for none.
    pub fn lock_all<I, N>(&self, names: I) -> Result<crate::MultiLock, Error>
    where
        I: IntoIterator<Item = N>,
        N: IntoLockName,
    {
        let locks = names
            .into_iter()
            .map(|n| self.lock(n))
            .collect::<Result<Vec<_>, _>>()?;
        crate::MultiLock::new(locks)
    }

    /// A candidate in the election `name` (see [`election`](crate::election)):
    /// campaigning takes the lock `name`, and the term is its fencing token.
    ///
    /// ```
    /// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
    /// let leadership = session.election("jobs/scheduler")?.campaign().await?;
    /// println!("leading in term {}", leadership.term());
    /// leadership.resign().await?;
    /// # Ok(()) }
    /// ```
    pub fn election(&self, name: impl IntoLockName) -> Result<crate::election::Election, Error> {
        Ok(crate::election::Election::new(self.lock(name)?))
    }

    /// A counting semaphore of `permits` permits named `name` (see
    /// [`semaphore`](crate::semaphore)): every client of it must give the
    /// same count. [`Error::Config`] for 0 or more than
    /// [`MAX_PERMITS`](crate::semaphore::MAX_PERMITS) permits.
    pub fn semaphore(
        &self,
        name: impl IntoLockName,
        permits: usize,
    ) -> Result<crate::semaphore::Semaphore, Error> {
        crate::semaphore::Semaphore::new(self.clone(), name, permits)
    }

    /// A read-write lock named `name` admitting
    /// [`DEFAULT_MAX_READERS`](crate::rwlock::DEFAULT_MAX_READERS) readers
    /// at once (see [`rwlock`](crate::rwlock)).
    pub fn rwlock(&self, name: impl IntoLockName) -> Result<crate::rwlock::RwLock, Error> {
        self.rwlock_with(name, crate::rwlock::DEFAULT_MAX_READERS)
    }

    /// A read-write lock named `name` admitting `max_readers` readers at
    /// once (a writer takes and renews that many permits); every client of
    /// it must give the same number. [`Error::Config`] for 0 or more than
    /// [`MAX_PERMITS`](crate::semaphore::MAX_PERMITS).
    pub fn rwlock_with(
        &self,
        name: impl IntoLockName,
        max_readers: usize,
    ) -> Result<crate::rwlock::RwLock, Error> {
        crate::rwlock::RwLock::new(self.clone(), name, max_readers)
    }

    /// The session id (`host:pid:start:random`).
    pub fn id(&self) -> &SessionId {
        self.state().id()
    }

    /// The TTL in effect (the store may have negotiated it).
    pub fn ttl(&self) -> Duration {
        self.state().timing.ttl
    }

    /// Whether the session is alive (not lost, not closed).
    pub fn is_alive(&self) -> bool {
        self.state().check_alive().is_ok()
    }

    /// Resolves when the session is lost in the store or closed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn ended(&self) -> impl Future<Output = ()> + Send + 'static {
        self.state().ended_owned()
    }

    /// What the session has done so far.
    pub fn stats(&self) -> SessionStats {
        self.state().stats.snapshot()
    }

    /// Ends the session: stops renewing, releases everything it holds (their
    /// guards' `lost()` fire with [`LostReason::Closed`](crate::LostReason::Closed)) and waits for its
    /// background tasks to finish.
    ///
    /// A close the store does not confirm within the request timeout is
    /// retried with backoff until what it frees would have expired by itself
    /// (at most about one TTL); only then does it return the error
    /// ([`Error::Unavailable`]), and the store frees what is left on expiry.
    ///
    /// # Cancel safety
    /// If dropped, the session is still closed (renewal stops at once), but the
    /// store side may linger until its TTL.
    pub async fn close(&self) -> Result<(), Error> {
        self.state().close().await
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", self.id())
            .field("backend", &self.state().scheme)
            .field("ttl", &self.ttl())
            .field("alive", &self.is_alive())
            .finish()
    }
}
