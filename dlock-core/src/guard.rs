//! Proof of holding: [`LockGuard`], its local validity deadline and lost signal.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::clock;
use tokio_util::sync::CancellationToken;

use crate::backend::Hold;
use crate::session::SessionHandle;
use crate::{Error, FencingToken, LockName, SessionId};

/// Why a hold ended; what [`LockGuard::lost`] resolves with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The local validity deadline passed before a renewal was confirmed
    /// (invariant S4): the store may give the lock to someone else from now on.
    Expired,
    /// The store reported that this session no longer holds the lock (it
    /// expired there, or an admin force-released it).
    Revoked,
    /// The session ended in the store (lease revoked, ZooKeeper session expired).
    SessionLost,
    /// The session was closed by its owner while the lock was held.
    Closed,
    /// The holder released it: not a loss, but the hold is over.
    Released,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Expired => "local validity deadline passed without a confirmed renewal",
            LostReason::Revoked => "the store no longer records this session as holder",
            LostReason::SessionLost => "the session expired in the store",
            LostReason::Closed => "the session was closed",
            LostReason::Released => "released by the holder",
        })
    }
}

/// The shared state of one hold: one per grant, shared by reentrant guards.
pub(crate) struct HeldState {
    pub(crate) id: u64,
    pub(crate) hold: Hold,
    epoch: Instant,
    /// Local validity deadline, in nanoseconds since `epoch`.
    deadline: AtomicU64,
    lost: CancellationToken,
    reason: OnceLock<LostReason>,
    /// Live guards of this hold (reentrancy count).
    guards: AtomicUsize,
}

impl HeldState {
    pub(crate) fn new(id: u64, hold: Hold, epoch: Instant, deadline: Instant) -> Self {
        Self {
            id,
            hold,
            epoch,
            deadline: AtomicU64::new(nanos_since(epoch, deadline)),
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
            guards: AtomicUsize::new(1),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.deadline.load(Ordering::Acquire))
    }

    /// Moves the deadline forward after a confirmed renewal, unless the hold
    /// already expired locally: an expired hold is never revived, since the
    /// client has already been told (or could have observed) that it is lost.
    /// Returns whether the hold is still live.
    pub(crate) fn extend(&self, to: Instant) -> bool {
        if !self.is_live() {
            self.lose(LostReason::Expired);
            return false;
        }
        self.deadline
            .fetch_max(nanos_since(self.epoch, to), Ordering::AcqRel);
        true
    }

    pub(crate) fn is_live(&self) -> bool {
        !self.lost.is_cancelled() && clock::now() < self.deadline()
    }

    /// Records the first reason the hold ended and fires `lost()`. Returns
    /// whether this call was the first.
    pub(crate) fn lose(&self, reason: LostReason) -> bool {
        let first = self.reason.set(reason).is_ok();
        if first {
            self.lost.cancel();
        }
        first
    }

    pub(crate) fn reason(&self) -> Option<LostReason> {
        self.reason.get().copied()
    }

    /// Resolves when the hold ends, by event or by the local deadline: it
    /// watches the deadline itself, so it fires on time even if the renewal
    /// task is starved or blocked on a hung request.
    pub(crate) async fn lost(self: Arc<Self>) -> LostReason {
        loop {
            if let Some(reason) = self.reason() {
                return reason;
            }
            let deadline = self.deadline();
            tokio::select! {
                _ = self.lost.cancelled() => {}
                _ = clock::sleep_until(deadline) => {
                    if clock::now() >= self.deadline() {
                        self.lose(LostReason::Expired);
                    }
                }
            }
        }
    }

    /// Adds a reentrant guard if the hold is live.
    pub(crate) fn try_reenter(&self) -> bool {
        let mut current = self.guards.load(Ordering::Acquire);
        loop {
            if current == 0 || !self.is_live() {
                return false;
            }
            match self.guards.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => current = now,
            }
        }
    }

    /// Drops one guard; true if it was the last.
    fn leave(&self) -> bool {
        self.guards.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// The error a release reports if the hold had ended before it.
    pub(crate) fn lost_error(&self) -> Option<Error> {
        match self.reason() {
            None | Some(LostReason::Released) => None,
            Some(reason) => Some(Error::Lost {
                name: self.hold.name.to_string(),
                reason,
            }),
        }
    }
}

pub(crate) fn nanos_since(epoch: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(epoch)
        .as_nanos()
        .min(u64::MAX as u128) as u64
}

/// Proof that this process holds a lock, with its [`FencingToken`].
///
/// Send [`token()`](Self::token) along with every write to the protected
/// resource, and stop work when [`lost()`](Self::lost) fires. Release with
/// [`release().await`](Self::release) to learn whether the hold lasted;
/// dropping the guard releases in the background instead.
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// let guard = session.lock("billing/invoice-run")?.acquire().await?;
/// tokio::select! {
///     reason = guard.lost() => eprintln!("lock lost ({reason}); stopping"),
///     _ = do_the_work(guard.token().get()) => {}
/// }
/// guard.release().await?;
/// # Ok(()) }
/// # async fn do_the_work(_token: u64) {}
/// ```
#[must_use = "dropping a LockGuard releases the lock at once"]
pub struct LockGuard {
    pub(crate) held: Arc<HeldState>,
    pub(crate) session: Arc<SessionHandle>,
    pub(crate) done: bool,
}

impl LockGuard {
    /// The fencing token of this grant.
    pub fn token(&self) -> FencingToken {
        self.held.hold.token
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.held.hold.name
    }

    /// The store-level hold (name, token, adapter key): for adapter tests and
    /// tools that talk to the store directly.
    pub fn hold(&self) -> &Hold {
        &self.held.hold
    }

    /// The holding session's id.
    pub fn session_id(&self) -> &SessionId {
        self.session.shared.id()
    }

    /// Whether the hold is still valid: not lost, and the local validity
    /// deadline (counted from when the last confirmed renewal was *sent*, minus
    /// the drift margin) has not passed. Needs no server contact.
    pub fn is_held(&self) -> bool {
        self.held.is_live()
    }

    /// The local validity deadline: after it, the store may grant the lock to
    /// someone else unless a renewal is confirmed first.
    ///
    /// It lives on tokio's clock shifted forward by the time the machine has
    /// spent suspended since the process started (`CLOCK_BOOTTIME` on Linux),
    /// since a store's TTL runs on while a client sleeps; compare it with
    /// tokio's `Instant::now()` only in processes that were never suspended.
    pub fn deadline(&self) -> Instant {
        self.held.deadline()
    }

    /// Why the hold ended, if it has.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.held.reason()
    }

    /// A future that resolves when the hold ends: lost (deadline passed,
    /// revoked, session lost) or released. It owns what it needs, so it can be
    /// moved into another task.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect; call again for a new one.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.held.clone().lost()
    }

    /// Releases the lock in the store (owner- and token-checked, invariant S3)
    /// and wakes the next waiter.
    ///
    /// For a reentrant guard (see [`Lock`](crate::Lock)), only the last release
    /// frees the lock. Returns [`Error::Lost`] if the hold had ended before the
    /// release (work done under it may not have been exclusive), and
    /// [`Error::NotHeld`] if the store no longer had it. Transient errors are
    /// retried until the hold's local deadline; if the store still did not
    /// confirm by then, this returns the error and the session keeps
    /// retrying in the background (while it lives), so a hold its lease
    /// keeps does not block the lock until the session closes.
    ///
    /// # Cancel safety
    /// If the future is dropped, the release continues in the background.
    pub async fn release(mut self) -> Result<(), Error> {
        self.done = true;
        let held = self.held.clone();
        if !held.leave() {
            return held.lost_error().map_or(Ok(()), Err);
        }
        let shared = self.session.shared.clone();
        // Inline (no hop to another task); if this future is dropped part-way,
        // the guard below finishes the release as a session task.
        let mut finish = FinishOnDrop {
            shared: Some(shared.clone()),
            held: held.clone(),
        };
        let result = crate::session::release_hold(shared, held).await;
        finish.shared = None;
        result
    }
}

/// Completes an interrupted `release()` in the background (releases are
/// owner-checked, so repeating one is harmless).
struct FinishOnDrop {
    shared: Option<Arc<crate::session::Shared>>,
    held: Arc<HeldState>,
}

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            let held = self.held.clone();
            let inner = shared.clone();
            shared.spawn(async move {
                let _ = crate::session::release_hold(inner, held).await;
            });
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done || !self.held.leave() {
            return;
        }
        let shared = self.session.shared.clone();
        let held = self.held.clone();
        self.session.shared.spawn(async move {
            if let Err(e) = crate::session::release_hold(shared, held).await {
                tracing::debug!(error = %e, "background release after drop failed");
            }
        });
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", self.name())
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish()
    }
}
