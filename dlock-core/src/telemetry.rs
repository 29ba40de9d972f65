//! Metrics through the [`metrics`] facade and the names they go by: written
//! here once, so the table in the crate docs is the whole list. Nothing is
//! recorded unless the application installs a recorder (a Prometheus
//! exporter, say); without one each call costs a few nanoseconds.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `dlock_acquire_total` | counter | `backend`, `outcome` | acquires by how they ended: `granted`, `busy` (a try found it held), `timeout` (the wait ran out), `error` |
//! | `dlock_acquire_wait_seconds` | histogram | `backend`, `outcome` | from the call to its answer |
//! | `dlock_hold_seconds` | histogram | `backend` | from the grant to the end of the hold (released or lost) |
//! | `dlock_renewal_seconds` | histogram | `backend` | one renewal round that answered for every hold it sent (all of a session's holds, or a retry's rest) |
//! | `dlock_renewal_lag_seconds` | histogram | `backend` | time left before the earliest local deadline when a renewal lands: the early warning of a lost lock (near zero: the store or network is too slow for the TTL) |
//! | `dlock_renewal_failures_total` | counter | `backend` | renewal rounds that failed, timed out or left some holds unanswered (what they confirmed stands; the rest is retried until its deadline), or found the session gone |
//! | `dlock_lost_total` | counter | `backend`, `cause` | holds that ended other than by release: `expired`, `revoked`, `session_lost`, `closed` (the session closed while holding), `hold_limit` |
//! | `dlock_sessions_open` | gauge | `backend` | sessions alive now |
//!
//! Lock names are never labels (unbounded cardinality); they are fields of
//! the `tracing` spans `dlock.acquire`, `dlock.renew` and `dlock.release`.

use std::time::Duration;

use crate::lost::LostReason;

/// Metric names (public so dashboards and tests can refer to them).
pub mod names {
    /// Counter: acquires by `backend` and `outcome`.
    pub const ACQUIRE_TOTAL: &str = "dlock_acquire_total";
    /// Histogram (seconds): acquire call to answer, by `backend` and `outcome`.
    pub const ACQUIRE_WAIT: &str = "dlock_acquire_wait_seconds";
    /// Histogram (seconds): grant to end of hold, by `backend`.
    pub const HOLD: &str = "dlock_hold_seconds";
    /// Histogram (seconds): one renewal round trip, by `backend`.
    pub const RENEWAL: &str = "dlock_renewal_seconds";
    /// Histogram (seconds): time left before the earliest local deadline
    /// when a renewal lands, by `backend`.
    pub const RENEWAL_LAG: &str = "dlock_renewal_lag_seconds";
    /// Counter: failed or timed-out renewals, by `backend`.
    pub const RENEWAL_FAILURES: &str = "dlock_renewal_failures_total";
    /// Counter: holds ended other than by release, by `backend` and `cause`.
    pub const LOST_TOTAL: &str = "dlock_lost_total";
    /// Gauge: sessions alive, by `backend`.
    pub const SESSIONS_OPEN: &str = "dlock_sessions_open";
}

/// How an acquire ended, as the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Granted,
    Busy,
    Timeout,
    Error,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Granted => "granted",
            Outcome::Busy => "busy",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
        }
    }
}

pub(crate) fn acquired(backend: &'static str, outcome: Outcome, took: Duration) {
    let outcome = outcome.label();
    metrics::counter!(names::ACQUIRE_TOTAL, "backend" => backend, "outcome" => outcome)
        .increment(1);
    metrics::histogram!(names::ACQUIRE_WAIT, "backend" => backend, "outcome" => outcome)
        .record(took.as_secs_f64());
}

/// A hold ended after `held`; `reason` other than `Released` is a loss.
pub(crate) fn hold_ended(backend: &'static str, reason: LostReason, held: Duration) {
    metrics::histogram!(names::HOLD, "backend" => backend).record(held.as_secs_f64());
    let cause = match reason {
        LostReason::Released => return,
        LostReason::Expired => "expired",
        LostReason::Revoked => "revoked",
        LostReason::SessionLost => "session_lost",
        LostReason::Closed => "closed",
        LostReason::HoldLimit => "hold_limit",
    };
    metrics::counter!(names::LOST_TOTAL, "backend" => backend, "cause" => cause).increment(1);
}

/// A renewal confirmed after `took`, landing `lag` before the earliest
/// local deadline it extends (`None`: no hold to extend).
pub(crate) fn renewed(backend: &'static str, took: Duration, lag: Option<Duration>) {
    metrics::histogram!(names::RENEWAL, "backend" => backend).record(took.as_secs_f64());
    if let Some(lag) = lag {
        metrics::histogram!(names::RENEWAL_LAG, "backend" => backend).record(lag.as_secs_f64());
    }
}

pub(crate) fn renewal_failed(backend: &'static str) {
    metrics::counter!(names::RENEWAL_FAILURES, "backend" => backend).increment(1);
}

/// A session opened (`+1`) or ended (`-1`).
pub(crate) fn sessions_open(backend: &'static str, delta: f64) {
    metrics::gauge!(names::SESSIONS_OPEN, "backend" => backend).increment(delta);
}
