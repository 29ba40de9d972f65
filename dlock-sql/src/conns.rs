//! The connections operations run on: at most `dlock_pool` at once, kept
//! idle between operations and handed back without a round trip.
//!
//! sqlx's pool pings every connection on its way back to the pool (an extra
//! round trip per statement, in a spawned task, on sqlx 0.8); a lock's
//! operations are single statements that either answer or get their
//! connection drained or closed by [`Conn`](crate::store::Conn), so that
//! ping buys nothing here. The pool still opens connections (connect
//! options, TLS, the prepared statements of `after_connect`, typed errors);
//! they are detached from it and kept in this LIFO cache, whose semaphore
//! bounds them to `dlock_pool`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{AnyConnection, AnyPool, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, timeout};

/// A connection idle for this long answers a ping before it is used again:
/// a server or middlebox may have dropped it meanwhile.
pub(crate) const IDLE_CHECK: Duration = Duration::from_secs(30);

/// The idle connections and the slots of all of them, idle or in use.
pub(crate) struct Conns {
    opener: AnyPool,
    idle: Mutex<Vec<(AnyConnection, Instant)>>,
    slots: Arc<Semaphore>,
}

/// One slot's connection, out of the cache for one operation.
pub(crate) struct Slot {
    pub(crate) conn: AnyConnection,
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

    /// A connection, within `limit`: the most recently used idle one (pinged
    /// first if idle for [`IDLE_CHECK`]), else a new one.
    pub(crate) async fn get(
        &self,
        limit: Duration,
        ping_limit: Duration,
    ) -> Result<Slot, sqlx::Error> {
        let permit = timeout(limit, self.slots.clone().acquire_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let popped = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((mut conn, since)) = popped else {
                let conn = self.opener.acquire().await?.detach();
                return Ok(Slot {
                    conn,
                    _permit: permit,
                });
            };
            if since.elapsed() < IDLE_CHECK
                || matches!(timeout(ping_limit, conn.ping()).await, Ok(Ok(())))
            {
                return Ok(Slot {
                    conn,
                    _permit: permit,
                });
            }
            // Dead while idle: dropped, and the next one tried.
        }
    }

    /// Takes `slot`'s connection back, answered and ready for the next
    /// statement; its slot is free again.
    pub(crate) fn put(&self, slot: Slot) {
        let Slot { conn, _permit } = slot;
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((conn, Instant::now()));
    }
}
