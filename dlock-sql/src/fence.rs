//! [`SqlFence`]: a lock's fencing token checked where the protected data lives.

use async_trait::async_trait;
use dlock_core::{Error, FenceError, FencingToken, StaleToken};

/// Fencing where the data lives: checks a lock's token inside
/// the caller's own transaction, in the database that holds the protected
/// data, so that a paused or partitioned former holder cannot write after a
/// newer one did.
///
/// The check records the highest token accepted per resource in a fence
/// table (`resource` primary key, `token` BIGINT). It is one conditional
/// write, atomic on the server, never a read-compare-write from the client:
///
/// * PostgreSQL, SQLite: `INSERT … ON CONFLICT (resource) DO UPDATE SET token
///   = excluded.token WHERE fences.token <= excluded.token RETURNING token`: no row
///   back means a newer token was accepted before.
/// * MySQL/MariaDB: `INSERT … ON DUPLICATE KEY UPDATE token = IF(token <=
///   VALUES(token), VALUES(token), LAST_INSERT_ID(token))`: a refusal keeps
///   the row and reports the newer token through `LAST_INSERT_ID`.
///
/// The write also locks the fence row until the transaction ends, so checks
/// of one resource are serialized by the database: at READ COMMITTED (the
/// PostgreSQL default) a writer with a newer token that checks while an
/// older one's transaction is open waits for it (and then writes after it),
/// one with an older token that checks after a newer one committed gets
/// [`FenceError::Stale`]. Roll the transaction back then; nothing it wrote
/// may land. Equal tokens are accepted, so one holder may write many times.
///
/// Rules of use:
/// * **The check is the first statement of a transaction** that sqlx began
///   (`pool.begin()`, `conn.begin()`): outside one it is
///   [`FenceError::NotInTransaction`], since the row lock would end with the
///   statement. Read the protected data only after it: a read before it
///   may see data an older holder's write then changes under you.
/// * **Retry the whole transaction** when the database aborts it:
///   serialization failures at REPEATABLE READ or SERIALIZABLE (PostgreSQL
///   40001), deadlocks (40P01, MySQL 1213), SQLite's busy errors. These are
///   [`FenceError::Store`]; never a silent pass.
/// * An older holder's transaction that stays open (a paused process) keeps
///   the fence row locked: set `lock_timeout` and
///   `idle_in_transaction_session_timeout` on PostgreSQL
///   (`innodb_lock_wait_timeout` on MySQL, 50 s by default) so that the next
///   holder is not blocked without end.
///
/// Tokens are per lock name: guard one resource with one lock name, on one
/// backend (tokens of different names or backends do not compare).
///
/// # Example
///
/// ```no_run
/// # #[cfg(feature = "postgres")]
/// # async fn demo(pool: sqlx::PgPool, guard: dlock_core::LockGuard) -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_sql::SqlFence;
///
/// let fence = SqlFence::new("dlock_fences")?;
/// fence.create_table(&mut *pool.acquire().await?).await?; // once
///
/// let mut tx = pool.begin().await?;
/// fence.check(&mut *tx, "accounts/42", guard.token()).await?; // Stale: roll back
/// sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 42")
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # One row, one statement
///
/// Where the protected data is one row, a fence column in that row does the
/// same without a fence table, in the write itself:
///
/// ```sql
/// UPDATE accounts SET balance = $1, fence = $2 WHERE id = $3 AND fence <= $2
/// ```
///
/// No row updated means a newer token wrote first (or there is no such row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlFence {
    table: String,
}

impl SqlFence {
    /// The fence kept in table `table` (`[A-Za-z_][A-Za-z0-9_]{0,47}`, in
    /// the connection's default schema or database); [`Error::Config`] for
    /// another name.
    pub fn new(table: &str) -> Result<Self, Error> {
        crate::options::check_table(table).map_err(Error::Config)?;
        Ok(Self {
            table: table.to_owned(),
        })
    }

    /// The fence table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the fence table if it does not exist.
    pub async fn create_table<C: FencedConnection>(&self, conn: &mut C) -> Result<(), sqlx::Error> {
        conn.create_fence_table(&self.table).await
    }

    /// Accepts `token` for `resource` if it is at least the highest token
    /// accepted for it, and records it; [`FenceError::Stale`] otherwise. Call
    /// it in the transaction that writes the protected data, before the
    /// write: the fence row stays locked until that transaction ends.
    pub async fn check<C: FencedConnection>(
        &self,
        conn: &mut C,
        resource: &str,
        token: FencingToken,
    ) -> Result<(), FenceError> {
        if resource.is_empty() || resource.len() > 255 {
            return Err(FenceError::InvalidResource {
                resource: resource.to_owned(),
                why: "must be 1 to 255 bytes (the fence table's key on MySQL)",
            });
        }
        if !conn.in_transaction() {
            return Err(FenceError::NotInTransaction {
                resource: resource.to_owned(),
            });
        }
        let Ok(value) = i64::try_from(token.get()) else {
            return Err(FenceError::TokenTooLarge {
                resource: resource.to_owned(),
                token,
            });
        };
        match conn.fence_check(&self.table, resource, value).await {
            Ok(None) => Ok(()),
            Ok(Some(highest)) => Err(FenceError::Stale {
                resource: resource.to_owned(),
                stale: StaleToken {
                    token,
                    highest: FencingToken::new(highest.max(0) as u64),
                },
            }),
            Err(source) => Err(FenceError::Store {
                resource: resource.to_owned(),
                source: Box::new(source),
            }),
        }
    }

    /// The highest token accepted for `resource`, if any.
    pub async fn highest<C: FencedConnection>(
        &self,
        conn: &mut C,
        resource: &str,
    ) -> Result<Option<FencingToken>, sqlx::Error> {
        Ok(conn
            .fence_highest(&self.table, resource)
            .await?
            .map(|t| FencingToken::new(t.max(0) as u64)))
    }
}

mod sealed {
    use async_trait::async_trait;

    /// The statements, out of reach outside the crate (they take the table
    /// name unchecked).
    #[async_trait]
    pub trait Sealed: Send {
        fn in_transaction(&self) -> bool;
        async fn create_fence_table(&mut self, table: &str) -> Result<(), sqlx::Error>;
        /// `None` if accepted, else the highest token accepted before.
        async fn fence_check(
            &mut self,
            table: &str,
            resource: &str,
            token: i64,
        ) -> Result<Option<i64>, sqlx::Error>;
        async fn fence_highest(
            &mut self,
            table: &str,
            resource: &str,
        ) -> Result<Option<i64>, sqlx::Error>;
    }
}

/// A connection [`SqlFence`] can check on: `PgConnection`, `MySqlConnection`,
/// `SqliteConnection`, and sqlx's `AnyConnection` on any of the three; pass
/// `&mut *tx` for a transaction `tx`. Sealed.
pub trait FencedConnection: sealed::Sealed {}

#[cfg(feature = "postgres")]
impl FencedConnection for sqlx::PgConnection {}
#[cfg(feature = "sqlite")]
impl FencedConnection for sqlx::SqliteConnection {}
#[cfg(feature = "mysql")]
impl FencedConnection for sqlx::MySqlConnection {}
impl FencedConnection for sqlx::AnyConnection {}

/// The fence's statements in one database's SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FenceSql {
    /// PostgreSQL and SQLite: an upsert whose `WHERE` refuses an older
    /// token, `$n` placeholders (SQLite reads them too).
    Upsert {
        /// The resource column's type.
        text: &'static str,
    },
    /// MySQL/MariaDB: the refusal reported through `LAST_INSERT_ID`.
    MySql,
}

impl FenceSql {
    const POSTGRES: FenceSql = FenceSql::Upsert { text: "TEXT" };
    const SQLITE: FenceSql = FenceSql::Upsert { text: "TEXT" };

    fn create(self, table: &str) -> String {
        match self {
            FenceSql::Upsert { text } => format!(
                "CREATE TABLE IF NOT EXISTS {table} (resource {text} PRIMARY KEY, token BIGINT NOT NULL)"
            ),
            FenceSql::MySql => format!(
                "CREATE TABLE IF NOT EXISTS {table} (resource VARBINARY(255) NOT NULL PRIMARY KEY, \
                 token BIGINT NOT NULL) ENGINE=InnoDB"
            ),
        }
    }

    /// Binds the resource, then the token. PostgreSQL and SQLite answer
    /// the row when accepted, nothing when refused. MySQL answers no row:
    /// its `LAST_INSERT_ID` is 0 when accepted, else the newer token (one
    /// statement; a refusal leaves the token as it is and reports it
    /// through LAST_INSERT_ID(expr), which the OK packet carries, 0 when
    /// accepted as the table has no AUTO_INCREMENT column; IF() evaluates
    /// only the branch it takes; tokens are at least 1, so a refusal never
    /// reports 0).
    fn check(self, table: &str) -> String {
        match self {
            FenceSql::Upsert { .. } => format!(
                "INSERT INTO {table} (resource, token) VALUES ($1, $2) \
                 ON CONFLICT (resource) DO UPDATE SET token = excluded.token \
                 WHERE {table}.token <= excluded.token RETURNING token"
            ),
            FenceSql::MySql => format!(
                "INSERT INTO {table} (resource, token) VALUES (?, ?) ON DUPLICATE KEY UPDATE \
                 token = IF(token <= VALUES(token), VALUES(token), LAST_INSERT_ID(token))"
            ),
        }
    }

    fn highest(self, table: &str) -> String {
        let at = match self {
            FenceSql::Upsert { .. } => "$1",
            FenceSql::MySql => "?",
        };
        format!("SELECT token FROM {table} WHERE resource = {at}")
    }

    /// Whether a failed `CREATE TABLE IF NOT EXISTS` means that another
    /// session created it at the same moment (PostgreSQL: the loser fails
    /// on the catalog's unique index).
    fn created_meanwhile(self, e: &sqlx::Error) -> bool {
        matches!(e, sqlx::Error::Database(e)
            if self != FenceSql::MySql && matches!(e.code().as_deref(), Some("23505" | "42P07")))
    }
}

/// The typed connections: each knows its SQL; `$check` turns the check's
/// query into the refusal (`None` when accepted). (Unused with no store's
/// feature on.)
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
macro_rules! typed_fence {
    ($conn:ty, $db:ty, $sql:expr, |$this:ident, $query:ident, $table:ident, $resource:ident| $check:expr) => {
        #[async_trait]
        impl sealed::Sealed for $conn {
            fn in_transaction(&self) -> bool {
                sqlx::Connection::is_in_transaction(self)
            }

            async fn create_fence_table(&mut self, table: &str) -> Result<(), sqlx::Error> {
                let sql: FenceSql = $sql;
                match sqlx::query(&sql.create(table)).execute(self).await {
                    Err(e) if sql.created_meanwhile(&e) => Ok(()),
                    r => r.map(drop),
                }
            }

            async fn fence_check(
                &mut self,
                $table: &str,
                $resource: &str,
                token: i64,
            ) -> Result<Option<i64>, sqlx::Error> {
                let sql: FenceSql = $sql;
                let text = sql.check($table);
                let $query = sqlx::query::<$db>(&text).bind($resource).bind(token);
                let $this = self;
                $check
            }

            async fn fence_highest(
                &mut self,
                table: &str,
                resource: &str,
            ) -> Result<Option<i64>, sqlx::Error> {
                let sql: FenceSql = $sql;
                let row: Option<(i64,)> = sqlx::query_as::<$db, (i64,)>(&sql.highest(table))
                    .bind(resource)
                    .fetch_optional(self)
                    .await?;
                Ok(row.map(|(t,)| t))
            }
        }
    };
}

/// MySQL's `LAST_INSERT_ID` after a check: `None` (0) when accepted, else
/// the newer token.
fn reported(last_insert_id: i64) -> Option<i64> {
    (last_insert_id != 0).then_some(last_insert_id)
}

/// PostgreSQL's and SQLite's check: the row back when accepted; else the
/// newer token (the upsert locked the row: read what won).
macro_rules! upsert_check {
    ($conn:ident, $query:ident, $table:ident, $resource:ident) => {{
        if $query.fetch_optional(&mut *$conn).await?.is_some() {
            return Ok(None);
        }
        Ok(Some(
            $conn.fence_highest($table, $resource).await?.unwrap_or(0),
        ))
    }};
}

#[cfg(feature = "postgres")]
typed_fence!(
    sqlx::PgConnection,
    sqlx::Postgres,
    FenceSql::POSTGRES,
    |conn, query, table, resource| upsert_check!(conn, query, table, resource)
);
#[cfg(feature = "sqlite")]
typed_fence!(
    sqlx::SqliteConnection,
    sqlx::Sqlite,
    FenceSql::SQLITE,
    |conn, query, table, resource| upsert_check!(conn, query, table, resource)
);
#[cfg(feature = "mysql")]
typed_fence!(
    sqlx::MySqlConnection,
    sqlx::MySql,
    FenceSql::MySql,
    |conn, query, _table, _resource| {
        let id = query.execute(&mut *conn).await?.last_insert_id();
        Ok(reported(i64::try_from(id).unwrap_or(i64::MAX)))
    }
);

/// The fence's SQL for the database behind an `AnyConnection`.
fn any_sql(conn: &sqlx::AnyConnection) -> Result<FenceSql, sqlx::Error> {
    match conn.backend_name() {
        "PostgreSQL" => Ok(FenceSql::POSTGRES),
        "SQLite" => Ok(FenceSql::SQLITE),
        "MySQL" => Ok(FenceSql::MySql),
        other => Err(sqlx::Error::Configuration(
            format!("SqlFence has no statements for {other}").into(),
        )),
    }
}

#[async_trait]
impl sealed::Sealed for sqlx::AnyConnection {
    fn in_transaction(&self) -> bool {
        sqlx::Connection::is_in_transaction(self)
    }

    async fn create_fence_table(&mut self, table: &str) -> Result<(), sqlx::Error> {
        let sql = any_sql(self)?;
        match sqlx::query(&sql.create(table)).execute(self).await {
            Err(e) if sql.created_meanwhile(&e) => Ok(()),
            r => r.map(drop),
        }
    }

    async fn fence_check(
        &mut self,
        table: &str,
        resource: &str,
        token: i64,
    ) -> Result<Option<i64>, sqlx::Error> {
        let sql = any_sql(self)?;
        let text = sql.check(table);
        let query = sqlx::query::<sqlx::Any>(&text).bind(resource).bind(token);
        if sql == FenceSql::MySql {
            let done = query.execute(&mut *self).await?;
            // (a missing LAST_INSERT_ID must not read as "accepted")
            let id = done.last_insert_id().ok_or_else(|| {
                sqlx::Error::Protocol(
                    "MySQL reported no LAST_INSERT_ID after the fence check".into(),
                )
            })?;
            return Ok(reported(id));
        }
        let conn = self;
        upsert_check!(conn, query, table, resource)
    }

    async fn fence_highest(
        &mut self,
        table: &str,
        resource: &str,
    ) -> Result<Option<i64>, sqlx::Error> {
        let sql = any_sql(self)?;
        let row: Option<(i64,)> = sqlx::query_as::<sqlx::Any, (i64,)>(&sql.highest(table))
            .bind(resource)
            .fetch_optional(self)
            .await?;
        Ok(row.map(|(t,)| t))
    }
}
