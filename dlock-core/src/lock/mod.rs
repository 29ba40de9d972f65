//! [`Lock`]: a named handle and the acquire loop, written once for all stores.
//!
//! `mod.rs` is the handle and what it owns (reentrancy, one claim at a time,
//! turning a grant into a guard); [`acquire`] is the loop, one function per
//! decision; [`pending`] owns a claim until it is granted or withdrawn;
//! [`pacing`] is retry timing and what a timeout reports.

mod acquire;
mod pacing;
mod pending;

pub(crate) use pacing::is_no_answer;

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::{Instant, timeout_at};
use tracing::Instrument;

use crate::backend::primitives::Hold;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::lost::LostReason;
use crate::name::LockName;
use crate::state::{KeepOpen, SessionState, Tenure};
use crate::telemetry::{self, Outcome};
use pending::PendingClaim;

/// The longest reason ([`Lock::why`]) kept, in bytes.
pub const MAX_WHY_LEN: usize = 512;

/// A named lock from a [`Session`](crate::Session): `session.lock("a/b")?`.
///
/// # Ownership and reentrancy
///
/// The handle is the owner. Two handles (even of one session, even for one
/// name, even a clone of this one) exclude each other like two processes
/// would. One handle is *reentrant, counted*: acquiring through a handle
/// whose earlier guard is still live returns at once with another guard
/// carrying the same token, and the lock is freed when the last of those
/// guards is released or dropped. Ownership lives in the handle, never in a
/// thread or task, since async code moves between threads.
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let lock = session.lock("billing/invoice-run")?.why("monthly invoices");
/// let outer = lock.acquire_timeout(Duration::from_secs(30)).await?;
/// let inner = lock.acquire().await?; // reentrant: same handle, same token
/// assert_eq!(inner.token(), outer.token());
/// inner.release().await?; // still held by `outer`
/// outer.release().await?; // freed
/// # Ok(()) }
/// ```
pub struct Lock {
    session: Arc<KeepOpen>,
    name: LockName,
    why: Option<Arc<str>>,
    /// [`Lock::hold_at_most`]'s limit.
    hold_limit: Option<Duration>,
    /// [`Lock::hold_at_least`]'s minimum.
    hold_min: Option<Duration>,
    handle: Arc<HandleState>,
}

/// A clone is a new handle: another owner of the same name, which the
/// original excludes (ownership is per handle, never shared by copying).
impl Clone for Lock {
    fn clone(&self) -> Self {
        Self {
            session: self.session.clone(),
            name: self.name.clone(),
            why: self.why.clone(),
            hold_limit: self.hold_limit,
            hold_min: self.hold_min,
            handle: Arc::default(),
        }
    }
}

/// What one handle (and not its clones) owns.
#[derive(Default)]
struct HandleState {
    /// The tenure this handle has, for reentrancy.
    current: Mutex<Weak<Tenure>>,
    /// One claim per handle at a time.
    gate: tokio::sync::Mutex<()>,
}

/// How long an acquire may wait for the lock.
#[derive(Clone, Copy)]
enum Wait {
    No,
    Forever,
    /// Deadline, and the wait asked for (for the error message).
    Until(Instant, Duration),
}

impl Wait {
    fn deadline(self) -> Option<Instant> {
        match self {
            Wait::Until(d, _) => Some(d),
            _ => None,
        }
    }
}

impl Lock {
    pub(crate) fn new(session: Arc<KeepOpen>, name: LockName) -> Self {
        Self {
            session,
            name,
            why: None,
            hold_limit: None,
            hold_min: None,
            handle: Arc::default(),
        }
    }

    /// Sets the reason recorded with the acquisition (shown by `inspect`, like
    /// the seeds' `why` field). Reasons longer than [`MAX_WHY_LEN`] bytes are
    /// cut there (at a character boundary), so every store can keep them.
    pub fn why(mut self, why: impl Into<String>) -> Self {
        let mut why = why.into();
        if why.len() > MAX_WHY_LEN {
            let mut end = MAX_WHY_LEN;
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            why.truncate(end);
        }
        self.why = Some(why.into());
        self
    }

    /// Ends every hold taken through this handle `limit` after its grant,
    /// even while the session renews it: the guard's [`lost`](LockGuard::lost)
    /// fires with [`LostReason::HoldLimit`] and the lock is released in the
    /// background (a scheduled job that hangs gives the lock back; ShedLock's
    /// "lock at most for"). Without it, a hold lasts until released or lost.
    ///
    /// ```
    /// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
    /// use std::time::Duration;
    /// let job = session.lock("jobs/nightly")?.hold_at_most(Duration::from_secs(3600));
    /// let guard = job.acquire().await?;
    /// tokio::select! {
    ///     reason = guard.lost() => eprintln!("stopping: {reason}"),
    ///     _ = async { /* the job */ } => {}
    /// }
    /// # Ok(()) }
    /// ```
    pub fn hold_at_most(mut self, limit: Duration) -> Self {
        self.hold_limit = Some(limit);
        self
    }

    /// Keeps every hold taken through this handle at least `minimum` after
    /// its grant: a release (or a dropped guard) before then returns at once
    /// and gives the lock back at that time, while the session goes on
    /// renewing it (ShedLock's "lock at least for": a scheduled job that
    /// finishes quickly is not run again by another node whose clock fires
    /// a little later). The hold still ends early if it is lost, or when the
    /// session closes or the process ends (the store's lease then expires
    /// it); `dlock run --hold-at-least` waits for it before exiting.
    ///
    /// ```
    /// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
    /// use std::time::Duration;
    /// let job = session.lock("jobs/hourly")?.hold_at_least(Duration::from_secs(60));
    /// if let Some(guard) = job.try_acquire().await? {
    ///     // ... a job that may take a second ...
    ///     guard.release().await?; // returns now; the lock is free 60 s after the grant
    /// }
    /// # Ok(()) }
    /// ```
    pub fn hold_at_least(mut self, minimum: Duration) -> Self {
        self.hold_min = Some(minimum);
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Takes the lock if it is free now; never waits. `Ok(None)` means busy
    /// (held by another owner or, on fair stores, others queue for it).
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped, whatever the claim left in the store is
    /// removed in the background (S5).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>, Error> {
        self.acquire_with(Wait::No).await
    }

    /// Waits until the lock is ours. Transient store errors are retried;
    /// [`Error::SessionLost`] if the session ends while waiting.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future at any await point leaves no queue
    /// entry behind and no hold beyond one TTL (S5); clean-up runs in the
    /// background.
    pub async fn acquire(&self) -> Result<LockGuard, Error> {
        self.acquire_with(Wait::Forever)
            .await
            .and_then(|g| g.ok_or_else(|| unreachable_busy(&self.name)))
    }

    /// Waits at most `wait` for the lock; [`Error::Timeout`] after that,
    /// within `wait` plus one round trip (invariant L5; plus the clean-up
    /// below on a busy lock), also when the store does not answer: the
    /// deadline cuts requests in flight. So a `wait`
    /// shorter than a round trip can time out on a free lock; for exactly
    /// one try use [`try_acquire`](Self::try_acquire).
    ///
    /// The timeout's `cause` is `None` when the lock stayed busy, and the
    /// store's last error (or "no answer before the deadline") when the
    /// store was failing or silent: a caller can tell "busy" from
    /// "unreachable".
    ///
    /// A waiter that timed out on a busy lock (no `cause`) has left the
    /// line when this returns: the holder's release then goes to whoever
    /// asks next, not to a place kept for a waiter that is gone. That
    /// clean-up costs the store's withdrawal requests (one round trip on
    /// most stores, a few on SQL's wait queue), at most a request timeout,
    /// after which it goes on in the background. A timeout with a `cause`
    /// (the store failing, or no answer yet) leaves it to the background.
    ///
    /// # Cancel safety
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard, Error> {
        // A wait too long to count is a wait without end.
        let until = match Instant::now().checked_add(wait) {
            Some(deadline) => Wait::Until(deadline, wait),
            None => Wait::Forever,
        };
        self.acquire_with(until)
            .await
            .and_then(|g| g.ok_or_else(|| unreachable_busy(&self.name)))
    }

    /// The session's request timeout.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.session_state().timing.request_timeout
    }

    fn session_state(&self) -> &Arc<SessionState> {
        &self.session.state
    }

    /// Another guard on this handle's live tenure, if it has one (reentrancy).
    fn reenter(&self) -> Option<LockGuard> {
        let tenure = self.handle.current.lock().unwrap().upgrade()?;
        tenure.try_reenter().then(|| LockGuard {
            tenure,
            session: self.session.clone(),
            done: false,
        })
    }

    async fn acquire_with(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        let state = self.session_state();
        let span = tracing::debug_span!("dlock.acquire", lock = %self.name, backend = state.scheme, session = %state.id());
        let started = Instant::now();
        let result = self.acquire_inner(wait).instrument(span).await;
        let outcome = match &result {
            Ok(Some(_)) => Outcome::Granted,
            Ok(None) => Outcome::Busy,
            Err(Error::Timeout { .. }) => Outcome::Timeout,
            Err(_) => Outcome::Error,
        };
        telemetry::acquired(state.scheme, outcome, started.elapsed());
        result
    }

    /// One claim per handle at a time: waits for this handle's other
    /// acquire (within the caller's deadline); `None` for a try that finds
    /// one in flight.
    async fn serialize(
        &self,
        wait: Wait,
    ) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>, Error> {
        Ok(Some(match wait {
            Wait::No => match self.handle.gate.try_lock() {
                Ok(g) => g,
                Err(_) => return Ok(None),
            },
            Wait::Forever => self.handle.gate.lock().await,
            Wait::Until(deadline, asked) => timeout_at(deadline, self.handle.gate.lock())
                .await
                .map_err(|_| self.timeout_error(asked, None))?,
        }))
    }

    /// Turns a grant into a guard.
    fn granted(
        &self,
        claim: &mut PendingClaim,
        hold: Hold,
        deadline: Instant,
    ) -> Result<LockGuard, Error> {
        let state = self.session_state();
        claim.disarm();
        let tenure = state.register(hold, deadline);
        if let Err(e) = state.check_alive() {
            state.lose(&tenure, LostReason::Closed);
            return Err(e);
        }
        *self.handle.current.lock().unwrap() = Arc::downgrade(&tenure);
        if let Some(limit) = self.hold_limit {
            end_at_limit(state, &tenure, limit);
        }
        if let Some(minimum) = self.hold_min {
            let _ = tenure.keep_until.set(crate::clock::now() + minimum);
        }
        tracing::debug!(token = %tenure.hold.token, "acquired");
        Ok(LockGuard {
            tenure,
            session: self.session.clone(),
            done: false,
        })
    }

    fn timeout_error(&self, asked: Duration, cause: Option<Error>) -> Error {
        Error::Timeout {
            name: self.name.to_string(),
            waited: asked,
            cause: cause.map(Box::new),
        }
    }
}

/// Ends `tenure` with [`LostReason::HoldLimit`] `limit` from now, unless it
/// ends first (released, lost) or the session does.
fn end_at_limit(state: &Arc<SessionState>, tenure: &Arc<Tenure>, limit: Duration) {
    let (session, weak) = (state.clone(), Arc::downgrade(tenure));
    let (ended, over) = (state.ended_owned(), tenure.clone().lost());
    state.spawn(async move {
        tokio::select! {
            // (the deadline clock: a suspended machine does not stretch it)
            _ = crate::clock::sleep_until(crate::clock::now() + limit) => {}
            _ = over => return,
            _ = ended => return,
        }
        if let Some(tenure) = weak.upgrade() {
            session.lose(&tenure, LostReason::HoldLimit);
        }
    });
}

/// A waiting acquire never answers "busy"; if the loop did, that is a bug.
fn unreachable_busy(name: &LockName) -> Error {
    Error::protocol(
        "dlock",
        format!("waiting acquire of {name:?} returned busy"),
    )
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("why", &self.why)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::memory::MemoryBackend;
    use crate::{Backend, Error, SessionOptions};

    /// L5 hygiene: once the caller's deadline has passed, no take goes out
    /// (it would be cut off at once, and could still land and hold the lock
    /// for no one). A busy lock nobody releases: the waiter sends its first
    /// take, is never woken, and must not send another at the deadline.
    #[tokio::test]
    async fn no_take_after_the_deadline() {
        let server = MemoryBackend::new();
        let options = SessionOptions::new().ttl(Duration::from_secs(5));
        let a = server.session(options.clone()).await.unwrap();
        let b = server.session(options).await.unwrap();
        let _held = a.lock("x").unwrap().acquire().await.unwrap();
        let r = b
            .lock("x")
            .unwrap()
            .acquire_timeout(Duration::from_millis(200))
            .await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(
            b.stats().take_attempts,
            1,
            "a take went out at the deadline"
        );
        // A deadline already past before the first take: none goes out.
        let r = b.lock("x").unwrap().acquire_timeout(Duration::ZERO).await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(
            b.stats().take_attempts,
            1,
            "a take went out past the deadline"
        );
    }

    /// A store that no longer knows the session (it expired there) ends it
    /// when a take meets that, not at the next renewal: the caller's error
    /// and `is_alive` agree, and the session's other holds are lost at once
    /// (conformance case `waiter_learns_session_lost` on etcd, whose waiter
    /// heard of its own queue key's deletion and met the expired lease
    /// before the renewal did).
    #[tokio::test]
    async fn a_take_meeting_a_lost_session_ends_it() {
        let server = MemoryBackend::new();
        let options = SessionOptions::new().ttl(Duration::from_secs(5));
        let a = server.session(options).await.unwrap();
        let other = a.lock("other").unwrap().acquire().await.unwrap();
        server.clock().step_forward(Duration::from_secs(10));
        let r = a.lock("x").unwrap().acquire().await;
        assert!(matches!(r, Err(Error::SessionLost { .. })), "{r:?}");
        assert!(
            !a.is_alive(),
            "the session lives on after the store said it was gone"
        );
        assert!(!other.is_held(), "a hold of the lost session is still held");
    }
}
