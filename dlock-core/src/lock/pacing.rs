//! Retry timing of the acquire loop and what its timeout reports.

use std::time::Duration;

use crate::error::Error;

/// What the store last said during one acquire: tells a [`Error::Timeout`]
/// for a busy lock (no cause) from one for a store that was failing or
/// silent (the cause), which e.g. `dlock run` reports differently.
pub(super) enum Last {
    /// No request has been answered yet.
    Nothing,
    /// The last answer was "busy".
    Busy,
    /// The last request failed with this transient error.
    Failed(Error),
}

impl Last {
    /// `timeout` with the cause this acquire ended on, if the store was not
    /// answering "busy".
    pub(super) fn explain(&mut self, timeout: Error, scheme: &'static str) -> Error {
        let Error::Timeout {
            name,
            waited,
            cause,
        } = timeout
        else {
            return timeout;
        };
        let cause = cause.or(match std::mem::replace(self, Last::Nothing) {
            Last::Busy => None,
            Last::Failed(e) => Some(Box::new(e)),
            Last::Nothing => Some(Box::new(Error::unavailable(scheme, NoAnswer))),
        });
        Error::Timeout {
            name,
            waited,
            cause,
        }
    }
}

/// ±10 % so that waiters polling the same lock spread out.
pub(super) fn jitter(d: Duration) -> Duration {
    let factor = 0.9 + rand::random::<f64>() * 0.2;
    d.mul_f64(factor)
}

/// Retry pacing: 10 ms doubling to 1 s, jittered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Self {
        Backoff(Duration::from_millis(10))
    }
}

impl Backoff {
    pub(super) fn next(&mut self) -> Duration {
        let now = self.0;
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
        jitter(now)
    }
}

/// The cause of a timeout whose acquire heard nothing from the store: a
/// type of its own, so that [`is_no_answer`] tells it by type, never by a
/// text that a store's own error could also carry.
#[derive(Debug, thiserror::Error)]
#[error("no answer before the deadline")]
struct NoAnswer;

/// Whether `cause` is [`Last::explain`]'s "heard nothing" (a semaphore
/// whose tries heard "busy" within the same wait reports busy instead).
pub(crate) fn is_no_answer(cause: &Error) -> bool {
    matches!(cause, Error::Unavailable { source, .. } if source.is::<NoAnswer>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_answer_is_told_by_type_not_text() {
        let timeout = || Error::Timeout {
            name: "x".into(),
            waited: Duration::from_millis(5),
            cause: None,
        };
        let Error::Timeout {
            cause: Some(cause), ..
        } = Last::Nothing.explain(timeout(), "memory")
        else {
            panic!("a timeout that heard nothing has a cause");
        };
        assert!(is_no_answer(&cause));
        assert_eq!(
            cause.to_string(),
            "memory is unavailable: no answer before the deadline"
        );
        // A store's error with the same text is the store's, not silence.
        let same_text = Error::unavailable("memory", "no answer before the deadline");
        assert!(!is_no_answer(&same_text));
    }
}
