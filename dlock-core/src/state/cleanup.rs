//! Work left in the store that the session finishes: releases (by a guard,
//! after a failure, of a lost hold) and [`Cleanup`]s retried with backoff.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, sleep, sleep_until, timeout};
use tracing::Instrument;

use super::{SessionState, Tenure};
use crate::backend::primitives::Hold;
use crate::clock;
use crate::error::Error;
use crate::lost::LostReason;

/// A clean-up in the store (an abandoned claim, a lost hold): tried until
/// it succeeds or finds nothing to clean ([`Error::NotHeld`]), retrying
/// transient errors with backoff while the session lives and what it cleans
/// would not expire by itself anyway (issue 12 item 13: a clean-up sent once
/// and dropped on error leaves an orphan for as long as the session lives).
pub(crate) struct Cleanup {
    pub(super) state: Arc<SessionState>,
    pub(super) what: &'static str,
    pub(super) backoff: Duration,
    pub(super) expires: Option<Instant>,
}

impl Cleanup {
    /// Runs one try within the request timeout; true when done.
    pub(crate) async fn try_once(
        &mut self,
        request: impl Future<Output = Result<(), Error>>,
    ) -> bool {
        match timeout(self.state.timing.request_timeout, request).await {
            Ok(Ok(()) | Err(Error::NotHeld { .. })) => true,
            Ok(Err(e)) if !e.is_retryable() => {
                tracing::debug!(target: crate::state::LOG_TARGET, what = self.what, error = %e, "clean-up failed for good");
                true
            }
            Ok(Err(e)) => {
                tracing::debug!(target: crate::state::LOG_TARGET, what = self.what, error = %e, "clean-up failed; retrying");
                false
            }
            Err(_) => {
                tracing::debug!(target: crate::state::LOG_TARGET, what = self.what, "clean-up timed out; retrying");
                false
            }
        }
    }

    /// Waits before the next try; false when trying again is pointless
    /// (the session ended, or what is left has expired by itself).
    pub(crate) async fn wait_to_retry(&mut self) -> bool {
        let next = Instant::now() + self.backoff;
        self.backoff =
            (self.backoff * 2).min(self.state.timing.renew_every.max(Duration::from_millis(10)));
        if self.expires.is_some_and(|e| next >= e) {
            return false;
        }
        tokio::select! {
            _ = self.state.ended.cancelled() => false,
            _ = sleep_until(next) => true,
        }
    }
}

impl SessionState {
    /// Ends a tenure by release, on behalf of its last guard.
    pub(crate) async fn release(self: Arc<Self>, tenure: Arc<Tenure>) -> Result<(), Error> {
        self.forget(&tenure);
        let lost_before = tenure.lost_error();
        tenure.lose(LostReason::Released);
        let give_up_at = tenure.deadline() + self.timing.drift;
        let span = tracing::debug_span!("dlock.release", lock = %tenure.hold.name, backend = self.scheme, session = %self.id);
        let result = self
            .release_in_store(&tenure.hold, tenure.deadline(), give_up_at)
            .instrument(span)
            .await;
        if result.as_ref().is_err_and(Error::is_retryable) {
            // Not confirmed, and the session no longer renews the hold by name;
            // where the session's lease keeps it, it would stay taken for as long
            // as the session lives: keep trying in the background (item 13).
            self.release_in_background(tenure.hold.clone(), "releasing after a failed release");
        }
        tracing::debug!(target: crate::state::LOG_TARGET, lock = %tenure.hold.name, token = %tenure.hold.token, session = %self.id, ok = result.is_ok(), "released");
        match lost_before {
            Some(lost) => Err(lost),
            None => result,
        }
    }

    /// Releases `hold` in the store, retrying transient errors until the store
    /// would have expired it anyway. A `NotHeld` after a try whose reply
    /// was lost means that try succeeded, but only if it comes back
    /// before the hold's local `deadline`: until then the store cannot have
    /// expired the hold (S4), later it may have, and the release is not
    /// known to have ended a valid hold.
    async fn release_in_store(
        &self,
        hold: &Hold,
        deadline: Instant,
        give_up_at: Instant,
    ) -> Result<(), Error> {
        self.until_confirmed("release", give_up_at, |retried| async move {
            match self.raw.release(hold).await {
                Err(Error::NotHeld { .. }) if retried && clock::now() < deadline => Ok(()),
                result => result,
            }
        })
        .await
    }

    /// Runs `request` (told whether an earlier try went unconfirmed) within
    /// the request timeout, retrying a time-out or a transient error with
    /// backoff (10 ms doubling to 500 ms) while the next try would begin
    /// before `give_up_at`: what `request` frees in the store would expire
    /// by then anyway. Every request it runs must be safe to repeat.
    pub(super) async fn until_confirmed<F, Fut>(
        &self,
        what: &'static str,
        give_up_at: Instant,
        mut request: F,
    ) -> Result<(), Error>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let mut retried = false;
        let mut backoff = Duration::from_millis(10);
        loop {
            let result = match timeout(self.timing.request_timeout, request(retried)).await {
                Ok(result) => result,
                Err(_) => Err(Error::unavailable(self.scheme, format!("{what} timed out"))),
            };
            match result {
                Err(e) if e.is_retryable() && clock::now() + backoff < give_up_at => {
                    tracing::debug!(target: crate::state::LOG_TARGET, what, error = %e, "not confirmed; retrying");
                    retried = true;
                    sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                result => return result,
            }
        }
    }

    /// Releases `hold` in the store as a [`Cleanup`]: retried with backoff
    /// until done, the session ends, or the hold would have expired anyway.
    pub(super) fn release_in_background(self: &Arc<Self>, hold: Hold, what: &'static str) {
        let state = self.clone();
        let mut cleanup = self.cleanup(what);
        self.spawn(async move {
            while !cleanup.try_once(state.raw.release(&hold)).await {
                if !cleanup.wait_to_retry().await {
                    return;
                }
            }
        });
    }
}
