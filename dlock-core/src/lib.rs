//! Distributed locks with fencing tokens: the core of dlock.
//!
//! This crate holds everything that is the same for every store: validated
//! [`LockName`]s, [`FencingToken`]s and the resource-side [`FenceGate`], the
//! [`Error`] type, and the client machinery written once — [`Session`]
//! (renewal in the background, local validity deadlines), [`Lock`] (the acquire
//! loop with waiting, timeouts, wake-ups and cancellation clean-up) and
//! [`LockGuard`] (proof of holding with a `lost()` signal). Stores plug in
//! through the small adapter contract in [`backend`]; [`memory`] is the
//! in-process reference implementation; [`raw`] reaches under the user types
//! for adapter tests and the conformance suite.
//!
//! ```
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use std::time::Duration;
//! use dlock_core::{Backend, FenceGate, SessionOptions, memory::MemoryBackend};
//!
//! let backend = MemoryBackend::new();
//! let session = backend.session(SessionOptions::new().ttl(Duration::from_secs(10))).await?;
//! let gate = FenceGate::new(); // lives with the protected resource
//!
//! let guard = session.lock("billing/invoice-run")?
//!     .acquire_timeout(Duration::from_secs(30))
//!     .await?;
//! tokio::select! {
//!     reason = guard.lost() => eprintln!("lock lost: {reason}"),
//!     _ = async { gate.check(guard.token()).expect("fenced write") } => {}
//! }
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! Safety: per name, at most one valid guard at a time as judged by the store
//! (S1); tokens strictly increase (S2); only the holder can release or renew
//! (S3); a holder learns of a loss no later than the store may re-grant (S4,
//! via [`LockGuard::is_held`] and [`LockGuard::lost`], which need no server
//! contact); dropping any future or guard leaves nothing behind for longer than
//! one TTL (S5); expiry is judged by the store's clock only (S6).
//!
//! Mutual exclusion by lease is only as good as the pause-free assumption: a
//! process paused past its deadline may still act on a stale belief. Pass the
//! token to the resource and check it there ([`FenceGate`]) — that check is
//! what makes the lock safe for correctness, not only for efficiency.
//!
//! # Cancel safety
//!
//! Every async method documents it in a `# Cancel safety` section. In short:
//! dropping an acquire future abandons the claim in the background; dropping a
//! guard releases in the background; dropping the last handle of a session
//! closes it in the background.

pub mod adapter;
pub mod backend;
mod capabilities;
mod clock;
pub mod election;
mod error;
pub mod fence_header;
pub mod floor;
pub mod forward;
mod guard;
mod info;
mod lock;
mod lost;
pub mod memory;
mod multi;
pub mod name;
mod options;
pub mod raw;
mod renew;
pub mod rwlock;
pub mod semaphore;
mod session;
mod state;
pub mod telemetry;
mod token;
pub mod url;
pub mod wake;

pub use adapter::{Adapter, Capabilities, Registry, registry};

#[doc(hidden)]
pub use async_trait::async_trait as __async_trait;
pub use backend::Backend;
pub use election::{Election, Leader, LeaderWatch, Leadership};
pub use error::{BoxError, Error, Result};
pub use guard::LockGuard;
pub use info::{LockInfo, SessionId};
pub use lock::{Lock, MAX_WHY_LEN};
pub use lost::LostReason;
pub use multi::{MultiGuard, MultiLock};
pub use name::{IntoLockName, LockName, MAX_NAME_LEN};
pub use options::{MAX_TTL, SessionOptions};
pub use rwlock::{ReadGuard, RwLock, WriteGuard};
pub use semaphore::{Permit, Semaphore};
pub use session::Session;
pub use state::SessionStats;
pub use token::{
    FenceError, FenceGate, FencingToken, GateRefused, StaleToken, WriteGate, WritePermit,
};
