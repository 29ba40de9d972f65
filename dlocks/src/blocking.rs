//! Locks for programs that are not async (CLI tools, build steps, sync web
//! frameworks), like `reqwest::blocking`: the same backends, names, tokens
//! and guarantees, with no runtime needed from the caller. Each
//! [`Backend`] runs one small tokio runtime (one worker thread) of its own,
//! which its sessions, locks and guards share; every call blocks the
//! calling thread until the store answers.
//!
//! ```
//! use std::time::Duration;
//! use dlocks::SessionOptions;
//!
//! let backend = dlocks::blocking::connect("memory://blocking-doc")?;
//! let session = backend.session(SessionOptions::new().ttl(Duration::from_secs(10)))?;
//! let guard = session.lock("nightly-report")?.acquire()?;
//! // ... the work, writing with guard.token() as its fence ...
//! assert!(guard.is_held());
//! guard.release()?; // or drop it: that releases too, before drop returns
//! # Ok::<(), dlocks::Error>(())
//! ```
//!
//! Differences from the async API, all because a thread has no `select!`:
//! - [`LockGuard::lost`] is a channel that receives the [`LostReason`] once
//!   the hold ends; [`LockGuard::lost_reason`] and [`LockGuard::is_held`]
//!   are checks.
//! - Dropping a [`LockGuard`] releases in the foreground (the drop returns
//!   when the store answered, or after the release's own bound), and the
//!   session closes in the foreground when its last [`Session`], [`Lock`]
//!   or [`LockGuard`] is dropped: nothing is left to a runtime that is about
//!   to stop.
//! - Called from a thread that is inside a runtime already (a
//!   `spawn_blocking` thread), each call runs on a helper thread and waits
//!   for it: it works, drops included. From an async task it works too,
//!   but blocks that task's worker thread as any blocking call does: use
//!   the async API there.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use dlock_core::name::IntoLockName;
use dlock_core::{FencingToken, LockInfo, LockName, LostReason, SessionOptions};

use crate::{Error, Result};

/// The runtime every object of one [`Backend`] runs on.
struct Runtime(Option<tokio::runtime::Runtime>);

impl Runtime {
    fn new() -> Result<Arc<Self>> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("dlock-blocking")
            .enable_all()
            .build()
            .map(|rt| Arc::new(Self(Some(rt))))
            .map_err(|e| Error::Config(format!("cannot start the blocking API's runtime: {e}")))
    }

    /// Runs `fut` to completion on this runtime, blocking the thread. A
    /// thread that is inside a runtime already (a `spawn_blocking` thread,
    /// or an async task that calls this API anyway) cannot `block_on`
    /// there: the future then runs on a helper thread, which this one waits
    /// for.
    fn block_on<F>(&self, fut: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        let rt = self.runtime();
        if tokio::runtime::Handle::try_current().is_err() {
            return rt.block_on(fut);
        }
        std::thread::scope(|s| {
            match std::thread::Builder::new()
                .name("dlock-blocking-call".into())
                .spawn_scoped(s, || rt.block_on(fut))
                .expect("spawn a helper thread")
                .join()
            {
                Ok(output) => output,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime().handle()
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("runtime present until drop")
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // (without waiting on the thread that drops it: that may be one of
        // the runtime's own, where a blocking shutdown would panic)
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Opens the backend a URL names, as [`crate::connect`] does.
///
/// # Errors
/// As [`crate::connect`].
pub fn connect(url: &str) -> Result<Backend> {
    let rt = Runtime::new()?;
    let inner = rt.block_on(crate::connect(url))?;
    Ok(Backend {
        inner: Some(inner),
        rt,
    })
}

/// A deployment of a lock store, blocking. Cheap to clone (the clones share
/// one runtime and one connection pool).
#[derive(Clone)]
pub struct Backend {
    inner: Option<Arc<dyn crate::Backend>>,
    rt: Arc<Runtime>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Drivers may spawn their clean-up as they are dropped: on our runtime.
        let _enter = self.rt.handle().enter();
        drop(self.inner.take());
    }
}

impl Backend {
    fn inner(&self) -> &Arc<dyn crate::Backend> {
        self.inner.as_ref().expect("present until drop")
    }

    /// Opens a session: see [`crate::Backend::session`].
    ///
    /// # Errors
    /// As [`crate::Backend::session`].
    pub fn session(&self, options: SessionOptions) -> Result<Session> {
        let session = self.rt.block_on(self.inner().session(options))?;
        Ok(Session {
            core: Arc::new(SessionCore {
                session: Some(session),
                rt: self.rt.clone(),
            }),
        })
    }

    /// Who holds `name`, if anyone: see [`crate::Backend::inspect`].
    ///
    /// # Errors
    /// As [`crate::Backend::inspect`].
    pub fn inspect(&self, name: impl IntoLockName) -> Result<Option<LockInfo>> {
        let name = name.into_lock_name()?;
        self.rt.block_on(self.inner().inspect(&name))
    }

    /// How long until this deployment may grant: see
    /// [`crate::Backend::ready_in`].
    ///
    /// # Errors
    /// As [`crate::Backend::ready_in`].
    pub fn ready_in(&self) -> Result<Duration> {
        self.rt.block_on(self.inner().ready_in())
    }

    /// Breaks the lock `name` whoever holds it (admin): see
    /// [`crate::Backend::force_release`]. Its holder learns at its next
    /// renewal.
    ///
    /// # Errors
    /// As [`crate::Backend::force_release`].
    pub fn force_release(&self, name: impl IntoLockName) -> Result<bool> {
        let name = name.into_lock_name()?;
        self.rt.block_on(self.inner().force_release(&name))
    }

    /// The URL scheme of the backend.
    pub fn scheme(&self) -> &'static str {
        self.inner().scheme()
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Backend")
            .field("scheme", &self.inner().scheme())
            .finish()
    }
}

/// One session and the runtime it runs on; closes the session in the
/// foreground when the last blocking handle on it goes.
struct SessionCore {
    session: Option<crate::Session>,
    rt: Arc<Runtime>,
}

impl SessionCore {
    fn session(&self) -> &crate::Session {
        self.session.as_ref().expect("present until drop")
    }
}

impl Drop for SessionCore {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let _ = self.rt.block_on(session.close());
        let _enter = self.rt.handle().enter();
        drop(session);
    }
}

/// A session, blocking: see [`crate::Session`]. Cheap to clone; it closes
/// when the last clone, [`Lock`] and [`LockGuard`] made from it are gone
/// (or at [`close`](Self::close)).
#[derive(Clone)]
pub struct Session {
    core: Arc<SessionCore>,
}

impl Session {
    /// A handle on the lock `name`: see [`crate::Session::lock`].
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn lock(&self, name: impl IntoLockName) -> Result<Lock> {
        Ok(Lock {
            inner: self.core.session().lock(name)?,
            core: self.core.clone(),
        })
    }

    /// Whether the session is still alive.
    pub fn is_alive(&self) -> bool {
        self.core.session().is_alive()
    }

    /// Ends the session now, releasing its holds: see
    /// [`crate::Session::close`].
    ///
    /// # Errors
    /// As [`crate::Session::close`].
    pub fn close(self) -> Result<()> {
        self.core.rt.block_on(self.core.session().close())
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Session")
            .field("id", self.core.session().id())
            .finish()
    }
}

/// A lock handle, blocking: see [`crate::Lock`].
pub struct Lock {
    inner: crate::Lock,
    core: Arc<SessionCore>,
}

impl Lock {
    /// Records why the lock is taken: see [`crate::Lock::why`].
    pub fn why(mut self, why: impl Into<String>) -> Self {
        self.inner = self.inner.why(why);
        self
    }

    /// Ends every hold after `limit`: see [`crate::Lock::hold_at_most`].
    pub fn hold_at_most(mut self, limit: Duration) -> Self {
        self.inner = self.inner.hold_at_most(limit);
        self
    }

    /// Keeps every hold at least `minimum`: see [`crate::Lock::hold_at_least`].
    pub fn hold_at_least(mut self, minimum: Duration) -> Self {
        self.inner = self.inner.hold_at_least(minimum);
        self
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.inner.name()
    }

    /// Takes the lock, waiting as long as it takes: see
    /// [`crate::Lock::acquire`].
    ///
    /// # Errors
    /// As [`crate::Lock::acquire`].
    pub fn acquire(&self) -> Result<LockGuard> {
        let guard = self.core.rt.block_on(self.inner.acquire())?;
        Ok(self.guard(guard))
    }

    /// Takes the lock if it is free now (`None` if it is held).
    ///
    /// # Errors
    /// As [`crate::Lock::try_acquire`].
    pub fn try_acquire(&self) -> Result<Option<LockGuard>> {
        let guard = self.core.rt.block_on(self.inner.try_acquire())?;
        Ok(guard.map(|g| self.guard(g)))
    }

    /// Takes the lock, waiting at most `wait`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when `wait` runs out; otherwise as
    /// [`crate::Lock::acquire_timeout`].
    pub fn acquire_timeout(&self, wait: Duration) -> Result<LockGuard> {
        let guard = self.core.rt.block_on(self.inner.acquire_timeout(wait))?;
        Ok(self.guard(guard))
    }

    fn guard(&self, guard: crate::LockGuard) -> LockGuard {
        LockGuard {
            inner: Some(guard),
            core: self.core.clone(),
        }
    }
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Lock")
            .field("name", self.inner.name())
            .finish()
    }
}

/// A held lock, blocking: see [`crate::LockGuard`]. Dropping it releases the
/// lock before the drop returns.
#[must_use = "dropping a LockGuard releases the lock at once"]
pub struct LockGuard {
    inner: Option<crate::LockGuard>,
    core: Arc<SessionCore>,
}

impl LockGuard {
    fn inner(&self) -> &crate::LockGuard {
        self.inner.as_ref().expect("present until release or drop")
    }

    /// The fencing token of this hold: pass it with every write the lock
    /// protects.
    pub fn token(&self) -> FencingToken {
        self.inner().token()
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        self.inner().name()
    }

    /// Whether the hold is still valid by the local deadline (invariant S4).
    pub fn is_held(&self) -> bool {
        self.inner().is_held()
    }

    /// Why the hold ended, once it has.
    pub fn lost_reason(&self) -> Option<LostReason> {
        self.inner().lost_reason()
    }

    /// A channel that receives why the hold ended, once it ends (lost, or
    /// released). For a worker thread that checks between steps
    /// (`try_recv`), or a watcher thread that waits (`recv`).
    pub fn lost(&self) -> mpsc::Receiver<LostReason> {
        let (tx, rx) = mpsc::sync_channel(1);
        let lost = self.inner().lost();
        self.core.rt.handle().spawn(async move {
            let _ = tx.send(lost.await);
        });
        rx
    }

    /// Releases the lock: see [`crate::LockGuard::release`].
    ///
    /// # Errors
    /// As [`crate::LockGuard::release`] ([`Error::Lost`] if the hold ended
    /// before).
    pub fn release(mut self) -> Result<()> {
        let guard = self.inner.take().expect("present until release or drop");
        self.core.rt.block_on(guard.release())
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(guard) = self.inner.take() else {
            return;
        };
        if let Err(e) = self.core.rt.block_on(guard.release()) {
            tracing::debug!(error = %e, "release on drop");
        }
    }
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::LockGuard")
            .field("name", self.inner().name())
            .field("token", &self.inner().token())
            .finish()
    }
}
