//! What a lock costs at the least on a store, for `dlock bench` to measure
//! dlock against: the raw operations a lock needs on the adapter's own
//! driver (the *floor*), and the store's own lock where it has one.
//!
//! An adapter opts in with [`Adapter::floor`](crate::Adapter::floor) (or
//! `floor:` in [`impl_adapter!`](crate::impl_adapter)); a third-party
//! adapter gets the same bench columns as a built-in one.
//!
//! ```
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use async_trait::async_trait;
//! use dlock_core::{Error, LockName, floor::Floor};
//!
//! /// A store whose raw take + release is free.
//! #[derive(Debug)]
//! struct Nothing;
//!
//! #[async_trait]
//! impl Floor for Nothing {
//!     fn operations(&self) -> &'static str { "nothing" }
//!     async fn cycle(&self, _key: &LockName) -> Result<(), Error> { Ok(()) }
//! }
//!
//! Nothing.cycle(&LockName::new("bench/floor")?).await?;
//! assert!(Nothing.native().is_none());
//! # Ok(()) }
//! ```

use std::fmt::Debug;

use async_trait::async_trait;

use crate::{Error, FencingToken, LockName};

/// The raw operations one lock needs, on one connection of its own.
///
/// Opened per benchmark client, so a cycle may keep per-connection state
/// (a session-level lock, a lease).
#[async_trait]
pub trait Floor: Send + Sync + Debug {
    /// What one [`Floor::cycle`] sends, for reports
    /// (`"SET NX PX + compare-and-DEL"`).
    fn operations(&self) -> &'static str;

    /// One uncontended take and release of `key` with the fewest requests
    /// the store allows: the lower bound of a dlock acquire + release.
    /// `key` is free and nobody else uses it.
    ///
    /// # Cancel safety
    /// May leave `key` taken until the connection closes.
    async fn cycle(&self, key: &LockName) -> Result<(), Error>;

    /// The store's own lock, if it has one (etcd's lock service,
    /// PostgreSQL's advisory locks): what dlock is compared with under
    /// contention. `None` by default.
    fn native(&self) -> Option<&dyn NativeLock> {
        None
    }

    /// The store's fenced writer next to the same write without it, if the
    /// adapter has one: what fencing the data adds to the user's own write.
    /// `None` by default.
    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        None
    }
}

/// One small write of the protected data, unguarded and through the
/// store's fenced writer (`SqlFence`, `RedisFence`, ...), on the floor's
/// connection: `dlock bench` times the two alternately and reports their
/// ratio.
#[async_trait]
pub trait FencedWrite: Send + Sync {
    /// What the two writes send, for reports (`"SET"` against
    /// `"RedisFence::set (one EVALSHA)"`).
    fn operations(&self) -> &'static str;

    /// Makes what the writes of `key` need (a table, a node, a document);
    /// called once before they are timed.
    async fn prepare(&self, key: &LockName) -> Result<(), Error> {
        let _ = key;
        Ok(())
    }

    /// Writes `value` under `key` as a user would without fencing.
    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error>;

    /// The same write through the fenced writer, with `token`. The bench
    /// passes increasing tokens for a key, so every write is accepted; a
    /// refusal is an error.
    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error>;

    /// Deletes the data and the fence of `key` (the bench's keys are its
    /// own; a real fence is never deleted).
    async fn remove(&self, key: &LockName) -> Result<(), Error>;
}

/// A store's own blocking lock.
#[async_trait]
pub trait NativeLock: Send + Sync {
    /// Its name, for reports (`"pg_advisory_lock"`).
    fn name(&self) -> &'static str;

    /// Takes the lock `key`, waiting as long as another holds it.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped wait may still be granted, until the
    /// connection closes.
    async fn lock(&self, key: &LockName) -> Result<Box<dyn NativeGuard>, Error>;
}

/// A held [`NativeLock`].
#[async_trait]
pub trait NativeGuard: Send {
    /// Gives the lock back. A guard dropped without this keeps the lock
    /// until the store notices (a closed connection, a lease's end).
    async fn release(self: Box<Self>) -> Result<(), Error>;
}
