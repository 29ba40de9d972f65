//! The connections operations run on: at most `dlock_pool` at once, kept
//! idle between operations and handed back without a round trip.
//!
//! sqlx's pool pings every connection on its way back to the pool (an extra
//! round trip per statement, in a spawned task, on sqlx 0.8); a lock's
//! operations are single statements that either answer or get their
//! connection drained or closed by [`Conn`](crate::store::Conn), so that
//! ping buys nothing here. The pool still opens connections (connect
//! options, TLS, the prepared statements of `after_connect`, typed errors);
//! they are detached from it (so it does not count them) and kept in this
//! LIFO cache, whose semaphore bounds them to `dlock_pool`. Like sqlx's
//! pool, the cache retires connections idle for [`IDLE_TIMEOUT`] or older
//! than [`MAX_LIFETIME`] (a failover or a moved DNS name reaches a process
//! that keeps busy), closing them gracefully.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{AnyConnection, AnyPool, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, timeout};

use crate::CONNECT_TIMEOUT;
use crate::store::DRAIN_TIMEOUT;

/// A connection idle for this long answers a ping before it is used again:
/// a server or middlebox may have dropped it meanwhile.
pub(crate) const IDLE_CHECK: Duration = Duration::from_secs(30);

/// A connection idle for this long is closed (sqlx's default).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// A connection this old is closed when it comes back (sqlx's default).
pub(crate) const MAX_LIFETIME: Duration = Duration::from_secs(1800);

/// How long a graceful close may take before the socket is just dropped.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// An open connection and when it was opened.
pub(crate) struct Open {
    pub(crate) conn: AnyConnection,
    opened: Instant,
    /// The server's id of this connection, once asked (a queue lane's wait
    /// is cancelled by it).
    pub(crate) pid: Option<i64>,
}

/// The idle connections and the slots of all of them, idle or in use.
pub(crate) struct Conns {
    opener: AnyPool,
    /// Most recently used last; each with when it went idle.
    idle: Mutex<Vec<(Open, Instant)>>,
    slots: Arc<Semaphore>,
}

/// One slot's connection, out of the cache for one operation.
pub(crate) struct Slot {
    pub(crate) open: Open,
    _permit: OwnedSemaphorePermit,
}

impl Conns {
    /// At most `size` connections, opened by `opener`.
    pub(crate) fn new(opener: AnyPool, size: u32) -> Arc<Self> {
        Arc::new(Self {
            opener,
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(size.max(1) as usize)),
        })
    }

    /// A connection within [`CONNECT_TIMEOUT`]: the most recently used idle
    /// one (pinged first, within [`DRAIN_TIMEOUT`], if idle for
    /// [`IDLE_CHECK`]), else a new one. When an idle one fails its ping, the
    /// older ones are dropped too: whatever killed it (a restart, a
    /// middlebox's idle timer) killed them.
    pub(crate) async fn get(&self) -> Result<Slot, sqlx::Error> {
        timeout(CONNECT_TIMEOUT, async {
            self.fill(self.slot().await?).await
        })
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    /// [`Conns::get`], but waiting for a free slot as long as it takes (in
    /// arrival order: the semaphore is fair); only opening or checking the
    /// connection is bounded by [`CONNECT_TIMEOUT`].
    pub(crate) async fn get_in_turn(&self) -> Result<Slot, sqlx::Error> {
        let permit = self.slot().await?;
        timeout(CONNECT_TIMEOUT, self.fill(permit))
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
    }

    /// A free slot, in arrival order.
    async fn slot(&self) -> Result<OwnedSemaphorePermit, sqlx::Error> {
        self.slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)
    }

    /// A connection for the slot `permit` holds.
    async fn fill(&self, permit: OwnedSemaphorePermit) -> Result<Slot, sqlx::Error> {
        loop {
            let popped = self.lock().pop();
            let Some((mut open, since)) = popped else {
                let conn = self.opener.acquire().await?.detach();
                let open = Open {
                    conn,
                    opened: Instant::now(),
                    pid: None,
                };
                return Ok(Slot {
                    open,
                    _permit: permit,
                });
            };
            if since.elapsed() < IDLE_CHECK
                || matches!(timeout(DRAIN_TIMEOUT, open.conn.ping()).await, Ok(Ok(())))
            {
                return Ok(Slot {
                    open,
                    _permit: permit,
                });
            }
            close(open);
            for (older, _) in self.lock().drain(..) {
                close(older);
            }
        }
    }

    /// Takes `slot`'s connection back, answered and ready for the next
    /// statement (closed instead if older than [`MAX_LIFETIME`]), and
    /// closes the ones idle for [`IDLE_TIMEOUT`]; the slot is free again.
    pub(crate) fn put(&self, slot: Slot) {
        let Slot { open, _permit } = slot;
        let now = Instant::now();
        let mut idle = self.lock();
        let stale = idle
            .iter()
            .take_while(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT)
            .count();
        let retired: Vec<_> = idle.drain(..stale).map(|(open, _)| open).collect();
        let old = if now.duration_since(open.opened) < MAX_LIFETIME {
            idle.push((open, now));
            None
        } else {
            Some(open)
        };
        drop(idle);
        retired.into_iter().chain(old).for_each(close);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Open, Instant)>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Closes `open` gracefully (PostgreSQL's Terminate, MySQL's COM_QUIT) in
/// the background when a runtime is there, so the server logs no aborted
/// connection; else drops the socket.
pub(crate) fn close(open: Open) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = timeout(CLOSE_TIMEOUT, open.conn.close()).await;
        });
    }
}
