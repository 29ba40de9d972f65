//! [`PendingClaim`]: the acquire loop's claim until it is granted or withdrawn.

use std::sync::Arc;

use crate::backend::primitives::Claim;
use crate::state::SessionState;

/// Owns a claim until it is granted; otherwise abandons it in the
/// background (also when the acquire future is dropped mid-way), retrying
/// until the clean-up succeeds or the session ends (S5, issue 12 item 13).
/// This is what makes every acquire future cancel safe: whatever await point
/// it is dropped at, the claim it opened is withdrawn.
pub(super) struct PendingClaim {
    claim: Option<Box<dyn Claim>>,
    state: Arc<SessionState>,
}

impl PendingClaim {
    pub(super) fn new(claim: Box<dyn Claim>, state: Arc<SessionState>) -> Self {
        Self {
            claim: Some(claim),
            state,
        }
    }

    pub(super) fn get(&mut self) -> &mut Box<dyn Claim> {
        self.claim.as_mut().expect("claim used after it ended")
    }

    /// The claim was granted: the guard owns the hold from now on, nothing
    /// is abandoned.
    pub(super) fn disarm(&mut self) {
        self.claim = None;
    }

    /// Abandons and waits for the first clean-up try (retries, if any, go
    /// on in the background). Dropping this future does not cut it short.
    pub(super) async fn abandon_now(&mut self) {
        if let Some(first_try) = self.spawn_abandon() {
            let _ = first_try.await;
        }
    }

    /// Spawns the clean-up; the returned receiver resolves after its first try.
    fn spawn_abandon(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let mut claim = self.claim.take()?;
        let (tried, first_try) = tokio::sync::oneshot::channel();
        let mut cleanup = self.state.cleanup("abandoning a claim");
        self.state.spawn(async move {
            let mut tried = Some(tried);
            loop {
                let done = cleanup.try_once(claim.abandon()).await;
                if let Some(tried) = tried.take() {
                    let _ = tried.send(());
                }
                if done || !cleanup.wait_to_retry().await {
                    return;
                }
            }
        });
        Some(first_try)
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        let _ = self.spawn_abandon();
    }
}
