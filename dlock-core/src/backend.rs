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

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{Error, FencingToken, LockInfo, LockName, Session, SessionId, SessionOptions};

/// A lock held in the store: what `renew` and `release` need to find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The lock.
    pub name: LockName,
    /// The token issued with this grant.
    pub token: FencingToken,
    /// The adapter's identity of the hold in the store: the owner value of a
    /// Redis key, a ZooKeeper node path, an etcd key, a SQL owner column.
    pub key: String,
}

/// What one `try_take` got.
#[derive(Debug)]
pub enum Take {
    /// The lock is ours.
    Granted(Hold),
    /// Someone else holds it, or is ahead in the queue.
    Busy(Busy),
}

/// Details of a busy lock that help the core decide when to look again.
#[derive(Debug, Clone, Default)]
pub struct Busy {
    /// When the lock (or the queue entry ahead) expires by the store's clock,
    /// as time from now, if the store can tell. The core re-checks then, so a
    /// holder that died without releasing is noticed without waiting for the
    /// fallback timer.
    pub retry_after: Option<Duration>,
}

/// How the store bounds a hold's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryModel {
    /// Each hold has its own expiry, set by the take and extended by `renew`
    /// (Redis `PX`, a SQL `expires_at` column).
    PerHold,
    /// Holds live as long as the session's lease (etcd lease, ZooKeeper
    /// session); a take does not extend it, only `renew` does.
    Session,
}

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
    /// [`Capabilities`](crate::Capabilities)). The default promises nothing.
    fn capabilities(&self) -> crate::Capabilities {
        crate::Capabilities::default()
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

    /// The largest TTL this deployment can honour: [`MAX_TTL`](crate::MAX_TTL)
    /// unless the store bounds it (a Redis restart guard refuses grants for
    /// its `max_ttl` after a restart, so no session may outlive that).
    fn max_ttl(&self) -> Duration {
        crate::MAX_TTL
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
        Session::open(self, options).await
    }
}

/// The store side of a session (see the [module docs](self) for the rules).
#[async_trait]
pub trait RawSession: Send + Sync + Debug {
    /// The TTL the store actually applies (it may have negotiated it).
    fn ttl(&self) -> Duration;

    /// How holds expire in this store.
    fn expiry(&self) -> ExpiryModel;

    /// Opens a claim on `name` (a place in line for it). Cheap: it may only prepare (e.g.
    /// subscribe to the lock's channel before the first take, so a release
    /// between take and wait is not missed).
    ///
    /// # Cancel safety
    /// Must be cancel safe: nothing in the store may depend on the claim
    /// object existing yet.
    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error>;

    /// Extends the session and every hold in `holds`, in one round trip where
    /// the store allows. Returns, in order, whether each hold is still ours.
    /// Called every renewal period, also with no holds (a session heartbeat).
    ///
    /// # Cancel safety
    /// Must be cancel safe: the core cuts a renewal off at its request timeout
    /// and only trusts renewals it saw confirmed.
    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error>;

    /// Releases `hold` if this session still holds it with that token; wakes
    /// the next waiter. [`Error::NotHeld`] otherwise (also when `hold` belongs
    /// to another session, even with the right key and token).
    ///
    /// # Cancel safety
    /// If dropped, the release may or may not have happened; the core retries
    /// and treats a `NotHeld` after an unknown outcome as success.
    async fn release(&self, hold: &Hold) -> Result<(), Error>;

    /// Ends the session in the store, freeing anything it still holds;
    /// `holds` are the holds the core knows of (stores without a per-session
    /// index free those; others may free by session).
    ///
    /// # Cancel safety
    /// If dropped, what was not freed expires after one TTL.
    async fn close(&self, holds: &[Hold]) -> Result<(), Error>;
}

/// One client's claim on one lock, a place in its line: [`try_take`](Claim::try_take)
/// takes it when this claim is first (joining the queue once), [`wait`](Claim::wait)
/// waits for a change, [`abandon`](Claim::abandon) withdraws. Owned by the core's
/// acquire loop; one per acquire, so ownership (S3) is the claim plus its token.
#[async_trait]
pub trait Claim: Send + Debug {
    /// Takes the lock if free and (for fair stores) this claim is first in
    /// line; otherwise joins the queue (once) and reports `Busy`. Idempotent:
    /// after a lost reply, the retry returns the same grant.
    ///
    /// # Cancel safety
    /// Must be cancel safe: if dropped, the core calls [`Claim::abandon`],
    /// which must clean up whatever the dropped call did.
    async fn try_take(&mut self) -> Result<Take, Error>;

    /// Returns when the lock may have become available (a release notification,
    /// the watched predecessor going away) or at `until`, whichever is first.
    /// Spurious returns are fine; the core calls `try_take` again.
    ///
    /// # Cancel safety
    /// Must be cancel safe (the core drops it at its deadline).
    async fn wait(&mut self, until: Instant) -> Result<(), Error>;

    /// Removes what this claim left in the store: its queue entry, or a grant
    /// it may have received without the core learning of it. Idempotent: the
    /// core calls it again after an error.
    ///
    /// # Cancel safety
    /// Runs as a session task and is retried with backoff until it succeeds;
    /// if the session ends first, what remains expires after one TTL
    /// (per-hold stores) or with the session.
    async fn abandon(&mut self) -> Result<(), Error>;
}
