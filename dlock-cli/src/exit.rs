//! Exit statuses (see the table in the crate docs) and [`Failure`], an error
//! that knows its status.

use std::fmt;

use dlocks::Error;

/// `status`: the lock is free (an answer, never an error).
pub(crate) const FREE: u8 = 1;
/// Errors of dlock itself or replies it cannot use (`EX_SOFTWARE`).
pub(crate) const FAILURE: u8 = 70;
/// The store refused the credentials (`EX_NOPERM`).
pub(crate) const AUTH: u8 = 77;
/// Usage errors: bad flags, durations, names or URLs; backend not compiled in.
pub(crate) const USAGE: u8 = 2;
/// The backend is unreachable, or the session ended for good
/// (`EX_UNAVAILABLE`).
pub(crate) const UNAVAILABLE: u8 = 69;
/// `run`: the lock was not acquired (`EX_TEMPFAIL`); `--conflict-exit-code`.
pub(crate) const CONFLICT: u8 = 75;
/// `run`: the lock was lost while the command ran.
pub(crate) const LOST: u8 = 76;
/// `run`: the command exists but cannot be executed.
pub(crate) const NOT_EXECUTABLE: u8 = 126;
/// `run`: the command was not found.
pub(crate) const NOT_FOUND: u8 = 127;
/// Added to a signal number: killed by that signal, as shells report it.
pub(crate) const SIGNAL_BASE: u8 = 128;

/// An error to print as `dlock: <message>` before exiting with `code`.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The exit status.
    pub(crate) code: u8,
    /// One line, without the `dlock: ` prefix.
    pub(crate) message: String,
}

impl Failure {
    /// A failure with the given status and message.
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A usage error (status 2).
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Self::new(code_for(&e), e.to_string())
    }
}

/// The exit status for a dlock error outside the `run` wait (where a timeout
/// is a conflict instead).
pub(crate) fn code_for(e: &Error) -> u8 {
    match e {
        Error::InvalidName { .. }
        | Error::InvalidTtl { .. }
        | Error::InvalidUrl { .. }
        | Error::Config(_)
        | Error::FeatureDisabled { .. } => USAGE,
        Error::Unavailable { .. } | Error::SessionLost { .. } => UNAVAILABLE,
        Error::Auth { .. } => AUTH,
        Error::Timeout { .. } => CONFLICT,
        Error::Lost { .. } => LOST,
        _ => FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_documented_statuses() {
        let bad_name = dlocks::LockName::new("a b").unwrap_err();
        assert_eq!(Failure::from(bad_name).code, USAGE);
        let bad_url = Error::invalid_url("gopher://u:pw@h", "unknown scheme");
        let failure = Failure::from(bad_url);
        assert_eq!(failure.code, USAGE);
        assert!(!failure.message.contains("pw@"), "{failure}");
        assert_eq!(
            code_for(&Error::unavailable("redis", "refused")),
            UNAVAILABLE
        );
        assert_eq!(code_for(&Error::Config("x".into())), USAGE);
        assert_eq!(code_for(&Error::protocol("sql", "garbage")), FAILURE);
        let lost = Error::session_lost("s", "expired");
        assert_eq!(code_for(&lost), UNAVAILABLE);
        // An error never shares a status with `status`'s answer "free".
        for e in [
            Error::protocol("sql", "garbage"),
            Error::backend("sql", "denied"),
            Error::Auth {
                backend: "sql",
                reason: "wrong password".into(),
            },
            lost,
        ] {
            assert_ne!(code_for(&e), FREE, "{e}");
        }
    }
}
