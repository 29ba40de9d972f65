//! Session options: TTL, renewal period, drift margin, fallback poll.

use std::time::Duration;

use crate::Error;

/// The largest TTL dlock accepts: a day. Longer leases only delay recovery
/// from a crashed holder (invariant L1) and are better expressed as renewal.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How a session keeps its locks: TTL and the timing derived from it.
///
/// Only the TTL usually needs setting; the rest default to values derived from
/// it. The TTL is the time the *store* keeps a lock after the holder's last
/// successful renewal; a crashed holder's lock becomes free after it
/// (invariant L1), so it trades recovery time against tolerance of pauses.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::SessionOptions;
/// let opts = SessionOptions::new().ttl(Duration::from_secs(9));
/// assert_eq!(opts.renew_every_or_default(), Duration::from_secs(3));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionOptions {
    ttl: Duration,
    renew_every: Option<Duration>,
    drift: Option<Duration>,
    poll_fallback: Option<Duration>,
    request_timeout: Option<Duration>,
    label: Option<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionOptions {
    /// Defaults: a 30 s TTL, renewal every TTL/3, drift margin TTL/100 + 2 ms.
    pub fn new() -> Self {
        Self {
            ttl: Duration::from_secs(30),
            renew_every: None,
            drift: None,
            poll_fallback: None,
            request_timeout: None,
            label: None,
        }
    }

    /// Sets the TTL (checked against the backend's bounds when the session opens).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Sets how often renewals are sent (default TTL/3, so two may fail before
    /// the lock is lost).
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// Sets the drift margin subtracted from every local validity deadline
    /// (invariant S4), covering clock-rate differences between client and store
    /// (default TTL/100 + 2 ms, as Redlock's).
    pub fn drift(mut self, drift: Duration) -> Self {
        self.drift = Some(drift);
        self
    }

    /// Sets the fallback timer of a waiting acquire: a waiter re-checks at least
    /// this often even if no notification arrives (invariant L2; default TTL/2,
    /// clamped to 50 ms ..= 2 s).
    pub fn poll_fallback(mut self, every: Duration) -> Self {
        self.poll_fallback = Some(every);
        self
    }

    /// Sets the time after which one store request counts as failed and is
    /// retried (default half the renewal period, at most 10 s). It must be
    /// shorter than the renewal period: a renewal stuck on a connection that
    /// died silently then fails in time for a retry on a new connection
    /// while the store still holds the lock.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    /// Adds a label (e.g. the program name) to the session id; letters, digits
    /// and `-_.` only, at most 32 bytes.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// The TTL asked for.
    pub fn ttl_value(&self) -> Duration {
        self.ttl
    }

    /// The label, if set.
    pub fn label_value(&self) -> Option<&str> {
        self.label.as_deref()
    }

    /// The renewal period in effect.
    pub fn renew_every_or_default(&self) -> Duration {
        self.renew_every.unwrap_or(self.ttl / 3)
    }

    /// The drift margin in effect.
    pub fn drift_or_default(&self) -> Duration {
        self.drift
            .unwrap_or(self.ttl / 100 + Duration::from_millis(2))
    }

    /// The fallback poll period in effect.
    pub fn poll_fallback_or_default(&self) -> Duration {
        self.poll_fallback.unwrap_or_else(|| {
            (self.ttl / 2).clamp(Duration::from_millis(50), Duration::from_secs(2))
        })
    }

    /// The request timeout in effect.
    pub fn request_timeout_or_default(&self) -> Duration {
        self.request_timeout
            .unwrap_or_else(|| (self.renew_every_or_default() / 2).min(Duration::from_secs(10)))
    }

    /// How long opening a session may take: the request timeout, but at
    /// least the TTL (within 1 s ..= 10 s), since opening may connect first.
    pub fn open_timeout(&self) -> Duration {
        self.request_timeout_or_default().max(
            self.ttl
                .clamp(Duration::from_secs(1), Duration::from_secs(10)),
        )
    }

    /// Checks the options against a backend's smallest TTL.
    ///
    /// Called by [`Backend::session`](crate::Backend::session); adapters that
    /// negotiate the TTL (ZooKeeper) call it again with what they got.
    pub fn validate(&self, min_ttl: Duration) -> Result<(), Error> {
        if self.ttl < min_ttl || self.ttl > MAX_TTL || self.ttl.is_zero() {
            return Err(Error::InvalidTtl {
                ttl: self.ttl,
                min: min_ttl,
                max: MAX_TTL,
            });
        }
        let drift = self.drift_or_default();
        if drift >= self.ttl / 2 {
            return Err(Error::Config(format!(
                "drift margin {drift:?} must be less than half the TTL {:?}",
                self.ttl
            )));
        }
        let renew = self.renew_every_or_default();
        if renew.is_zero() || renew > (self.ttl - drift) / 2 {
            return Err(Error::Config(format!(
                "renewal period {renew:?} must be positive and at most (TTL - drift)/2 = {:?}, \
                 so that one lost renewal does not lose the lock",
                (self.ttl - drift) / 2
            )));
        }
        let poll = self.poll_fallback_or_default();
        if poll.is_zero() || poll > MAX_TTL {
            return Err(Error::Config(format!(
                "fallback poll period {poll:?} must be positive and at most {MAX_TTL:?}"
            )));
        }
        let request_timeout = self.request_timeout_or_default();
        if request_timeout.is_zero() || request_timeout >= renew {
            return Err(Error::Config(format!(
                "request timeout {request_timeout:?} must be positive and less than the renewal \
                 period {renew:?}, so that a renewal stuck on a dead connection is retried in time"
            )));
        }
        if let Some(label) = &self.label {
            let ok = !label.is_empty()
                && label.len() <= 32
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if !ok {
                return Err(Error::Config(format!(
                    "session label {label:?} must be 1-32 of [A-Za-z0-9-_.]"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ttl_bounds_are_typed() {
        let min = 100 * MS;
        for ttl in [Duration::ZERO, 99 * MS, MAX_TTL + MS] {
            match SessionOptions::new().ttl(ttl).validate(min) {
                Err(Error::InvalidTtl { ttl: t, min: m, .. }) => {
                    assert_eq!((t, m), (ttl, min));
                }
                other => panic!("{ttl:?}: {other:?}"),
            }
        }
        SessionOptions::new().ttl(min).validate(min).unwrap();
    }

    #[test]
    fn renewal_must_leave_room_for_one_failure() {
        let o = SessionOptions::new()
            .ttl(Duration::from_secs(3))
            .renew_every(Duration::from_secs(2));
        assert!(matches!(o.validate(MS), Err(Error::Config(_))));
        let o = SessionOptions::new()
            .ttl(Duration::from_secs(3))
            .drift(Duration::from_secs(2));
        assert!(matches!(o.validate(MS), Err(Error::Config(_))));
    }

    #[test]
    fn requests_time_out_within_the_renewal_period() {
        let o = SessionOptions::new().ttl(Duration::from_secs(9));
        assert_eq!(o.request_timeout_or_default(), Duration::from_millis(1500));
        o.validate(MS).unwrap();
        let o = SessionOptions::new()
            .ttl(Duration::from_secs(9))
            .request_timeout(Duration::from_secs(3));
        assert!(matches!(o.validate(MS), Err(Error::Config(_))));
        let long = SessionOptions::new().ttl(Duration::from_secs(3600));
        assert_eq!(long.request_timeout_or_default(), Duration::from_secs(10));
    }

    #[test]
    fn bad_labels_are_refused() {
        for l in ["", "a b", &"x".repeat(33)] {
            assert!(
                SessionOptions::new().label(l).validate(MS).is_err(),
                "{l:?}"
            );
        }
        SessionOptions::new()
            .label("cron-job_1.2")
            .validate(MS)
            .unwrap();
    }
}
