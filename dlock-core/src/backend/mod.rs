//! The adapter author's contract: the few store primitives a backend implements.
//!
//! Everything else (the acquire loop, timeouts, wake-up timing, renewal
//! scheduling, local validity deadlines, the lost signal, guards, reentrancy,
//! cancellation clean-up) is written once in this crate on top of these three
//! object-safe traits:
//!
//! * [`Backend`] — one store deployment: opens sessions and answers admin
//!   questions (`inspect`, `list`, `validate`, `force_release`).
//! * [`RawSession`] — one client's liveness context in the store: opens
//!   [`Claim`]s, renews all its holds in one round trip, releases by owner and
//!   token.
//! * [`Claim`] — one client's place in line for one lock: take when first (joining
//!   the queue once), wait for a change, withdraw ([`Claim::abandon`]).
//!
//! # Rules an adapter must keep
//!
//! 1. **Atomic take, server time (S1, S6).** `try_take` takes a free or expired
//!    lock in one atomic step judged by the store's clock and issues the fencing
//!    token in the same step.
//! 2. **Tokens (S2).** Per name, strictly increasing over grants, never reused,
//!    across expiry, takeover and `force_release` (and restarts, where the
//!    backend claims durable tokens).
//! 3. **Owner checks (S3).** `release` and `renew` act only when the store's
//!    holder is this session *and* the hold's token; otherwise they change
//!    nothing (`release` returns [`Error::NotHeld`], `renew` reports `false`).
//! 4. **Idempotent take.** If the claim already holds the lock (its earlier
//!    reply was lost), `try_take` returns `Granted` with the same token *and
//!    extends the hold's expiry as a fresh take would*: the core counts the
//!    grant's validity from when this retry was sent (rule 5).
//! 5. **Store expiry ≥ TTL from send (S4).** A hold granted or renewed by a
//!    request sent at client time `t` is not given to anyone else before
//!    `t + ttl` (the core subtracts the drift margin). For
//!    [`ExpiryModel::Session`] stores, the same holds for the session lease.
//! 6. **Clean abandon (S5).** `abandon` removes whatever the claim created,
//!    including a grant whose reply never arrived; it is called from a spawned
//!    task when an `acquire` future is dropped, times out, or gives up.
//! 7. **Errors by meaning.** Connection problems and request time-outs are
//!    [`Error::Unavailable`] (retried by the core); a session the store has
//!    dropped is [`Error::SessionLost`]; garbage replies are [`Error::Protocol`].
//!    Never panic on a reply.
//!
//! `dlock-conformance` checks all of these against a real server.

mod doubtful;
pub(crate) mod primitives;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::timeout;

pub use doubtful::{Doubtful, Sending};
pub use primitives::{Busy, Claim, ExpiryModel, Hold, RawSession, RenewalReport, Renewed, Take};

use crate::capabilities::Capabilities;
use crate::clock;
use crate::error::Error;
use crate::info::{LockInfo, SessionId};
use crate::name::LockName;
use crate::options::SessionOptions;
use crate::session::Session;
use crate::token::FencingToken;
/// One store deployment, opened from a URL.
///
/// Object safe: applications and the conformance suite hold an
/// `Arc<dyn Backend>`.
///
/// ```
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// use dlock_core::{Backend, SessionOptions, memory::MemoryBackend};
/// let backend = MemoryBackend::new();
/// let session = backend.session(SessionOptions::new().ttl(Duration::from_secs(5))).await?;
/// let guard = session.lock("reports/nightly")?.acquire().await?;
/// println!("holding with token {}", guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Backend: Send + Sync + Debug {
    /// The URL scheme, e.g. `"redis"`; used in errors and logs.
    fn scheme(&self) -> &'static str;

    /// The smallest TTL this deployment can honour.
    fn min_ttl(&self) -> Duration;

    /// What this deployment promises beyond the safety invariants (see
    /// [`Capabilities`]). The default promises nothing.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Waits, at most `limit`, until this deployment may grant locks. Most
    /// may at once (the default); a Redis node guarding against a restart
    /// refuses grants for its `max_ttl` after dlock first sees it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] if it is still not ready after `limit`.
    ///
    /// # Cancel safety
    /// Cancel safe.
    async fn wait_ready(&self, limit: Duration) -> Result<(), Error> {
        let _ = limit;
        Ok(())
    }

    /// How long until this deployment may grant locks: zero when it may now
    /// (the default, and every store but a guarded Redis). A Redis
    /// deployment with the restart guard (Redlock by default) answers how
    /// long a majority of its nodes still refuse grants after dlock first
    /// saw their server processes: up to its `max_ttl`. A program shows this
    /// wait (the CLI prints a line) instead of letting a first acquire look
    /// like a busy lock.
    ///
    /// ```
    /// # async fn demo() -> Result<(), dlock_core::Error> {
    /// use dlock_core::Backend;
    /// let backend = dlock_core::memory::MemoryBackend::new();
    /// assert!(backend.ready_in().await?.is_zero());
    /// # Ok(()) }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(demo()).unwrap();
    /// ```
    ///
    /// # Errors
    /// [`Error::Unavailable`] if the deployment cannot tell (too few nodes
    /// answer).
    ///
    /// # Cancel safety
    /// Cancel safe.
    async fn ready_in(&self) -> Result<Duration, Error> {
        Ok(Duration::ZERO)
    }

    /// The largest TTL this deployment can honour: [`MAX_TTL`](crate::MAX_TTL)
    /// unless the store bounds it (a Redis restart guard refuses grants for
    /// its `max_ttl` after a restart, so no session may outlive that).
    fn max_ttl(&self) -> Duration {
        crate::options::MAX_TTL
    }

    /// Primitive: creates the store side of a session with id `id`.
    ///
    /// Users call [`Backend::session`] instead, which validates the options and
    /// starts the renewal task.
    ///
    /// # Cancel safety
    /// Must be cancel safe: a dropped call may leave at most a store session
    /// that expires after one TTL.
    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error>;

    /// Who holds `name` now, by the store's clock; `None` if free.
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error>;

    /// The held locks whose names start with `prefix` (`""` for all), by name.
    /// A prefix that no valid name can start with is [`Error::InvalidName`].
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error>;

    /// Whether `token` is the current, unexpired holder's token of `name`
    /// (SharkLock's `checkVersion`): a resource can ask before it serves a
    /// request. A [`FenceGate`](crate::FenceGate) needs no round trip and is
    /// preferred where the resource can keep state.
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error>;

    /// Admin break: frees `name` whoever holds it; returns whether it was held.
    /// The next holder still gets a larger token (S2) and the old holder's
    /// renewal fails, so its `lost()` fires within one renewal period.
    ///
    /// # Cancel safety
    /// If dropped, the lock may or may not have been freed; calling again is
    /// harmless.
    async fn force_release(&self, name: &LockName) -> Result<bool, Error>;

    /// One plain round trip to the store (`PING`, `SELECT 1`, a read): the
    /// physical floor that benchmarks compare lock operations with. The
    /// default reads a lock that nobody holds.
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    async fn ping(&self) -> Result<(), Error> {
        let name = LockName::new("dlock-ping")?;
        self.inspect(&name).await.map(|_| ())
    }

    /// Opens a [`Session`]: validates `options` against [`Backend::min_ttl`],
    /// creates the store side and starts renewing in the background.
    ///
    /// Adapters do not override this.
    ///
    /// # Cancel safety
    /// Dropping the future before it completes leaves at most an empty store
    /// session that expires after one TTL.
    async fn session(&self, options: SessionOptions) -> Result<Session, Error> {
        let scheme = self.scheme();
        options.validate(self.min_ttl())?;
        let max_ttl = self.max_ttl();
        if options.ttl_value() > max_ttl {
            return Err(Error::InvalidTtl {
                ttl: options.ttl_value(),
                min: self.min_ttl(),
                max: max_ttl,
            });
        }
        let id = SessionId::generate(options.label_value());
        let sent = clock::now();
        let raw = match timeout(options.open_timeout(), self.open(id.clone(), &options)).await {
            Ok(raw) => raw?,
            Err(_) => return Err(Error::unavailable(scheme, "timed out opening a session")),
        };
        Session::start(id, raw, scheme, options, sent).await
    }
}
