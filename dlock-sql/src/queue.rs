//! The wait queue in front of the lock rows (PostgreSQL, MySQL): waiters
//! line up in the database's own lock manager, one lock per lock name
//! (`pg_advisory_lock` / `GET_LOCK`), which grants in arrival order and
//! wakes one waiter per release, from inside the server.
//!
//! The row stays the only thing that grants (S1–S5 are the row
//! statements'); the queue only decides who may ask, and when:
//! * a take that finds no one in the queue (or is its head) may take a
//!   free row; one that finds the queue occupied is busy, and its claim
//!   joins the queue on a **lane**, a connection of its own (at most
//!   `dlock_queue` per backend) whose lock wait runs in a task, outliving
//!   the core's bounded waits;
//! * the head takes the row on its lane and keeps the queue lock for as long
//!   as it holds the row, so the next waiter is woken by the lock manager
//!   the moment the holder releases (release and unlock in one statement) —
//!   no notification, no poll;
//! * a holder or head that stalls (paused, or gone while its connection
//!   lingers) cannot stall the lock for long: once a row has been free or
//!   expired for the grace period ([`grace_ms`]), anyone may take it.
//!
//! A wrong queue state can only delay a grant, never make one.

use std::sync::Arc;

use dlock_core::Error;
use sqlx::Row;
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::Inner;
use crate::dialect::{Arg, Dialect};
use crate::store::{Conn, DRAIN_TIMEOUT, map_err};

/// The queue lock of one lock name in one table.
#[derive(Debug, Clone)]
pub(crate) struct QueueKey {
    id: i64,
    name: String,
}

impl QueueKey {
    /// FNV-1a (64 bits) of the scope (the schema or database, and the table)
    /// and the name: the same in every process and version. Two names that
    /// collide share a queue, which costs fairness, not safety (and their
    /// grace period bounds the wait).
    pub(crate) fn new(scope: &str, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in scope.bytes().chain([0]).chain(name.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Self {
            id: h as i64,
            name: format!("dlock/{h:016x}"),
        }
    }

    /// The key as the dialect's lock functions take it.
    pub(crate) fn arg(&self, dialect: Dialect) -> Arg<'_> {
        match dialect {
            Dialect::MySql => Arg::Text(&self.name),
            _ => Arg::Int(self.id),
        }
    }
}

/// How long a freed or expired row is kept for the queue's head before any
/// take may have it: a quarter of the TTL, at most 250 ms. A head takes
/// within a round trip of its turn, so this only matters when the head (or
/// a holder whose lane keeps the queue lock) is stuck: then it is what a
/// crash costs beyond the TTL, within the declared 1 s recovery bound (L1).
pub(crate) fn grace_ms(ttl_ms: i64) -> i64 {
    (ttl_ms / 4).min(250)
}

/// A claim waiting in the queue on its lane. Dropping it leaves the queue.
pub(crate) struct Queued {
    scheme: &'static str,
    /// The lane, once it holds the queue lock (or the wait's error).
    /// `None` once taken.
    rx: Option<oneshot::Receiver<Result<Conn, Error>>>,
    /// Dropped with the claim's place: the lane's task then leaves the queue.
    _stay: oneshot::Sender<()>,
}

impl Queued {
    /// Joins the queue of `key`: a task waits for a lane (in arrival order
    /// among this backend's waiters), then in the lock manager. `None` if
    /// the queue is off.
    pub(crate) fn join(inner: &Arc<Inner>, key: &QueueKey) -> Option<Self> {
        inner.lanes.as_ref()?;
        let (tx, rx) = oneshot::channel();
        let (stay, left) = oneshot::channel();
        tokio::spawn(wait_in_line(inner.clone(), key.clone(), tx, left));
        Some(Self {
            scheme: inner.sql.dialect.scheme(),
            rx: Some(rx),
            _stay: stay,
        })
    }

    /// Resolves when this claim is first in line, with its lane (holding the
    /// queue lock), or with the error that ended its wait.
    ///
    /// # Cancel safety
    /// Cancel safe: the answer stays until a call takes it.
    pub(crate) async fn first(&mut self) -> Result<Conn, Error> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(Error::protocol(self.scheme, "the queue's answer was taken"));
        };
        let answer = rx.await;
        self.rx = None;
        self.answer(answer)
    }

    /// [`Queued::first`] if it has answered already.
    pub(crate) fn try_first(&mut self) -> Option<Result<Conn, Error>> {
        let answer = self.rx.as_mut()?.try_recv();
        if matches!(answer, Err(oneshot::error::TryRecvError::Empty)) {
            return None;
        }
        self.rx = None;
        Some(self.answer(answer.map_err(|_| ())))
    }

    /// Leaves the queue and waits until this claim's place is gone from the
    /// server: its wait cancelled, or, if it was first in line meanwhile,
    /// its queue lock let go. So a take that follows does not find the
    /// queue occupied by a claim that gave up (L4: a timed-out waiter
    /// blocks no one). Dropping this future leaves the rest to the lane's
    /// task.
    pub(crate) async fn leave(self) {
        let Self {
            rx, _stay: stay, ..
        } = self;
        drop(stay); // the task cancels the wait, and ends
        if let Some(rx) = rx
            && let Ok(Ok(lane)) = rx.await
        {
            lane.unlock().await; // first in line before it heard
        }
    }

    fn answer<E>(&self, answer: Result<Result<Conn, Error>, E>) -> Result<Conn, Error> {
        answer.unwrap_or_else(|_| {
            Err(Error::unavailable(
                self.scheme,
                "the queue's lock wait ended",
            ))
        })
    }
}

/// A queued claim's task: a lane, its id, then the lock manager's wait,
/// answered on `tx`. When `left` fires (the claim left the queue), the wait
/// is cancelled on the server from another connection (so no dead waiter
/// stays in line), and the lane is unlocked (it may have got the lock
/// meanwhile), with an answer before the task ends, then closed. The task
/// owns the lane throughout, so the id it cancels is still this lane's.
async fn wait_in_line(
    inner: Arc<Inner>,
    key: QueueKey,
    tx: oneshot::Sender<Result<Conn, Error>>,
    mut left: oneshot::Receiver<()>,
) {
    let Some(queue) = &inner.sql.queue else {
        return;
    };
    let scheme = inner.sql.dialect.scheme();
    let ready = async {
        let mut lane = Conn::lane(&inner).await.expect("queue on")?;
        let pid = lane.pid(&queue.pid).await?;
        Ok::<_, sqlx::Error>((lane, pid))
    };
    let (mut lane, pid) = tokio::select! {
        ready = ready => match ready {
            Ok(ready) => ready,
            Err(e) => {
                let _ = tx.send(Err(map_err(scheme, e)));
                return;
            }
        },
        _ = &mut left => return,
    };
    // From here the lane may hold the queue lock: it goes back to the cache
    // only after an unlock that answered.
    lane.mark_queue_locked(inner.clone(), key.clone());
    let arg = key.arg(inner.sql.dialect);
    let answer = {
        let wait = lane.fetch_one(queue.lock.bind(&[arg]));
        tokio::pin!(wait);
        tokio::select! {
            // A wait that answered is used, not cancelled: a cancel sent
            // after its answer could reach a later statement on the lane.
            biased;
            waited = &mut wait => Some(waited),
            _ = &mut left => {
                if !matches!(timeout(DRAIN_TIMEOUT, cancel(&inner, pid)).await, Ok(Ok(()))) {
                    tracing::debug!("cancelling a queued lock wait failed; its lane is closed");
                }
                let _ = timeout(DRAIN_TIMEOUT, wait).await;
                None
            }
        }
    };
    match answer {
        Some(waited) => {
            // If the claim is gone meanwhile, the lane is dropped with the
            // message, which lets its queue lock go (see `Conn`'s drop).
            let _ = tx.send(
                first_in_line(waited)
                    .map(|()| lane)
                    .map_err(|e| map_err(scheme, e)),
            );
        }
        // Sent a cancel, which may yet land on a later statement: the lane
        // is closed, after an unlock with an answer before the task ends
        // (`Queued::leave` waits for the end), since the wait may have got
        // the lock (it answered so, or a cancel after the grant failed the
        // statement: a session lock outlives it). Undrained, it is dropped:
        // drained, then unlocked, then closed.
        None => {
            lane.retire();
            lane.unlock().await;
        }
    }
}

/// Whether the lock manager's wait answered "yours".
fn first_in_line(waited: Result<sqlx::any::AnyRow, sqlx::Error>) -> Result<(), sqlx::Error> {
    match waited?.try_get::<Option<i64>, _>(0)? {
        Some(1) => Ok(()),
        other => Err(sqlx::Error::Protocol(format!(
            "the queue's lock wait answered {other:?}"
        ))),
    }
}

/// Cancels the statement running on the connection `pid`, from another
/// connection.
async fn cancel(inner: &Inner, pid: i64) -> Result<(), sqlx::Error> {
    let mut conn = Conn::get(inner)
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)?;
    match inner.sql.dialect {
        Dialect::Postgres => {
            let cancel = sqlx::query("SELECT pg_cancel_backend(CAST($1 AS INTEGER))").bind(pid);
            conn.fetch_all(cancel).await?;
        }
        // KILL cannot be prepared; `pid` is a number the server gave.
        _ => conn.execute_raw(&format!("KILL QUERY {pid}")).await?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_fit_mysql() {
        let k = QueueKey::new("dlock_locks", "jobs/a");
        assert_eq!(k.name.len(), 22); // GET_LOCK names: at most 64
        assert_eq!(k.id, QueueKey::new("dlock_locks", "jobs/a").id);
        assert_ne!(k.id, QueueKey::new("dlock_locks", "jobs/b").id);
        assert_ne!(k.id, QueueKey::new("other", "jobs/a").id);
        // FNV-1a's published value for the empty input is its offset basis.
        let empty = QueueKey::new("", "");
        assert_ne!(empty.id, 0);
    }

    #[test]
    fn grace_is_a_quarter_of_the_ttl_up_to_250_ms() {
        assert_eq!(grace_ms(100), 25);
        assert_eq!(grace_ms(30_000), 250);
    }
}
