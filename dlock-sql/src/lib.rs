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
//! * **Take** is one statement: `INSERT … ON CONFLICT … DO UPDATE … WHERE
//!   expires_at <= now` (PostgreSQL, SQLite) or `INSERT … ON DUPLICATE KEY
//!   UPDATE` with every column guarded by the same expiry test (MySQL).
//! * **Release / renewal** are owner-checked (`WHERE name AND owner AND
//!   token`, S3). A session's renewal extends all its locks in one statement
//!   per period (`WHERE holder = session`). There is no separate sessions
//!   table: each lock's own `expires_at` is the lease, which meets S4 with one
//!   statement less per period.
//! * **Wake-ups**: PostgreSQL releases `pg_notify` in the same statement and
//!   waiters `LISTEN` on one connection per backend; MySQL and SQLite waiters
//!   poll with a bounded backoff (5 ms doubling to 100 ms) and wake at the
//!   holder's `expires_at`. Waiters in the same process are woken directly.
//! * Not fair (no queue): whoever asks first after a release wins.
//!
//! URLs: `postgres://user:pass@host:port/db`, `mysql://…` (MariaDB too),
//! `sqlite://path` (created if missing; WAL mode, 5 s busy timeout, usable by
//! several processes). dlock's own options ride in the query string and are
//! removed before the driver sees it: `dlock_table=NAME` (default
//! `dlock_locks`, `[A-Za-z_][A-Za-z0-9_]{0,47}`) and `dlock_pool=N` (default 4
//! connections). Passwords never appear in `Debug`, errors or logs.
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

mod dialect;
mod notify;
mod options;
mod store;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::{
    Backend, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use dialect::{Arg, Dialect, Statements, prefix_end};
use dlock_core::wake::WakeHub;
pub use options::{DEFAULT_TABLE, SqlOptions};

/// The smallest TTL: the database clock has millisecond resolution, and a
/// statement plus a renewal round must fit comfortably.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// A lock service on one SQL database (see the [crate docs](crate)).
#[derive(Clone)]
pub struct SqlBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: AnyPool,
    pub(crate) sql: Statements,
    pub(crate) hub: Arc<WakeHub>,
    pub(crate) options: SqlOptions,
    _listener: Option<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl SqlBackend {
    /// Connects to `url` (see the [crate docs](crate) for the forms) and
    /// creates the table if needed.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is left behind but an idempotently created table.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::with_options(SqlOptions::from_url(url)?).await
    }

    /// Connects with explicit options.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`SqlBackend::connect`].
    pub async fn with_options(options: SqlOptions) -> Result<Self, Error> {
        sqlx::any::install_default_drivers();
        let dialect = options.dialect;
        let scheme = dialect.scheme();
        let mut pool = AnyPoolOptions::new()
            .max_connections(options.pool)
            .acquire_timeout(Duration::from_secs(5));
        if dialect == Dialect::Sqlite {
            // WAL lets readers and one writer of several processes share the
            // file; the busy timeout makes writers queue instead of failing.
            pool = pool.after_connect(|conn, _| {
                Box::pin(async move {
                    use sqlx::Executor;
                    conn.execute("PRAGMA busy_timeout = 5000").await?;
                    conn.execute("PRAGMA journal_mode = WAL").await?;
                    conn.execute("PRAGMA synchronous = NORMAL").await?;
                    Ok(())
                })
            });
        }
        let pool = pool
            .connect(options.driver_url())
            .await
            .map_err(|e| store::map_err(scheme, e))?;
        let sql = Statements::new(dialect, &options.table);
        for statement in &sql.create {
            if let Err(e) = statement.bind(&[]).execute(&pool).await {
                // Concurrent CREATE … IF NOT EXISTS may race in PostgreSQL's
                // catalog; the table exists either way.
                let raced = matches!(&e, sqlx::Error::Database(d)
                    if matches!(d.code().as_deref(), Some("23505" | "42P07")));
                if !raced {
                    return Err(store::map_err(scheme, e));
                }
            }
        }
        let hub = Arc::new(WakeHub::default());
        let listener = Self::start_listener(&options, &hub);
        tracing::debug!(backend = scheme, url = %options, "connected");
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                sql,
                hub,
                options,
                _listener: listener,
            }),
        })
    }

    #[cfg(feature = "postgres")]
    fn start_listener(options: &SqlOptions, hub: &Arc<WakeHub>) -> Option<AbortOnDrop> {
        (options.dialect == Dialect::Postgres).then(|| {
            let task = tokio::spawn(notify::listen(
                options.driver_url().to_owned(),
                format!("dlock_{}", options.table),
                Arc::downgrade(hub),
            ));
            AbortOnDrop(task)
        })
    }

    #[cfg(not(feature = "postgres"))]
    fn start_listener(_: &SqlOptions, _: &Arc<WakeHub>) -> Option<AbortOnDrop> {
        None
    }

    /// Lock rows under `prefix` that are currently held (free rows are kept
    /// on purpose: they carry the token forward).
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    pub async fn held_rows(&self, prefix: &str) -> Result<usize, Error> {
        name::check_prefix(prefix)?;
        let end = prefix_end(prefix);
        let row = self
            .inner
            .sql
            .count_held
            .bind(&[Arg::Text(prefix), Arg::Text(&end)])
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(row.try_get::<i64, _>(0).map_err(|e| self.err(e))? as usize)
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
        sqlx::query("SELECT 1")
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let row = self
            .inner
            .sql
            .inspect
            .bind(&[Arg::Text(name.as_str())])
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|r| self.info(name.clone(), &r, 0)).transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let end = prefix_end(prefix);
        let rows = self
            .inner
            .sql
            .list
            .bind(&[Arg::Text(prefix), Arg::Text(&end)])
            .fetch_all(&self.inner.pool)
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
        let row = self
            .inner
            .sql
            .validate
            .bind(&[Arg::Text(name.as_str()), Arg::Int(token.get() as i64)])
            .fetch_one(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(row.try_get::<i64, _>(0).map_err(|e| self.err(e))? > 0)
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let done = self
            .inner
            .sql
            .force
            .bind(&[Arg::Text(name.as_str())])
            .execute(&self.inner.pool)
            .await
            .map_err(|e| self.err(e))?;
        let freed = done.rows_affected() > 0;
        if freed {
            tracing::info!(lock = %name, "force-released");
            self.inner.hub.wake_all(name.as_str());
        }
        Ok(freed)
    }
}
