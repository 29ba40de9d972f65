//! [`Lock`]: a named handle and the acquire loop, written once for all stores.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tracing::Instrument;

use crate::backend::{Attempt, Take};
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
/// name) exclude each other like two processes would. One handle is
/// *reentrant, counted*: acquiring through a handle (or a clone of it) whose
/// earlier guard is still live returns at once with another guard carrying the
/// same token, and the lock is freed when the last of those guards is released
/// or dropped. Ownership lives in the handle, never in a thread or task, since
/// async code moves between threads.
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
#[derive(Clone)]
pub struct Lock {
    session: Arc<SessionHandle>,
    name: LockName,
    why: Option<Arc<str>>,
    state: Arc<HandleState>,
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

    /// Waits until the lock is ours. Transient store errors are retried.
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

    /// Waits at most `wait` for the lock; [`Error::Timeout`] after that
    /// (within `wait` plus one round trip, invariant L5).
    ///
    /// # Cancel safety
    /// As [`acquire`](Self::acquire).
    pub async fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard, Error> {
        let start = Instant::now();
        self.acquire_with(Wait::Until(start + wait, wait))
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

    async fn acquire_inner(&self, wait: Wait) -> Result<Option<LockGuard>, Error> {
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let _serial = match wait {
            Wait::No => match self.state.gate.try_lock() {
                Ok(g) => g,
                Err(_) => return Ok(None), // this handle's own acquire is in flight
            },
            Wait::Forever => self.state.gate.lock().await,
            Wait::Until(deadline, asked) => {
                match timeout_at(deadline, self.state.gate.lock()).await {
                    Ok(g) => g,
                    Err(_) => return Err(self.timeout_error(asked)),
                }
            }
        };
        if let Some(guard) = self.reenter() {
            return Ok(Some(guard));
        }
        let shared = self.shared().clone();
        shared.check_alive()?;
        let timing = shared.timing;
        let attempt = self
            .request(shared.raw.attempt(&self.name, self.why.as_deref()))
            .await?;
        let mut attempt = AttemptGuard::new(attempt, shared.clone());
        let mut backoff = Duration::from_millis(10);
        loop {
            let sent = Instant::now();
            Stats::bump(&shared.stats.take_attempts);
            match self.request(attempt.get().try_take()).await {
                Ok(Take::Granted(hold)) => {
                    attempt.disarm();
                    let deadline = shared.grant_deadline(sent);
                    if deadline <= Instant::now() {
                        // The take took longer than the TTL allows (Redlock's
                        // "validity ≤ 0"): the store may already free it, so it
                        // is not ours to use. Give it back and try again.
                        tracing::warn!(took = ?sent.elapsed(), "grant arrived after its validity; retrying");
                        let raw = shared.raw.clone();
                        let request_timeout = timing.request_timeout;
                        shared.spawn(async move {
                            let _ = timeout(request_timeout, raw.release(&hold)).await;
                        });
                        let again = self
                            .request(shared.raw.attempt(&self.name, self.why.as_deref()))
                            .await?;
                        attempt = AttemptGuard::new(again, shared.clone());
                        continue;
                    }
                    let held = shared.register(hold, deadline);
                    if let Err(e) = shared.check_alive() {
                        shared.lose(&held, crate::LostReason::Closed);
                        return Err(e);
                    }
                    *self.state.current.lock().unwrap() = Arc::downgrade(&held);
                    tracing::debug!(token = %held.hold.token, "acquired");
                    return Ok(Some(LockGuard {
                        held,
                        session: self.session.clone(),
                        done: false,
                    }));
                }
                Ok(Take::Busy(busy)) => {
                    backoff = Duration::from_millis(10);
                    let now = Instant::now();
                    match wait {
                        Wait::No => {
                            // Finish the clean-up before answering, so a
                            // try-only attempt leaves nothing in a fair queue
                            // that could make the next try see "busy".
                            attempt.abandon_now().await;
                            return Ok(None);
                        }
                        Wait::Until(deadline, asked) if now >= deadline => {
                            attempt.abandon();
                            return Err(self.timeout_error(asked));
                        }
                        _ => {}
                    }
                    let mut until = now + jitter(timing.poll_fallback);
                    if let Some(after) = busy.retry_after {
                        until = until.min(now + after + Duration::from_millis(1));
                    }
                    if let Some(deadline) = wait.deadline() {
                        until = until.min(deadline);
                    }
                    Stats::bump(&shared.stats.waits);
                    let waited =
                        timeout_at(until + timing.request_timeout, attempt.get().wait(until)).await;
                    match waited {
                        Ok(Ok(())) | Err(_) => {}
                        Ok(Err(e)) if e.is_retryable() => sleep_until(until).await,
                        Ok(Err(e)) => return Err(e),
                    }
                }
                Err(e) if e.is_retryable() && !matches!(wait, Wait::No) => {
                    tracing::debug!(error = %e, "take failed; retrying");
                    let mut until = Instant::now() + jitter(backoff);
                    if let Some(deadline) = wait.deadline() {
                        if Instant::now() >= deadline {
                            return Err(e);
                        }
                        until = until.min(deadline);
                    }
                    sleep_until(until).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Bounds one store request by the session's request timeout.
    async fn request<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let shared = self.shared();
        match timeout(shared.timing.request_timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::unavailable(shared.scheme, "request timed out")),
        }
    }

    fn timeout_error(&self, asked: Duration) -> Error {
        Error::Timeout {
            name: self.name.to_string(),
            waited: asked,
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

/// Owns an attempt until it is granted; otherwise abandons it in the
/// background (also when the acquire future is dropped mid-way).
struct AttemptGuard {
    attempt: Option<Box<dyn Attempt>>,
    shared: Arc<Shared>,
}

impl AttemptGuard {
    fn new(attempt: Box<dyn Attempt>, shared: Arc<Shared>) -> Self {
        Self {
            attempt: Some(attempt),
            shared,
        }
    }

    fn get(&mut self) -> &mut Box<dyn Attempt> {
        self.attempt.as_mut().expect("attempt used after it ended")
    }

    fn disarm(&mut self) {
        self.attempt = None;
    }

    /// Abandons and waits for the clean-up to finish. The clean-up runs as a
    /// session task, so dropping this future does not cut it short.
    async fn abandon_now(&mut self) {
        if let Some(task) = self.spawn_abandon() {
            let _ = task.await;
        }
    }

    fn spawn_abandon(&mut self) -> Option<tokio::task::JoinHandle<()>> {
        let attempt = self.attempt.take()?;
        let request_timeout = self.shared.timing.request_timeout;
        Some(self.shared.spawn(async move {
            if let Ok(Err(e)) = timeout(request_timeout, attempt.abandon()).await {
                tracing::debug!(error = %e, "abandoning an attempt failed");
            }
        }))
    }

    fn abandon(&mut self) {
        let _ = self.spawn_abandon();
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        self.abandon();
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
