//! The store primitives on SQL: sessions, attempts, connections, error
//! mapping.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Busy, Claim, Doubtful, ExpiryModel, Hold, RawSession, Take};
use dlock_core::wake::{PollBackoff, Waiter};
use dlock_core::{Error, LockName, SessionId};
use sqlx::any::{AnyArguments, AnyQueryResult, AnyRow};
use sqlx::query::Query;
use sqlx::{Any, Connection, Row};
use tokio::sync::oneshot;
use tokio::sync::oneshot::error::TryRecvError;
use tokio::time::{Instant, sleep_until, timeout};

use crate::conns::{Conns, Slot};
use crate::dialect::{
    Arg, Close, Dialect, LaneRelease, MYSQL_BUSY, MYSQL_OFFSET, RENEW_CHUNK, Sql,
};
use crate::queue::{QueueKey, Queued, grace_ms};
use crate::{Inner, token_of};

/// How long a connection whose statement was abandoned mid-way (the core's
/// request timeout) may take to answer a ping before it is closed: a late
/// reply is drained and the connection (with its prepared statements) goes
/// back to the cache; a lost one costs the connection, not its slot.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Maps a driver error to the meaning-based core error.
pub(crate) fn map_err(scheme: &'static str, e: sqlx::Error) -> Error {
    use sqlx::Error as E;
    match e {
        E::Io(_) | E::Tls(_) | E::WorkerCrashed => Error::unavailable(scheme, e),
        E::PoolTimedOut => Error::unavailable(
            scheme,
            "no connection to the database could be opened or freed in time",
        ),
        E::PoolClosed => Error::unavailable(scheme, "the connection pool is closed"),
        E::Configuration(_) => Error::Config(format!("{scheme}: {e}")),
        E::Database(ref d) => match classify(d.as_ref()) {
            Class::Auth => Error::Auth {
                backend: scheme,
                reason: d.message().to_owned(),
            },
            Class::Transient => Error::unavailable(scheme, e),
            Class::Refused => Error::backend(scheme, e),
        },
        other => Error::protocol(scheme, other.to_string()),
    }
}

/// What a database error means for the caller.
#[derive(Debug, PartialEq, Eq)]
enum Class {
    /// Wrong user or password: not retryable, and says so.
    Auth,
    /// Worth retrying: the server is busy, shutting down, read-only for a
    /// failover, or the statement lost a lock race.
    Transient,
    /// Anything else: the request is wrong for this server.
    Refused,
}

fn classify(d: &dyn sqlx::error::DatabaseError) -> Class {
    #[cfg(feature = "mysql")]
    if let Some(my) = d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        // MySQL's SQLSTATE is coarse (HY000 for most): its error numbers say
        // what happened.
        return match my.number() {
            // Access denied (password), denied without a password (auth
            // plugin), password expired / must be reset.
            1045 | 1698 | 1862 | 1820 => Class::Auth,
            // Lock wait timeout, deadlock, too many connections (global and
            // per user), server shutting down, connection killed, read-only
            // (--read-only during a failover, a read-only transaction).
            1205 | 1213 | 1040 | 1203 | 1053 | 1927 | 1290 | 1792 => Class::Transient,
            // The server closed an idle connection (wait_timeout, 8.0.24+):
            // a fresh one works.
            4031 => Class::Transient,
            _ if my.code() == Some("25006") => Class::Transient,
            _ => Class::Refused,
        };
    }
    let code = d.code().unwrap_or_default();
    let code = code.as_ref();
    if code.starts_with("28") {
        // PostgreSQL: invalid authorization specification / password.
        return Class::Auth;
    }
    let transient = matches!(
        code,
        // PostgreSQL: serialization, deadlock, admin/crash shutdown, cannot
        // connect now, too many connections, lock not available, read-only
        // transaction (a standby during a failover).
        "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "53300" | "55P03" | "25006"
        // PostgreSQL: an idle (session or transaction) timeout closed the
        // pooled connection; a fresh one works.
        | "57P05" | "25P03"
        // SQLite: BUSY, LOCKED (and their extended codes).
        | "5" | "6" | "261" | "262" | "517"
    ) || code.starts_with("08");
    if transient {
        Class::Transient
    } else {
        Class::Refused
    }
}

/// A connection for one operation.
///
/// The core cuts a request off at its request timeout by dropping it; if
/// that happens while a statement is in flight, the connection still owes
/// the reply. Such a connection is given [`DRAIN_TIMEOUT`] to answer a ping
/// (a late reply is drained and the connection reused) and is closed
/// otherwise, so a connection whose replies are lost never keeps its slot.
/// A connection whose statement answered goes back at once, without a
/// round trip (see [`Conns`]).
pub(crate) struct Conn {
    slot: Option<Slot>,
    conns: Arc<Conns>,
    /// A statement is in flight.
    busy: bool,
    /// A statement failed: the connection is closed, not reused (an error
    /// may come from a server turned read-only by a failover, or leave
    /// the connection in a state no ping reveals).
    failed: bool,
    /// Told once the connection is drained after an abandoned statement
    /// (`()`: that statement was answered), or, by being dropped, once it is
    /// closed unanswered (or at once if none was abandoned).
    drained: Option<oneshot::Sender<()>>,
    /// What the connection may hold that its next user must not inherit.
    locked: Locked,
}

/// A lock a connection may hold beyond its statements.
enum Locked {
    /// Nothing: the connection can be handed back as it is.
    No,
    /// Something only closing lets go (SQLite's write lock, in an open
    /// transaction): closed, never handed back.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    UntilClosed,
    /// A queue lane's queue lock of this key: handed back only after an
    /// unlock that answered, closed otherwise (which frees the lock once
    /// the server notices; see `queue`).
    Queue(Arc<Inner>, QueueKey),
}

impl Conn {
    /// A connection from `inner`'s cache.
    pub(crate) async fn get(inner: &Inner) -> Result<Self, Error> {
        let scheme = inner.sql.dialect.scheme();
        let slot = inner.conns.get().await.map_err(|e| match e {
            // Garbage while opening a connection is the network's doing (a
            // connection cut during the handshake), not the store's reply.
            sqlx::Error::Protocol(_) => Error::unavailable(scheme, e),
            e => map_err(scheme, e),
        })?;
        Ok(Self::new(slot, inner.conns.clone()))
    }

    fn new(slot: Slot, conns: Arc<Conns>) -> Self {
        Self {
            slot: Some(slot),
            conns,
            busy: false,
            failed: false,
            drained: None,
            locked: Locked::No,
        }
    }

    /// A queue lane: a connection from `inner`'s lanes (`dlock_queue` of
    /// them, apart from the `dlock_pool` ones, so that waiters never take
    /// the connections releases need), waiting in arrival order for one to
    /// be free. `None` if the queue is off.
    pub(crate) async fn lane(inner: &Inner) -> Option<Result<Self, sqlx::Error>> {
        let lanes = inner.lanes.as_ref()?;
        Some(
            lanes
                .get_in_turn()
                .await
                .map(|slot| Self::new(slot, lanes.clone())),
        )
    }

    /// The connection's id on the server, asked once per connection.
    pub(crate) async fn pid(&mut self, query: &Sql) -> Result<i64, sqlx::Error> {
        if let Some(pid) = self.open().pid {
            return Ok(pid);
        }
        let pid: i64 = self.fetch_one(query.bind(&[])).await?.try_get(0)?;
        self.open().pid = Some(pid);
        Ok(pid)
    }

    fn open(&mut self) -> &mut crate::conns::Open {
        &mut self
            .slot
            .as_mut()
            .expect("connection present until drop")
            .open
    }

    /// From now on the connection may hold a lock only closing lets go.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn mark_locked(&mut self) {
        self.locked = Locked::UntilClosed;
    }

    /// From now on the lane may hold the queue lock of `key`.
    pub(crate) fn mark_queue_locked(&mut self, inner: Arc<Inner>, key: QueueKey) {
        self.locked = Locked::Queue(inner, key);
    }

    /// An unlock answered: the connection holds no lock.
    pub(crate) fn mark_unlocked(&mut self) {
        self.locked = Locked::No;
    }

    /// Never handed back: closed when dropped (after the unlock of a queue
    /// lock it may hold). For a lane whose wait was sent a cancel, which
    /// could still reach a later statement on it.
    pub(crate) fn retire(&mut self) {
        self.failed = true;
    }

    /// Lets the queue lock this lane may hold go and waits for the answer,
    /// so that a take sent after this returns finds the queue as the unlock
    /// left it (a closed lane frees its lock only when the server notices
    /// the disconnect). Then the lane goes back to the lanes, unless it
    /// failed or was retired (closed); one whose unlock fails, or does not
    /// answer within the drain timeout, is closed. A lane with a statement
    /// still in flight is dropped: drained, then unlocked.
    pub(crate) async fn unlock(mut self) {
        match std::mem::replace(&mut self.locked, Locked::No) {
            Locked::Queue(inner, key) if !self.busy => {
                let slot = self.slot.take().expect("connection present until drop");
                unlock_then_put(slot, self.conns.clone(), inner, key, !self.failed).await;
            }
            other => self.locked = other, // dropped as it is
        }
    }

    /// For the next statement of a connection kept across statements (a
    /// lane): `drained` is told once it answered ([`Conn::settle`]) or, if
    /// it is cut off, once the connection is drained or closed.
    pub(crate) fn watch(&mut self, drained: oneshot::Sender<()>) {
        self.drained = Some(drained);
    }

    /// The watched statement answered.
    pub(crate) fn settle(&mut self) {
        self.drained = None;
    }

    /// `drained` is told `()` once an abandoned statement of this
    /// connection was answered (the drain's ping answered after it), and is
    /// dropped when the connection goes back normally or is closed without
    /// that answer. A statement cut off before its bytes left sqlx's buffer
    /// is sent by that drain: late, which is what the receiver waits for.
    pub(crate) fn drained(mut self, drained: oneshot::Sender<()>) -> Self {
        self.drained = Some(drained);
        self
    }

    /// Runs `request` on the connection, marked busy while it runs: a
    /// request dropped before its answer leaves the connection busy, so it
    /// is drained rather than handed back.
    async fn run<'c, T, Fut>(
        &'c mut self,
        request: impl FnOnce(&'c mut sqlx::AnyConnection) -> Fut,
    ) -> Result<T, sqlx::Error>
    where
        Fut: Future<Output = Result<T, sqlx::Error>> + 'c,
    {
        let Self {
            slot, busy, failed, ..
        } = self;
        *busy = true;
        let conn = &mut slot
            .as_mut()
            .expect("connection present until drop")
            .open
            .conn;
        let r = request(conn).await;
        *busy = false;
        *failed |= r.is_err();
        r
    }

    pub(crate) async fn execute<'q>(
        &mut self,
        q: Query<'q, Any, AnyArguments<'q>>,
    ) -> Result<AnyQueryResult, sqlx::Error> {
        self.run(|c| q.execute(c)).await
    }

    pub(crate) async fn fetch_optional<'q>(
        &mut self,
        q: Query<'q, Any, AnyArguments<'q>>,
    ) -> Result<Option<AnyRow>, sqlx::Error> {
        self.run(|c| q.fetch_optional(c)).await
    }

    pub(crate) async fn fetch_one<'q>(
        &mut self,
        q: Query<'q, Any, AnyArguments<'q>>,
    ) -> Result<AnyRow, sqlx::Error> {
        self.run(|c| q.fetch_one(c)).await
    }

    pub(crate) async fn fetch_all<'q>(
        &mut self,
        q: Query<'q, Any, AnyArguments<'q>>,
    ) -> Result<Vec<AnyRow>, sqlx::Error> {
        self.run(|c| q.fetch_all(c)).await
    }

    /// A statement that cannot be prepared (MySQL's `KILL`).
    pub(crate) async fn execute_raw(&mut self, text: &str) -> Result<(), sqlx::Error> {
        self.run(|c| sqlx::Executor::execute(c, text))
            .await
            .map(drop)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else {
            return;
        };
        let locked = std::mem::replace(&mut self.locked, Locked::No);
        let reuse = !self.failed;
        if !self.busy {
            // Answered: a plain connection goes back at once; a lane's
            // unlock runs in a task (without a runtime the lane is dropped:
            // closed, and its lock goes with the connection).
            if let Some(unlock) = hand_back(slot, &self.conns, locked, reuse)
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
            {
                runtime.spawn(unlock);
            }
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the connection is dropped (closed)
        };
        let drained = self.drained.take();
        let conns = self.conns.clone();
        runtime.spawn(async move {
            // Told only when the drain, and the unlock after it, are done:
            // `()` if the statement was answered (drained), nothing (the
            // sender dropped) if the connection was closed unanswered.
            let mut slot = slot;
            match timeout(DRAIN_TIMEOUT, slot.open.conn.ping()).await {
                // The late reply is drained: as an answered statement's.
                Ok(Ok(())) => {
                    if let Some(unlock) = hand_back(slot, &conns, locked, reuse) {
                        unlock.await;
                    }
                    if let Some(drained) = drained {
                        let _ = drained.send(());
                    }
                }
                // Broken or silent: close it and free its slot at once.
                _ => {
                    tracing::debug!(
                        "closing a connection that did not answer after an abandoned statement"
                    );
                    drop(slot);
                }
            }
        });
    }
}

/// Where a connection that answered its last statement goes: one that may
/// hold a queue lock lets go first (the returned unlock, which then puts it
/// back or closes it); one that may hold what only closing frees
/// (SQLite's open transaction) is closed; the rest goes back to `conns`
/// unless its statement failed (`reuse` false: closed).
fn hand_back(
    slot: Slot,
    conns: &Arc<Conns>,
    locked: Locked,
    reuse: bool,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    match locked {
        // A session lock outlives a failed statement: unlocked either way.
        Locked::Queue(inner, key) => {
            return Some(unlock_then_put(slot, conns.clone(), inner, key, reuse));
        }
        Locked::UntilClosed => crate::conns::close(slot.open),
        Locked::No if reuse => conns.put(slot),
        Locked::No => crate::conns::close(slot.open),
    }
    None
}

/// Unlocks `key`'s queue lock on the lane in `slot` and waits for the
/// answer; then the lane goes back to `conns` if `reuse`, else is closed.
/// One whose unlock fails is closed, one that does not answer within the
/// drain timeout is dropped.
async fn unlock_then_put(
    mut slot: Slot,
    conns: Arc<Conns>,
    inner: Arc<Inner>,
    key: QueueKey,
    reuse: bool,
) {
    let Some(queue) = &inner.sql.queue else {
        return; // no queue, no lock: closed
    };
    // A retired lane's wait was sent a cancel, which may meet this unlock
    // instead (it takes effect once): such a lane tries twice.
    let mut tries = if reuse { 1 } else { 2 };
    loop {
        tries -= 1;
        let unlock = queue.unlock.bind(&[key.arg(inner.sql.dialect)]);
        match timeout(DRAIN_TIMEOUT, unlock.fetch_one(&mut slot.open.conn)).await {
            Ok(Ok(_)) if reuse => return conns.put(slot),
            Ok(Ok(_)) => return crate::conns::close(slot.open),
            Ok(Err(sqlx::Error::Database(e))) if tries > 0 => {
                tracing::debug!(error = %e, "unlocking a retired queue lane failed; once more");
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "unlocking a queue lane failed; it is closed");
                return crate::conns::close(slot.open);
            }
            Err(_) => {
                tracing::debug!("a queue lane's unlock did not answer; it is dropped");
                return;
            }
        }
    }
}

pub(crate) struct SqlSession {
    inner: Arc<Inner>,
    id: SessionId,
    ttl: Duration,
    lanes: Arc<HeldLanes>,
    /// Attempts with a take that may still be on the wire: their end leaves
    /// a tombstone first.
    doubtful: Doubtful,
}

/// Leaves the tombstone of attempt `owner`, which ends while a take of it
/// may still be on the wire (see `Statements::tombstone`), before the
/// statement that frees its row: a take landing after that is refused,
/// whoever took and freed the lock in between. Sweeps the tombstones that
/// ran out (one per faulty attempt: rare).
async fn leave_tombstone(inner: &Inner, owner: &str, ttl: Duration) -> Result<(), Error> {
    let scheme = inner.sql.dialect.scheme();
    let life = Doubtful::tombstone_life(ttl).as_millis() as i64;
    let mut conn = Conn::get(inner).await?;
    conn.execute(
        inner
            .sql
            .tombstone
            .bind(&[Arg::Text(owner), Arg::Int(life)]),
    )
    .await
    .map_err(|e| map_err(scheme, e))?;
    if let Err(e) = conn.execute(inner.sql.sweep.bind(&[])).await {
        tracing::debug!(error = %map_err(scheme, e), "sweeping tombstones failed");
    }
    Ok(())
}

/// The lanes of holds granted through the wait queue, by lock name and
/// owner: each keeps its queue lock until its hold is released (so the next
/// waiter is woken by the lock manager), or dropped (which lets the lock
/// go) when its hold is found gone. At most half a backend's lanes
/// are kept so (`Inner::held_lanes` counts them): the others stay for
/// waiters, or a backend holding many contended locks could never queue
/// for another.
pub(crate) struct HeldLanes {
    inner: Arc<Inner>,
    lanes: Mutex<HashMap<(String, String), Conn>>,
}

impl HeldLanes {
    pub(crate) fn new(inner: Arc<Inner>) -> Self {
        Self {
            inner,
            lanes: Mutex::default(),
        }
    }

    /// Keeps `lane` with `hold`, or, over the budget, lets its queue lock
    /// go at once (in the background: the grant does not wait for it).
    fn put(&self, hold: &Hold, lane: Conn) {
        let budget = self.inner.options.queue as usize / 2;
        let held = &self.inner.held_lanes;
        if held.fetch_add(1, Ordering::SeqCst) < budget {
            let key = (hold.name.to_string(), hold.key.clone());
            self.lock().insert(key, lane);
            return;
        }
        held.fetch_sub(1, Ordering::SeqCst);
        drop(lane); // dropped, a lane lets its queue lock go (see `Conn`'s drop)
    }

    fn take(&self, name: &LockName, owner: &str) -> Option<Conn> {
        let lane = self.lock().remove(&(name.to_string(), owner.to_owned()));
        if lane.is_some() {
            self.inner.held_lanes.fetch_sub(1, Ordering::SeqCst);
        }
        lane
    }

    /// Every kept lane, no longer kept.
    fn drain(&self) -> Vec<Conn> {
        let lanes: Vec<Conn> = self.lock().drain().map(|(_, lane)| lane).collect();
        self.inner
            .held_lanes
            .fetch_sub(lanes.len(), Ordering::SeqCst);
        lanes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Conn>> {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for HeldLanes {
    fn drop(&mut self) {
        drop(self.drain()); // each lets its queue lock go in the background
    }
}

impl SqlSession {
    pub(crate) fn new(inner: Arc<Inner>, id: SessionId, ttl: Duration) -> Self {
        Self {
            lanes: Arc::new(HeldLanes::new(inner.clone())),
            inner,
            id,
            ttl,
            doubtful: Doubtful::default(),
        }
    }

    fn scheme(&self) -> &'static str {
        self.inner.sql.dialect.scheme()
    }

    /// The end of `owner`'s attempt: its tombstone first if it is doubtful
    /// (see [`leave_tombstone`]).
    async fn tombstone_first(&self, owner: &str) -> Result<(), Error> {
        let leave = || leave_tombstone(&self.inner, owner, self.ttl);
        self.doubtful.tombstone_if_doubtful(owner, leave).await?;
        Ok(())
    }

    fn ttl_ms(&self) -> i64 {
        self.ttl.as_millis() as i64
    }

    /// A release's arguments: name, owner, token, session, the queue key
    /// and whether this backend queues (PostgreSQL's release notifies
    /// only for a queue's head then). Each statement binds what it uses.
    fn release_args<'a>(&'a self, hold: &'a Hold, key: &'a QueueKey) -> [Arg<'a>; 6] {
        [
            Arg::Text(hold.name.as_str()),
            Arg::Text(&hold.key),
            Arg::Int(hold.token.get() as i64),
            Arg::Text(self.id.as_str()),
            key.arg(self.inner.sql.dialect),
            Arg::Int(i64::from(self.inner.lanes.is_some())),
        ]
    }

    /// Releases `hold` on its lane and lets the queue lock go, in one
    /// statement (the next waiter's take then waits for this one's
    /// commit); on MySQL a second one only if the hold was gone, since its
    /// statement unlocks only with the row it matches. Returns the rows
    /// freed.
    /// The lane goes back to the lanes' cache only after an unlock that
    /// answered.
    async fn release_on_lane(&self, mut lane: Conn, hold: &Hold) -> Result<u64, sqlx::Error> {
        let sql = &self.inner.sql;
        let queue = sql.queue.as_ref().expect("a lane implies a queue");
        let key = self.inner.queue_key(&hold.name);
        let args = self.release_args(hold, &key);
        let freed = match &queue.release {
            LaneRelease::Counted(both) => {
                let row = lane.fetch_one(both.bind(&args)).await?;
                row.try_get::<i64, _>(0)? as u64
            }
            LaneRelease::Matched(both) => {
                let freed = lane.execute(both.bind(&args)).await?.rows_affected();
                if freed == 0
                    && lane
                        .fetch_one(queue.unlock.bind(&args[4..5]))
                        .await
                        .is_err()
                {
                    // The hold is gone whatever the unlock's fate: say so
                    // (a retryable error would be retried elsewhere, find
                    // nothing and pass for a release). The lane, still
                    // marked as holding the queue lock, is unlocked and
                    // closed as it drops.
                    return Ok(0);
                }
                freed
            }
        };
        lane.mark_unlocked();
        Ok(freed)
    }

    /// Extends the live holds among `batch` (at most [`RENEW_CHUNK`]) in one
    /// statement (MySQL: two when one of them is gone); adds the live ones
    /// to `live`.
    async fn renew_batch(
        &self,
        conn: &mut Conn,
        batch: &[Hold],
        live: &mut HashSet<(String, i64)>,
    ) -> Result<(), sqlx::Error> {
        let sql = &self.inner.sql;
        let listed = holds_json(batch);
        let args = [
            Arg::Text(self.id.as_str()),
            Arg::Int(self.ttl_ms()),
            Arg::Text(&listed),
        ];
        let rows = match &sql.held {
            None => conn.fetch_all(sql.renew.bind(&args)).await?,
            Some(held) => {
                let done = conn.execute(sql.renew.bind(&args)).await?;
                // sqlx asks MySQL for found (matched) rows, so every listed
                // live hold counts, changed or not.
                if done.rows_affected() == batch.len() as u64 {
                    live.extend(
                        batch
                            .iter()
                            .map(|h| (h.name.to_string(), h.token.get() as i64)),
                    );
                    return Ok(());
                }
                conn.fetch_all(held.bind(&args)).await?
            }
        };
        for row in rows {
            live.insert((row.try_get(0)?, row.try_get(1)?));
        }
        Ok(())
    }
}

/// `holds` as the JSON array of `[name, owner, token]` the renewal
/// statements read.
fn holds_json(holds: &[Hold]) -> String {
    let listed: Vec<(&str, &str, u64)> = holds
        .iter()
        .map(|h| (h.name.as_str(), h.key.as_str(), h.token.get()))
        .collect();
    serde_json::to_string(&listed).expect("strings and numbers encode")
}

impl fmt::Debug for SqlSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlSession")
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .finish()
    }
}

#[async_trait]
impl RawSession for SqlSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::PerHold
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        // With a queue, only the head (or a claim without a lane) waits for
        // release notifications: it subscribes when it becomes one.
        let waiter = match self.inner.lanes {
            Some(_) => None,
            None => Some(self.inner.hub.subscribe(name.as_str())),
        };
        let owner = self.id.claim_owner();
        Ok(Box::new(SqlClaim {
            waiter,
            key: self.inner.queue_key(name),
            place: Place::Out,
            lanes: self.lanes.clone(),
            inner: self.inner.clone(),
            session: self.id.clone(),
            name: name.clone(),
            owner,
            why: why.map(str::to_owned),
            ttl_ms: self.ttl_ms(),
            doubtful: self.doubtful.clone(),
            sent: false,
            in_flight: Vec::new(),
            unclean: false,
            backoff: PollBackoff::default(),
        }))
    }

    /// Extends exactly `holds` (each by name, owner and token: S3), never
    /// another row of this session: a take the core never learned of (its
    /// acquire gave up while the take committed) or a hold whose release
    /// failed expires after one TTL instead of living as long as the session
    /// (issue 12 item 5). One statement per [`RENEW_CHUNK`] holds.
    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = Conn::get(&self.inner).await?;
        let mut live = HashSet::new();
        for batch in holds.chunks(RENEW_CHUNK) {
            self.renew_batch(&mut conn, batch, &mut live)
                .await
                .map_err(|e| map_err(self.scheme(), e))?;
        }
        let live: Vec<bool> = holds
            .iter()
            .map(|h| live.contains(&(h.name.to_string(), h.token.get() as i64)))
            .collect();
        for (hold, _) in holds.iter().zip(&live).filter(|(_, live)| !**live) {
            drop(self.lanes.take(&hold.name, &hold.key));
        }
        Ok(live)
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        self.tombstone_first(&hold.key).await?;
        let freed = match self.lanes.take(&hold.name, &hold.key) {
            Some(lane) => self.release_on_lane(lane, hold).await,
            None => {
                let key = self.inner.queue_key(&hold.name);
                let args = self.release_args(hold, &key);
                let mut conn = Conn::get(&self.inner).await?;
                conn.execute(self.inner.sql.release.bind(&args))
                    .await
                    .map(|done| done.rows_affected())
            }
        }
        .map_err(|e| map_err(self.scheme(), e))?;
        if freed == 0 {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        // One local waiter (L6); if it loses the race, the winner's release
        // wakes the next; if it is gone, its registration passes it on.
        self.inner.hub.wake_first(hold.name.as_str());
        Ok(())
    }

    /// Frees the session's holds: on PostgreSQL the listed ones (the
    /// contract's "holds the core knows of"; an untracked grant expires one
    /// TTL later, as it would without a close), elsewhere every row the
    /// session holds.
    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        for hold in holds {
            self.tombstone_first(&hold.key).await?;
        }
        let sql = &self.inner.sql;
        let id = Arg::Text(self.id.as_str());
        let closed = async {
            let listed = match &sql.close {
                Close::Session(close) => {
                    let mut conn = Conn::get(&self.inner).await?;
                    conn.execute(close.bind(&[id]))
                        .await
                        .map_err(|e| map_err(self.scheme(), e))?;
                    return Ok(());
                }
                Close::Listed(_) if holds.is_empty() => return Ok(()),
                Close::Listed(close) => close,
            };
            let mut conn = Conn::get(&self.inner).await?;
            for batch in holds.chunks(RENEW_CHUNK) {
                let list = holds_json(batch);
                conn.execute(listed.bind(&[id.clone(), Arg::Text(&list)]))
                    .await
                    .map_err(|e| map_err(self.scheme(), e))?;
            }
            Ok(())
        }
        .await;
        // The kept lanes' queue locks go with an answer too: a take sent
        // after the close finds the queue as the unlocks left it.
        let unlocks: Vec<_> = self
            .lanes
            .drain()
            .into_iter()
            .map(|lane| tokio::spawn(lane.unlock()))
            .collect();
        for unlock in unlocks {
            let _ = unlock.await; // all at once; cut off, they go on alone
        }
        closed?;
        for hold in holds {
            self.inner.hub.wake_first(hold.name.as_str());
        }
        Ok(())
    }
}

/// A claim on one lock. On PostgreSQL and MySQL a busy claim joins the
/// database's lock queue (see `queue`) and takes the row when first in
/// line; without a lane (SQLite, `dlock_queue=0`, every lane in use) it
/// polls, or on PostgreSQL waits for `NOTIFY`, and tries again.
struct SqlClaim {
    inner: Arc<Inner>,
    session: SessionId,
    name: LockName,
    /// This attempt's identity in the `owner` column.
    owner: String,
    /// The session's doubtful attempts (see [`SqlSession`]).
    doubtful: Doubtful,
    why: Option<String>,
    ttl_ms: i64,
    /// Release notifications (see [`SqlSession::claim`]).
    waiter: Option<Waiter>,
    /// The name's queue lock.
    key: QueueKey,
    /// Where the claim is in the queue.
    place: Place,
    /// The session's lanes of held locks: a grant on this claim's lane goes
    /// there.
    lanes: Arc<HeldLanes>,
    /// Whether a take was sent (so a grant may exist that abandon must free).
    sent: bool,
    /// Takes cut off in flight (the core's request timeout, the caller's
    /// deadline, a dropped acquire) whose connections are still draining:
    /// such a take may still land, after an abandon sent on another
    /// connection, so abandon waits for them and cleans up again. Each
    /// answers `()` once drained (its statement answered), or closes if its
    /// connection was closed unanswered.
    in_flight: Vec<oneshot::Receiver<()>>,
    /// A take of this attempt may land at any time: cut off on a connection
    /// closed unanswered, or failed without the database's answer. Until
    /// then, a claim whose cut-off takes all drained is no longer doubtful
    /// (its abandon then leaves no tombstone: the semaphore's dropped tries
    /// would write one each).
    unclean: bool,
    backoff: PollBackoff,
}

/// A claim's place in the wait queue.
enum Place {
    /// Not in it: not waiting yet, or waiting without a lane.
    Out,
    /// Waiting in the database's lock manager.
    Queued(Queued),
    /// First in line: the lane holds the queue lock.
    Head(Conn),
}

impl fmt::Debug for SqlClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = match self.place {
            Place::Out => "out",
            Place::Queued(_) => "queued",
            Place::Head(_) => "head",
        };
        f.debug_struct("SqlClaim")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .field("place", &place)
            .finish()
    }
}

impl SqlClaim {
    fn scheme(&self) -> &'static str {
        self.inner.sql.dialect.scheme()
    }

    fn granted(&self, token: i64) -> Result<Take, Error> {
        Ok(Take::Granted(Hold {
            name: self.name.clone(),
            token: token_of(token)?,
            key: self.owner.clone(),
        }))
    }

    /// Busy, with the holder's remaining time as the hint; where a queue
    /// kept a free row from this take, the end of its grace period.
    fn busy(&self, remaining: Option<i64>) -> Take {
        let grace = match self.inner.sql.queue {
            Some(_) => grace_ms(self.ttl_ms),
            None => 0,
        };
        let hint = remaining.map(|ms| if ms > 0 { ms } else { (grace + ms).max(0) });
        Take::Busy(Busy {
            retry_after: hint.map(|ms| Duration::from_millis(ms as u64)),
        })
    }

    /// First in line, with `lane`: from now on it waits for the row's
    /// release (subscribed before its first take as the head, L2).
    fn head(&mut self, lane: Conn) {
        let (hub, name) = (&self.inner.hub, &self.name);
        self.waiter
            .get_or_insert_with(|| hub.subscribe(name.as_str()));
        self.backoff = PollBackoff::default();
        self.place = Place::Head(lane);
    }

    /// One take on `conn`, doubtful until answered (see [`Doubtful`]).
    async fn take(&mut self, conn: &mut Conn) -> Result<Take, sqlx::Error> {
        let sending = self.doubtful.sending(&self.owner);
        let taken = self.take_once(conn).await;
        // The database's own error is an answer too: the statement ended.
        if matches!(taken, Ok(_) | Err(sqlx::Error::Database(_))) {
            sending.answered();
        } else {
            self.unclean = true;
        }
        taken
    }

    async fn take_once(&mut self, conn: &mut Conn) -> Result<Take, sqlx::Error> {
        let sql = &self.inner.sql;
        let args = [
            Arg::Text(self.name.as_str()),
            Arg::Text(self.session.as_str()),
            Arg::Text(&self.owner),
            Arg::OptText(self.why.as_deref()),
            Arg::Int(self.ttl_ms),
            self.key.arg(sql.dialect),
            Arg::Int(grace_ms(self.ttl_ms)),
        ];
        match sql.dialect {
            // `fetch_all`: the statement's commit is confirmed before the
            // grant is reported (a commit refused after the row was sent, as
            // a serialization failure can be, is this take's error, not the
            // next statement's on this connection).
            Dialect::Postgres => {
                let rows = conn.fetch_all(sql.take.bind(&args)).await?;
                let row = rows.first().ok_or(sqlx::Error::RowNotFound)?;
                let token: Option<i64> = row.try_get(0)?;
                let remaining: Option<i64> = row.try_get(1)?;
                Ok(match token {
                    Some(token) => self.granted(token).map_err(protocol)?,
                    None => self.busy(remaining),
                })
            }
            // `fetch_all`, not `fetch_optional`: sqlx-sqlite stops at the
            // first row and commits when the statement is reset, dropping a
            // failed commit's error; a take reported granted must be
            // committed (adversarial review: a grant rolled back at commit
            // was reported, and its token issued again).
            Dialect::Sqlite => match conn.fetch_all(sql.take.bind(&args)).await?.first() {
                Some(row) => self.granted(row.try_get(0)?).map_err(protocol),
                None => {
                    let row = conn.fetch_optional(sql.state.bind(&args)).await?;
                    Ok(self.busy(row.map(|r| r.try_get(0)).transpose()?))
                }
            },
            // The answer is the statement's LAST_INSERT_ID (see `dialect`).
            Dialect::MySql => {
                let done = conn.execute(sql.take.bind(&args)).await?;
                match done.last_insert_id().unwrap_or(0) {
                    busy if busy >= MYSQL_BUSY => {
                        Ok(self.busy(Some(busy - MYSQL_BUSY - MYSQL_OFFSET)))
                    }
                    token if token > 0 => self.granted(token).map_err(protocol),
                    other => Err(sqlx::Error::Protocol(format!(
                        "the take answered LAST_INSERT_ID {other}"
                    ))),
                }
            }
        }
    }

    /// The head's take, on its lane: a grant keeps the lane (and the queue
    /// lock) with the hold; busy keeps it at the head; an error closes it,
    /// which lets the next waiter through.
    async fn take_as_head(&mut self, mut lane: Conn) -> Result<Take, Error> {
        let (drained, rx) = oneshot::channel();
        self.in_flight.push(rx);
        lane.watch(drained);
        self.sent = true;
        let taken = self.take(&mut lane).await;
        lane.settle();
        self.in_flight.pop(); // answered: nothing of this take is left to land
        match &taken {
            Ok(Take::Granted(hold)) => self.lanes.put(hold, lane),
            Ok(Take::Busy(_)) => self.place = Place::Head(lane),
            Err(_) => {
                drop(lane);
                self.waiter = None; // no longer the head
            }
        }
        taken.map_err(|e| map_err(self.scheme(), e))
    }
}

/// Carries a core error through sqlx's error type (`map_err` turns it into
/// a protocol error again).
fn protocol(e: Error) -> sqlx::Error {
    sqlx::Error::Protocol(e.to_string())
}

#[async_trait]
impl Claim for SqlClaim {
    /// One statement that takes a free or expired lock, or re-confirms and
    /// extends this attempt's own grant after a lost reply (rule 4): the
    /// retry of a take whose reply was lost returns the same token. The
    /// head of the queue takes on its lane; anyone else on a pooled
    /// connection, which the queue lets through only if no one waits in it
    /// (or the row has been free for the grace period).
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.note_drained();
        if let Place::Queued(queued) = &mut self.place {
            match queued.try_first() {
                Some(Ok(lane)) => self.head(lane),
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "left the lock queue");
                    self.place = Place::Out;
                }
                None => {}
            }
        }
        // Out of its place while it runs: a take cut off drops the lane
        // (drained, then closed).
        if let Place::Head(lane) = std::mem::replace(&mut self.place, Place::Out) {
            return self.take_as_head(lane).await;
        }
        let (drained, rx) = oneshot::channel();
        self.in_flight.push(rx);
        let mut conn = Conn::get(&self.inner).await?.drained(drained);
        self.sent = true;
        let scheme = self.scheme();
        let taken = self.take(&mut conn).await.map_err(|e| map_err(scheme, e));
        drop(conn);
        self.in_flight.pop(); // answered: nothing of this take is left to land
        if matches!(taken, Ok(Take::Granted(_))) {
            self.place = Place::Out; // leaves the queue, if in it
        }
        taken
    }

    /// Queued: until first in line (or `until`); joins the queue first if
    /// a lane is free. The head, or a claim without a lane: until a release
    /// notification (PostgreSQL) or the next poll.
    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        if matches!(self.place, Place::Out)
            && let Some(queued) = Queued::join(&self.inner, &self.key)
        {
            // Not listening while queued: a notification woken for it would
            // be one the head (in this process) misses.
            self.waiter = None;
            self.place = Place::Queued(queued);
        }
        if let Place::Queued(queued) = &mut self.place {
            // Waiting in the process for a lane (every lane in use), no
            // release wakes it: it looks again at `until` (the holder's
            // expiry, the fallback timer). Polling sooner would make a herd
            // of the waiters beyond `dlock_queue`, whose lanes usually free
            // up as the line moves.
            tokio::select! {
                first = queued.first() => match first {
                    Ok(lane) => self.head(lane),
                    Err(e) => {
                        tracing::debug!(error = %e, "left the lock queue");
                        self.place = Place::Out;
                    }
                },
                _ = sleep_until(until) => {}
            }
            return Ok(());
        }
        let (hub, name) = (&self.inner.hub, &self.name);
        let waiter = self
            .waiter
            .get_or_insert_with(|| hub.subscribe(name.as_str()));
        // SQLite: commits are seen as writes to the database's files (see
        // `file_wake`). The waiter is registered first, so a write seen
        // from the watch's start on is kept; one before it may have been
        // missed, so the first wait after the start looks again at once.
        if self.inner.watch_files() {
            return Ok(());
        }
        if self.inner.sql.dialect == Dialect::Postgres {
            waiter.wait_until(until).await;
        } else {
            waiter.wait_polling(&mut self.backoff, until).await;
        }
        Ok(())
    }

    /// Leaves the queue; frees this attempt's grant, if it has one; then,
    /// if takes of it were cut off in flight, waits until their connections
    /// are drained or closed (one may land only now, e.g. after the
    /// holder's release: its grant lives until this second pass) and frees
    /// again. If a take of it may land at any time (closed unanswered, or
    /// failed without the database's answer), the attempt's tombstone goes
    /// first: at once if that is known on entry, else once the drains tell
    /// (see [`Doubtful`]).
    async fn abandon(&mut self) -> Result<(), Error> {
        // No longer waiting: a notification must go to whoever waits now.
        self.waiter = None;
        // Out of the queue, with the server's answer: a take sent after
        // this abandon returns (the core waits for it before a timed-out
        // acquire answers) must not find this claim's place.
        match std::mem::replace(&mut self.place, Place::Out) {
            Place::Queued(queued) => queued.leave().await,
            Place::Head(lane) => lane.unlock().await,
            Place::Out => {}
        }
        // A grant on the lane the core never learned of: its lane goes (the
        // row is freed below).
        drop(self.lanes.take(&self.name, &self.owner));
        if !self.sent {
            return Ok(());
        }
        // Known already to have a take that may land at any time: its
        // tombstone before anything else (the drains below may take a
        // while, and the core may cut this abandon off meanwhile).
        self.note_drained();
        let mut tombstoned = self.unclean && self.tombstone_if_doubtful().await?;
        self.abandon_once().await?;
        // A cut-off take that drained has landed (the second pass frees
        // what it granted); one whose connection closed unanswered may land
        // at any time, so it gets the tombstone too.
        let waited = !self.in_flight.is_empty();
        while let Some(rx) = self.in_flight.last_mut() {
            self.unclean |= rx.await.is_err();
            self.in_flight.pop();
        }
        if !self.unclean {
            self.doubtful.settled(&self.owner);
        }
        tombstoned |= self.tombstone_if_doubtful().await?;
        if waited || tombstoned {
            self.abandon_once().await?;
        }
        Ok(())
    }
}

impl SqlClaim {
    /// Takes in flight whose connections have been drained or closed since
    /// leave the list; a closed one makes the claim unclean.
    fn note_drained(&mut self) {
        let mut unclean = false;
        self.in_flight.retain_mut(|rx| match rx.try_recv() {
            Err(TryRecvError::Empty) => true,
            Ok(()) => false,
            Err(TryRecvError::Closed) => {
                unclean = true;
                false
            }
        });
        self.unclean |= unclean;
    }

    /// Ends the attempt with its tombstone if it is doubtful (see
    /// [`leave_tombstone`]); whether one was written.
    async fn tombstone_if_doubtful(&mut self) -> Result<bool, Error> {
        let ttl = Duration::from_millis(self.ttl_ms as u64);
        let (inner, owner) = (&self.inner, &self.owner);
        let leave = || leave_tombstone(inner, owner, ttl);
        self.doubtful.tombstone_if_doubtful(owner, leave).await
    }

    async fn abandon_once(&mut self) -> Result<(), Error> {
        let scheme = self.scheme();
        let mut conn = Conn::get(&self.inner).await?;
        let done = conn
            .execute(
                self.inner
                    .sql
                    .abandon
                    .bind(&[Arg::Text(self.name.as_str()), Arg::Text(&self.owner)]),
            )
            .await
            .map_err(|e| map_err(scheme, e))?;
        if done.rows_affected() > 0 {
            self.inner.hub.wake_first(self.name.as_str());
        }
        Ok(())
    }
}
