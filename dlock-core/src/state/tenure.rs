//! [`Tenure`]: the core's record of one grant while a guard owns it.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::primitives::Hold;
use crate::clock;
use crate::error::Error;
use crate::lost::LostReason;

/// One grant as the core keeps it while it is ours: the store's [`Hold`],
/// its local validity deadline (S4), the lost signal and the count of
/// reentrant guards sharing it. One per grant; [`Hold`] is only what the
/// store needs to find the grant, this is what the holder believes of it.
pub(crate) struct Tenure {
    pub(crate) id: u64,
    pub(crate) hold: Hold,
    epoch: Instant,
    /// Local validity deadline, in nanoseconds since `epoch`.
    deadline: AtomicU64,
    lost: CancellationToken,
    reason: OnceLock<LostReason>,
    /// Live guards of this tenure (reentrancy count).
    guards: AtomicUsize,
    /// [`Lock::hold_at_least`](crate::Lock::hold_at_least): a release
    /// before this instant (deadline clock) is carried out at it.
    pub(crate) keep_until: OnceLock<Instant>,
    /// The backend's scheme and the grant's local time, for the metrics
    /// recorded once when the hold ends.
    scheme: &'static str,
    granted_at: Instant,
}

impl Tenure {
    pub(crate) fn new(
        id: u64,
        hold: Hold,
        epoch: Instant,
        deadline: Instant,
        scheme: &'static str,
    ) -> Self {
        Self {
            scheme,
            granted_at: Instant::now(),
            id,
            hold,
            epoch,
            deadline: AtomicU64::new(nanos_since(epoch, deadline)),
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
            guards: AtomicUsize::new(1),
            keep_until: OnceLock::new(),
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
            crate::telemetry::hold_ended(self.scheme, reason, self.granted_at.elapsed());
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
    pub(crate) fn leave(&self) -> bool {
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

/// `t` as nanoseconds after `epoch` (saturating), for deadlines kept in atomics.
pub(crate) fn nanos_since(epoch: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(epoch)
        .as_nanos()
        .min(u64::MAX as u128) as u64
}
