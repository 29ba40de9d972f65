//! The one error type of dlock, shared by every adapter.

use std::time::Duration;

use crate::lost::LostReason;

/// A boxed error from a driver, kept as the `source` of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias used throughout dlock.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, by meaning rather than by store.
///
/// Adapters map their driver errors into these variants, so code written
/// against one backend handles another the same way. [`Error::is_retryable`]
/// says whether trying again later may succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A lock name (or listing prefix) breaks one of [`LockName`](crate::LockName)'s rules.
    #[error("invalid lock name \"{name}\": {reason}")]
    InvalidName {
        /// The offending name, escaped and shortened for display.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },

    /// A session TTL outside the bounds this backend can honour.
    #[error(
        "invalid TTL {ttl:?}: must be between {min:?} and {max:?}{}",
        if *max < crate::MAX_TTL { " (the backend's max_ttl: an option of its URL sets it, ?max_ttl= on Redis, ?max_age= on NATS)" } else { "" }
    )]
    InvalidTtl {
        /// The TTL asked for.
        ttl: Duration,
        /// The smallest TTL this backend allows.
        min: Duration,
        /// The largest TTL dlock allows.
        max: Duration,
    },

    /// A URL that cannot be used (bad syntax, unknown scheme, missing host ...).
    /// Passwords are never included.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL with any password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Any other configuration value that is out of range or malformed.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// The URL's backend exists but was not compiled in.
    #[error(
        "the {scheme}:// backend is not compiled in; enable the `{feature}` feature of the `dlocks` crate"
    )]
    FeatureDisabled {
        /// The URL scheme.
        scheme: String,
        /// The Cargo feature that provides it.
        feature: &'static str,
    },

    /// `acquire_timeout` gave up: the lock stayed busy, or (with `cause`)
    /// the store did not answer in time.
    #[error("timed out after {waited:?} waiting for lock {name:?}{}", cause.as_ref().map(|c| format!(" (the store was not answering: {c})")).unwrap_or_default())]
    Timeout {
        /// The lock that was not acquired.
        name: String,
        /// How long the caller waited.
        waited: Duration,
        /// The transient error the wait ended on, if the store was failing
        /// rather than the lock busy (a CLI says "unreachable", not "busy").
        #[source]
        cause: Option<Box<Error>>,
    },

    /// The store says this session does not hold the lock with this token
    /// (invariant S3): a release or renewal by a non-owner, or too late.
    #[error("lock {name:?} is not held by this session with that token")]
    NotHeld {
        /// The lock.
        name: String,
    },

    /// The hold was lost before the operation (see [`LostReason`]).
    #[error("lock {name:?} was lost: {reason}")]
    Lost {
        /// The lock.
        name: String,
        /// Why it was lost.
        reason: LostReason,
    },

    /// The session has ended (expired on the server, or closed); open a new one.
    #[error("{} is no longer alive: {reason}", session_label(session))]
    SessionLost {
        /// The session id; empty where the driver's error does not say which
        /// session (the text then reads "the session").
        session: String,
        /// Why, in the store's terms ("its lease expired on the server").
        reason: String,
    },

    /// The store could not be reached or did not answer in time. Retryable.
    #[error("{backend} is unavailable: {source}")]
    Unavailable {
        /// Which backend (URL scheme).
        backend: &'static str,
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The store refused the credentials (wrong user or password, a client
    /// certificate it does not accept). Not retryable: retrying a wrong
    /// password only locks accounts. The password is never included.
    #[error("{backend} refused the credentials: {reason}")]
    Auth {
        /// Which backend (URL scheme).
        backend: &'static str,
        /// What the store said, without secrets.
        reason: String,
    },

    /// The store refused the request (permissions, schema, limits). Not retryable.
    #[error("{backend} refused the request: {source}")]
    Backend {
        /// Which backend (URL scheme).
        backend: &'static str,
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The store answered with something dlock cannot interpret.
    #[error("{backend} returned an unexpected reply: {what}")]
    Protocol {
        /// Which backend (URL scheme).
        backend: &'static str,
        /// What was unexpected.
        what: String,
    },
}

/// "session ID", or "the session" when the id is not known where the error was made.
fn session_label(session: &str) -> String {
    if session.is_empty() {
        "the session".to_owned()
    } else {
        format!("session {session}")
    }
}

impl Error {
    /// Whether the same call may succeed if tried again later.
    ///
    /// `Unavailable` (network, server down, request timeout) and `Timeout` (the
    /// lock was busy) are; everything else needs a change first: a valid name, a
    /// new session, a different configuration.
    ///
    /// ```
    /// use dlock_core::Error;
    /// let e = Error::Unavailable { backend: "redis", source: "connection refused".into() };
    /// assert!(e.is_retryable());
    /// assert!(!Error::Config("bad".into()).is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::Timeout { .. })
    }

    /// Shorthand for an [`Error::Unavailable`].
    pub fn unavailable(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Unavailable {
            backend,
            source: source.into(),
        }
    }

    /// Shorthand for an [`Error::SessionLost`].
    ///
    /// ```
    /// use dlock_core::Error;
    /// let e = Error::session_lost("7f3a", "its lease expired on the server");
    /// assert_eq!(e.to_string(), "session 7f3a is no longer alive: its lease expired on the server");
    /// let e = Error::session_lost("", "the client was closed");
    /// assert_eq!(e.to_string(), "the session is no longer alive: the client was closed");
    /// ```
    pub fn session_lost(session: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::SessionLost {
            session: session.into(),
            reason: reason.into(),
        }
    }

    /// The same error, naming `session` if it names no session yet (a
    /// driver's error mapped where the session id is not at hand).
    pub fn in_session(self, id: &str) -> Self {
        match self {
            Error::SessionLost { session, reason } if session.is_empty() => Error::SessionLost {
                session: id.to_owned(),
                reason,
            },
            other => other,
        }
    }

    /// Shorthand for an [`Error::Backend`].
    pub fn backend(backend: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            backend,
            source: source.into(),
        }
    }

    /// Shorthand for an [`Error::Protocol`].
    pub fn protocol(backend: &'static str, what: impl Into<String>) -> Self {
        Error::Protocol {
            backend,
            what: what.into(),
        }
    }

    /// Shorthand for an [`Error::InvalidUrl`]; strips any password from `url`.
    pub fn invalid_url(url: &str, reason: impl Into<String>) -> Self {
        Error::InvalidUrl {
            url: crate::url::redact(url),
            reason: reason.into(),
        }
    }
}
