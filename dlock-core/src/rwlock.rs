//! [`RwLock`]: many readers or one writer, written once on the lock
//! contract for every store.
//!
//! The read side is a [`Semaphore`] of R permits (`name/permits/i`, R the
//! most readers at once, [`DEFAULT_MAX_READERS`] unless set); a writer holds
//! **every** permit. Readers and writers line up on one queue lock
//! (`name/queue`): a writer at the head of the line claims all permits and
//! keeps the line until it has them, so readers that come after it wait,
//! and the readers before it finish. On stores that declare `fair` the line
//! is first come, first served, so a stream of readers cannot starve a
//! writer; on the others (Redis, SQLite, MongoDB) the line's lock goes to
//! whoever asks when it is free, and a writer may wait behind many readers.
//! Every client of one lock must admit the same number of readers: a
//! writer excludes only the readers' places it knows of.
//!
//! A read's token orders it only against writes on its own permit: do not
//! check reads with the writers' fence. A read whose hold was lost (see
//! [`ReadGuard::lost`]) may have overlapped a write.
//!
//! Tokens: a reader's is its permit's; a writer's is the largest of its R
//! permits' tokens. Each permit's tokens grow with every grant, so a
//! writer's token is larger than every earlier writer's and than the token
//! of every read that ended before the write began: fence the resource's
//! writes with [`WriteGuard::token`].
//!
//! There is no upgradeable read lock: a reader that claims the other
//! permits while a writer at the head of the line waits for the reader's
//! own permit would wait for each other forever, and going through the line
//! means giving up the read first. Read, release, then write. For the same
//! reason a second read while holding one waits forever behind a writer at
//! the head of the line: do not nest reads.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::Error;
use crate::guard::LockGuard;
use crate::lost::LostReason;
use crate::multi::MultiGuard;
use crate::name::{IntoLockName, LockName};
use crate::semaphore::{Permit, Semaphore};
use crate::session::Session;
use crate::token::FencingToken;

/// How many readers an [`RwLock`] admits at once unless
/// [`max_readers`](Session::rwlock_with) says otherwise. A writer takes
/// (and renews) one permit per reader.
pub const DEFAULT_MAX_READERS: usize = 16;

/// A read-write lock of one session: `session.rwlock("catalog")?`.
///
/// Each [`read`](Self::read) and [`write`](Self::write) is one more hold
/// (not reentrant). Every client of one lock must admit the same number of
/// readers.
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let catalog = session.rwlock("catalog")?;
/// let reading = catalog.read().await?; // many at once
/// reading.release().await?;
/// let writing = catalog.write_timeout(Duration::from_secs(30)).await?; // alone
/// let token = writing.token(); // fence the writes with it
/// writing.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RwLock {
    readers: Semaphore,
}

impl RwLock {
    pub(crate) fn new(
        session: Session,
        name: impl IntoLockName,
        max_readers: usize,
    ) -> Result<Self, Error> {
        Ok(Self {
            readers: Semaphore::new(session, name, max_readers)?,
        })
    }

    /// Sets the reason recorded with each hold (see
    /// [`Lock::why`](crate::Lock::why)).
    pub fn why(self, why: impl Into<String>) -> Self {
        Self {
            readers: self.readers.why(why),
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.readers.name()
    }

    /// The most readers at once.
    pub fn max_readers(&self) -> usize {
        self.readers.permits()
    }

    /// Reads if no writer holds the lock and a reader's place is free now;
    /// never waits, and may pass clients in line (a waiting writer that has
    /// not claimed every place yet too). Tries the places one after
    /// another: up to R round trips.
    ///
    /// # Cancel safety
    /// As [`Lock::try_acquire`](crate::Lock::try_acquire).
    pub async fn try_read(&self) -> Result<Option<ReadGuard>, Error> {
        Ok(self.readers.try_acquire().await?.map(ReadGuard))
    }

    /// Waits in line to read.
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    pub async fn read(&self) -> Result<ReadGuard, Error> {
        self.readers.acquire().await.map(ReadGuard)
    }

    /// Waits at most `wait` to read; [`Error::Timeout`] after that.
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    pub async fn read_timeout(&self, wait: Duration) -> Result<ReadGuard, Error> {
        self.readers.acquire_timeout(wait).await.map(ReadGuard)
    }

    /// Writes if nobody reads or writes now; never waits. `Ok(None)` when
    /// busy (what it took meanwhile is given back first).
    ///
    /// # Cancel safety
    /// Cancel safe: what it took is given back in the background.
    pub async fn try_write(&self) -> Result<Option<WriteGuard>, Error> {
        let mut guards = Vec::with_capacity(self.max_readers());
        for slot in 0..self.max_readers() {
            match self.readers.permit_lock(slot)?.try_acquire().await {
                Ok(Some(guard)) => guards.push(guard),
                other => {
                    self.give_back(guards).await;
                    return other.map(|_| None);
                }
            }
        }
        Ok(self.held_or_given_back(guards).await)
    }

    /// Waits in line to write: once at the head of the line, keeps later
    /// readers and writers waiting while the readers before it finish.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped wait leaves the line, and what it took is
    /// given back, in the background.
    pub async fn write(&self) -> Result<WriteGuard, Error> {
        self.write_until(None).await
    }

    /// Waits at most `wait` to write; [`Error::Timeout`] (naming the lock)
    /// after that, having given back what it took (one more round trip; at
    /// most a request timeout when the store does not answer, the rest of
    /// the releases then going on in the background).
    ///
    /// # Cancel safety
    /// As [`write`](Self::write).
    pub async fn write_timeout(&self, wait: Duration) -> Result<WriteGuard, Error> {
        let until = Instant::now().checked_add(wait);
        match self.write_until(until).await {
            Err(Error::Timeout { cause, .. }) => Err(Error::Timeout {
                name: self.name().to_string(),
                waited: wait,
                cause,
            }),
            other => other,
        }
    }

    async fn write_until(&self, until: Option<Instant>) -> Result<WriteGuard, Error> {
        let left = || until.map(|d| d.saturating_duration_since(Instant::now()));
        loop {
            let place = self.readers.line_up(left()).await?;
            // Only the head of the line claims every permit: a writer whose
            // place was lost (expired, force-released) stops claiming, or
            // two writers could split the permits and wait for each other.
            let claimed = tokio::select! {
                claimed = self.claim_every_permit(until) => Some(claimed),
                _ = place.lost() => None,
            };
            // (the queue lock guards nothing: its release is not waited for)
            drop(place);
            match claimed {
                Some(Ok(guards)) => {
                    if let Some(guard) = self.held_or_given_back(guards).await {
                        return Ok(guard);
                    }
                    // A permit was lost while another was waited for: again.
                }
                Some(Err(e)) => return Err(e),
                // (what it had claimed is withdrawn or given back in the
                // background as the claims drop)
                None => {
                    tracing::debug!(lock = %self.name(), "rwlock: a writer lost its place in line; lining up again")
                }
            }
        }
    }

    /// Claims every permit at once (no other writer does: this one is at
    /// the head of the line); all of them, or the first error with what
    /// was taken given back.
    async fn claim_every_permit(&self, until: Option<Instant>) -> Result<Vec<LockGuard>, Error> {
        let mut claims = JoinSet::new();
        let wait = until.map(|d| d.saturating_duration_since(Instant::now()));
        for slot in 0..self.max_readers() {
            let lock = self.readers.permit_lock(slot)?;
            claims.spawn(async move {
                match wait {
                    None => lock.acquire().await,
                    Some(wait) => lock.acquire_timeout(wait).await,
                }
            });
        }
        let mut guards = Vec::with_capacity(self.max_readers());
        while let Some(done) = claims.join_next().await {
            let failed = match done {
                Ok(Ok(guard)) => {
                    guards.push(guard);
                    continue;
                }
                Ok(Err(e)) => e,
                Err(e) => Error::protocol(
                    "dlock",
                    format!("a claim on a permit of {} failed: {e}", self.name()),
                ),
            };
            // The others are withdrawn (a late grant given back) as the
            // set drops, in the background.
            drop(claims);
            self.give_back(guards).await;
            return Err(failed);
        }
        Ok(guards)
    }

    /// One write guard over `guards` if each is still held; else all given
    /// back and `None`.
    async fn held_or_given_back(&self, guards: Vec<LockGuard>) -> Option<WriteGuard> {
        if guards.iter().all(LockGuard::is_held) {
            return Some(WriteGuard {
                all: MultiGuard::from_guards(guards),
            });
        }
        self.give_back(guards).await;
        None
    }

    /// Releases `guards` (all at once: one round trip), waiting at most one
    /// request timeout when the store does not answer (the rest goes on in
    /// the background), so that a timed-out write has given back what it
    /// took; failures are logged, since the answer is about the acquire.
    async fn give_back(&self, guards: Vec<LockGuard>) {
        crate::multi::give_back(guards, self.readers.request_timeout(), "rwlock").await;
    }
}

/// A read hold of an [`RwLock`]: one reader's permit.
#[must_use = "dropping a ReadGuard releases it at once"]
#[derive(Debug)]
pub struct ReadGuard(Permit);

impl ReadGuard {
    /// This read's token (its permit's).
    pub fn token(&self) -> FencingToken {
        self.0.token()
    }

    /// Whether the read hold is still valid (see [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.0.is_held()
    }

    /// Resolves when the read hold is lost or released.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.0.lost()
    }

    /// Ends the read; answers as [`LockGuard::release`].
    ///
    /// # Cancel safety
    /// If dropped, the release continues in the background.
    pub async fn release(self) -> Result<(), Error> {
        self.0.release().await
    }
}

/// The write hold of an [`RwLock`]: every reader's permit.
#[must_use = "dropping a WriteGuard releases it at once"]
pub struct WriteGuard {
    all: MultiGuard,
}

impl WriteGuard {
    /// The write's fencing token: the largest of its permits' tokens,
    /// larger than every earlier writer's and every read's that ended
    /// before this write began.
    pub fn token(&self) -> FencingToken {
        self.all
            .guards()
            .iter()
            .map(LockGuard::token)
            .max()
            .expect("a write holds at least one permit")
    }

    /// Whether the write hold is still valid: every permit held.
    pub fn is_held(&self) -> bool {
        self.all.is_held()
    }

    /// Resolves when the write hold ends: the first of its permits lost or
    /// released, and why.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        let lost = self.all.lost();
        async move { lost.await.1 }
    }

    /// Ends the write (every permit; the first error, see
    /// [`LockGuard::release`]).
    ///
    /// # Cancel safety
    /// The permits not yet released are released in the background.
    pub async fn release(self) -> Result<(), Error> {
        self.all.release().await
    }
}

impl std::fmt::Debug for WriteGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGuard")
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryBackend, test_session as session};

    #[tokio::test]
    async fn readers_together_writers_alone() {
        let backend = MemoryBackend::new();
        let (a, b) = (session(&backend).await, session(&backend).await);
        let (ra, rb) = (
            a.rwlock_with("rw", 3).unwrap(),
            b.rwlock_with("rw", 3).unwrap(),
        );
        let r1 = ra.read().await.unwrap();
        let r2 = rb.read().await.unwrap();
        assert!(rb.try_write().await.unwrap().is_none());
        assert!(matches!(
            rb.write_timeout(Duration::from_millis(30)).await,
            Err(Error::Timeout { name, .. }) if name == "rw"
        ));
        // Nothing left held by the failed writes: a third reader fits.
        let r3 = ra.try_read().await.unwrap().expect("a free reader's place");
        let read_tokens = [r1.token(), r2.token(), r3.token()];
        let writer = tokio::spawn(async move { rb.write().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A writer waits at the head of the line: a new reader waits behind it.
        assert!(ra.read_timeout(Duration::from_millis(30)).await.is_err());
        for r in [r1, r2, r3] {
            r.release().await.unwrap();
        }
        let w = writer.await.unwrap().unwrap();
        assert!(w.is_held());
        assert!(read_tokens.iter().all(|&t| w.token() > t));
        assert!(ra.try_read().await.unwrap().is_none());
        let first = w.token();
        w.release().await.unwrap();
        let w2 = ra.write().await.unwrap();
        assert!(w2.token() > first);
        w2.release().await.unwrap();
        assert!(ra.try_read().await.unwrap().is_some());
    }

    /// Readers and writers on a fair store with session leases, where every
    /// permit claim a reader withdraws must really be withdrawn: a claim's
    /// take overtaken by its abandon once left a permit held for the
    /// session's life, and the next writer waited forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_and_writers_never_wedge() {
        for _ in 0..5 {
            let backend = MemoryBackend::new().session_leases();
            let mut tasks = Vec::new();
            for client in 0..6 {
                let s = session(&backend).await;
                let lock = s.rwlock_with("rw", 4).unwrap();
                tasks.push(tokio::spawn(async move {
                    for _ in 0..5 {
                        let wait = Duration::from_secs(10);
                        if client < 4 {
                            let read = lock.read_timeout(wait).await.unwrap();
                            tokio::time::sleep(Duration::from_millis(3)).await;
                            read.release().await.unwrap();
                        } else {
                            let write = lock.write_timeout(wait).await.unwrap();
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            write.release().await.unwrap();
                        }
                    }
                    s
                }));
            }
            for task in tasks {
                task.await.unwrap();
            }
        }
    }
}
