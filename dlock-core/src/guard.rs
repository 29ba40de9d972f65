//! Proof of holding: [`LockGuard`], its local validity deadline and lost signal.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;

use crate::error::Error;
use crate::fence_header::FenceHeader;
use crate::info::SessionId;
use crate::lost::LostReason;
use crate::name::LockName;
use crate::state::{KeepOpen, SessionState, Tenure};
use crate::token::FencingToken;

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
    pub(crate) tenure: Arc<Tenure>,
    pub(crate) session: Arc<KeepOpen>,
    pub(crate) done: bool,
}

impl LockGuard {
    /// The fencing token of this grant.
    pub fn token(&self) -> FencingToken {
        self.tenure.hold.token
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.tenure.hold.name
    }

    /// The name and token to send with a request another service carries
    /// out for this holder: its `to_string()` is the value of the
    /// [`Dlock-Fence`](crate::fence_header) header.
    pub fn fence_header(&self) -> FenceHeader {
        FenceHeader::new(self.name().clone(), self.token())
    }

    /// The holding session's id.
    pub fn session_id(&self) -> &SessionId {
        self.session.state.id()
    }

    /// Whether the hold is still valid: not lost, and the local validity
    /// deadline (counted from when the last confirmed renewal was *sent*, minus
    /// the drift margin) has not passed. Needs no server contact.
    pub fn is_held(&self) -> bool {
        self.tenure.is_live()
    }

    /// The local validity deadline: after it, the store may grant the lock to
    /// someone else unless a renewal is confirmed first.
    ///
    /// It lives on tokio's clock shifted forward by the time the machine has
    /// spent suspended since the process started (`CLOCK_BOOTTIME` on Linux),
    /// since a store's TTL runs on while a client sleeps; compare it with
    /// tokio's `Instant::now()` only in processes that were never suspended.
    pub fn deadline(&self) -> Instant {
        self.tenure.deadline()
    }

    /// Why the hold ended, if it has.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.tenure.reason()
    }

    /// A future that resolves when the hold ends: lost (deadline passed,
    /// revoked, session lost) or released. It owns what it needs, so it can be
    /// moved into another task.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping it has no effect; call again for a new one.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.tenure.clone().lost()
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
    /// Under [`Lock::hold_at_least`](crate::Lock::hold_at_least), a release
    /// before the minimum returns at once (`Ok` unless the hold had already
    /// ended) and is carried out at the minimum.
    ///
    /// # Cancel safety
    /// If the future is dropped, the release continues in the background.
    pub async fn release(mut self) -> Result<(), Error> {
        self.done = true;
        let tenure = self.tenure.clone();
        if !tenure.leave() {
            return tenure.lost_error().map_or(Ok(()), Err);
        }
        let state = self.session.state.clone();
        if release_later(&state, &tenure) {
            return tenure.lost_error().map_or(Ok(()), Err);
        }
        // Inline (no hop to another task); if this future is dropped part-way,
        // the guard below finishes the release as a session task.
        let mut finish = FinishOnDrop {
            state: Some(state.clone()),
            tenure: tenure.clone(),
        };
        let result = state.release(tenure).await;
        finish.state = None;
        result
    }
}

/// Completes an interrupted `release()` in the background (releases are
/// owner-checked, so repeating one is harmless).
struct FinishOnDrop {
    state: Option<Arc<SessionState>>,
    tenure: Arc<Tenure>,
}

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            let tenure = self.tenure.clone();
            state.clone().spawn(async move {
                let _ = state.release(tenure).await;
            });
        }
    }
}

/// Under [`Lock::hold_at_least`](crate::Lock::hold_at_least), a release
/// before the hold's minimum: carried out then by a session task (sooner if
/// the hold is lost; the session's close releases it if that comes first).
/// Whether it was deferred.
fn release_later(state: &Arc<SessionState>, tenure: &Arc<Tenure>) -> bool {
    let Some(&at) = tenure.keep_until.get() else {
        return false;
    };
    if crate::clock::now() >= at {
        return false;
    }
    let (session, tenure) = (state.clone(), tenure.clone());
    let (ended, lost) = (state.ended_owned(), tenure.clone().lost());
    state.spawn(async move {
        tokio::select! {
            _ = crate::clock::sleep_until(at) => {}
            _ = lost => {}
            _ = ended => return,
        }
        if let Err(e) = session.release(tenure).await {
            tracing::debug!(error = %e, "release after the hold's minimum failed");
        }
    });
    true
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done || !self.tenure.leave() {
            return;
        }
        let state = self.session.state.clone();
        if release_later(&state, &self.tenure) {
            return;
        }
        let tenure = self.tenure.clone();
        self.session.state.spawn(async move {
            if let Err(e) = state.release(tenure).await {
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
