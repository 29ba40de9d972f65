//! The session's shared state and the records of its holds: what
//! [`Session`](crate::Session), [`Lock`](crate::Lock),
//! [`LockGuard`](crate::LockGuard) and the renewal task all work on.
//!
//! Everything here depends only on the store primitives (`backend::primitives`)
//! and leaf modules, never on its users, so the module graph has no cycle:
//! `guard` and `renew` depend on `state`, `lock` on `guard`, `session` on
//! `lock` and `renew`, `backend` (whose `Backend::session` starts one) on
//! `session`, and `raw` on `session` and `guard`.
//!
//! Three names, three roles: [`SessionState`] is the session as the core
//! runs it (shared with its background tasks), [`KeepOpen`] is one user-side
//! reference that keeps it open, and the adapter's
//! [`RawSession`] is the store side it drives.

mod cleanup;
mod stats;
mod tenure;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tokio_util::task::TaskTracker;

pub(crate) use cleanup::Cleanup;
pub use stats::SessionStats;
pub(crate) use stats::Stats;
pub(crate) use tenure::Tenure;
use tenure::nanos_since;

use crate::backend::primitives::{ExpiryModel, Hold, RawSession};
use crate::clock;
use crate::error::Error;
use crate::info::SessionId;
use crate::lost::LostReason;
use crate::options::SessionOptions;

/// The `tracing` target of the session's events ("lock lost", "session
/// lost", releases and clean-ups), wherever their code lives: applications
/// filter on it (the CLI silences "lock lost", which it reports itself), so
/// it stays the same when modules move.
pub(crate) const LOG_TARGET: &str = "dlock_core::session";

const ALIVE: u8 = 0;
const LOST: u8 = 1;
const CLOSED: u8 = 2;

/// The timing a session runs with, derived once from its options and the
/// store's effective TTL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) ttl: Duration,
    pub(crate) renew_every: Duration,
    pub(crate) drift: Duration,
    pub(crate) poll_fallback: Duration,
    pub(crate) request_timeout: Duration,
}

impl Timing {
    pub(crate) fn from(options: &SessionOptions) -> Self {
        Self {
            ttl: options.ttl_value(),
            renew_every: options.renew_every_or_default(),
            drift: options.drift_or_default(),
            poll_fallback: options.poll_fallback_or_default(),
            request_timeout: options.request_timeout_or_default(),
        }
    }

    /// The local validity deadline of a grant or renewal sent at `sent` (S4).
    pub(crate) fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.ttl - self.drift
    }
}

/// One session as the core runs it: the store side, its timing, its live
/// [`Tenure`]s, its lifecycle and its background tasks. Shared by the user's
/// handles (through [`KeepOpen`]) and by the session's own tasks, which must
/// not keep it open.
pub(crate) struct SessionState {
    id: SessionId,
    pub(crate) raw: Arc<dyn RawSession>,
    pub(crate) scheme: &'static str,
    pub(crate) timing: Timing,
    expiry: ExpiryModel,
    epoch: Instant,
    /// The session lease's local deadline (nanos since `epoch`), for
    /// [`ExpiryModel::Session`] stores.
    session_deadline: AtomicU64,
    tenures: Mutex<HashMap<u64, Arc<Tenure>>>,
    next_tenure: AtomicU64,
    lifecycle: AtomicU8,
    /// Stops the renewal task.
    pub(crate) shutdown: CancellationToken,
    /// Fires when the session is lost or closed.
    ended: CancellationToken,
    tasks: TaskTracker,
    runtime: Handle,
    pub(crate) stats: Stats,
}

impl SessionState {
    /// The state of a session whose store side `raw` was opened by a request
    /// sent at `sent` (the session lease's first local deadline counts from it).
    pub(crate) fn new(
        id: SessionId,
        raw: Arc<dyn RawSession>,
        scheme: &'static str,
        timing: Timing,
        sent: Instant,
    ) -> Arc<Self> {
        let epoch = sent;
        crate::telemetry::sessions_open(scheme, 1.0);
        Arc::new(Self {
            session_deadline: AtomicU64::new(nanos_since(epoch, timing.valid_until(sent))),
            expiry: raw.expiry(),
            raw,
            scheme,
            timing,
            epoch,
            id,
            tenures: Mutex::new(HashMap::new()),
            next_tenure: AtomicU64::new(0),
            lifecycle: AtomicU8::new(ALIVE),
            shutdown: CancellationToken::new(),
            ended: CancellationToken::new(),
            tasks: TaskTracker::new(),
            runtime: Handle::current(),
            stats: Stats::default(),
        })
    }

    pub(crate) fn id(&self) -> &SessionId {
        &self.id
    }

    /// Spawns a task that belongs to this session (counted, never detached
    /// from the session's runtime).
    pub(crate) fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn_on(fut, &self.runtime)
    }

    /// Background tasks running now (renewal, releases, clean-ups).
    pub(crate) fn task_count(&self) -> usize {
        self.tasks.len()
    }

    /// Holds the session has now.
    pub(crate) fn tenure_count(&self) -> usize {
        self.tenures.lock().unwrap().len()
    }

    pub(crate) fn check_alive(&self) -> Result<(), Error> {
        match self.lifecycle.load(Ordering::Acquire) {
            ALIVE => Ok(()),
            _ => Err(self.lost_error()),
        }
    }

    /// The error for work on a session that has ended.
    pub(crate) fn lost_error(&self) -> Error {
        Error::session_lost(
            self.id.to_string(),
            "it expired on the server, could not be renewed in time, or was closed",
        )
    }

    /// Resolves when the session is lost or closed.
    pub(crate) fn ended(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.ended.cancelled()
    }

    /// As [`ended`](Self::ended), owning what it needs.
    pub(crate) fn ended_owned(&self) -> WaitForCancellationFutureOwned {
        self.ended.clone().cancelled_owned()
    }

    /// A retry policy for one clean-up in the store (see [`Cleanup`]).
    pub(crate) fn cleanup(self: &Arc<Self>, what: &'static str) -> Cleanup {
        Cleanup {
            state: self.clone(),
            what,
            backoff: Duration::from_millis(10),
            // What a per-hold store keeps expires on its own after a TTL.
            expires: match self.expiry {
                ExpiryModel::PerHold => Some(Instant::now() + self.timing.ttl),
                ExpiryModel::Session => None,
            },
        }
    }

    /// The local deadline of a grant whose take was sent at `sent`.
    pub(crate) fn grant_deadline(&self, sent: Instant) -> Instant {
        match self.expiry {
            ExpiryModel::PerHold => self.timing.valid_until(sent),
            ExpiryModel::Session => self.session_deadline(),
        }
    }

    fn session_deadline(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.session_deadline.load(Ordering::Acquire))
    }

    pub(crate) fn extend_session(&self, to: Instant) {
        self.session_deadline
            .fetch_max(nanos_since(self.epoch, to), Ordering::AcqRel);
    }

    /// Records a grant as a new tenure of this session.
    pub(crate) fn register(self: &Arc<Self>, hold: Hold, deadline: Instant) -> Arc<Tenure> {
        let id = self.next_tenure.fetch_add(1, Ordering::Relaxed);
        let tenure = Arc::new(Tenure::new(id, hold, self.epoch, deadline, self.scheme));
        self.tenures.lock().unwrap().insert(id, tenure.clone());
        Stats::bump(&self.stats.grants);
        tenure
    }

    pub(crate) fn forget(&self, tenure: &Tenure) {
        self.tenures.lock().unwrap().remove(&tenure.id);
    }

    /// Forgets every tenure, firing `lost()` with `reason`; returns their
    /// holds for the store to free.
    fn take_holds(&self, reason: LostReason) -> Vec<Hold> {
        let drained: Vec<_> = self
            .tenures
            .lock()
            .unwrap()
            .drain()
            .map(|(_, t)| t)
            .collect();
        drained
            .into_iter()
            .map(|tenure| {
                tenure.lose(reason);
                tenure.hold.clone()
            })
            .collect()
    }

    pub(crate) fn tenures(&self) -> Vec<Arc<Tenure>> {
        self.tenures.lock().unwrap().values().cloned().collect()
    }

    /// The earliest local deadline among holds (and the session lease).
    pub(crate) fn earliest_deadline(&self) -> Option<Instant> {
        let tenures = self.tenures.lock().unwrap();
        let earliest = tenures.values().map(|t| t.deadline()).min();
        match self.expiry {
            ExpiryModel::Session if !tenures.is_empty() => {
                Some(earliest.map_or(self.session_deadline(), |e| e.min(self.session_deadline())))
            }
            _ => earliest,
        }
    }

    /// Ends a tenure other than by release: fires `lost()`, forgets it and, if
    /// the store might still have it, releases it there in the background so
    /// others need not wait for the store's expiry.
    ///
    /// The clean-up keys on removing the tenure from the session, not on being
    /// the first to mark it lost: a `lost()` future may have marked it first
    /// (it watches the deadline itself), and the hold must still be released.
    pub(crate) fn lose(self: &Arc<Self>, tenure: &Arc<Tenure>, reason: LostReason) {
        tenure.lose(reason);
        let removed = self.tenures.lock().unwrap().remove(&tenure.id).is_some();
        if !removed {
            return;
        }
        let reason = tenure.reason().unwrap_or(reason);
        Stats::bump(&self.stats.losses);
        tracing::warn!(target: crate::state::LOG_TARGET, lock = %tenure.hold.name, token = %tenure.hold.token, session = %self.id, %reason, "lock lost");
        if matches!(
            reason,
            LostReason::Expired | LostReason::Closed | LostReason::HoldLimit
        ) {
            self.release_in_background(tenure.hold.clone(), "releasing a lost hold");
        }
    }

    /// Fires `lost()` for every tenure past its local deadline.
    pub(crate) fn expire_overdue(self: &Arc<Self>) {
        let now = clock::now();
        for tenure in self.tenures() {
            if tenure.deadline() <= now || !tenure.is_live() {
                self.lose(&tenure, LostReason::Expired);
            }
        }
    }

    /// The renewal task died (a panic in an adapter or driver): without it
    /// the holds would look valid while nothing renews them, so the session
    /// is lost now, and freed in the store so others need not wait (item 8).
    pub(crate) fn renewal_died(self: &Arc<Self>) {
        tracing::error!(target: crate::state::LOG_TARGET, session = %self.id, "the renewal task panicked; the session is lost");
        let holds: Vec<Hold> = self.tenures().iter().map(|t| t.hold.clone()).collect();
        self.mark_lost();
        let state = self.clone();
        self.spawn(async move {
            let _ = timeout(state.timing.request_timeout, state.raw.close(&holds)).await;
        });
    }

    /// The store dropped the session: every hold is lost, nothing more works.
    pub(crate) fn mark_lost(self: &Arc<Self>) {
        if self
            .lifecycle
            .compare_exchange(ALIVE, LOST, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            crate::telemetry::sessions_open(self.scheme, -1.0);
            tracing::warn!(target: crate::state::LOG_TARGET, session = %self.id, "session lost");
        }
        for tenure in self.tenures() {
            self.lose(&tenure, LostReason::SessionLost);
        }
        self.shutdown.cancel();
        self.ended.cancel();
    }

    /// Ends the session in the foreground: stops renewing, frees its holds
    /// (their `lost()` fire with [`LostReason::Closed`]) and waits for its
    /// background tasks. See [`Session::close`](crate::Session::close).
    pub(crate) async fn close(self: &Arc<Self>) -> Result<(), Error> {
        let was = self.lifecycle.swap(CLOSED, Ordering::AcqRel);
        if was == ALIVE {
            crate::telemetry::sessions_open(self.scheme, -1.0);
        }
        self.shutdown.cancel();
        // The session has ended even if this close is dropped while it
        // retries: waits on it end with `SessionLost` (L5).
        let ended = self.ended.clone().drop_guard();
        let give_up_at = self.close_give_up_at();
        let holds = self.take_holds(LostReason::Closed);
        let result = if was == CLOSED {
            Ok(())
        } else {
            self.until_confirmed("close", give_up_at, |_| self.raw.close(&holds))
                .await
        };
        drop(ended);
        self.tasks.close();
        let _ = timeout(self.timing.request_timeout * 2, self.tasks.wait()).await;
        tracing::debug!(target: crate::state::LOG_TARGET, session = %self.id, "session closed");
        result
    }

    /// Until when a close is worth retrying: while what the session may
    /// have in the store could still be there. Its holds, grants whose
    /// replies were lost (which a close frees too) and, on a session store,
    /// the session itself were last taken or renewed by a request sent
    /// before now, so the store frees them by itself within one TTL (plus
    /// the drift) from now. Not only the known holds' deadlines: a session
    /// whose guards were all released has none, and its close (SQLite's,
    /// cut off behind busy writers in CI: `contention`) would get one try.
    fn close_give_up_at(&self) -> Instant {
        // (the retry loop's clock: it counts time the host was suspended)
        clock::now() + self.timing.ttl + self.timing.drift
    }

    /// Ends the session in the background, once its last [`KeepOpen`] is gone.
    fn close_in_background(self: &Arc<Self>) {
        match self.lifecycle.swap(CLOSED, Ordering::AcqRel) {
            CLOSED => return,
            ALIVE => crate::telemetry::sessions_open(self.scheme, -1.0),
            _ => {}
        }
        self.shutdown.cancel();
        let give_up_at = self.close_give_up_at();
        let holds = self.take_holds(LostReason::Closed);
        let state = self.clone();
        self.spawn(async move {
            let _ = state
                .until_confirmed("close", give_up_at, |_| state.raw.close(&holds))
                .await;
            state.ended.cancel();
        });
        self.tasks.close();
    }
}

/// One user-side reference to a session: held by [`Session`](crate::Session)
/// clones, lock handles and guards (never by the session's own tasks); when
/// the last one goes, the session closes in the background (S5: no task
/// outlives it).
pub(crate) struct KeepOpen {
    pub(crate) state: Arc<SessionState>,
}

impl Drop for KeepOpen {
    fn drop(&mut self) {
        self.state.close_in_background();
    }
}
