//! The acquire loop, one function per decision: re-enter, start the claim,
//! take or wait, on a grant, on busy, on an error or the deadline. Clean-up
//! is [`PendingClaim`]'s: whatever await point an acquire future is dropped
//! at, the claim it opened is withdrawn in the background (S5).

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, sleep_until, timeout_at};

use super::pacing::{Backoff, Last, jitter};
use super::{Lock, PendingClaim, Wait};
use crate::backend::primitives::{Busy, Hold, Take};
use crate::clock;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::state::{SessionState, Stats};

/// What one step of the loop decided: stop with this answer, or go on.
type Step = ControlFlow<Option<LockGuard>>;

impl Lock {
    /// The acquire loop: take, else wait for a change, retrying transient
    /// errors, within the caller's deadline and the session's life.
    pub(super) async fn acquire_inner(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let Some(_serial) = self.serialize(wait).await? else {
            return Ok(None); // this handle's own acquire is in flight
        };
        // The acquire this one waited behind may have been granted: share it.
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let state = self.session_state().clone();
        state.check_alive()?;
        let mut run = Acquire {
            lock: self,
            state,
            wait,
            backoff: Backoff::default(),
            last: Last::Nothing,
        };
        // From here on the claim is owned by `PendingClaim`: dropping this
        // future at any await point abandons it in the background.
        let mut claim = run.start_claim().await?;
        loop {
            match run.take_or_wait(&mut claim).await {
                Ok(ControlFlow::Break(answer)) => return Ok(answer),
                Ok(ControlFlow::Continue(())) => {}
                Err(e) => {
                    // The lock stayed busy: withdraw the claim before
                    // answering, as a try does, so that a timed-out waiter
                    // leaves no place in a fair queue that could make the
                    // next take see "busy" after the holder's release
                    // (L4, case `timed_out_waiter_leaves_no_trace`). Bounded
                    // by the request timeout; a failing store's clean-up
                    // goes on in the background (L5).
                    if matches!(e, Error::Timeout { cause: None, .. }) {
                        claim.abandon_now().await;
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// One acquire in progress: its handle, its session, how long it may wait
/// and what the store last said.
struct Acquire<'a> {
    lock: &'a Lock,
    state: Arc<SessionState>,
    wait: Wait,
    backoff: Backoff,
    last: Last,
}

impl Acquire<'_> {
    /// Opens the claim on the lock, retrying transient errors while the
    /// caller may wait.
    async fn start_claim(&mut self) -> Result<PendingClaim, Error> {
        loop {
            let why = self.lock.why.as_deref();
            match self
                .request(self.state.raw.claim(&self.lock.name, why))
                .await
            {
                Ok(claim) => return Ok(PendingClaim::new(claim, self.state.clone())),
                Err(e) => self.on_error(e, "opening a claim failed; retrying").await?,
            }
        }
    }

    /// One take, and what its answer decides.
    async fn take_or_wait(&mut self, claim: &mut PendingClaim) -> Result<Step, Error> {
        self.check_deadline()?;
        let sent = clock::now();
        Stats::bump(&self.state.stats.take_attempts);
        match self.request(claim.get().try_take()).await {
            Ok(Take::Granted(hold)) => self.on_grant(claim, hold, sent).await,
            Ok(Take::Busy(busy)) => self.on_busy(claim, busy).await,
            Err(e) => {
                self.on_error(e, "take failed; retrying").await?;
                Ok(ControlFlow::Continue(()))
            }
        }
    }

    /// No take once the caller's deadline has passed (also the first: the
    /// wait may have gone on this handle's gate or on opening the claim): it
    /// would be cut off at once, its reply never used, while it may still
    /// land and hold the lock for no one (L5).
    fn check_deadline(&mut self) -> Result<(), Error> {
        if let Wait::Until(deadline, asked) = self.wait
            && Instant::now() >= deadline
        {
            let timeout = self.lock.timeout_error(asked, None);
            return Err(self.last.explain(timeout, self.state.scheme));
        }
        Ok(())
    }

    /// A grant whose take was sent at `sent`: a guard, unless it arrived
    /// after its validity.
    async fn on_grant(
        &mut self,
        claim: &mut PendingClaim,
        hold: Hold,
        sent: Instant,
    ) -> Result<Step, Error> {
        let deadline = self.state.grant_deadline(sent);
        if deadline > clock::now() {
            let guard = self.lock.granted(claim, hold, deadline)?;
            return Ok(ControlFlow::Break(Some(guard)));
        }
        // The take took longer than the TTL allows (Redlock's "validity ≤ 0"):
        // the store may free it any moment, so it is not ours to use yet (S4).
        // Take again with the same claim: that re-extends the grant (adapter
        // rule 4) and keeps the queue place.
        tracing::warn!(took = ?sent.elapsed(), "grant arrived after its validity; taking again");
        let late = Error::unavailable(self.state.scheme, "grants arrive after their validity");
        self.pause(late).await?;
        Ok(ControlFlow::Continue(()))
    }

    /// Busy: a try answers `None`, a wait past its deadline times out,
    /// anything else waits for a change.
    async fn on_busy(&mut self, claim: &mut PendingClaim, busy: Busy) -> Result<Step, Error> {
        self.backoff = Backoff::default();
        self.last = Last::Busy;
        match self.wait {
            Wait::No => {
                // Finish the clean-up before answering, so a try-only claim
                // leaves nothing in a fair queue that could make the next
                // try see "busy".
                claim.abandon_now().await;
                return Ok(ControlFlow::Break(None));
            }
            Wait::Until(deadline, asked) if Instant::now() >= deadline => {
                return Err(self.lock.timeout_error(asked, None));
            }
            _ => {}
        }
        self.wait_for_change(claim, busy).await?;
        Ok(ControlFlow::Continue(()))
    }

    /// A failed request: the caller's deadline ends the acquire (with the
    /// store's last error as the cause); a transient error is retried after
    /// a pause, except by a try; anything else ends the acquire. A store
    /// that no longer knows the session (its lease or session is gone) ends
    /// the session too, now rather than at the next renewal: every hold of
    /// it is lost, and `is_alive` agrees with the error the caller gets.
    async fn on_error(&mut self, e: Error, retrying: &'static str) -> Result<(), Error> {
        match e {
            e @ Error::Timeout { .. } => Err(self.last.explain(e, self.state.scheme)),
            e if e.is_retryable() && !matches!(self.wait, Wait::No) => {
                tracing::debug!(error = %e, "{retrying}");
                self.pause(e).await
            }
            e @ Error::SessionLost { .. } => {
                // Not a session closed meanwhile (the core's own
                // `SessionLost` for work past its end): its holds were
                // freed as closed.
                if self.state.check_alive().is_ok() {
                    self.state.mark_lost();
                }
                Err(e)
            }
            e => Err(e),
        }
    }

    /// Waits until the lock may have changed: the adapter's notification, the
    /// holder's expiry hint or the jittered fallback timer, within the
    /// caller's deadline; ends early if the session ends.
    async fn wait_for_change(&self, claim: &mut PendingClaim, busy: Busy) -> Result<(), Error> {
        let state = &self.state;
        let timing = state.timing;
        let now = Instant::now();
        let mut until = now + jitter(timing.poll_fallback);
        if let Some(after) = busy.retry_after
            && let Some(hint) = now.checked_add(after + Duration::from_millis(1))
        {
            until = until.min(hint);
        }
        if let Some(deadline) = self.wait.deadline() {
            until = until.min(deadline);
        }
        Stats::bump(&state.stats.waits);
        let waited = tokio::select! {
            _ = state.ended() => return Err(state.lost_error()),
            w = timeout_at(until + timing.request_timeout, claim.get().wait(until)) => w,
        };
        match waited {
            Ok(Ok(())) | Err(_) => Ok(()),
            Ok(Err(e)) if e.is_retryable() => {
                tokio::select! {
                    _ = state.ended() => Err(state.lost_error()),
                    _ = sleep_until(until) => Ok(()),
                }
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// Sleeps before retrying after `failed` (remembered in `last`);
    /// [`Error::Timeout`] (with `failed` as its cause) if the caller's
    /// deadline comes first, [`Error::SessionLost`] if the session ends.
    async fn pause(&mut self, failed: Error) -> Result<(), Error> {
        let mut until = Instant::now() + self.backoff.next();
        self.last = Last::Failed(failed);
        if let Wait::Until(deadline, asked) = self.wait {
            if Instant::now() >= deadline {
                let timeout = self.lock.timeout_error(asked, None);
                return Err(self.last.explain(timeout, self.state.scheme));
            }
            until = until.min(deadline);
        }
        tokio::select! {
            _ = self.state.ended() => Err(self.state.lost_error()),
            _ = sleep_until(until) => Ok(()),
        }
    }

    /// Bounds one store request by the session's request timeout and the
    /// caller's deadline (which wins: [`Error::Timeout`] without a cause,
    /// which [`Last::explain`] supplies), and by the session's life.
    async fn request<T>(&self, fut: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let state = &self.state;
        let mut limit = Instant::now() + state.timing.request_timeout;
        let mut cut_by_caller = None;
        if let Wait::Until(deadline, asked) = self.wait
            && deadline < limit
        {
            limit = deadline;
            cut_by_caller = Some(asked);
        }
        tokio::select! {
            r = timeout_at(limit, fut) => match r {
                Ok(r) => r,
                Err(_) => Err(match cut_by_caller {
                    Some(asked) => self.lock.timeout_error(asked, None),
                    None => Error::unavailable(state.scheme, "request timed out"),
                }),
            },
            _ = state.ended(), if !matches!(self.wait, Wait::No) => Err(state.lost_error()),
        }
    }
}
