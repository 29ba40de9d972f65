//! [`MultiLock`]: several names taken all-or-nothing, written once on top of
//! [`Lock`] for every store.
//!
//! The names are taken one at a time in one global order (their bytes,
//! sorted), so that two multi-locks over overlapping names never wait for
//! each other in a cycle; whoever waits holds only names that sort before
//! the one it waits for. A failed or timed-out attempt releases what it had
//! taken before it returns (if the store confirms within a request timeout;
//! a slower release goes on in the background, so that a slow store does
//! not stretch the caller's deadline); a dropped one releases it in the
//! background.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::guard::LockGuard;
use crate::lock::Lock;
use crate::lost::LostReason;
use crate::name::LockName;
use crate::token::FencingToken;

/// Several locks of one session, taken all-or-nothing:
/// `session.lock_all(["accounts/1", "accounts/2"])?`.
///
/// Deadlock-free among multi-locks: names are taken in sorted order. A
/// caller that also holds single locks must take them in the same order
/// (or not wait for a multi-lock while holding one), and must not hold one
/// of the names through another handle: handles exclude each other, even
/// within one session, so that wait would never end. Duplicate names count
/// once. Acquiring twice through one `MultiLock` is reentrant, as for
/// [`Lock`]. A timed wait must cover a round trip per name
/// (`Duration::ZERO` always times out).
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let transfer = session.lock_all(["accounts/2", "accounts/1"])?.why("transfer");
/// let both = transfer.acquire_timeout(Duration::from_secs(10)).await?;
/// let (from, to) = (both.token("accounts/1"), both.token("accounts/2"));
/// // ... write both accounts, each with its own token ...
/// both.release().await?;
/// # let _ = (from, to);
/// # Ok(()) }
/// ```
pub struct MultiLock {
    /// One handle per name, sorted by name.
    locks: Vec<Lock>,
}

/// How long an attempt may wait for each name.
#[derive(Clone, Copy)]
enum Wait {
    No,
    Forever,
    Until(Instant, Duration),
}

impl MultiLock {
    /// Handles on `locks`, sorted and without duplicates; [`Error::Config`]
    /// for none.
    pub(crate) fn new(mut locks: Vec<Lock>) -> Result<Self, Error> {
        locks.sort_by(|a, b| a.name().as_str().cmp(b.name().as_str()));
        locks.dedup_by(|a, b| a.name() == b.name());
        if locks.is_empty() {
            return Err(Error::Config("lock_all: no lock names given".into()));
        }
        Ok(Self { locks })
    }

    /// Sets the reason recorded with each of the locks (see
    /// [`Lock::why`]).
    pub fn why(self, why: impl Into<String>) -> Self {
        let why = why.into();
        Self {
            locks: self.locks.into_iter().map(|l| l.why(why.clone())).collect(),
        }
    }

    /// The names, in the order they are taken.
    pub fn names(&self) -> impl Iterator<Item = &LockName> {
        self.locks.iter().map(Lock::name)
    }

    /// Takes every lock if each is free now; never waits. `Ok(None)` if one
    /// is busy: those taken before it are released before this returns.
    ///
    /// # Cancel safety
    /// Cancel safe: locks taken before the drop are released in the
    /// background.
    pub async fn try_acquire(&self) -> Result<Option<MultiGuard>, Error> {
        self.acquire_with(Wait::No).await
    }

    /// Waits until every lock is ours, in name order.
    ///
    /// # Cancel safety
    /// As [`try_acquire`](Self::try_acquire).
    pub async fn acquire(&self) -> Result<MultiGuard, Error> {
        let all = self.acquire_with(Wait::Forever).await?;
        all.ok_or_else(|| Error::protocol("dlock", "lock_all: a wait without end gave up"))
    }

    /// Waits at most `wait` for all of them together; [`Error::Timeout`]
    /// (naming the lock it was waiting for) after that, having released the
    /// ones it had taken.
    ///
    /// # Cancel safety
    /// As [`try_acquire`](Self::try_acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<MultiGuard, Error> {
        let until = match Instant::now().checked_add(wait) {
            Some(deadline) => Wait::Until(deadline, wait),
            None => Wait::Forever,
        };
        let all = self.acquire_with(until).await?;
        all.ok_or_else(|| {
            Error::protocol("dlock", "lock_all: a timed wait gave up without a timeout")
        })
    }

    async fn acquire_with(&self, wait: Wait) -> Result<Option<MultiGuard>, Error> {
        loop {
            let guards = match self.take_each(wait).await {
                Ok(Some(guards)) => guards,
                Ok(None) => return Ok(None),
                Err(e) => return Err(e),
            };
            // A name taken early may have been lost while a later one was
            // waited for: never hand out a guard that is not held. Give all
            // back and start again (a try reports busy).
            if guards.iter().all(LockGuard::is_held) {
                return Ok(Some(MultiGuard { guards }));
            }
            self.give_back(guards).await;
            if matches!(wait, Wait::No) {
                return Ok(None);
            }
        }
    }

    /// One pass over the names in order: all guards, or `None` when one is
    /// busy (a try), or the error; what was taken is given back first.
    async fn take_each(&self, wait: Wait) -> Result<Option<Vec<LockGuard>>, Error> {
        let mut guards: Vec<LockGuard> = Vec::with_capacity(self.locks.len());
        for lock in &self.locks {
            let got = match wait {
                Wait::No => lock.try_acquire().await,
                Wait::Forever => lock.acquire().await.map(Some),
                Wait::Until(deadline, asked) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match lock.acquire_timeout(left).await {
                        // The timeout is the whole wait's, not this lock's share.
                        Err(Error::Timeout { name, cause, .. }) => Err(Error::Timeout {
                            name,
                            waited: asked,
                            cause,
                        }),
                        other => other.map(Some),
                    }
                }
            };
            match got {
                Ok(Some(guard)) => guards.push(guard),
                Ok(None) => {
                    self.give_back(guards).await;
                    return Ok(None);
                }
                Err(e) => {
                    self.give_back(guards).await;
                    return Err(e);
                }
            }
        }
        Ok(Some(guards))
    }

    /// Releases `guards`, waiting at most one request timeout (a store that
    /// does not answer must not stretch the caller's deadline: what is left
    /// then is released in the background, as for dropped guards); a
    /// failure is logged, since the caller's answer is about the acquire.
    async fn give_back(&self, guards: Vec<LockGuard>) {
        give_back(guards, self.locks[0].request_timeout(), "lock_all").await;
    }
}

/// Gives back what an acquire of `what` took and will not keep: waits at
/// most `limit` (a request timeout) for the releases, the rest going on in
/// the background; a failure is only logged, since the caller's answer is
/// about the acquire. Shared by [`MultiLock`] and the read-write lock.
pub(crate) async fn give_back(guards: Vec<LockGuard>, limit: Duration, what: &str) {
    match tokio::time::timeout(limit, release_all(guards)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "{what}: giving back what was taken"),
        Err(_) => tracing::debug!("{what}: giving back continues in the background"),
    }
}

/// Releases `guards` (all of them at once, whatever fails: one round trip,
/// not one per guard); the first error. Dropped part-way, the releases not
/// yet done go on in the background (as each guard's release does).
pub(crate) async fn release_all(guards: Vec<LockGuard>) -> Result<(), Error> {
    let mut releases = tokio::task::JoinSet::new();
    for guard in guards {
        releases.spawn(guard.release());
    }
    let mut first = Ok(());
    while let Some(released) = releases.join_next().await {
        let released = released.unwrap_or_else(|e| {
            Err(Error::protocol(
                "dlock",
                format!("a release task failed: {e}"),
            ))
        });
        // (every guard is released; the first error is kept)
        if first.is_ok() {
            first = released;
        }
    }
    first
}

/// The locks of a [`MultiLock`], all held. Dropping it releases them in the
/// background; it is lost when any of them is.
#[must_use = "dropping a MultiGuard releases its locks at once"]
pub struct MultiGuard {
    /// Sorted by name.
    guards: Vec<LockGuard>,
}

impl MultiGuard {
    /// One guard over `guards` (the caller holds them all).
    pub(crate) fn from_guards(mut guards: Vec<LockGuard>) -> Self {
        guards.sort_by(|a, b| a.name().as_str().cmp(b.name().as_str()));
        Self { guards }
    }

    /// The guards, in name order.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The fencing token of the lock `name`, if it is one of them. Each
    /// name has its own tokens: fence each resource with its own lock's.
    pub fn token(&self, name: impl AsRef<str>) -> Option<FencingToken> {
        let name = name.as_ref();
        self.guards
            .iter()
            .find(|g| g.name().as_str() == name)
            .map(LockGuard::token)
    }

    /// Whether every lock is still held (see [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.guards.iter().all(LockGuard::is_held)
    }

    /// Resolves when the first of the locks is lost or released: its name
    /// and why.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn lost(&self) -> impl Future<Output = (LockName, LostReason)> + Send + 'static {
        let each: Vec<_> = self
            .guards
            .iter()
            .map(|g| {
                let (name, lost) = (g.name().clone(), g.lost());
                Box::pin(async move { (name, lost.await) })
            })
            .collect();
        async move { futures_select_first(each).await }
    }

    /// Releases every lock (all of them, whatever fails); the first error
    /// (see [`LockGuard::release`]).
    ///
    /// # Cancel safety
    /// The locks not yet released when the future is dropped are released
    /// in the background.
    pub async fn release(self) -> Result<(), Error> {
        release_all(self.guards).await
    }
}

/// The output of whichever of `futures` finishes first.
async fn futures_select_first<F: Future + Unpin>(futures: Vec<F>) -> F::Output {
    let mut futures = futures;
    std::future::poll_fn(move |cx| {
        for f in futures.iter_mut() {
            if let std::task::Poll::Ready(out) = std::pin::Pin::new(f).poll(cx) {
                return std::task::Poll::Ready(out);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;
    use crate::{Backend, SessionOptions};

    async fn session(backend: &MemoryBackend) -> crate::Session {
        backend
            .session(SessionOptions::new().ttl(Duration::from_secs(5)))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn all_or_nothing_in_name_order() {
        let backend = MemoryBackend::new();
        let (a, b) = (session(&backend).await, session(&backend).await);
        let held = a.lock("m/b").unwrap().acquire().await.unwrap();
        let both = b.lock_all(["m/b", "m/a", "m/b"]).unwrap();
        let names: Vec<_> = both.names().map(LockName::as_str).collect();
        assert_eq!(names, ["m/a", "m/b"]);
        assert!(both.try_acquire().await.unwrap().is_none());
        // m/a was taken, then given back before try_acquire returned.
        let free = a.lock("m/a").unwrap().try_acquire().await.unwrap();
        free.expect("m/a left held by a failed lock_all")
            .release()
            .await
            .unwrap();
        let timed_out = both.acquire_timeout(Duration::from_millis(50)).await;
        assert!(
            matches!(&timed_out, Err(Error::Timeout { name, waited, .. })
                if name == "m/b" && *waited == Duration::from_millis(50)),
            "{:?}",
            timed_out.err()
        );
        held.release().await.unwrap();
        let guard = both.acquire_timeout(Duration::from_secs(5)).await.unwrap();
        assert!(guard.is_held());
        assert!(guard.token("m/a").is_some() && guard.token("m/b").is_some());
        assert!(guard.token("m/c").is_none());
        guard.release().await.unwrap();
        assert!(
            a.lock("m/a")
                .unwrap()
                .try_acquire()
                .await
                .unwrap()
                .is_some()
        );
        assert!(b.lock_all(Vec::<&str>::new()).is_err());
    }

    #[tokio::test]
    async fn lost_when_any_is_lost() {
        let backend = MemoryBackend::new();
        let a = session(&backend).await;
        let guard = a.lock_all(["l/x", "l/y"]).unwrap().acquire().await.unwrap();
        let lost = guard.lost();
        backend
            .force_release(&LockName::new("l/y").unwrap())
            .await
            .unwrap();
        let (name, _) = tokio::time::timeout(Duration::from_secs(10), lost)
            .await
            .expect("lost() did not resolve when one lock was broken");
        assert_eq!(name.as_str(), "l/y");
        assert!(!guard.is_held());
    }
}
