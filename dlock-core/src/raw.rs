//! Under the user API: the adapter-level side of a [`Session`] and a
//! [`LockGuard`], for adapter authors, the conformance suite and tools that
//! talk to the store directly. Applications do not need any of it.
//!
//! These are free functions rather than methods so that the user types'
//! method lists stay the user's: what is here bypasses the core (a release
//! through [`session`] is not tracked by the session) or exposes numbers
//! that are only meaningful to someone checking the core's timing.
//!
//! ```
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions, memory::MemoryBackend, raw};
//! let backend = MemoryBackend::new();
//! let a = backend.session(SessionOptions::new()).await?;
//! let b = backend.session(SessionOptions::new()).await?;
//! let guard = a.lock("x")?.acquire().await?;
//! // Another session cannot release A's hold, even with its key and token (S3).
//! assert!(raw::session(&b).release(raw::hold(&guard)).await.is_err());
//! guard.release().await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use crate::backend::primitives::{Hold, RawSession};
use crate::guard::LockGuard;
use crate::session::Session;

/// The store side of `session`: calls on it bypass the core (nothing is
/// tracked, renewed or cleaned up), e.g. a release attempt by a non-owner.
pub fn session(session: &Session) -> &Arc<dyn RawSession> {
    &session.state().raw
}

/// The store-level hold behind `guard` (name, token, adapter key).
pub fn hold(guard: &LockGuard) -> &Hold {
    &guard.tenure.hold
}

/// The renewal period `session` runs with (from its options and the TTL in
/// effect), for bounds on how soon a loss is noticed.
pub fn renew_every(session: &Session) -> Duration {
    session.state().timing.renew_every
}

/// The request timeout `session` runs with (from its options and the TTL
/// in effect): how long one store request may take before it counts as
/// failed, and how long a failed multi-lock or read-write lock attempt
/// waits for the releases of what it took.
pub fn request_timeout(session: &Session) -> Duration {
    session.state().timing.request_timeout
}

/// The fallback poll period of `session`'s waiting acquires, for bounds on
/// wake-up latency without notifications.
pub fn poll_fallback(session: &Session) -> Duration {
    session.state().timing.poll_fallback
}

/// Background tasks `session` has running: the renewal task plus any
/// pending releases or abandoned-claim clean-ups. Zero after `close`; a
/// leak check (S5).
pub fn background_tasks(session: &Session) -> usize {
    session.state().task_count()
}

/// Number of locks `session` holds now, as the core counts them; a leak
/// check (S5).
pub fn held_count(session: &Session) -> usize {
    session.state().tenure_count()
}
