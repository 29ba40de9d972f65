//! [`Semaphore`]: N permits, each with its own lease and fencing token,
//! written once on the lock contract for every store.
//!
//! Permit `i` of the semaphore `name` is the lock `name/permits/i`, so at
//! most N permits are valid at once (S1 of each of N locks gives S7), a
//! crashed holder's permit comes back after its own TTL (the lock's expiry),
//! and each grant carries that lock's fencing token. Waiters line up on the
//! lock `name/queue` (first come, first served on the stores that declare
//! `fair`); the head of the line tries every permit at once, and if none
//! is free claims every permit at once and keeps the first one granted, so
//! it wakes as soon as any permit is freed.
//!
//! Every client of one semaphore must give the same number of permits: the
//! bound is the number of permit locks, and a client that counts more
//! permits can hold the others' and its own extra ones at once.
//!
//! Cost: a wait takes the queue lock, tries every permit at once (a round
//! trip, N requests; two round trips on Redis, whose busy try is followed
//! by a clean-up; a try of a held permit leaves nothing behind),
//! and only if none was free claims every permit at once and withdraws the
//! N - 1 claims it does not keep; then it gives the queue lock back.
//! (Claiming at once without the tries halved PostgreSQL's permit grants/s
//! in `dlock bench`: a waiting claim enters the permit's queue in the
//! database and must be withdrawn from it.) `try_acquire` skips the line
//! and tries the permits one after another. On a free semaphore the tries
//! or claims may be granted several permits for a moment: until they are
//! given back (in the background) other clients' tries may find them
//! taken, and on stores without notifications the next waiter may wait for
//! its poll.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::backend::Backend;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::info::LockInfo;
use crate::lost::LostReason;
use crate::name::{IntoLockName, LockName};
use crate::session::Session;
use crate::token::FencingToken;

/// The most permits one semaphore may have.
pub const MAX_PERMITS: usize = 256;

/// A counting semaphore of one session: `session.semaphore("pools/db", 4)?`.
///
/// Each [`acquire`](Self::acquire) takes one more permit (not reentrant:
/// two acquires through one handle hold two permits).
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let pool = session.semaphore("pools/reports-db", 4)?.why("nightly export");
/// let permit = pool.acquire_timeout(Duration::from_secs(30)).await?;
/// println!("permit {} with token {}", permit.slot(), permit.token());
/// tokio::select! {
///     reason = permit.lost() => eprintln!("permit lost ({reason})"),
///     _ = async { /* use the pool */ } => {}
/// }
/// permit.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    session: Session,
    name: LockName,
    queue: LockName,
    /// The permit locks, by slot.
    slots: Arc<[LockName]>,
    why: Option<String>,
}

impl Semaphore {
    pub(crate) fn new(
        session: Session,
        name: impl IntoLockName,
        permits: usize,
    ) -> Result<Self, Error> {
        let name = name.into_lock_name()?;
        if !(1..=MAX_PERMITS).contains(&permits) {
            return Err(Error::Config(format!(
                "semaphore {name}: {permits} permits; give 1 to {MAX_PERMITS}"
            )));
        }
        let queue = LockName::new(format!("{name}/queue"))?;
        let slots = (0..permits)
            .map(|i| LockName::new(permit_name(&name, i)))
            .collect::<Result<Arc<[_]>, _>>()?;
        Ok(Self {
            session,
            name,
            queue,
            slots,
            why: None,
        })
    }

    /// Sets the reason recorded with each permit (see
    /// [`Lock::why`](crate::Lock::why)).
    pub fn why(mut self, why: impl Into<String>) -> Self {
        self.why = Some(why.into());
        self
    }

    /// The semaphore's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// How many permits it has.
    pub fn permits(&self) -> usize {
        self.slots.len()
    }

    /// Takes a permit if one is free now; never waits, and may pass
    /// clients that wait in line. `Ok(None)`: every permit is held (or, on
    /// fair stores, claimed).
    ///
    /// # Cancel safety
    /// As [`Lock::try_acquire`](crate::Lock::try_acquire).
    pub async fn try_acquire(&self) -> Result<Option<Permit>, Error> {
        let start = rand::rng().random_range(0..self.slots.len());
        for i in (0..self.slots.len()).map(|k| (start + k) % self.slots.len()) {
            if let Some(guard) = self.permit_lock(i)?.try_acquire().await? {
                return Ok(Some(Permit { guard, slot: i }));
            }
        }
        Ok(None)
    }

    /// Waits in line for a permit. [`Error::SessionLost`] if the session
    /// ends meanwhile.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped wait leaves its place in line and its claims
    /// in the background, and gives back a permit granted meanwhile (S5).
    pub async fn acquire(&self) -> Result<Permit, Error> {
        self.acquire_until(None).await
    }

    /// Waits at most `wait` for a permit; [`Error::Timeout`] (naming the
    /// semaphore) after that, within `wait` plus a round trip.
    ///
    /// # Cancel safety
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<Permit, Error> {
        let deadline = Instant::now().checked_add(wait);
        match self.acquire_until(deadline.map(|d| (d, wait))).await {
            Err(Error::Timeout { cause, .. }) => Err(Error::Timeout {
                name: self.name.to_string(),
                waited: wait,
                cause,
            }),
            other => other,
        }
    }

    async fn acquire_until(&self, until: Option<(Instant, Duration)>) -> Result<Permit, Error> {
        let left = || until.map(|(d, _)| d.saturating_duration_since(Instant::now()));
        let place = self.line_up(left()).await?;
        let permit = self.claim_all(left()).await;
        // The line moves on whether or not this one got a permit; the queue
        // lock guards nothing, so its release is not waited for.
        drop(place);
        permit
    }

    /// A place at the head of the line (the queue lock), waiting at most
    /// `wait` (`None`: no end).
    pub(crate) async fn line_up(&self, wait: Option<Duration>) -> Result<LockGuard, Error> {
        let queue = self.session.lock(&self.queue)?;
        match wait {
            None => queue.acquire().await,
            Some(wait) => queue.acquire_timeout(wait).await,
        }
    }

    /// The session's request timeout.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.session.state().timing.request_timeout
    }

    /// At the head of the line: a claim on every permit at once (a free
    /// one is granted in one round trip), keeping the first granted (the
    /// others are withdrawn, a permit granted meanwhile is given back, both
    /// in the background). Each claim retries transient errors as
    /// [`Lock::acquire`](crate::Lock::acquire) does.
    async fn claim_all(&self, wait: Option<Duration>) -> Result<Permit, Error> {
        let started = Instant::now();
        let heard_busy = match self.try_all(wait).await? {
            Tried::Granted(permit) => return Ok(permit),
            Tried::NotGranted { busy_only } => busy_only,
        };
        let wait = wait.map(|w| w.saturating_sub(started.elapsed()));
        match self.claim_each(wait).await {
            // Busy, not silent: the tries heard "busy" within this wait, and
            // the claims heard nothing more before it ran out (as a lock's
            // timeout tells the last thing it heard).
            Err(Error::Timeout {
                name,
                waited,
                cause: Some(cause),
            }) if heard_busy && crate::lock::is_no_answer(&cause) => Err(Error::Timeout {
                name,
                waited,
                cause: None,
            }),
            other => other,
        }
    }

    /// Claims every permit at once, keeping the first granted (see
    /// [`claim_all`](Self::claim_all)).
    async fn claim_each(&self, wait: Option<Duration>) -> Result<Permit, Error> {
        let mut claims = JoinSet::new();
        for i in 0..self.slots.len() {
            let lock = self.permit_lock(i)?;
            claims.spawn(async move {
                let guard = match wait {
                    None => lock.acquire().await,
                    Some(wait) => lock.acquire_timeout(wait).await,
                };
                guard.map(|guard| Permit { guard, slot: i })
            });
        }
        let mut last = None;
        while let Some(done) = claims.join_next().await {
            match done {
                Ok(Ok(permit)) => return Ok(permit),
                // (a claim that heard something outranks one that heard
                // nothing before the deadline, whatever order they end in)
                Ok(Err(e)) if last.as_ref().is_none_or(heard_nothing) => last = Some(e),
                Ok(Err(_)) => {}
                Err(e) => {
                    last = Some(Error::protocol(
                        "dlock",
                        format!("a claim on a permit of {} failed: {e}", self.name),
                    ))
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::protocol("dlock", "a semaphore without permits")))
    }

    /// One try of every permit at once, within `wait`: the first granted,
    /// if any. A try of a held permit leaves nothing behind, where a waiting
    /// claim enters that permit's queue (on fair stores, the database's lock
    /// queue) and must then be withdrawn. A try costs a round trip (two on
    /// stores whose busy answer is followed by a clean-up, as Redis's). The
    /// other tries are dropped with this call's `JoinSet`: like any dropped
    /// acquire, each withdraws its claim, and gives back what it was
    /// granted, in a task of the session (S5). Errors are left to the
    /// waiting claims, which retry what is transient; a session that ends
    /// meanwhile ends the wait at once.
    async fn try_all(&self, wait: Option<Duration>) -> Result<Tried, Error> {
        let state = self.session.state().clone();
        let mut tries = JoinSet::new();
        for i in 0..self.slots.len() {
            let lock = self.permit_lock(i)?;
            tries.spawn(async move { (i, lock.try_acquire().await) });
        }
        // (atomics: counted inside the raced future, read after it)
        let busy = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::atomic::AtomicUsize::new(0);
        let first = async {
            while let Some(done) = tries.join_next().await {
                let count = match done {
                    Ok((slot, Ok(Some(guard)))) => return Some(Permit { guard, slot }),
                    Ok((_, Ok(None))) => &busy,
                    _ => &failed,
                };
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            None
        };
        let permit = tokio::select! {
            _ = state.ended() => return Err(state.lost_error()),
            permit = async {
                match wait {
                    None => first.await,
                    Some(wait) => tokio::time::timeout(wait, first).await.ok().flatten(),
                }
            } => permit,
        };
        Ok(match permit {
            Some(permit) => Tried::Granted(permit),
            None => Tried::NotGranted {
                busy_only: busy.into_inner() > 0 && failed.into_inner() == 0,
            },
        })
    }

    pub(crate) fn permit_lock(&self, slot: usize) -> Result<crate::Lock, Error> {
        let lock = self.session.lock(&self.slots[slot])?;
        Ok(match &self.why {
            Some(why) => lock.why(why.as_str()),
            None => lock,
        })
    }
}

impl std::fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name)
            .field("permits", &self.slots.len())
            .finish()
    }
}

/// A timeout whose acquire heard nothing from the store before it.
fn heard_nothing(e: &Error) -> bool {
    matches!(e, Error::Timeout { cause: Some(cause), .. } if crate::lock::is_no_answer(cause))
}

/// What [`Semaphore::try_all`] found.
enum Tried {
    /// A permit, the first granted.
    Granted(Permit),
    /// None granted; `busy_only`: some tries answered busy and none failed
    /// (the others, if any, were still in flight when the wait ran out).
    NotGranted { busy_only: bool },
}

/// One permit of a [`Semaphore`]: the guard of its permit lock.
///
/// Stop using what the permit guards when [`lost`](Self::lost) fires;
/// dropping it gives the permit back in the background.
#[must_use = "dropping a Permit gives it back at once"]
pub struct Permit {
    pub(crate) guard: LockGuard,
    slot: usize,
}

impl Permit {
    /// Which permit this is (0 to N - 1).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The fencing token of this grant, larger than every earlier grant of
    /// the same permit (tokens of different permits are not comparable).
    pub fn token(&self) -> FencingToken {
        self.guard.token()
    }

    /// Whether the permit is still valid (see [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.guard.is_held()
    }

    /// Resolves when the permit is lost or given back (see
    /// [`LockGuard::lost`]).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub fn lost(&self) -> impl Future<Output = LostReason> + Send + 'static {
        self.guard.lost()
    }

    /// The permit lock's guard.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Gives the permit back; answers as [`LockGuard::release`].
    ///
    /// # Cancel safety
    /// If dropped, the release continues in the background.
    pub async fn release(self) -> Result<(), Error> {
        self.guard.release().await
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("name", self.guard.name())
            .field("token", &self.token())
            .field("held", &self.is_held())
            .finish()
    }
}

/// The permit lock of slot `i`.
fn permit_name(semaphore: &LockName, i: usize) -> String {
    format!("{semaphore}/permits/{i}")
}

/// The permits of `semaphore` held now, as the store reports them (one
/// [`LockInfo`] per permit lock, with its holder, token and expiry).
///
/// # Cancel safety
/// Cancel safe (one read).
pub async fn holders(
    backend: &dyn Backend,
    semaphore: impl IntoLockName,
) -> Result<Vec<LockInfo>, Error> {
    let name = semaphore.into_lock_name()?;
    let prefix = format!("{name}/permits/");
    let held = backend.list(&prefix).await?;
    Ok(held
        .into_iter()
        .filter(|info| {
            info.name.as_str()[prefix.len()..]
                .parse::<usize>()
                .is_ok_and(|i| permit_name(&name, i) == info.name.as_str())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryBackend, test_session as session};

    #[tokio::test]
    async fn n_permits_then_busy_then_one_back() {
        let backend = MemoryBackend::new();
        let (a, b) = (session(&backend).await, session(&backend).await);
        let sem = a.semaphore("pool", 2).unwrap();
        let one = sem.acquire().await.unwrap();
        let two = sem.acquire().await.unwrap();
        assert_ne!(one.slot(), two.slot());
        let other = b.semaphore("pool", 2).unwrap();
        assert!(other.try_acquire().await.unwrap().is_none());
        assert!(matches!(
            other.acquire_timeout(Duration::from_millis(50)).await,
            Err(Error::Timeout { name, .. }) if name == "pool"
        ));
        assert_eq!(holders(&backend, "pool").await.unwrap().len(), 2);
        let waiting = tokio::spawn(async move { other.acquire().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (slot, token) = (two.slot(), two.token());
        two.release().await.unwrap();
        let next = waiting.await.unwrap().unwrap();
        assert_eq!(next.slot(), slot);
        assert!(next.token() > token);
        assert_eq!(holders(&backend, "pool").await.unwrap().len(), 2);
        drop((one, next));
    }

    /// A wait that the tries leave too little of ends as busy (no cause),
    /// not as "no answer before the deadline" from claims cut off before
    /// their reply (the adversarial review of 329fa58; red before its fix
    /// for waits a little longer than the line plus the tries). And a
    /// permit freed while the tries answer is still granted to the claims.
    /// Paused time: the link's delays are exact.
    #[tokio::test(start_paused = true)]
    async fn a_busy_semaphore_times_out_as_busy() {
        use crate::memory::Fault;
        let backend = MemoryBackend::new();
        let a = session(&backend).await;
        let held = a.semaphore("pool", 1).unwrap().acquire().await.unwrap();
        let (linked, link) = backend.linked();
        let b = session(&linked).await;
        link.set(Fault::delay(
            Duration::from_millis(20),
            Duration::from_millis(20),
        ));
        let sem = b.semaphore("pool", 1).unwrap();
        // What the line and a try cost on this link.
        let t = Instant::now();
        drop(b.lock("other").unwrap().acquire().await.unwrap());
        let line = t.elapsed();
        let t = Instant::now();
        assert!(sem.try_acquire().await.unwrap().is_none());
        let tries = t.elapsed();
        assert!(
            line >= Duration::from_millis(40) && tries >= line,
            "{line:?} {tries:?}"
        );
        let (mut wait, mut rounds) = (line + tries + Duration::from_millis(5), 0);
        while wait <= line + tries * 3 {
            rounds += 1;
            // (the last wait's place in line is given back in the background)
            tokio::time::sleep(Duration::from_millis(500)).await;
            match sem.acquire_timeout(wait).await {
                Err(Error::Timeout { cause, .. }) => {
                    assert!(cause.is_none(), "waited {wait:?}: {cause:?}")
                }
                other => panic!("waited {wait:?}: {other:?}"),
            }
            wait += Duration::from_millis(5);
        }
        assert!(rounds >= 10, "{rounds} waits tried");
        // A permit freed while the tries answer: the claims get it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        // (a wait the tries leave less than their own time of: the claims,
        // not an early "busy", must answer)
        let wait = line + tries + Duration::from_millis(60);
        let waiting = tokio::spawn(async move { sem.acquire_timeout(wait).await });
        tokio::time::sleep(line + tries / 2).await;
        held.release().await.unwrap();
        let permit = waiting.await.unwrap();
        assert!(
            permit.is_ok(),
            "a permit freed during the tries: {permit:?}"
        );
    }

    #[tokio::test]
    async fn bad_permit_counts_are_refused() {
        let backend = MemoryBackend::new();
        let a = session(&backend).await;
        assert!(matches!(a.semaphore("pool", 0), Err(Error::Config(_))));
        assert!(matches!(
            a.semaphore("pool", MAX_PERMITS + 1),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            a.semaphore("x".repeat(195), 20),
            Err(Error::InvalidName { .. })
        ));
    }
}
