//! [`LostReason`]: why a hold ended. A leaf module, so that the error type,
//! the session state and the guard can all name it without depending on
//! each other.

use std::fmt;

/// Why a hold ended; what [`LockGuard::lost`](crate::LockGuard::lost) resolves with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostReason {
    /// The local validity deadline passed before a renewal was confirmed
    /// (invariant S4): the store may give the lock to someone else from now on.
    Expired,
    /// The store reported that this session no longer holds the lock (it
    /// expired there, or an admin force-released it).
    Revoked,
    /// The session ended in the store (lease revoked, ZooKeeper session expired).
    SessionLost,
    /// The session was closed by its owner while the lock was held.
    Closed,
    /// The holder released it: not a loss, but the hold is over.
    Released,
    /// The hold reached its [`Lock::hold_at_most`](crate::Lock::hold_at_most)
    /// limit; it is released in the background.
    HoldLimit,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LostReason::Expired => "local validity deadline passed without a confirmed renewal",
            LostReason::Revoked => "the store no longer records this session as holder",
            LostReason::SessionLost => "the session expired in the store",
            LostReason::Closed => "the session was closed",
            LostReason::Released => "released by the holder",
            LostReason::HoldLimit => "held for its hold_at_most limit",
        })
    }
}
