//! [`Session`]: one client's liveness context, its holds and its background work.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{ExpiryModel, Hold, RawSession};
use crate::guard::{HeldState, nanos_since};
use crate::name::IntoLockName;
use crate::{Backend, Error, Lock, LostReason, SessionId, SessionOptions};

const ALIVE: u8 = 0;
const LOST: u8 = 1;
const CLOSED: u8 = 2;

/// The timing a session runs with, derived once from its options and the
/// store's effective TTL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) ttl: Duration,
    pub(crate) renew_every: Duration,
    pub(crate) drift: Duration,
    pub(crate) poll_fallback: Duration,
    pub(crate) request_timeout: Duration,
}

impl Timing {
    fn from(options: &SessionOptions) -> Self {
        Self {
            ttl: options.ttl_value(),
            renew_every: options.renew_every_or_default(),
            drift: options.drift_or_default(),
            poll_fallback: options.poll_fallback_or_default(),
            request_timeout: options.request_timeout_or_default(),
        }
    }

    /// The local validity deadline of a grant or renewal sent at `sent` (S4).
    pub(crate) fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.ttl - self.drift
    }
}

/// Counters of what a session did; cheap to read, for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionStats {
    /// `try_take` calls sent to the store (a herd shows up here).
    pub take_attempts: u64,
    /// Successful acquisitions (reentrant ones excluded).
    pub grants: u64,
    /// Waits for a change (notification or timer).
    pub waits: u64,
    /// Renewal rounds that succeeded.
    pub renewals: u64,
    /// Renewal rounds that failed.
    pub renewal_failures: u64,
    /// Holds that ended other than by release.
    pub losses: u64,
}

#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) take_attempts: AtomicU64,
    pub(crate) grants: AtomicU64,
    pub(crate) waits: AtomicU64,
    pub(crate) renewals: AtomicU64,
    pub(crate) renewal_failures: AtomicU64,
    pub(crate) losses: AtomicU64,
}

impl Stats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the session's owners, its holds and its renewal task share.
pub(crate) struct Shared {
    id: SessionId,
    pub(crate) raw: Arc<dyn RawSession>,
    pub(crate) scheme: &'static str,
    pub(crate) timing: Timing,
    expiry: ExpiryModel,
    epoch: Instant,
    /// The session lease's local deadline (nanos since `epoch`), for
    /// [`ExpiryModel::Session`] stores.
    session_deadline: AtomicU64,
    held: Mutex<HashMap<u64, Arc<HeldState>>>,
    next_hold: AtomicU64,
    state: AtomicU8,
    /// Stops the renewal task.
    pub(crate) shutdown: CancellationToken,
    /// Fires when the session is lost or closed.
    ended: CancellationToken,
    tasks: TaskTracker,
    runtime: Handle,
    pub(crate) stats: Stats,
}

impl Shared {
    pub(crate) fn id(&self) -> &SessionId {
        &self.id
    }

    /// Spawns a task that belongs to this session (counted, never detached
    /// from the session's runtime).
    pub(crate) fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn_on(fut, &self.runtime)
    }

    pub(crate) fn check_alive(&self) -> Result<(), Error> {
        match self.state.load(Ordering::Acquire) {
            ALIVE => Ok(()),
            _ => Err(self.lost_error()),
        }
    }

    /// The error for work on a session that has ended.
    pub(crate) fn lost_error(&self) -> Error {
        Error::SessionLost {
            session: self.id.to_string(),
        }
    }

    /// Resolves when the session is lost or closed.
    pub(crate) fn ended(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.ended.cancelled()
    }

    /// A retry policy for one clean-up in the store (see [`Cleanup`]).
    pub(crate) fn cleanup(self: &Arc<Self>, what: &'static str) -> Cleanup {
        Cleanup {
            shared: self.clone(),
            what,
            backoff: Duration::from_millis(10),
            // What a per-hold store keeps expires on its own after a TTL.
            expires: match self.expiry {
                ExpiryModel::PerHold => Some(Instant::now() + self.timing.ttl),
                ExpiryModel::Session => None,
            },
        }
    }

    /// The local deadline of a grant whose take was sent at `sent`.
    pub(crate) fn grant_deadline(&self, sent: Instant) -> Instant {
        match self.expiry {
            ExpiryModel::PerHold => self.timing.valid_until(sent),
            ExpiryModel::Session => self.session_deadline(),
        }
    }

    fn session_deadline(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.session_deadline.load(Ordering::Acquire))
    }

    pub(crate) fn extend_session(&self, to: Instant) {
        self.session_deadline
            .fetch_max(nanos_since(self.epoch, to), Ordering::AcqRel);
    }

    /// Records a grant; `None` if the session ended meanwhile (the hold is
    /// then released in the background).
    pub(crate) fn register(self: &Arc<Self>, hold: Hold, deadline: Instant) -> Arc<HeldState> {
        let id = self.next_hold.fetch_add(1, Ordering::Relaxed);
        let held = Arc::new(HeldState::new(id, hold, self.epoch, deadline));
        self.held.lock().unwrap().insert(id, held.clone());
        Stats::bump(&self.stats.grants);
        held
    }

    pub(crate) fn forget(&self, held: &HeldState) {
        self.held.lock().unwrap().remove(&held.id);
    }

    /// Forgets every hold, firing `lost()` with `reason`; returns them for
    /// the store to free.
    fn take_holds(&self, reason: LostReason) -> Vec<Hold> {
        let drained: Vec<_> = self.held.lock().unwrap().drain().map(|(_, h)| h).collect();
        drained
            .into_iter()
            .map(|held| {
                held.lose(reason);
                held.hold.clone()
            })
            .collect()
    }

    pub(crate) fn holds(&self) -> Vec<Arc<HeldState>> {
        self.held.lock().unwrap().values().cloned().collect()
    }

    /// The earliest local deadline among holds (and the session lease).
    pub(crate) fn earliest_deadline(&self) -> Option<Instant> {
        let holds = self.held.lock().unwrap();
        let earliest = holds.values().map(|h| h.deadline()).min();
        match self.expiry {
            ExpiryModel::Session if !holds.is_empty() => {
                Some(earliest.map_or(self.session_deadline(), |e| e.min(self.session_deadline())))
            }
            _ => earliest,
        }
    }

    /// Ends a hold other than by release: fires `lost()`, forgets it and, if the
    /// store might still have it, releases it there in the background so
    /// others need not wait for the store's expiry.
    ///
    /// The clean-up keys on removing the hold from the session, not on being
    /// the first to mark it lost: a `lost()` future may have marked it first
    /// (it watches the deadline itself), and the hold must still be released.
    pub(crate) fn lose(self: &Arc<Self>, held: &Arc<HeldState>, reason: LostReason) {
        held.lose(reason);
        let removed = self.held.lock().unwrap().remove(&held.id).is_some();
        if !removed {
            return;
        }
        let reason = held.reason().unwrap_or(reason);
        Stats::bump(&self.stats.losses);
        tracing::warn!(lock = %held.hold.name, token = %held.hold.token, session = %self.id, %reason, "lock lost");
        if matches!(reason, LostReason::Expired | LostReason::Closed) {
            self.release_in_background(held.hold.clone(), "releasing a lost hold");
        }
    }

    /// Releases `hold` in the store as a [`Cleanup`]: retried with backoff
    /// until done, the session ends, or the hold would have expired anyway.
    fn release_in_background(self: &Arc<Self>, hold: Hold, what: &'static str) {
        let shared = self.clone();
        let mut cleanup = self.cleanup(what);
        self.spawn(async move {
            while !cleanup.try_once(shared.raw.release(&hold)).await {
                if !cleanup.wait_to_retry().await {
                    return;
                }
            }
        });
    }

    /// Fires `lost()` for every hold past its local deadline.
    pub(crate) fn expire_overdue(self: &Arc<Self>) {
        let now = crate::clock::now();
        for held in self.holds() {
            if held.deadline() <= now || !held.is_live() {
                self.lose(&held, LostReason::Expired);
            }
        }
    }

    /// The renewal task died (a panic in an adapter or driver): without it
    /// the holds would look valid while nothing renews them, so the session
    /// is lost now, and freed in the store so others need not wait (item 8).
    pub(crate) fn renewal_died(self: &Arc<Self>) {
        tracing::error!(session = %self.id, "the renewal task panicked; the session is lost");
        let holds: Vec<Hold> = self.holds().iter().map(|h| h.hold.clone()).collect();
        self.mark_lost();
        let shared = self.clone();
        self.spawn(async move {
            let _ = timeout(shared.timing.request_timeout, shared.raw.close(&holds)).await;
        });
    }

    /// The store dropped the session: every hold is lost, nothing more works.
    pub(crate) fn mark_lost(self: &Arc<Self>) {
        if self
            .state
            .compare_exchange(ALIVE, LOST, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            tracing::warn!(session = %self.id, "session lost");
        }
        for held in self.holds() {
            self.lose(&held, LostReason::SessionLost);
        }
        self.shutdown.cancel();
        self.ended.cancel();
    }

    /// Releases `hold` in the store, retrying transient errors until the store
    /// would have expired it anyway. A `NotHeld` after an attempt whose reply
    /// was lost means that attempt succeeded, but only if it comes back
    /// before the hold's local `deadline`: until then the store cannot have
    /// expired the hold (S4), later it may have, and the release is not
    /// known to have ended a valid hold.
    async fn release_in_store(
        &self,
        hold: &Hold,
        deadline: Instant,
        give_up_at: Instant,
    ) -> Result<(), Error> {
        let mut outcome_unknown = false;
        let mut backoff = Duration::from_millis(10);
        loop {
            let result = match timeout(self.timing.request_timeout, self.raw.release(hold)).await {
                Ok(result) => result,
                Err(_) => Err(Error::unavailable(self.scheme, "release timed out")),
            };
            match result {
                Ok(()) => return Ok(()),
                Err(Error::NotHeld { .. }) if outcome_unknown && crate::clock::now() < deadline => {
                    return Ok(());
                }
                Err(e) if e.is_retryable() && crate::clock::now() + backoff < give_up_at => {
                    tracing::debug!(lock = %hold.name, error = %e, "release failed; retrying");
                    outcome_unknown = true;
                    sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A clean-up in the store (an abandoned attempt, a lost hold): tried until
/// it succeeds or finds nothing to clean ([`Error::NotHeld`]), retrying
/// transient errors with backoff while the session lives and what it cleans
/// would not expire by itself anyway (issue 12 item 13: a clean-up sent once
/// and dropped on error leaves an orphan for as long as the session lives).
pub(crate) struct Cleanup {
    shared: Arc<Shared>,
    what: &'static str,
    backoff: Duration,
    expires: Option<Instant>,
}

impl Cleanup {
    /// Runs one try within the request timeout; true when done.
    pub(crate) async fn try_once(
        &mut self,
        request: impl Future<Output = Result<(), Error>>,
    ) -> bool {
        match timeout(self.shared.timing.request_timeout, request).await {
            Ok(Ok(()) | Err(Error::NotHeld { .. })) => true,
            Ok(Err(e)) if !e.is_retryable() => {
                tracing::debug!(what = self.what, error = %e, "clean-up failed for good");
                true
            }
            Ok(Err(e)) => {
                tracing::debug!(what = self.what, error = %e, "clean-up failed; retrying");
                false
            }
            Err(_) => {
                tracing::debug!(what = self.what, "clean-up timed out; retrying");
                false
            }
        }
    }

    /// Waits before the next try; false when trying again is pointless
    /// (the session ended, or what is left has expired by itself).
    pub(crate) async fn wait_to_retry(&mut self) -> bool {
        let next = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(
            self.shared
                .timing
                .renew_every
                .max(Duration::from_millis(10)),
        );
        if self.expires.is_some_and(|e| next >= e) {
            return false;
        }
        tokio::select! {
            _ = self.shared.ended.cancelled() => false,
            _ = sleep_until(next) => true,
        }
    }
}

/// Ends a hold by release, on behalf of its last guard.
pub(crate) async fn release_hold(shared: Arc<Shared>, held: Arc<HeldState>) -> Result<(), Error> {
    shared.forget(&held);
    let lost_before = held.lost_error();
    held.lose(LostReason::Released);
    let give_up_at = held.deadline() + shared.timing.drift;
    let result = shared
        .release_in_store(&held.hold, held.deadline(), give_up_at)
        .await;
    if result.as_ref().is_err_and(Error::is_retryable) {
        // Not confirmed, and the session no longer renews the hold by name;
        // where the session's lease keeps it, it would stay taken for as long
        // as the session lives: keep trying in the background (item 13).
        shared.release_in_background(held.hold.clone(), "releasing after a failed release");
    }
    tracing::debug!(lock = %held.hold.name, token = %held.hold.token, session = %shared.id, ok = result.is_ok(), "released");
    match lost_before {
        Some(lost) => Err(lost),
        None => result,
    }
}

/// Owned by [`Session`] clones, guards and lock handles; when the last one
/// goes, the session closes in the background (S5: no task outlives it).
pub(crate) struct SessionHandle {
    pub(crate) shared: Arc<Shared>,
}

impl Drop for SessionHandle {
    fn drop(&mut self) {
        let shared = self.shared.clone();
        if shared.state.swap(CLOSED, Ordering::AcqRel) == CLOSED {
            return;
        }
        shared.shutdown.cancel();
        let holds = shared.take_holds(LostReason::Closed);
        let inner = shared.clone();
        shared.spawn(async move {
            let _ = timeout(inner.timing.request_timeout, inner.raw.close(&holds)).await;
            inner.ended.cancel();
        });
        shared.tasks.close();
    }
}

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
    pub(crate) handle: Arc<SessionHandle>,
}

impl Session {
    pub(crate) async fn open<B: Backend + ?Sized>(
        backend: &B,
        options: SessionOptions,
    ) -> Result<Session, Error> {
        let scheme = backend.scheme();
        options.validate(backend.min_ttl())?;
        let max_ttl = backend.max_ttl();
        if options.ttl_value() > max_ttl {
            return Err(Error::InvalidTtl {
                ttl: options.ttl_value(),
                min: backend.min_ttl(),
                max: max_ttl,
            });
        }
        let id = SessionId::generate(options.label_value());
        let request_timeout = options.open_timeout();
        let sent = crate::clock::now();
        let raw = match timeout(request_timeout, backend.open(id.clone(), &options)).await {
            Ok(raw) => raw?,
            Err(_) => return Err(Error::unavailable(scheme, "timed out opening a session")),
        };
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
        let epoch = sent;
        let shared = Arc::new(Shared {
            session_deadline: AtomicU64::new(nanos_since(epoch, timing.valid_until(sent))),
            expiry: raw.expiry(),
            raw,
            scheme,
            timing,
            epoch,
            id,
            held: Mutex::new(HashMap::new()),
            next_hold: AtomicU64::new(0),
            state: AtomicU8::new(ALIVE),
            shutdown: CancellationToken::new(),
            ended: CancellationToken::new(),
            tasks: TaskTracker::new(),
            runtime: Handle::current(),
            stats: Stats::default(),
        });
        let renewal = shared.clone();
        shared.spawn(async move {
            // Watched, so that a panic cannot leave a zombie session.
            let task = tokio::spawn(crate::renew::run(renewal.clone()));
            if let Err(e) = task.await
                && e.is_panic()
            {
                renewal.renewal_died();
            }
        });
        tracing::debug!(session = %shared.id, backend = scheme, ttl = ?timing.ttl, "session opened");
        Ok(Session {
            handle: Arc::new(SessionHandle { shared }),
        })
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    /// A handle on the lock `name` (validated here; see [`LockName`](crate::LockName)).
    ///
    /// Each call returns a new, independent owner: two handles for the same
    /// name exclude each other even within one session.
    pub fn lock(&self, name: impl IntoLockName) -> Result<Lock, Error> {
        Ok(Lock::new(self.handle.clone(), name.into_lock_name()?))
    }

    /// The session id (`host:pid:start:random`).
    pub fn id(&self) -> &SessionId {
        self.shared().id()
    }

    /// The store side of this session, for adapter tests and the conformance
    /// suite (e.g. a release attempt by a non-owner). Applications do not need it.
    pub fn raw_session(&self) -> &Arc<dyn RawSession> {
        &self.shared().raw
    }

    /// The renewal period in effect.
    pub fn renew_every(&self) -> Duration {
        self.shared().timing.renew_every
    }

    /// The fallback poll period of waiting acquires in effect.
    pub fn poll_fallback(&self) -> Duration {
        self.shared().timing.poll_fallback
    }

    /// The TTL in effect (the store may have negotiated it).
    pub fn ttl(&self) -> Duration {
        self.shared().timing.ttl
    }

    /// Whether the session is alive (not lost, not closed).
    pub fn is_alive(&self) -> bool {
        self.shared().check_alive().is_ok()
    }

    /// Resolves when the session is lost in the store or closed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn ended(&self) -> impl Future<Output = ()> + Send + 'static {
        self.shared().ended.clone().cancelled_owned()
    }

    /// What the session has done so far.
    pub fn stats(&self) -> SessionStats {
        let s = &self.shared().stats;
        SessionStats {
            take_attempts: s.take_attempts.load(Ordering::Relaxed),
            grants: s.grants.load(Ordering::Relaxed),
            waits: s.waits.load(Ordering::Relaxed),
            renewals: s.renewals.load(Ordering::Relaxed),
            renewal_failures: s.renewal_failures.load(Ordering::Relaxed),
            losses: s.losses.load(Ordering::Relaxed),
        }
    }

    /// Background tasks this session has running: the renewal task plus any
    /// pending releases or abandoned-attempt clean-ups. Zero after `close`.
    pub fn background_tasks(&self) -> usize {
        self.shared().tasks.len()
    }

    /// Number of locks this session holds now.
    pub fn held_count(&self) -> usize {
        self.shared().held.lock().unwrap().len()
    }

    /// Ends the session: stops renewing, releases everything it holds (their
    /// guards' `lost()` fire with [`LostReason::Closed`]) and waits for its
    /// background tasks to finish.
    ///
    /// # Cancel safety
    /// If dropped, the session is still closed (renewal stops at once), but the
    /// store side may linger until its TTL.
    pub async fn close(&self) -> Result<(), Error> {
        let shared = self.shared().clone();
        let was = shared.state.swap(CLOSED, Ordering::AcqRel);
        shared.shutdown.cancel();
        let holds = shared.take_holds(LostReason::Closed);
        let result = if was == CLOSED {
            Ok(())
        } else {
            match timeout(shared.timing.request_timeout, shared.raw.close(&holds)).await {
                Ok(r) => r,
                Err(_) => Err(Error::unavailable(shared.scheme, "close timed out")),
            }
        };
        shared.ended.cancel();
        shared.tasks.close();
        let _ = timeout(shared.timing.request_timeout * 2, shared.tasks.wait()).await;
        tracing::debug!(session = %shared.id, "session closed");
        result
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", self.id())
            .field("backend", &self.shared().scheme)
            .field("ttl", &self.ttl())
            .field("alive", &self.is_alive())
            .finish()
    }
}
