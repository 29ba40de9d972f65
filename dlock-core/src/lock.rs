//! [`Lock`]: a named handle and the acquire loop, written once for all stores.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::Instrument;

use crate::backend::{Claim, Take};
use crate::guard::HeldState;
use crate::session::{SessionHandle, Shared, Stats};
use crate::{Error, LockGuard, LockName};

/// The longest reason ([`Lock::why`]) kept, in bytes.
pub const MAX_WHY_LEN: usize = 512;

/// A named lock from a [`Session`](crate::Session): `session.lock("a/b")?`.
///
/// # Ownership and reentrancy
///
/// The handle is the owner. Two handles (even of one session, even for one
/// name, even a clone of this one) exclude each other like two processes
/// would. One handle is *reentrant, counted*: acquiring through a handle
/// whose earlier guard is still live returns at once with another guard
/// carrying the same token, and the lock is freed when the last of those
/// guards is released or dropped. Ownership lives in the handle, never in a
/// thread or task, since async code moves between threads.
///
/// ```
/// # async fn demo(session: dlock_core::Session) -> Result<(), dlock_core::Error> {
/// use std::time::Duration;
/// let lock = session.lock("billing/invoice-run")?.why("monthly invoices");
/// let outer = lock.acquire_timeout(Duration::from_secs(30)).await?;
/// let inner = lock.acquire().await?; // reentrant: same handle, same token
/// assert_eq!(inner.token(), outer.token());
/// inner.release().await?; // still held by `outer`
/// outer.release().await?; // freed
/// # Ok(()) }
/// ```
pub struct Lock {
    session: Arc<SessionHandle>,
    name: LockName,
    why: Option<Arc<str>>,
    state: Arc<HandleState>,
}

/// A clone is a new handle: another owner of the same name, which the
/// original excludes (ownership is per handle, never shared by copying).
impl Clone for Lock {
    fn clone(&self) -> Self {
        Self {
            session: self.session.clone(),
            name: self.name.clone(),
            why: self.why.clone(),
            state: Arc::default(),
        }
    }
}

#[derive(Default)]
struct HandleState {
    /// The hold this handle has, for reentrancy.
    current: Mutex<Weak<HeldState>>,
    /// One store attempt per handle at a time.
    gate: tokio::sync::Mutex<()>,
}

#[derive(Clone, Copy)]
enum Wait {
    No,
    Forever,
    /// Deadline, and the wait asked for (for the error message).
    Until(Instant, Duration),
}

impl Wait {
    fn deadline(self) -> Option<Instant> {
        match self {
            Wait::Until(d, _) => Some(d),
            _ => None,
        }
    }
}

impl Lock {
    pub(crate) fn new(session: Arc<SessionHandle>, name: LockName) -> Self {
        Self {
            session,
            name,
            why: None,
            state: Arc::default(),
        }
    }

    /// Sets the reason recorded with the acquisition (shown by `inspect`, like
    /// the seeds' `why` field). Reasons longer than [`MAX_WHY_LEN`] bytes are
    /// cut there (at a character boundary), so every store can keep them.
    pub fn why(mut self, why: impl Into<String>) -> Self {
        let mut why = why.into();
        if why.len() > MAX_WHY_LEN {
            let mut end = MAX_WHY_LEN;
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            why.truncate(end);
        }
        self.why = Some(why.into());
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Takes the lock if it is free now; never waits. `Ok(None)` means busy
    /// (held by another owner or, on fair stores, others queue for it).
    ///
    /// # Cancel safety
    /// Cancel safe: if dropped, whatever the attempt left in the store is
    /// removed in the background (S5).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>, Error> {
        self.acquire_with(Wait::No).await
    }

    /// Waits until the lock is ours. Transient store errors are retried;
    /// [`Error::SessionLost`] if the session ends while waiting.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future at any await point leaves no queue
    /// entry behind and no hold beyond one TTL (S5); clean-up runs in the
    /// background.
    pub async fn acquire(&self) -> Result<LockGuard, Error> {
        self.acquire_with(Wait::Forever)
            .await
            .and_then(|g| g.ok_or_else(|| unreachable_busy(&self.name)))
    }

    /// Waits at most `wait` for the lock; [`Error::Timeout`] after that,
    /// within `wait` plus one round trip (invariant L5), also when the store
    /// does not answer: the deadline cuts requests in flight. So a `wait`
    /// shorter than a round trip can time out on a free lock; for exactly
    /// one try use [`try_acquire`](Self::try_acquire).
    ///
    /// The timeout's `cause` is `None` when the lock stayed busy, and the
    /// store's last error (or "no answer before the deadline") when the
    /// store was failing or silent: a caller can tell "busy" from
    /// "unreachable".
    ///
    /// # Cancel safety
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard, Error> {
        // A wait too long to count is a wait without end.
        let until = match Instant::now().checked_add(wait) {
            Some(deadline) => Wait::Until(deadline, wait),
            None => Wait::Forever,
        };
        self.acquire_with(until)
            .await
            .and_then(|g| g.ok_or_else(|| unreachable_busy(&self.name)))
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.session.shared
    }

    fn reenter(&self) -> Option<LockGuard> {
        let held = self.state.current.lock().unwrap().upgrade()?;
        held.try_reenter().then(|| LockGuard {
            held,
            session: self.session.clone(),
            done: false,
        })
    }

    async fn acquire_with(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        let span =
            tracing::debug_span!("dlock.acquire", lock = %self.name, session = %self.shared().id());
        self.acquire_inner(wait).instrument(span).await
    }

    /// The acquire loop: take, else wait for a change, retrying transient
    /// errors, within the caller's deadline and the session's life.
    async fn acquire_inner(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let Some(_serial) = self.serialize(wait).await? else {
            return Ok(None); // this handle's own acquire is in flight
        };
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let shared = self.shared().clone();
        shared.check_alive()?;
        let mut backoff = Backoff::default();
        let mut last = Last::Nothing;
        let attempt = loop {
            match self
                .request(wait, shared.raw.claim(&self.name, self.why.as_deref()))
                .await
            {
                Ok(attempt) => break attempt,
                Err(e @ Error::Timeout { .. }) => return Err(last.explain(e, shared.scheme)),
                Err(e) if e.is_retryable() && !matches!(wait, Wait::No) => {
                    tracing::debug!(error = %e, "starting an attempt failed; retrying");
                    self.pause(wait, &mut backoff, &mut last, e).await?;
                }
                Err(e) => return Err(e),
            }
        };
        let mut attempt = PendingClaim::new(attempt, shared.clone());
        loop {
            // No take once the caller's deadline has passed (also the first:
            // the wait may have gone on this handle's gate or on starting
            // the attempt): it would be cut off at once, its reply never
            // used, while it may still land and hold the lock for no one.
            if let Wait::Until(deadline, asked) = wait
                && Instant::now() >= deadline
            {
                return Err(last.explain(self.timeout_error(asked, None), shared.scheme));
            }
            let sent = crate::clock::now();
            Stats::bump(&shared.stats.take_attempts);
            match self.request(wait, attempt.get().try_take()).await {
                Ok(Take::Granted(hold)) => {
                    let deadline = shared.grant_deadline(sent);
                    if deadline > crate::clock::now() {
                        return self.granted(&mut attempt, hold, deadline).map(Some);
                    }
                    // The take took longer than the TTL allows (Redlock's
                    // "validity ≤ 0"): the store may free it any moment, so
                    // it is not ours to use yet. Take again with the same
                    // attempt: that re-extends the grant (adapter rule 4)
                    // and keeps the queue place.
                    tracing::warn!(took = ?sent.elapsed(), "grant arrived after its validity; taking again");
                    let late =
                        Error::unavailable(shared.scheme, "grants arrive after their validity");
                    self.pause(wait, &mut backoff, &mut last, late).await?;
                }
                Ok(Take::Busy(busy)) => {
                    backoff = Backoff::default();
                    last = Last::Busy;
                    match wait {
                        Wait::No => {
                            // Finish the clean-up before answering, so a
                            // try-only attempt leaves nothing in a fair queue
                            // that could make the next try see "busy".
                            attempt.abandon_now().await;
                            return Ok(None);
                        }
                        Wait::Until(deadline, asked) if Instant::now() >= deadline => {
                            return Err(self.timeout_error(asked, None));
                        }
                        _ => {}
                    }
                    self.wait_for_change(&mut attempt, busy, wait).await?;
                }
                Err(e @ Error::Timeout { .. }) => return Err(last.explain(e, shared.scheme)),
                Err(e) if e.is_retryable() && !matches!(wait, Wait::No) => {
                    tracing::debug!(error = %e, "take failed; retrying");
                    self.pause(wait, &mut backoff, &mut last, e).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One store attempt per handle at a time: waits for this handle's other
    /// acquire (within the caller's deadline); `None` for a try that finds
    /// one in flight.
    async fn serialize(
        &self,
        wait: Wait,
    ) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>, Error> {
        Ok(Some(match wait {
            Wait::No => match self.state.gate.try_lock() {
                Ok(g) => g,
                Err(_) => return Ok(None),
            },
            Wait::Forever => self.state.gate.lock().await,
            Wait::Until(deadline, asked) => timeout_at(deadline, self.state.gate.lock())
                .await
                .map_err(|_| self.timeout_error(asked, None))?,
        }))
    }

    /// Turns a grant into a guard.
    fn granted(
        &self,
        attempt: &mut PendingClaim,
        hold: crate::backend::Hold,
        deadline: Instant,
    ) -> Result<LockGuard, Error> {
        let shared = self.shared();
        attempt.disarm();
        let held = shared.register(hold, deadline);
        if let Err(e) = shared.check_alive() {
            shared.lose(&held, crate::LostReason::Closed);
            return Err(e);
        }
        *self.state.current.lock().unwrap() = Arc::downgrade(&held);
        tracing::debug!(token = %held.hold.token, "acquired");
        Ok(LockGuard {
            held,
            session: self.session.clone(),
            done: false,
        })
    }

    /// Waits until the lock may have changed: the adapter's notification, the
    /// holder's expiry hint or the jittered fallback timer, within the
    /// caller's deadline; ends early if the session ends.
    async fn wait_for_change(
        &self,
        attempt: &mut PendingClaim,
        busy: crate::backend::Busy,
        wait: Wait,
    ) -> Result<(), Error> {
        let shared = self.shared().clone();
        let timing = shared.timing;
        let now = Instant::now();
        let mut until = now + jitter(timing.poll_fallback);
        if let Some(after) = busy.retry_after
            && let Some(hint) = now.checked_add(after + Duration::from_millis(1))
        {
            until = until.min(hint);
        }
        if let Some(deadline) = wait.deadline() {
            until = until.min(deadline);
        }
        Stats::bump(&shared.stats.waits);
        let waited = tokio::select! {
            _ = shared.ended() => return Err(shared.lost_error()),
            w = timeout_at(until + timing.request_timeout, attempt.get().wait(until)) => w,
        };
        match waited {
            Ok(Ok(())) | Err(_) => Ok(()),
            Ok(Err(e)) if e.is_retryable() => {
                tokio::select! {
                    _ = shared.ended() => Err(shared.lost_error()),
                    _ = sleep_until(until) => Ok(()),
                }
            }
            Ok(Err(e)) => Err(e),
        }
    }

    /// Sleeps before retrying after `failed` (remembered in `last`);
    /// [`Error::Timeout`] (with `failed` as its cause) if the caller's
    /// deadline comes first, [`Error::SessionLost`] if the session ends.
    async fn pause(
        &self,
        wait: Wait,
        backoff: &mut Backoff,
        last: &mut Last,
        failed: Error,
    ) -> Result<(), Error> {
        let shared = self.shared();
        let mut until = Instant::now() + backoff.next();
        *last = Last::Failed(failed);
        if let Wait::Until(deadline, asked) = wait {
            if Instant::now() >= deadline {
                return Err(last.explain(self.timeout_error(asked, None), shared.scheme));
            }
            until = until.min(deadline);
        }
        tokio::select! {
            _ = shared.ended() => Err(shared.lost_error()),
            _ = sleep_until(until) => Ok(()),
        }
    }

    /// Bounds one store request by the session's request timeout and the
    /// caller's deadline (which wins: [`Error::Timeout`] without a cause,
    /// which [`Last::explain`] supplies), and by the session's life.
    async fn request<T>(
        &self,
        wait: Wait,
        fut: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let shared = self.shared();
        let mut limit = Instant::now() + shared.timing.request_timeout;
        let mut cut_by_caller = None;
        if let Wait::Until(deadline, asked) = wait
            && deadline < limit
        {
            limit = deadline;
            cut_by_caller = Some(asked);
        }
        tokio::select! {
            r = timeout_at(limit, fut) => match r {
                Ok(r) => r,
                Err(_) => Err(match cut_by_caller {
                    Some(asked) => self.timeout_error(asked, None),
                    None => Error::unavailable(shared.scheme, "request timed out"),
                }),
            },
            _ = shared.ended(), if !matches!(wait, Wait::No) => Err(shared.lost_error()),
        }
    }

    fn timeout_error(&self, asked: Duration, cause: Option<Error>) -> Error {
        Error::Timeout {
            name: self.name.to_string(),
            waited: asked,
            cause: cause.map(Box::new),
        }
    }
}

/// What the store last said during one acquire: tells a [`Error::Timeout`]
/// for a busy lock (no cause) from one for a store that was failing or
/// silent (the cause), which e.g. `dlock run` reports differently.
enum Last {
    /// No request has been answered yet.
    Nothing,
    /// The last answer was "busy".
    Busy,
    /// The last request failed with this transient error.
    Failed(Error),
}

impl Last {
    /// `timeout` with the cause this acquire ended on, if the store was not
    /// answering "busy".
    fn explain(&mut self, timeout: Error, scheme: &'static str) -> Error {
        let Error::Timeout {
            name,
            waited,
            cause,
        } = timeout
        else {
            return timeout;
        };
        let cause = cause.or(match std::mem::replace(self, Last::Nothing) {
            Last::Busy => None,
            Last::Failed(e) => Some(Box::new(e)),
            Last::Nothing => Some(Box::new(Error::unavailable(
                scheme,
                "no answer before the deadline",
            ))),
        });
        Error::Timeout {
            name,
            waited,
            cause,
        }
    }
}

fn unreachable_busy(name: &LockName) -> Error {
    Error::protocol(
        "dlock",
        format!("waiting acquire of {name:?} returned busy"),
    )
}

/// ±10 % so that waiters polling the same lock spread out.
fn jitter(d: Duration) -> Duration {
    let factor = 0.9 + rand::random::<f64>() * 0.2;
    d.mul_f64(factor)
}

/// Retry pacing: 10 ms doubling to 1 s, jittered.
#[derive(Debug, Clone, Copy)]
struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Self {
        Backoff(Duration::from_millis(10))
    }
}

impl Backoff {
    fn next(&mut self) -> Duration {
        let now = self.0;
        self.0 = (self.0 * 2).min(Duration::from_secs(1));
        jitter(now)
    }
}

/// Owns an attempt until it is granted; otherwise abandons it in the
/// background (also when the acquire future is dropped mid-way), retrying
/// until the clean-up succeeds or the session ends (S5, issue 12 item 13).
struct PendingClaim {
    attempt: Option<Box<dyn Claim>>,
    shared: Arc<Shared>,
}

impl PendingClaim {
    fn new(attempt: Box<dyn Claim>, shared: Arc<Shared>) -> Self {
        Self {
            attempt: Some(attempt),
            shared,
        }
    }

    fn get(&mut self) -> &mut Box<dyn Claim> {
        self.attempt.as_mut().expect("attempt used after it ended")
    }

    fn disarm(&mut self) {
        self.attempt = None;
    }

    /// Abandons and waits for the first clean-up try (retries, if any, go
    /// on in the background). Dropping this future does not cut it short.
    async fn abandon_now(&mut self) {
        if let Some(first_try) = self.spawn_abandon() {
            let _ = first_try.await;
        }
    }

    /// Spawns the clean-up; the returned receiver resolves after its first try.
    fn spawn_abandon(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let mut attempt = self.attempt.take()?;
        let (tried, first_try) = tokio::sync::oneshot::channel();
        let mut cleanup = self.shared.cleanup("abandoning an attempt");
        self.shared.spawn(async move {
            let mut tried = Some(tried);
            loop {
                let done = cleanup.try_once(attempt.abandon()).await;
                if let Some(tried) = tried.take() {
                    let _ = tried.send(());
                }
                if done || !cleanup.wait_to_retry().await {
                    return;
                }
            }
        });
        Some(first_try)
    }
}

impl Drop for PendingClaim {
    fn drop(&mut self) {
        let _ = self.spawn_abandon();
    }
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.name)
            .field("why", &self.why)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::memory::MemoryBackend;
    use crate::{Backend, Error, SessionOptions};

    /// L5 hygiene: once the caller's deadline has passed, no take goes out
    /// (it would be cut off at once, and could still land and hold the lock
    /// for no one). A busy lock nobody releases: the waiter sends its first
    /// take, is never woken, and must not send another at the deadline.
    #[tokio::test]
    async fn no_take_after_the_deadline() {
        let server = MemoryBackend::new();
        let options = SessionOptions::new().ttl(Duration::from_secs(5));
        let a = server.session(options.clone()).await.unwrap();
        let b = server.session(options).await.unwrap();
        let _held = a.lock("x").unwrap().acquire().await.unwrap();
        let r = b
            .lock("x")
            .unwrap()
            .acquire_timeout(Duration::from_millis(200))
            .await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(
            b.stats().take_attempts,
            1,
            "a take went out at the deadline"
        );
        // A deadline already past before the first take: none goes out.
        let r = b.lock("x").unwrap().acquire_timeout(Duration::ZERO).await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(
            b.stats().take_attempts,
            1,
            "a take went out past the deadline"
        );
    }
}
