//! Leader election, written once on the lock contract for every store.
//!
//! To lead the election `name` is to hold the lock `name`: no two valid
//! leaderships at once (S7's "one leader" is the lock's S1, with the same
//! exceptions: see the README's "What each backend survives"), and the
//! **term** is that hold's fencing token, so every later term is larger (S2) and a deposed
//! leader's writes are refused by the resource's fenced writer like a former
//! holder's. A leader's *proclamation* (its address, say) is the lock's
//! `why`, which observers read through [`Backend::inspect`]: observing needs
//! no session and never campaigns.
//!
//! An election shares its name with the lock of that name (`dlock status
//! NAME` shows the leader); do not use one name for both.
//!
//! ```
//! # async fn demo(session: dlock_core::Session, backend: std::sync::Arc<dyn dlock_core::Backend>) -> Result<(), dlock_core::Error> {
//! use dlock_core::election;
//! let election = session.election("jobs/scheduler")?.proclaim("10.0.0.7:8080");
//! let leadership = election.campaign().await?; // waits until it leads
//! let term = leadership.term(); // pass it to every fenced write
//! tokio::select! {
//!     reason = leadership.deposed() => eprintln!("no longer leader ({reason})"),
//!     _ = lead(term.get()) => leadership.resign().await?,
//! }
//! // Elsewhere, without campaigning:
//! if let Some(leader) = election::leader(&*backend, "jobs/scheduler").await? {
//!     println!("term {} led by {:?}", leader.term, leader.value);
//! }
//! # Ok(()) }
//! # async fn lead(_term: u64) {}
//! ```

use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::backend::Backend;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::lock::Lock;
use crate::lost::LostReason;
use crate::name::{IntoLockName, LockName};
use crate::token::FencingToken;

/// A candidate in one election: `session.election("name")?`. Campaigning
/// is acquiring the election's lock, with everything that says about
/// waiting, fairness, timeouts and cancellation (see [`Lock`]).
///
/// Each campaign is a candidacy of its own (a new owner of the lock, never
/// a reentrant one): two campaigns, even through one `Election`, compete
/// with each other, so a second campaign while this process leads waits
/// until that leadership ends, and every [`Leadership`] is the only one of
/// its term.
#[derive(Clone)]
pub struct Election {
    lock: Lock,
}

impl Election {
    pub(crate) fn new(lock: Lock) -> Self {
        Self { lock }
    }

    /// What this candidate tells observers while it leads (its address, an
    /// id): [`Leader::value`]. Cut at [`MAX_WHY_LEN`](crate::MAX_WHY_LEN)
    /// bytes, since it is stored as the lock's `why`.
    pub fn proclaim(self, value: impl Into<String>) -> Self {
        Self {
            lock: self.lock.why(value),
        }
    }

    /// The election's name.
    pub fn name(&self) -> &LockName {
        self.lock.name()
    }

    /// Waits until this campaign leads. [`Error::SessionLost`] if the
    /// session ends meanwhile.
    ///
    /// # Cancel safety
    /// As [`Lock::acquire`]: a dropped campaign leaves nothing behind.
    pub async fn campaign(&self) -> Result<Leadership, Error> {
        self.candidacy().acquire().await.map(Leadership::new)
    }

    /// Waits at most `wait` to lead; [`Error::Timeout`] after that (see
    /// [`Lock::acquire_timeout`]).
    ///
    /// # Cancel safety
    /// As [`Lock::acquire`].
    pub async fn campaign_timeout(&self, wait: Duration) -> Result<Leadership, Error> {
        self.lock.acquire_timeout(wait).await.map(Leadership::new)
    }

    /// Leads if nobody does now; `Ok(None)` when someone leads (another
    /// candidate, or another campaign of this one) or, on fair stores,
    /// others are in line.
    ///
    /// # Cancel safety
    /// As [`Lock::try_acquire`].
    pub async fn try_campaign(&self) -> Result<Option<Leadership>, Error> {
        Ok(self.candidacy().try_acquire().await?.map(Leadership::new))
    }

    /// A new owner of the election's lock (a clone is one: see [`Lock`]).
    fn candidacy(&self) -> Lock {
        self.lock.clone()
    }
}

/// This process leads an election: proof of leadership for one term.
///
/// The same guarantees as a [`LockGuard`] (it is one): stop acting as leader
/// when [`deposed`](Self::deposed) fires, and send [`term`](Self::term)
/// with every write that only the leader may make. Dropping it resigns in
/// the background.
#[must_use = "dropping a Leadership resigns at once"]
pub struct Leadership {
    guard: LockGuard,
}

impl Leadership {
    fn new(guard: LockGuard) -> Self {
        Self { guard }
    }

    /// The term: this leadership's fencing token, larger than every earlier
    /// term of the election.
    pub fn term(&self) -> FencingToken {
        self.guard.token()
    }

    /// The election's name.
    pub fn name(&self) -> &LockName {
        self.guard.name()
    }

    /// Whether this process still leads, by the local validity deadline
    /// (no server contact; see [`LockGuard::is_held`]).
    pub fn is_leader(&self) -> bool {
        self.guard.is_held()
    }

    /// Resolves when this leadership ends (the session lost it, it was
    /// revoked, or it was resigned), with why. Owns what it needs.
    ///
    /// # Cancel safety
    /// Cancel safe: call again for a new one.
    pub fn deposed(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// The lock guard behind this leadership, for APIs that take one (the
    /// `Dlock-Fence` header, say).
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Steps down: frees the election for the next candidate (no other
    /// `Leadership` shares this term). Answers as
    /// [`LockGuard::release`]: [`Error::Lost`] if the leadership had
    /// already ended (what was done as leader may not have been exclusive).
    ///
    /// # Cancel safety
    /// If dropped, the resignation continues in the background.
    pub async fn resign(self) -> Result<(), Error> {
        self.guard.release().await
    }
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("name", self.name())
            .field("term", &self.term())
            .field("is_leader", &self.is_leader())
            .finish()
    }
}

/// Who leads an election, as the store reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's term (its fencing token).
    pub term: FencingToken,
    /// The leader's session id.
    pub session: String,
    /// What the leader proclaimed ([`Election::proclaim`]), if anything.
    pub value: Option<String>,
    /// When its term began, by the store's clock, where the store says.
    pub since: Option<SystemTime>,
}

/// Who leads `election` now, asked of the store without campaigning;
/// `None` when nobody does. A leader whose lease the store has not yet
/// expired is still reported, like a lock's holder.
///
/// # Cancel safety
/// Cancel safe (one read).
pub async fn leader(
    backend: &dyn Backend,
    election: impl IntoLockName,
) -> Result<Option<Leader>, Error> {
    let name = election.into_lock_name()?;
    Ok(backend.inspect(&name).await?.map(|info| Leader {
        term: info.token,
        session: info.holder,
        value: info.why,
        since: info.acquired_at,
    }))
}

/// Follows an election from outside: each [`changed`](Self::changed)
/// returns the leader once it differs from the one returned before (a new
/// term, or no leader, or a leader again after none), asking the store
/// every `every`. A term below one already returned is a stale read (a
/// lagging replica) and is not reported.
///
/// ```
/// # async fn demo(backend: std::sync::Arc<dyn dlock_core::Backend>) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let mut watch = dlock_core::election::LeaderWatch::new(backend, "jobs/scheduler", Duration::from_millis(200))?;
/// loop {
///     match watch.changed().await? {
///         Some(leader) => println!("term {}: {:?}", leader.term, leader.value),
///         None => println!("no leader"),
///     }
/// #   break;
/// }
/// # Ok(()) }
/// ```
pub struct LeaderWatch {
    backend: std::sync::Arc<dyn Backend>,
    name: LockName,
    every: Duration,
    /// What `changed` returned last; `None` before the first call.
    seen: Option<Option<Leader>>,
    /// The highest term returned so far.
    highest: Option<FencingToken>,
    /// The last call returned a store error: the next waits `every` first.
    errored: bool,
}

impl LeaderWatch {
    /// A watch on `election` that asks `backend` every `every` (at least
    /// 1 ms); [`Error::InvalidName`] for a bad name.
    pub fn new(
        backend: std::sync::Arc<dyn Backend>,
        election: impl IntoLockName,
        every: Duration,
    ) -> Result<Self, Error> {
        Ok(Self {
            backend,
            name: election.into_lock_name()?,
            every: every.max(Duration::from_millis(1)),
            seen: None,
            highest: None,
            errored: false,
        })
    }

    /// The leader now, at once on the first call; on later calls, waits
    /// until the store reports a change. A store error is returned as it
    /// comes (the next call asks again after `every`, so a caller that
    /// retries at once does not spin); the next call goes on from the
    /// leader returned last.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call returned nothing and changes nothing.
    pub async fn changed(&mut self) -> Result<Option<Leader>, Error> {
        if self.errored {
            tokio::time::sleep(self.every).await;
            self.errored = false;
        }
        loop {
            let now = match leader(&*self.backend, &self.name).await {
                Ok(now) => now,
                Err(e) => {
                    self.errored = true;
                    return Err(e);
                }
            };
            if self.is_news(now.as_ref()) {
                if let Some(l) = &now {
                    self.highest = self.highest.max(Some(l.term));
                }
                self.seen = Some(now.clone());
                return Ok(now);
            }
            tokio::time::sleep(self.every).await;
        }
    }

    /// Whether `now` is to be reported after what was returned last.
    fn is_news(&self, now: Option<&Leader>) -> bool {
        let Some(seen) = &self.seen else {
            return true;
        };
        if let Some(l) = now
            && self.highest.is_some_and(|h| l.term < h)
        {
            return false;
        }
        let key = |l: Option<&Leader>| l.map(|l| (l.term, l.session.clone()));
        key(seen.as_ref()) != key(now)
    }

    /// The leader `changed` returned last (`None` also before the first
    /// call).
    pub fn last(&self) -> Option<&Leader> {
        self.seen.as_ref().and_then(Option::as_ref)
    }
}

impl std::fmt::Debug for LeaderWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderWatch")
            .field("name", &self.name)
            .field("every", &self.every)
            .field("last", &self.last())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::memory::{MemoryBackend, test_session as session};

    #[tokio::test]
    async fn one_leader_and_a_larger_term_after_it() {
        let backend = MemoryBackend::new();
        let (a, b) = (session(&backend).await, session(&backend).await);
        let first = a.election("e").unwrap().proclaim("a:1");
        let second = b.election("e").unwrap().proclaim("b:1");
        let led = first.campaign().await.unwrap();
        assert!(led.is_leader());
        assert!(second.try_campaign().await.unwrap().is_none());
        let seen = leader(&backend, "e").await.unwrap().unwrap();
        assert_eq!(
            (seen.term, seen.value.as_deref()),
            (led.term(), Some("a:1"))
        );
        assert_eq!(seen.session, a.id().as_str());
        let term = led.term();
        led.resign().await.unwrap();
        let next = second.campaign().await.unwrap();
        assert!(next.term() > term, "{} after {term}", next.term());
        next.resign().await.unwrap();
        assert_eq!(leader(&backend, "e").await.unwrap(), None);
    }

    #[tokio::test]
    async fn two_campaigns_of_one_candidate_never_share_a_term() {
        let backend = MemoryBackend::new();
        let a = session(&backend).await;
        let candidate = a.election("e").unwrap();
        let first = candidate.campaign().await.unwrap();
        assert!(candidate.try_campaign().await.unwrap().is_none());
        let second = {
            let candidate = candidate.clone();
            tokio::spawn(async move { candidate.campaign().await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !second.is_finished(),
            "a second campaign joined the first's term"
        );
        let term = first.term();
        first.resign().await.unwrap();
        let next = second.await.unwrap().unwrap();
        assert!(next.term() > term);
        next.resign().await.unwrap();
        assert_eq!(leader(&backend, "e").await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_watch_reports_each_term_once() {
        let backend = MemoryBackend::new();
        let shared: Arc<dyn Backend> = Arc::new(backend.clone());
        let a = session(&backend).await;
        let mut watch = LeaderWatch::new(shared, "e", Duration::from_millis(2)).unwrap();
        assert_eq!(watch.changed().await.unwrap(), None);
        let led = a.election("e").unwrap().campaign().await.unwrap();
        let seen = watch.changed().await.unwrap().unwrap();
        assert_eq!(seen.term, led.term());
        // Unchanged: nothing to report.
        let quiet = tokio::time::timeout(Duration::from_millis(30), watch.changed()).await;
        assert!(quiet.is_err(), "reported again without a change: {quiet:?}");
        let term = led.term();
        led.resign().await.unwrap();
        assert_eq!(watch.changed().await.unwrap(), None);
        let again = a.election("e").unwrap().campaign().await.unwrap();
        let seen = watch.changed().await.unwrap().unwrap();
        assert!(seen.term > term);
        assert_eq!(watch.last().map(|l| l.term), Some(again.term()));
        assert!(LeaderWatch::new(Arc::new(backend), "", Duration::ZERO).is_err());
    }
}
