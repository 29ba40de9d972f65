//! The store primitives under [`Backend`](super::Backend): a session's store
//! side, a claim on one lock and the values they exchange. Kept apart from
//! `Backend` (which opens a [`Session`](crate::Session)) so that the core's
//! session state can depend on them without depending on `Session`; the
//! rules they keep are in the [module docs](crate::backend).

use std::fmt::Debug;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::Error;
use crate::name::LockName;
use crate::token::FencingToken;

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

/// What a renewal says of one hold ([`RawSession::renew_each`],
/// [`RenewalReport::record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewed {
    /// Still ours: its local deadline moves on, counted from when the
    /// renewal was sent.
    Held,
    /// No longer ours (expired, taken over, or revoked in the store).
    Lost,
    /// The server that keeps it did not answer: neither extended nor lost;
    /// the core tries again soon, and the hold is lost only if its
    /// deadline passes first.
    Unknown,
}

impl From<bool> for Renewed {
    fn from(held: bool) -> Self {
        if held { Renewed::Held } else { Renewed::Lost }
    }
}

/// Where a renewal records each hold's answer as soon as the store gives it
/// ([`RawSession::renew_into`]). The core reads it after the round, also
/// after cutting the round off at its request timeout: a store that renews
/// holds in many requests (a write per NATS key, a script per Redis Cluster
/// slot) keeps what was confirmed before the cut, so a session with more
/// holds than one request timeout can renew still keeps them (L3), while
/// every deadline it moves was confirmed by the store (S4).
///
/// A hold with no answer recorded is [`Renewed::Unknown`]. Recording
/// `Unknown` changes nothing, and `Lost` is never turned back into `Held`.
///
/// ```
/// use dlock_core::backend::{RenewalReport, Renewed};
/// let report = RenewalReport::new(3);
/// report.record(0, Renewed::Held);
/// report.record(2, Renewed::Lost);
/// report.record(2, Renewed::Held); // (a lost hold stays lost)
/// assert_eq!(report.answers(), [Renewed::Held, Renewed::Unknown, Renewed::Lost]);
/// assert!(report.still_held("demo").is_err()); // (one unanswered)
/// report.record(1, Renewed::Held);
/// assert_eq!(report.still_held("demo")?, [true, true, false]);
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Debug)]
pub struct RenewalReport {
    answers: Mutex<Vec<Renewed>>,
}

impl RenewalReport {
    /// A report for a round of `holds` holds, none answered yet.
    pub fn new(holds: usize) -> Self {
        Self {
            answers: Mutex::new(vec![Renewed::Unknown; holds]),
        }
    }

    /// Records the store's answer for the hold at `index` in the round's
    /// `holds`. An index past the round's holds is ignored.
    pub fn record(&self, index: usize, renewed: Renewed) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = answers.get_mut(index) {
            match (*slot, renewed) {
                (_, Renewed::Unknown) | (Renewed::Lost, _) => {}
                _ => *slot = renewed,
            }
        }
    }

    /// Records a whole round's answers, in the holds' order; fails (and
    /// records nothing) when they are not one per hold: an adapter bug the
    /// core must not guess around.
    pub fn record_all(&self, answers: Vec<Renewed>) -> Result<(), Error> {
        let expected = self.len();
        if answers.len() != expected {
            return Err(Error::protocol(
                "dlock-core",
                format!(
                    "adapter bug: renew answered for {} holds, {expected} were sent",
                    answers.len()
                ),
            ));
        }
        for (index, renewed) in answers.into_iter().enumerate() {
            self.record(index, renewed);
        }
        Ok(())
    }

    /// How many holds the round renews.
    pub fn len(&self) -> usize {
        self.answers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the round renews no hold (a session heartbeat).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The answers so far, one per hold, in the holds' order.
    pub fn answers(&self) -> Vec<Renewed> {
        self.answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The answers as [`RawSession::renew`] gives them (whether each hold
    /// is still ours), for an adapter whose `renew` is its `renew_into`;
    /// [`Error::Unavailable`] of `backend` if some hold went unanswered.
    pub fn still_held(&self, backend: &'static str) -> Result<Vec<bool>, Error> {
        let answers = self.answers();
        let unknown = answers.iter().filter(|r| **r == Renewed::Unknown).count();
        if unknown > 0 {
            return Err(Error::unavailable(
                backend,
                format!(
                    "the renewal of {unknown} of {} holds was not answered",
                    answers.len()
                ),
            ));
        }
        Ok(answers.into_iter().map(|r| r == Renewed::Held).collect())
    }
}

/// The store side of a session (see the [module docs](crate::backend) for the rules).
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
    /// Called every renewal period with every hold, also with none (a
    /// session heartbeat), and on a retry with those the period has not
    /// confirmed yet.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the core cuts a renewal off at its request timeout
    /// and only trusts renewals it saw confirmed.
    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error>;

    /// [`renew`](Self::renew), for a store whose holds live on independent
    /// servers (a Redis Cluster's masters): the holds of a server that did
    /// not answer are [`Renewed::Unknown`], so that one failing server does
    /// not cost the holds the others confirmed (L3). An `Err` still means
    /// that nothing was confirmed. The default calls `renew`.
    ///
    /// # Cancel safety
    /// As [`renew`](Self::renew).
    async fn renew_each(&self, holds: &[Hold]) -> Result<Vec<Renewed>, Error> {
        Ok(self
            .renew(holds)
            .await?
            .into_iter()
            .map(Renewed::from)
            .collect())
    }

    /// [`renew_each`](Self::renew_each), recording each hold's answer in
    /// `report` as soon as it is known, for a store that renews holds in
    /// more than one request: the core cuts a round off at its request
    /// timeout and keeps the answers recorded before the cut (the others
    /// are [`Renewed::Unknown`] and retried first). An `Err` leaves what was
    /// recorded valid: only answers the store gave may be recorded. What
    /// the core calls; the default records `renew_each`'s answers when they
    /// are all in, for a store that renews in one round trip. On an
    /// [`ExpiryModel::Session`] store, record `Held` only once the session's
    /// lease is confirmed extended too (a hold's deadline moves with it).
    ///
    /// # Cancel safety
    /// As [`renew`](Self::renew); answers recorded before a cut stand.
    async fn renew_into(&self, holds: &[Hold], report: &RenewalReport) -> Result<(), Error> {
        report.record_all(self.renew_each(holds).await?)
    }

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
    /// Safe to repeat: the core retries a close that failed with a retryable
    /// error or was cut off at the request timeout (its effect unknown), so a
    /// close that finds the session already closed and its holds already
    /// freed answers `Ok`.
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
