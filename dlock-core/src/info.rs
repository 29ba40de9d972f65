//! Session ids and what `inspect` reports.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{FencingToken, LockName};

/// A session's id, naming the process like the seeds' `config.lockpings`:
/// `host:pid:start:random` (plus `:label` if one was set).
///
/// Only characters valid in lock names, so adapters may embed it in keys and
/// paths.
///
/// ```
/// use dlock_core::SessionId;
/// let id = SessionId::generate(Some("cron"));
/// assert_eq!(id.as_str().split(':').count(), 5);
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(Arc<str>);

impl SessionId {
    /// A fresh id for this process.
    pub fn generate(label: Option<&str>) -> Self {
        let host: String = gethostname::gethostname()
            .to_string_lossy()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        let host = if host.is_empty() { "host".into() } else { host };
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let random: u32 = rand::random();
        let mut id = format!("{host}:{}:{start}:{random:08x}", std::process::id());
        if let Some(label) = label {
            id.push(':');
            id.push_str(label);
        }
        Self(id.into())
    }

    /// Wraps an id read back from a store.
    pub fn from_stored(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A fresh owner value for one claim of this session: the id, `#` and
    /// 64 random bits, so two claims of one session on one name (a retry
    /// after a lost reply, a second guard) never pass for each other, and
    /// [`SessionId::issued`] still tells this session's owners from others'.
    ///
    /// ```
    /// use dlock_core::SessionId;
    /// let id = SessionId::generate(None);
    /// let owner = id.claim_owner();
    /// assert!(id.issued(&owner));
    /// assert_ne!(owner, id.claim_owner());
    /// assert!(!SessionId::generate(None).issued(&owner));
    /// ```
    pub fn claim_owner(&self) -> String {
        format!("{self}#{:016x}", rand::random::<u64>())
    }

    /// Whether `owner` is one of this session's [`claim_owner`](Self::claim_owner)
    /// values (S3: another session's hold is refused even with the right
    /// key and token).
    pub fn issued(&self, owner: &str) -> bool {
        owner
            .strip_prefix(self.as_str())
            .is_some_and(|rest| rest.starts_with('#'))
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What [`Backend::inspect`](crate::Backend::inspect) reports about a held lock.
///
/// Times are by the store's clock where the store keeps one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock.
    pub name: LockName,
    /// The holder's session id.
    pub holder: String,
    /// The holder's fencing token.
    pub token: FencingToken,
    /// The reason given at acquisition (the seeds' `why`).
    pub why: Option<String>,
    /// When it was acquired, by the store's clock.
    pub acquired_at: Option<SystemTime>,
    /// When the store will free it unless renewed.
    pub expires_at: Option<SystemTime>,
    /// For a lock bound to its holder's session whose expiry the store keeps
    /// to itself (ZooKeeper tells no other client when it last heard from a
    /// session): the store frees the lock about this long after the holder's
    /// session last reached it. `expires_at` is then `None`.
    pub session_timeout: Option<Duration>,
    /// How many clients wait for it, where the store can tell.
    pub waiters: Option<usize>,
}

impl LockInfo {
    /// A record with the required fields; adapters fill in the rest.
    pub fn new(name: LockName, holder: impl Into<String>, token: FencingToken) -> Self {
        Self {
            name,
            holder: holder.into(),
            token,
            why: None,
            acquired_at: None,
            expires_at: None,
            session_timeout: None,
            waiters: None,
        }
    }
}
