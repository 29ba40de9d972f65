//! In-process fault injection: a wrapper around any real backend that can
//! stall renewals, crash the client, lose replies and silence notifications.
//!
//! The wrapper sits between the core and the adapter, so what it injects looks
//! to the core exactly like a network fault looks to the adapter, while the
//! store itself stays real. (Faults below the adapter — a TCP proxy, killing
//! the server — come with the adapters that need them.)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Claim, ExpiryModel, Hold, RawSession, RenewalReport, Renewed, Take};
use dlock_core::{Backend, Error, LockName, SessionId, SessionOptions};
use tokio::time::{Instant, sleep_until};

/// The switches of a [`FaultyBackend`]; flip them at any time.
#[derive(Debug, Default)]
pub struct Faults {
    stall_renewals: AtomicBool,
    panic_renewals: AtomicBool,
    crashed: AtomicBool,
    lose_take_replies: AtomicU32,
    lose_release_replies: AtomicU32,
    hang_close_replies: AtomicU32,
    deaf: AtomicBool,
    /// How long a lost take reply keeps the caller waiting.
    lost_take_delay: std::sync::Mutex<Duration>,
    drop_abandons: AtomicBool,
}

impl Faults {
    /// Renewals hang (a paused process, a black-holed connection): the
    /// requests never reach the store and never return.
    pub fn stall_renewals(&self) {
        self.stall_renewals.store(true, Ordering::SeqCst);
    }

    /// The adapter's renewal panics (a bug in an adapter or a driver).
    pub fn panic_renewals(&self) {
        self.panic_renewals.store(true, Ordering::SeqCst);
    }

    /// The client is gone: every request fails at once without reaching the
    /// store, including the releases a dropped guard would send.
    pub fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
    }

    /// The next `n` takes reach the store but their replies are lost.
    pub fn lose_take_replies(&self, n: u32) {
        self.lose_take_replies.store(n, Ordering::SeqCst);
    }

    /// Like [`Faults::lose_take_replies`], but each lost reply keeps the
    /// caller waiting `delay` first (a slow network, then a timeout).
    pub fn lose_take_replies_after(&self, n: u32, delay: Duration) {
        *self.lost_take_delay.lock().unwrap() = delay;
        self.lose_take_replies.store(n, Ordering::SeqCst);
    }

    /// The next `n` releases reach the store but their replies are lost.
    pub fn lose_release_replies(&self, n: u32) {
        self.lose_release_replies.store(n, Ordering::SeqCst);
    }

    /// The next `n` closes reach the store, but their replies never come
    /// (a reply lost on a connection that stays open): the core's request
    /// timeout cuts them off.
    pub fn hang_close_replies(&self, n: u32) {
        self.hang_close_replies.store(n, Ordering::SeqCst);
    }

    /// Notifications never arrive: waits last until their timer.
    pub fn deafen(&self) {
        self.deaf.store(true, Ordering::SeqCst);
    }

    /// Abandons of attempts never reach the store (they report success).
    pub fn drop_abandons(&self) {
        self.drop_abandons.store(true, Ordering::SeqCst);
    }

    fn crashed(&self) -> Result<(), Error> {
        if self.crashed.load(Ordering::SeqCst) {
            Err(Error::unavailable(
                "faulty",
                "client crashed (fault injection)",
            ))
        } else {
            Ok(())
        }
    }

    fn take_one(counter: &AtomicU32) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

fn lost_reply() -> Error {
    Error::unavailable("faulty", "reply lost (fault injection)")
}

/// A backend that forwards to a real one, with [`Faults`] in between.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    faults: Arc<Faults>,
}

impl FaultyBackend {
    /// Wraps `inner`; returns the backend and its switches.
    pub fn wrap(inner: Arc<dyn Backend>) -> (Arc<dyn Backend>, Arc<Faults>) {
        let faults = Arc::new(Faults::default());
        let backend = Arc::new(Self {
            inner,
            faults: faults.clone(),
        });
        (backend, faults)
    }
}

dlock_core::forward_backend! {
    impl Backend for FaultyBackend => inner;
    forward: scheme, min_ttl, max_ttl, capabilities, wait_ready, inspect, list, validate,
        force_release;

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        self.faults.crashed()?;
        let inner = self.inner.open(id, options).await?;
        Ok(Arc::new(FaultySession {
            inner,
            faults: self.faults.clone(),
        }))
    }
}

#[derive(Debug)]
struct FaultySession {
    inner: Arc<dyn RawSession>,
    faults: Arc<Faults>,
}

impl FaultySession {
    /// The faults of a renewal, before it reaches the store.
    async fn renewal_faults(&self) -> Result<(), Error> {
        self.faults.crashed()?;
        if self.faults.stall_renewals.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.faults.panic_renewals.load(Ordering::SeqCst) {
            // An unwinding panic as a bug would raise, without the panic
            // hook (whose backtrace printing can stall a loaded machine for
            // longer than a test TTL).
            std::panic::resume_unwind(Box::new("renewal panicked (fault injection)"));
        }
        Ok(())
    }
}

#[async_trait]
impl RawSession for FaultySession {
    fn ttl(&self) -> Duration {
        self.inner.ttl()
    }

    fn expiry(&self) -> ExpiryModel {
        self.inner.expiry()
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        self.faults.crashed()?;
        let inner = self.inner.claim(name, why).await?;
        Ok(Box::new(FaultyClaim {
            inner,
            faults: self.faults.clone(),
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        self.renewal_faults().await?;
        self.inner.renew(holds).await
    }

    async fn renew_each(&self, holds: &[Hold]) -> Result<Vec<Renewed>, Error> {
        self.renewal_faults().await?;
        self.inner.renew_each(holds).await
    }

    async fn renew_into(&self, holds: &[Hold], report: &RenewalReport) -> Result<(), Error> {
        self.renewal_faults().await?;
        self.inner.renew_into(holds, report).await
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        self.faults.crashed()?;
        let result = self.inner.release(hold).await;
        if Faults::take_one(&self.faults.lose_release_replies) {
            return Err(lost_reply());
        }
        result
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        self.faults.crashed()?;
        let result = self.inner.close(holds).await;
        if Faults::take_one(&self.faults.hang_close_replies) {
            std::future::pending::<()>().await;
        }
        result
    }
}

#[derive(Debug)]
struct FaultyClaim {
    inner: Box<dyn Claim>,
    faults: Arc<Faults>,
}

#[async_trait]
impl Claim for FaultyClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.faults.crashed()?;
        let result = self.inner.try_take().await;
        if Faults::take_one(&self.faults.lose_take_replies) {
            let delay = *self.faults.lost_take_delay.lock().unwrap();
            tokio::time::sleep(delay).await;
            return Err(lost_reply());
        }
        result
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        self.faults.crashed()?;
        if self.faults.deaf.load(Ordering::SeqCst) {
            sleep_until(until).await;
            return Ok(());
        }
        self.inner.wait(until).await
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        self.faults.crashed()?;
        if self.faults.drop_abandons.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.abandon().await
    }
}
