//! What a session counts: [`SessionStats`] for readers, [`Stats`] for writers.

use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Renewal periods in which every hold was renewed: by one round, or
    /// by a round and retries of the holds it left unanswered.
    pub renewals: u64,
    /// Renewal rounds that left holds unanswered (failed, timed out, or a
    /// server did not answer for some); what they confirmed still counts.
    pub renewal_failures: u64,
    /// Holds that ended other than by release.
    pub losses: u64,
}

/// The live counters behind [`SessionStats`], bumped by the acquire loop and
/// the renewal task.
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

    /// The counters as they are now.
    pub(crate) fn snapshot(&self) -> SessionStats {
        SessionStats {
            take_attempts: self.take_attempts.load(Ordering::Relaxed),
            grants: self.grants.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            renewals: self.renewals.load(Ordering::Relaxed),
            renewal_failures: self.renewal_failures.load(Ordering::Relaxed),
            losses: self.losses.load(Ordering::Relaxed),
        }
    }
}
