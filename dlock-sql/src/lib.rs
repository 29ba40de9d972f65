//! dlock on SQL databases: PostgreSQL, MySQL/MariaDB and SQLite (sqlx).
//!
//! The seeds' unique-key table (seed 003), made atomic and fenced. One row per
//! lock name, kept after release so its token only grows:
//!
//! | column | meaning |
//! |---|---|
//! | `name` | the lock name (primary key, binary collation: case-sensitive) |
//! | `holder` | the holding session's id (`host:pid:start:random`) |
//! | `owner` | the holding attempt (`session#random`), for owner-checked release |
//! | `token` | the fencing token: `token + 1` on every grant (S2) |
//! | `why` | the reason given at acquisition |
//! | `acquired_at`, `expires_at` | milliseconds since the epoch, **by the database clock** (S6) |
//!
//! * **Take** is one statement and one round trip: `INSERT … ON CONFLICT …
//!   DO UPDATE … WHERE expires_at <= now OR owner = this attempt` (PostgreSQL
//!   in a CTE that also reports the holder's remaining time, SQLite with
//!   `RETURNING`) or `INSERT … ON DUPLICATE KEY UPDATE` with every column
//!   guarded by the same test and the answer (the granted token, or the
//!   holder's remaining time) returned as the statement's `LAST_INSERT_ID`
//!   (MySQL). A take that finds the lock busy asks for the holder's expiry
//!   in a second statement on SQLite only.
//!   The same statement is the idempotent retry after a lost reply (rule 4):
//!   the attempt's own live grant keeps its token and is extended. Its
//!   values come from a `SELECT … WHERE NOT EXISTS` the attempt's
//!   *tombstone*: a row of the table `<table>$ended` (the attempt and its
//!   expiry) left (for two minutes, or a TTL if longer) before the
//!   release, abandon or close of an attempt a take of which was cut off in
//!   flight, so that this take, should it reach the database later,
//!   inserts and updates nothing (`Capabilities::refuses_late_takes`, case
//!   `cut_take_delivered_late`). Tombstones are swept when the next one is
//!   written. They live in a table of their own: the lock table holds locks
//!   only, and MySQL's shared gap lock where the take's check looks (an
//!   `INSERT … SELECT` under REPEATABLE READ) falls in that table, not
//!   in the lock table's index, where it made a new lock name's first
//!   insert wait. The adapter creates both tables at connect if they do
//!   not exist; a database user granted single tables needs `SELECT`,
//!   `INSERT`, `UPDATE` and `DELETE` on `<table>$ended` too, and where
//!   several roles share the tables (the first to connect owns what it
//!   creates, on PostgreSQL), each needs them on both.
//! * **Release / renewal** are owner-checked (`WHERE name AND owner AND
//!   token`, S3). A renewal extends exactly the holds the core passes it,
//!   listed by name, owner and token (one statement for up to 16,384 holds,
//!   more in chunks; MySQL adds a read only when one of them is gone), never
//!   another row of the session: a take the core never learned of (an
//!   acquire that gave up while its take committed) or a hold whose release
//!   failed expires one TTL later instead of living as long as the session
//!   renews (S4's converse, L1). There is no separate sessions table: each
//!   lock's own `expires_at` is the lease. Closing a session frees its
//!   holds: on MySQL and SQLite every row it holds (by an index on
//!   `holder`); on PostgreSQL the holds the core lists (every one it knows
//!   of), found by primary key as a renewal finds them, since its table has
//!   no other index: a take, release or renewal changes only unindexed
//!   columns and can then be a HOT update (no new index entries, less WAL),
//!   on pages that keep 30 % free for it (`fillfactor = 70`). A table made
//!   by an earlier version keeps its `holder` index (the adapter runs no DDL
//!   on an existing table) and works as before; to let its updates be HOT,
//!   run `DROP INDEX <table>_holder; ALTER TABLE <table> SET (fillfactor =
//!   70)` when no lock operation needs it quick (the drop waits for every
//!   transaction on the table). A freed row (release, abandon, close,
//!   force release) keeps the attempt that last had it as its `owner`,
//!   without a holder: a late copy of that attempt's take (its first
//!   request timed out in the core and was retried on another connection,
//!   whose grant has been used and released since) finds the lock busy
//!   instead of taking it again for no one (S5).
//! * **The wait queue** (PostgreSQL, MySQL; `dlock_queue`): waiters line up
//!   in the database's own lock manager, one lock per lock name
//!   (`pg_advisory_lock`, `GET_LOCK`), which grants in arrival order and wakes
//!   one waiter per release from inside the server. A take grants a free row
//!   only if no one waits (PostgreSQL: `pg_try_advisory_xact_lock` in the
//!   take; MySQL: `IS_FREE_LOCK`) or if it comes from the head; a busy claim
//!   that waits joins the queue on a **lane**, a connection of its own whose
//!   lock wait runs in a task; the head takes the row on its lane and keeps
//!   the queue lock while it holds the row, and releases and unlocks in one
//!   statement (MySQL: `RELEASE_LOCK` inside the release's `UPDATE`, which
//!   runs only for the row it matches; a release that finds its hold gone
//!   unlocks in a second statement), so the next waiter's turn starts the
//!   moment the row is free: its take, a locking write, waits for the
//!   release's commit (so a slow commit now shows in the head's take,
//!   bounded by the request timeout, rather than in its queue wait). Safety stays with the row: the queue only decides who
//!   asks, so a wrong queue state can only delay a grant.
//!   - *Stuck heads.* A row free or expired for a grace period (a quarter of
//!     the TTL, at most 250 ms) can be taken by anyone, so a head or holder
//!     that stalls (a paused process) costs at most that beyond the TTL. A
//!     holder whose client vanished without closing its lane (a partition)
//!     leaves the queue lock with a connection the server still thinks
//!     alive: until the server drops it (TCP keepalives of 10 s + 3 × 5 s
//!     on PostgreSQL lanes; the server's own keepalive on MySQL), each
//!     handoff of that lock goes through the grace period and the waiters'
//!     timers (the holder's expiry, the fallback timer). A waiter that gives
//!     up has its wait cancelled on the server (`pg_cancel_backend`, `KILL
//!     QUERY`); one whose wait the server cancels (`statement_timeout`,
//!     `lock_timeout`) joins again at the back.
//!   - *Cost.* One connection per waiting claim and per lock held after a
//!     wait (not per uncontended hold), at most `dlock_queue` per backend
//!     (default 16) on top of `dlock_pool`; more waiters than lanes wait in
//!     the process, in arrival order, for a lane, and until they have one
//!     no release wakes them: they look at the lock on their timers (the
//!     holder's expiry, the fallback timer of at most 2 s). Held locks keep
//!     at most half the lanes (none with `dlock_queue=1`); beyond that a
//!     grant lets its queue lock go at once and the next head waits for the
//!     release by notification or poll.
//!     Size the server's `max_connections` for `dlock_pool` plus
//!     `dlock_queue` per backend, plus one `LISTEN` connection per backend
//!     on PostgreSQL.
//!   - *Limits.* Lanes need session state: not through a pooler in
//!     transaction mode (PgBouncer), where session locks and
//!     `pg_cancel_backend` would reach other clients. On MySQL with
//!     `binlog_format=STATEMENT` the queue is off (its functions are unsafe
//!     for statement replication), with a warning. Two names whose 64-bit
//!     keys collide share a queue (fairness, not safety). All processes on
//!     one table should agree on `dlock_queue`: a process with the queue off
//!     (`dlock_queue=0`) does not test it, so it may take a lock ahead of
//!     queued waiters, and its waiters, outside the queue, are not woken by
//!     a queued holder's release (they look again on their timers: the
//!     holder's expiry, the fallback timer of at most 2 s).
//! * **Wake-ups**: the queue wakes the next waiter itself. The head, and
//!   every waiter without a queue, waits for a release by notification:
//!   PostgreSQL releases `pg_notify` in the same statement and waiters
//!   `LISTEN` on one connection per backend; MySQL and SQLite waiters poll
//!   with a bounded backoff (5 ms doubling to 100 ms), the longest-waiting
//!   waiter of a name in the process only (the next takes over when it is
//!   granted or leaves), and wake at the holder's `expires_at`. SQLite waiters also wake when the database's
//!   files are written (its WAL: every commit, a release in another process
//!   too), seen through the OS's file notifications (inotify, FSEvents; the
//!   `notify` crate) on a watch of the database's directory that the first
//!   wait starts (one per file and process, shared by its backends: an
//!   inotify instance and a thread, while a backend on the file lives). A
//!   write names no lock: each backend with waiters answers a commit with
//!   one read of which of the locks it waits for are held, and wakes the
//!   longest-waiting waiter of each one that is not (no herd; a busy take
//!   writes nothing, so waiting wakes no one). Where the OS reports
//!   nothing (network file systems) or the watch cannot be set up (a
//!   warning), waiters poll as before; this is why SQLite does not declare
//!   `notify_wakeup`. The cost: each read takes SQLite's write lock for a
//!   moment (`BEGIN IMMEDIATE`, so that it sees the commit that was
//!   written), usually once per commit and backend with waiters. A release
//!   (local, or a notification) wakes the longest-waiting such waiter of
//!   this backend only (L6: one per process unless several backends of
//!   one process use one file); if it loses the
//!   race, the winner's release wakes the next, and a woken waiter that goes
//!   away passes the wake-up on (L2). The first `LISTEN` is in place before
//!   [`SqlBackend::connect`] returns; each time its connection is
//!   re-established every local waiter is woken, since notifications sent
//!   while it was down are lost.
//! * **Handoff cost.** Through the queue a handoff takes about two round
//!   trips (the release with its unlock, then the next head's take), but
//!   each is a committed write: the take's new token must be durable before
//!   the grant is reported (S2), and the release frees the row. The
//!   database's own `pg_advisory_lock` / `GET_LOCK` writes nothing, so a
//!   fenced lock hands over at a fifth to a third of its rate on the same
//!   server (BENCHMARKS.md: 0.22–0.31× in turns with it, in one run). That
//!   is the price of tokens that survive a restart, not of the queue.
//! * Fair on PostgreSQL and MySQL with the queue (L4); not on SQLite, a
//!   single file with no lock manager to queue in (whoever asks first after
//!   a release wins).
//! * **Connections**: at most `dlock_pool` connections, kept open between
//!   operations (closed after 10 min idle or 30 min of age, and after a
//!   statement that failed). The statements of
//!   a lock's life are prepared when a connection opens, and connections are
//!   not pinged before use (only after 30 s idle) nor after it (sqlx's pool
//!   pings every connection it gets back; sqlx only opens them here), so
//!   every operation is one round trip and a request that reaches the server
//!   takes effect even if its reply is lost (the core's retry then finds it:
//!   same grant, or `NotHeld` after a release). A statement cut off by the
//!   core's request timeout leaves its
//!   connection 2 s to answer a ping (a late reply is drained and the
//!   connection reused), else it is closed: a connection that died silently
//!   never keeps its slot. A take cut off that way
//!   may still land (its bytes may leave only with the drain's ping): the
//!   attempt's abandon frees its grant, waits for those drains, and frees
//!   again.
//! * **Errors**: [`SqlBackend::connect`] opens one connection first, so a
//!   refused connection is an immediate [`Error::Unavailable`] saying so, a
//!   wrong user or password an [`Error::Auth`] (PostgreSQL SQLSTATE class 28,
//!   MySQL 1045 and friends; never retried), and a TLS failure an
//!   [`Error::Config`]. Transient server errors are [`Error::Unavailable`]:
//!   PostgreSQL by SQLSTATE (serialization, deadlock, shutdown, too many
//!   connections, read-only transaction), MySQL by error number (1205 lock
//!   wait timeout, 1213 deadlock, 1040/1203 too many connections, 1290/1792
//!   read-only, SQLSTATE 25006), SQLite `BUSY`/`LOCKED`.
//! * **Durability**: tokens survive restarts (S2) on all three. SQLite runs
//!   in WAL mode with `synchronous = FULL`: a commit is on disk before it is
//!   acknowledged, so an OS crash or power loss cannot take back a token
//!   already handed out. The cost is an `fsync` of the WAL per take, release
//!   and renewal (with `NORMAL`, WAL syncs only at checkpoints and the last
//!   commits can be lost).
//!
//! URLs: `postgres://user:pass@host:port/db` (or `postgresql://`),
//! `mysql://…` (MariaDB too, or `mariadb://`), `sqlite://relative/path.db` or
//! `sqlite:///absolute/path.db` (created if missing unless the URL gives its
//! own `mode`; WAL mode, 5 s busy timeout, usable by several processes; an
//! in-memory database, `sqlite::memory:` or `mode=memory`, is refused: use
//! `memory://`). Each scheme needs its Cargo feature (`postgres`, `mysql`,
//! `sqlite`); [`SqlAdapter`] registers them all in a
//! [`Registry`](dlock_core::Registry), and
//! [`Backend::capabilities`] says what each promises
//! ([`SqlOptions::capabilities`]). dlock's own options ride in the query
//! string and are removed before the driver sees it: `dlock_table=NAME`
//! (default `dlock_locks`, `[A-Za-z_][A-Za-z0-9_]{0,47}`; the adapter
//! keeps the table's tombstones in `NAME$ended`, a name no lock table can
//! have), `dlock_pool=N`
//! (default 4 connections, 1–256) and `dlock_queue=N` (the wait queue's
//! lanes, default 16, 0–1024, 0 for no queue; PostgreSQL and MySQL); any other `dlock_…` option is an
//! [`Error::InvalidUrl`]. The drivers' own options pass through to sqlx,
//! which checks them, TLS among them (rustls with ring, the webpki roots):
//! `postgres://…?sslmode=verify-full&sslrootcert=/path/ca.pem` (`disable`,
//! `prefer` — the default —, `require`, `verify-ca`, `verify-full`;
//! `sslcert`/`sslkey` for client certificates) and
//! `mysql://…?ssl-mode=verify_identity&ssl-ca=/path/ca.pem` (`disabled`,
//! `preferred`, `required`, `verify_ca`, `verify_identity`). Passwords never
//! appear in `Debug`, errors or logs.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//! let backend = dlock_sql::SqlBackend::connect("sqlite://dlock.db").await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("nightly/report")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod conns;
mod dialect;
mod fence;
#[cfg(feature = "sqlite")]
mod file_wake;
mod floor;
#[cfg(feature = "postgres")]
mod notify;
mod options;
mod queue;
mod store;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::{AnyConnection, Connection, Row};

use conns::Conns;
use dialect::{Arg, Dialect, Sql, Statements, prefix_end};
pub use dlock_core::FenceError;
use dlock_core::wake::WakeHub;
pub use fence::{FencedConnection, SqlFence};
pub use floor::SqlFloor;
pub use options::{DEFAULT_QUEUE, DEFAULT_TABLE, SqlOptions};
/// The sqlx this crate speaks (its connections are what [`SqlFence`] checks on).
pub use sqlx;

/// The smallest TTL: the database clock has millisecond resolution, and a
/// statement plus a renewal round must fit comfortably.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// How long opening a connection may take (the first one, in
/// [`SqlBackend::connect`], and the pool's) before it counts as failed.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The SQL [`Adapter`](dlock_core::Adapter): `postgres://`, `postgresql://`, `mysql://`,
/// `mariadb://` and `sqlite://` URLs, opened with [`SqlBackend::connect`].
/// A scheme whose feature is not compiled in is
/// [`Error::FeatureDisabled`].
///
/// ```no_run
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// let registry = dlock_core::Registry::new();
/// registry.register(dlock_sql::SqlAdapter)?;
/// let backend = registry.connect("sqlite://dlock.db?dlock_table=jobs").await?;
/// // SQLite polls (and watches its files, where the OS reports writes)
/// assert!(!backend.capabilities().notify_wakeup);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SqlAdapter;

dlock_core::impl_adapter!(SqlAdapter, name: "sql", schemes: &["postgres", "postgresql", "mysql", "mariadb", "sqlite"], connect: SqlBackend::connect, floor: SqlFloor::connect);

/// A lock service on one SQL database (see the [crate docs](crate)).
#[derive(Clone)]
pub struct SqlBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) conns: Arc<Conns>,
    /// The wait queue's lanes (`None`: no queue).
    pub(crate) lanes: Option<Arc<Conns>>,
    /// What a queue key is unique within besides the lock name: the table
    /// and its schema (PostgreSQL, whose advisory locks are per database
    /// already) or database (MySQL, whose `GET_LOCK` names are server-wide).
    pub(crate) queue_scope: String,
    /// Lanes kept by held locks, across sessions (see `store::HeldLanes`).
    pub(crate) held_lanes: std::sync::atomic::AtomicUsize,
    pub(crate) sql: Statements,
    pub(crate) hub: Arc<WakeHub>,
    pub(crate) options: SqlOptions,
    _listener: Option<AbortOnDrop>,
    /// SQLite: the database file SQLite opened (`PRAGMA database_list`).
    #[cfg(feature = "sqlite")]
    sqlite_file: Option<std::path::PathBuf>,
    /// SQLite: the watch on the database's files, started by the first
    /// wait: `None` before, `Some(None)` if it could not be set up (waiters
    /// poll).
    #[cfg(feature = "sqlite")]
    file_wake: std::sync::Mutex<Option<Option<file_wake::FileWake>>>,
}

impl Inner {
    /// SQLite: starts the watch on the database's files unless it was
    /// started before; whether it started now (a commit before it went
    /// unseen, so the caller should look again at once).
    ///
    /// Started again if its task ended: the runtime that ran it shut down
    /// while the backend lives on in another.
    #[cfg(feature = "sqlite")]
    pub(crate) fn watch_files(self: &Arc<Self>) -> bool {
        let Some(path) = &self.sqlite_file else {
            return false;
        };
        let mut state = self.file_wake.lock().unwrap();
        match &*state {
            Some(Some(watch)) if !watch.ended() => return false,
            Some(None) => return false,
            _ => {}
        }
        *state = Some(
            match file_wake::FileWake::start(path, Arc::downgrade(self)) {
                Ok(watch) => Some(watch),
                Err(e) => {
                    tracing::warn!(backend = "sqlite", file = %path.display(), error = %e, "cannot watch the database's files; waiters poll (5 ms to 100 ms)");
                    None
                }
            },
        );
        true
    }

    /// Without SQLite there is nothing to watch.
    #[cfg(not(feature = "sqlite"))]
    pub(crate) fn watch_files(self: &Arc<Self>) -> bool {
        false
    }
}

/// A task that ends with its owner.
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl SqlBackend {
    /// Connects to `url` (see the [crate docs](crate) for the forms) and
    /// creates the lock table and its tombstone table (`<table>$ended`) if
    /// needed.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is left behind but idempotently created tables.
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        Self::with_options(SqlOptions::from_url(url)?).await
    }

    /// Connects with explicit options.
    ///
    /// One connection is opened first, so that a refused connection, a wrong
    /// password ([`Error::Auth`]) or a TLS problem ([`Error::Config`]) is
    /// reported at once and by its meaning; the pool then opens its
    /// connections as they are needed.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`SqlBackend::connect`].
    pub async fn with_options(options: SqlOptions) -> Result<Self, Error> {
        let dialect = options.dialect;
        let scheme = dialect.scheme();
        let created = Statements::new(dialect, &options.table, false);
        let (mut first, connect_options) = ready_connection(&options, &created).await?;
        // PostgreSQL's advisory locks are per database already; the schema
        // tells two tables of one name apart.
        let (queue_scope, statement_binlog) = match dialect {
            Dialect::Postgres => {
                let row = sqlx::query("SELECT CAST(current_schema() AS TEXT)")
                    .fetch_one(&mut first)
                    .await
                    .map_err(|e| store::map_err(scheme, e))?;
                let schema: Option<String> =
                    row.try_get(0).map_err(|e| store::map_err(scheme, e))?;
                let scope = format!("{}\0{}", schema.unwrap_or_default(), options.table);
                (scope, false)
            }
            Dialect::MySql => {
                let row = sqlx::query("SELECT DATABASE(), CAST(@@binlog_format AS CHAR)")
                    .fetch_one(&mut first)
                    .await
                    .map_err(|e| store::map_err(scheme, e))?;
                let db: Option<String> = row.try_get(0).map_err(|e| store::map_err(scheme, e))?;
                let binlog: Option<String> =
                    row.try_get(1).map_err(|e| store::map_err(scheme, e))?;
                let scope = format!("{}\0{}", db.unwrap_or_default(), options.table);
                (
                    scope,
                    binlog.is_some_and(|f| f.eq_ignore_ascii_case("STATEMENT")),
                )
            }
            _ => (options.table.clone(), false),
        };
        #[cfg(feature = "sqlite")]
        let sqlite_file = match dialect {
            Dialect::Sqlite => sqlite_file(&mut first).await,
            _ => None,
        };
        let _ = first.close().await;
        // The queue's functions (IS_FREE_LOCK, CONNECTION_ID) in the take
        // are unsafe for statement-based replication: a replica would
        // replay a take the primary refused. Without them the take is the
        // deterministic row statement it was.
        if statement_binlog && options.queue > 0 {
            tracing::warn!(
                backend = scheme,
                "binlog_format is STATEMENT: the wait queue is off (not fair)"
            );
        }
        let queue = options.queue > 0 && !statement_binlog && dialect != Dialect::Sqlite;
        let sql = Statements::new(dialect, &options.table, queue);
        // The pool only opens connections (see `conns`): none kept in it,
        // none tested on the way out (the cache pings the long-idle ones).
        let mut pool = AnyPoolOptions::new()
            .max_connections(options.pool)
            .min_connections(0)
            .acquire_timeout(CONNECT_TIMEOUT)
            .test_before_acquire(false);
        if dialect == Dialect::Sqlite {
            pool = pool.after_connect(|conn, _| Box::pin(sqlite_pragmas(conn)));
        } else {
            let hot = Arc::new(sql.hot());
            pool = pool.after_connect(move |conn, _| {
                let hot = hot.clone();
                Box::pin(async move { prepare(conn, &hot).await })
            });
        }
        let pool = pool
            .connect_with(connect_options)
            .await
            .map_err(|e| store::map_err(scheme, e))?;
        let lanes = sql
            .queue
            .is_some()
            .then(|| Conns::new(pool.clone(), options.queue));
        let conns = Conns::new(pool, options.pool);
        // One connection now, prepared while the network is known to work.
        let warm = conns.get().await.map_err(|e| store::map_err(scheme, e))?;
        conns.put(warm);
        let hub = Arc::new(WakeHub::default());
        let listener = Self::start_listener(&options, &hub).await;
        tracing::debug!(backend = scheme, url = %options, "connected");
        Ok(Self {
            inner: Arc::new(Inner {
                conns,
                lanes,
                queue_scope,
                held_lanes: Default::default(),
                sql,
                hub,
                options,
                _listener: listener,
                #[cfg(feature = "sqlite")]
                sqlite_file,
                #[cfg(feature = "sqlite")]
                file_wake: std::sync::Mutex::new(None),
            }),
        })
    }

    /// PostgreSQL: the first `LISTEN` is in place before this returns (so
    /// its start need not wake anyone), then a task keeps it up.
    #[cfg(feature = "postgres")]
    async fn start_listener(options: &SqlOptions, hub: &Arc<WakeHub>) -> Option<AbortOnDrop> {
        if options.dialect != Dialect::Postgres {
            return None;
        }
        let url = options.driver_url().to_owned();
        let channel = format!("dlock_{}", options.table);
        let first = notify::first_listener(&url, &channel, CONNECT_TIMEOUT).await;
        let task = tokio::spawn(notify::listen(url, channel, Arc::downgrade(hub), first));
        Some(AbortOnDrop(task))
    }

    #[cfg(not(feature = "postgres"))]
    async fn start_listener(_: &SqlOptions, _: &Arc<WakeHub>) -> Option<AbortOnDrop> {
        None
    }

    /// Lock rows under `prefix` that are currently held (free rows are kept
    /// on purpose: they carry the token forward).
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    pub async fn held_rows(&self, prefix: &str) -> Result<usize, Error> {
        let end = checked_prefix_end(prefix)?;
        let args = [Arg::Text(prefix), Arg::Text(&end)];
        Ok(self.count(&self.inner.sql.count_held, &args).await? as usize)
    }

    /// The first column of the one row `sql` answers with `args`: a count.
    async fn count<'q>(&self, sql: &'q Sql, args: &[Arg<'q>]) -> Result<i64, Error> {
        let row = self
            .conn()
            .await?
            .fetch_one(sql.bind(args))
            .await
            .map_err(|e| self.err(e))?;
        row.try_get::<i64, _>(0).map_err(|e| self.err(e))
    }

    async fn conn(&self) -> Result<store::Conn, Error> {
        store::Conn::get(&self.inner).await
    }

    fn err(&self, e: sqlx::Error) -> Error {
        store::map_err(self.inner.sql.dialect.scheme(), e)
    }

    fn info(&self, name: LockName, row: &AnyRow, offset: usize) -> Result<LockInfo, Error> {
        let get = |e: sqlx::Error| self.err(e);
        let holder: Option<String> = row.try_get(offset).map_err(get)?;
        let token: i64 = row.try_get(offset + 1).map_err(get)?;
        let why: Option<String> = row.try_get(offset + 2).map_err(get)?;
        let acquired: i64 = row.try_get(offset + 3).map_err(get)?;
        let expires: i64 = row.try_get(offset + 4).map_err(get)?;
        let mut info = LockInfo::new(name, holder.unwrap_or_default(), token_of(token)?);
        info.why = why;
        info.acquired_at = Some(epoch_ms(acquired));
        info.expires_at = Some(epoch_ms(expires));
        Ok(info)
    }
}

impl Inner {
    /// The wait queue's lock of `name` in this backend's table.
    pub(crate) fn queue_key(&self, name: &LockName) -> queue::QueueKey {
        queue::QueueKey::new(&self.queue_scope, name.as_str())
    }
}

pub(crate) fn token_of(value: i64) -> Result<FencingToken, Error> {
    u64::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .map(FencingToken::new)
        .ok_or_else(|| {
            Error::protocol(
                "sql",
                format!("token {value} in the lock table is not positive"),
            )
        })
}

/// One connection of its own to the store `options` name, with the lock
/// table created (typed errors as [`first_connection`]), and the options it
/// was opened with, for more: what both the backend and its floor start
/// from.
async fn ready_connection(
    options: &SqlOptions,
    sql: &Statements,
) -> Result<(AnyConnection, AnyConnectOptions), Error> {
    sqlx::any::install_default_drivers();
    let connect_options = options
        .connect_options()
        .map_err(|e| store::map_err(options.dialect.scheme(), e))?;
    let mut conn = first_connection(options, &connect_options).await?;
    create_table(&mut conn, sql).await?;
    Ok((conn, connect_options))
}

/// A plain connection to the database a dlock URL names, with its TLS and
/// time-outs (the `dlock_…` options are read, then ignored): for writes of
/// the protected data through [`SqlFence`], e.g. by `dlock fence`.
///
/// # Cancel safety
/// Cancel safe.
pub async fn connect_data<U>(url: U) -> Result<AnyConnection, Error>
where
    U: TryInto<StoreUrl, Error = Error>,
{
    let options = SqlOptions::from_url(url)?;
    sqlx::any::install_default_drivers();
    let connect_options = options
        .connect_options()
        .map_err(|e| store::map_err(options.dialect.scheme(), e))?;
    first_connection(&options, &connect_options).await
}

/// Creates the lock table, its index and its tombstone table if they do
/// not exist.
async fn create_table(conn: &mut AnyConnection, sql: &Statements) -> Result<(), Error> {
    for statement in &sql.create {
        if let Err(e) = statement.bind(&[]).execute(&mut *conn).await {
            // Concurrent CREATE … IF NOT EXISTS may race in PostgreSQL's
            // catalog; the table exists either way.
            let raced = matches!(&e, sqlx::Error::Database(d)
                if matches!(d.code().as_deref(), Some("23505" | "42P07")));
            if !raced {
                return Err(store::map_err(sql.dialect.scheme(), e));
            }
        }
    }
    Ok(())
}

/// The first connection of a backend, with its errors typed: a refused or
/// silent server is [`Error::Unavailable`] naming the (redacted) URL, a wrong
/// password [`Error::Auth`], a TLS failure [`Error::Config`]; for SQLite,
/// with its pragmas set.
async fn first_connection(
    options: &SqlOptions,
    connect_options: &AnyConnectOptions,
) -> Result<AnyConnection, Error> {
    let scheme = options.dialect.scheme();
    let connected = tokio::time::timeout(
        CONNECT_TIMEOUT,
        AnyConnection::connect_with(connect_options),
    )
    .await
    .map_err(|_| {
        Error::unavailable(
            scheme,
            format!("{options} did not answer within {CONNECT_TIMEOUT:?}"),
        )
    })?;
    let mut conn = match connected {
        Ok(conn) => conn,
        // TLS refused (the server has none, a certificate that does not
        // verify): a configuration to fix, not a server to wait for.
        Err(sqlx::Error::Tls(e)) => {
            return Err(Error::Config(format!("{scheme}: TLS with {options}: {e}")));
        }
        Err(sqlx::Error::Io(e)) if is_tls_failure(&e) => {
            return Err(Error::Config(format!("{scheme}: TLS with {options}: {e}")));
        }
        Err(e) if options.dialect == Dialect::Sqlite && cannot_open(&e) => {
            return Err(sqlite_cannot_open(options));
        }
        Err(e) => {
            return Err(match store::map_err(scheme, e) {
                Error::Unavailable { source, .. } => {
                    Error::unavailable(scheme, format!("cannot connect to {options}: {source}"))
                }
                other => other,
            });
        }
    };
    if options.dialect == Dialect::Sqlite {
        sqlite_pragmas(&mut conn)
            .await
            .map_err(|e| store::map_err(scheme, e))?;
    }
    Ok(conn)
}

/// SQLite's SQLITE_CANTOPEN (14): the file cannot be opened or created.
fn cannot_open(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("14"))
}

/// Why SQLite cannot open the URL's file, as a configuration error naming
/// the path: most often a directory that does not exist (SQLite creates
/// the file, never its directory).
fn sqlite_cannot_open(options: &SqlOptions) -> Error {
    let path = sqlite_path(options);
    let dir = match std::path::Path::new(path).parent() {
        Some(d) if d.as_os_str().is_empty() => std::path::Path::new("."),
        Some(d) => d,
        None => std::path::Path::new("/"),
    };
    let why = if !dir.is_dir() {
        format!(
            "the directory {} does not exist (SQLite creates the database file, not its directory)",
            dir.display()
        )
    } else {
        "SQLite cannot open or create it (permissions? a directory of that name? mode=ro on a \
         missing file?)"
            .to_owned()
    };
    Error::Config(format!("sqlite: cannot open {path}: {why}"))
}

/// The file of the database SQLite opened on `conn` (absolute, decoded);
/// `None` if it has none or does not say.
#[cfg(feature = "sqlite")]
async fn sqlite_file(conn: &mut AnyConnection) -> Option<std::path::PathBuf> {
    let rows = sqlx::query("PRAGMA database_list")
        .fetch_all(conn)
        .await
        .ok()?;
    rows.iter()
        .find(|row| row.try_get::<String, _>(1).is_ok_and(|name| name == "main"))
        .and_then(|row| row.try_get::<String, _>(2).ok())
        .filter(|file| !file.is_empty())
        .map(std::path::PathBuf::from)
}

/// The database file of a `sqlite://` URL, as written in it (for messages:
/// relative to the working directory unless absolute).
fn sqlite_path(options: &SqlOptions) -> &str {
    let url = options.driver_url();
    url.strip_prefix("sqlite://")
        .unwrap_or(url)
        .split('?')
        .next()
        .unwrap_or_default()
}

/// Prepares `statements` on a new connection (PostgreSQL, MySQL). A
/// statement the driver cannot describe is left to be prepared on first use;
/// a broken connection fails.
async fn prepare(conn: &mut AnyConnection, statements: &[String]) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    for text in statements {
        match conn.prepare(text.as_str()).await {
            Ok(_) => {}
            Err(e @ (sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_))) => {
                return Err(e);
            }
            Err(e) => tracing::debug!(error = %e, "statement not prepared in advance"),
        }
    }
    Ok(())
}

/// A TLS handshake failure, which sqlx reports as an I/O error carrying
/// rustls' error (e.g. an unknown issuer).
fn is_tls_failure(e: &std::io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
}

/// Every SQLite connection: WAL lets readers and one writer of several
/// processes share the file; the busy timeout makes writers queue instead of
/// failing; `synchronous = FULL` makes a commit durable before it is
/// acknowledged (WAL with `NORMAL` can lose the last commits on a power loss
/// or OS crash, and with them tokens already handed out: S2 across restarts,
/// which this backend claims). The cost is one `fsync` of the WAL per
/// commit, i.e. per take, release and renewal.
async fn sqlite_pragmas(conn: &mut AnyConnection) -> Result<(), sqlx::Error> {
    use sqlx::Executor;
    conn.execute("PRAGMA busy_timeout = 5000").await?;
    conn.execute("PRAGMA journal_mode = WAL").await?;
    conn.execute("PRAGMA synchronous = FULL").await?;
    Ok(())
}

/// The end of the range of lock names beginning with `prefix` (checked).
fn checked_prefix_end(prefix: &str) -> Result<String, Error> {
    name::check_prefix(prefix)?;
    Ok(prefix_end(prefix))
}

fn epoch_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

impl fmt::Debug for SqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlBackend")
            .field("url", &self.inner.options.to_string())
            .field("table", &self.inner.options.table)
            .finish()
    }
}

#[async_trait]
impl Backend for SqlBackend {
    fn scheme(&self) -> &'static str {
        self.inner.sql.dialect.scheme()
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    /// See [`SqlOptions::capabilities`]: notifications on PostgreSQL only.
    fn capabilities(&self) -> Capabilities {
        let mut caps = self.inner.options.capabilities();
        // The queue may have been turned off at connect (MySQL with
        // statement-based replication).
        let queued = self.inner.lanes.is_some();
        (caps.fair, caps.no_herd) = (queued, queued);
        caps
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(store::SqlSession::new(
            self.inner.clone(),
            id,
            options.ttl_value(),
        )))
    }

    async fn ping(&self) -> Result<(), Error> {
        self.conn()
            .await?
            .execute(sqlx::query("SELECT 1"))
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let row = self
            .conn()
            .await?
            .fetch_optional(self.inner.sql.inspect.bind(&[Arg::Text(name.as_str())]))
            .await
            .map_err(|e| self.err(e))?;
        row.map(|r| self.info(name.clone(), &r, 0)).transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        let end = checked_prefix_end(prefix)?;
        let rows = self
            .conn()
            .await?
            .fetch_all(
                self.inner
                    .sql
                    .list
                    .bind(&[Arg::Text(prefix), Arg::Text(&end)]),
            )
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| {
                let name: String = r.try_get(0).map_err(|e| self.err(e))?;
                let name = LockName::new(&name).map_err(|_| {
                    Error::protocol(
                        self.scheme(),
                        format!("invalid lock name {name:?} in the table"),
                    )
                })?;
                self.info(name, r, 1)
            })
            .collect()
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        let args = [Arg::Text(name.as_str()), Arg::Int(token.get() as i64)];
        Ok(self.count(&self.inner.sql.validate, &args).await? > 0)
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let done = self
            .conn()
            .await?
            .execute(self.inner.sql.force.bind(&[Arg::Text(name.as_str())]))
            .await
            .map_err(|e| self.err(e))?;
        let freed = done.rows_affected() > 0;
        if freed {
            tracing::info!(lock = %name, "force-released");
            self.inner.hub.wake_first(name.as_str());
        }
        Ok(freed)
    }
}

/// Tests that need the adapter's own connections, against the real servers
/// of `scripts/services` (SQLite on a temporary file).
#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::Executor;

    fn url(store: &str) -> Option<String> {
        if dlock_conformance::skip_requested(store, "dlock-sql unit test") {
            return None;
        }
        let default = match store {
            "postgres" => "postgres://dlock:dlock@127.0.0.1:15432/dlock",
            _ => "mysql://dlock:dlock@127.0.0.1:13306/dlock",
        };
        let url = std::env::var(format!("DLOCK_TEST_{}_URL", store.to_uppercase()))
            .unwrap_or_else(|_| default.to_owned());
        Some(format!(
            "{url}{}dlock_table=dlock_unit_test",
            if url.contains('?') { '&' } else { '?' }
        ))
    }

    /// A SQLite database file of one test, removed with its WAL and
    /// shared-memory files when dropped (also after a failed assertion).
    struct TempDb(std::path::PathBuf);

    impl TempDb {
        fn new() -> Self {
            let name = format!(
                "dlock-unit-{}-{:08x}.db",
                std::process::id(),
                rand::random::<u32>()
            );
            Self(std::env::temp_dir().join(name))
        }

        fn url(&self) -> String {
            format!("sqlite://{}", self.0.display())
        }
    }

    impl Drop for TempDb {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
            }
        }
    }

    /// Issue 12 item 11 (S2 across a power loss): every SQLite connection
    /// commits with `synchronous = FULL` (2), not `NORMAL` (1).
    #[tokio::test]
    async fn sqlite_commits_are_durable() {
        let db = TempDb::new();
        let backend = SqlBackend::connect(&db.url()).await.unwrap();
        // More than one pooled connection: each has its own setting.
        let mut conns = Vec::new();
        for _ in 0..2 {
            conns.push(backend.inner.conns.get().await.unwrap());
        }
        for slot in &mut conns {
            let conn = &mut slot.open.conn;
            let row = conn.fetch_one("PRAGMA synchronous").await.unwrap();
            assert_eq!(
                row.try_get::<i64, _>(0).unwrap(),
                2,
                "synchronous is not FULL"
            );
            let row = conn.fetch_one("PRAGMA journal_mode").await.unwrap();
            assert_eq!(row.try_get::<String, _>(0).unwrap(), "wal");
        }
    }

    /// S5 on each dialect's own statements (SQLite has no wire on which
    /// `cut_take_delivered_late` could hold a take): while an attempt's
    /// tombstone lives, its take inserts nothing on a new name and takes
    /// nothing on a freed row that another attempt held last; another
    /// attempt's take is granted.
    async fn a_take_of_an_ended_attempt_grants_nothing(url: &str) {
        let backend = SqlBackend::connect(url).await.unwrap();
        let inner = &backend.inner;
        let (sql, dialect, table) = (&inner.sql, inner.sql.dialect, &inner.options.table);
        let name = LockName::new(format!("unit/ended/{:08x}", rand::random::<u32>())).unwrap();
        let key = inner.queue_key(&name);
        let tag = format!("{:08x}", rand::random::<u32>());
        let (ended, other) = (format!("unit#ended-{tag}"), format!("unit#other-{tag}"));
        let mut slot = inner.conns.get().await.unwrap();
        let conn = &mut slot.open.conn;
        async fn take(
            conn: &mut AnyConnection,
            sql: &Statements,
            name: &str,
            key: Arg<'_>,
            owner: &str,
        ) {
            let args = [
                Arg::Text(name),
                Arg::Text("unit-session"),
                Arg::Text(owner),
                Arg::OptText(None),
                Arg::Int(10_000),
                key,
                Arg::Int(250),
            ];
            sql.take.bind(&args).fetch_all(conn).await.unwrap();
        }
        // Rows of the name (of `owner` holding it, if given).
        async fn rows(conn: &mut AnyConnection, q: &Sql, name: &str, owner: &str) -> i64 {
            let args = [Arg::Text(name), Arg::Text(owner)];
            let row = q.bind(&args).fetch_one(conn).await.unwrap();
            row.try_get(0).unwrap()
        }
        let any = Sql::new(dialect, table, "SELECT COUNT(*) FROM {t} WHERE name = ?1");
        let held = Sql::new(
            dialect,
            table,
            "SELECT COUNT(*) FROM {t} WHERE name = ?1 AND owner = ?2 AND holder IS NOT NULL",
        );
        conn.execute(sql.tombstone.bind(&[Arg::Text(&ended), Arg::Int(60_000)]))
            .await
            .unwrap();
        take(conn, sql, name.as_str(), key.arg(dialect), &ended).await;
        let n = rows(conn, &any, name.as_str(), "").await;
        assert_eq!(n, 0, "{dialect:?}: an ended attempt's take inserted a row");
        take(conn, sql, name.as_str(), key.arg(dialect), &other).await;
        let n = rows(conn, &held, name.as_str(), &other).await;
        assert_eq!(n, 1, "{dialect:?}: another attempt's take was not granted");
        conn.execute(sql.force.bind(&[Arg::Text(name.as_str())]))
            .await
            .unwrap();
        take(conn, sql, name.as_str(), key.arg(dialect), &ended).await;
        let n = rows(conn, &held, name.as_str(), &ended).await;
        assert_eq!(
            n, 0,
            "{dialect:?}: an ended attempt's take took a freed row"
        );
    }

    #[tokio::test]
    async fn sqlite_take_of_an_ended_attempt_grants_nothing() {
        a_take_of_an_ended_attempt_grants_nothing(&TempDb::new().url()).await;
    }

    #[tokio::test]
    async fn postgres_take_of_an_ended_attempt_grants_nothing() {
        let Some(url) = url("postgres") else { return };
        a_take_of_an_ended_attempt_grants_nothing(&url).await;
    }

    #[tokio::test]
    async fn mysql_take_of_an_ended_attempt_grants_nothing() {
        let Some(url) = url("mysql") else { return };
        a_take_of_an_ended_attempt_grants_nothing(&url).await;
    }

    /// Issue 12 item 18: MySQL errors are told apart by their error number
    /// (their SQLSTATE is mostly HY000): a lock wait timeout (1205) and a
    /// write in a read-only transaction (1792, SQLSTATE 25006) are
    /// retryable, as a deadlock (1213) is.
    #[tokio::test]
    async fn mysql_transient_errors_are_retryable() {
        let Some(url) = url("mysql") else { return };
        let backend = SqlBackend::connect(&url).await.unwrap();
        let conns = &backend.inner.conns;
        let table = &backend.inner.options.table;
        let name = format!("unit/{:08x}", rand::random::<u32>());
        let (mut sa, mut sb) = (conns.get().await.unwrap(), conns.get().await.unwrap());
        let (a, b) = (&mut sa.open.conn, &mut sb.open.conn);
        a.execute(
            sqlx::query(&format!(
                "INSERT INTO {table} (name, token, acquired_at, expires_at) VALUES (?, 1, 0, 0)"
            ))
            .bind(&name),
        )
        .await
        .unwrap();
        let update = format!("UPDATE {table} SET token = token + 1 WHERE name = ?");

        // 1205: b waits for the row a has locked.
        a.execute("BEGIN").await.unwrap();
        a.execute(sqlx::query(&update).bind(&name)).await.unwrap();
        b.execute("SET SESSION innodb_lock_wait_timeout = 1")
            .await
            .unwrap();
        let e = b
            .execute(sqlx::query(&update).bind(&name))
            .await
            .unwrap_err();
        a.execute("ROLLBACK").await.unwrap();
        let mapped = store::map_err("mysql", e);
        assert!(mapped.is_retryable(), "lock wait timeout: {mapped:?}");

        // 1792 / 25006: a write in a read-only transaction (what a replica
        // being promoted, or a failover in progress, answers).
        b.execute("START TRANSACTION READ ONLY").await.unwrap();
        let e = b
            .execute(sqlx::query(&update).bind(&name))
            .await
            .unwrap_err();
        b.execute("ROLLBACK").await.unwrap();
        let mapped = store::map_err("mysql", e);
        assert!(mapped.is_retryable(), "read-only transaction: {mapped:?}");

        // A wrong statement is not retryable.
        let e = b
            .execute("SELECT * FROM no_such_table_x")
            .await
            .unwrap_err();
        assert!(!store::map_err("mysql", e).is_retryable());
    }
}
