//! The floor of a SQL lock for `dlock bench` ([`dlock_core::floor`]): an
//! upsert of the lock's row and its `DELETE`, in the lock table, on one
//! connection of its own; and the database's own lock where it has one
//! (PostgreSQL's session-level advisory locks, MySQL/MariaDB's
//! `GET_LOCK`). SQLite has none.

use std::sync::Arc;

use async_trait::async_trait;
use dlock_core::floor::{FencedWrite, Floor, NativeGuard, NativeLock};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};
use sqlx::{AnyConnection, Connection, Row};
use tokio::sync::Mutex;

use crate::dialect::{Arg, Dialect, Sql, Statements};
use crate::options::SqlOptions;
use crate::{SqlFence, ready_connection, store};

/// The row and native-lock name of the floor of `key`: a space, which no
/// [`LockName`] contains, keeps the floor's rows apart from every real
/// lock's (a cycle on a held name must not bump its token or delete its row:
/// S1, S2), and its native locks apart from other applications' names.
fn floor_key(key: &LockName) -> String {
    format!("dlock floor {key}")
}

/// How long MySQL's `GET_LOCK` waits before it gives up, in seconds: longer
/// than any benchmark waits for one grant.
const GET_LOCK_WAIT_S: i64 = 3600;

/// The statements of a floor, in its database's dialect.
#[derive(Debug)]
struct FloorSql {
    dialect: Dialect,
    upsert: Sql,
    delete: Sql,
    /// Takes the native lock `?1`; answers 1 when granted.
    lock: Sql,
    /// Releases it; answers 1 when it was held.
    unlock: Sql,
    /// The fenced-write measure: its data table, an upsert of one of its
    /// rows, and the deletes of the row and its fence.
    create_data: Sql,
    write_data: Sql,
    delete_data: Sql,
    delete_fence: Sql,
}

/// The fenced-write measure's tables (in the lock table's schema).
const DATA_TABLE: &str = "dlock_floor_data";
const FENCE_TABLE: &str = "dlock_floor_fences";

impl FloorSql {
    fn new(dialect: Dialect, table: &str) -> Self {
        let sql = |template: &str| Sql::new(dialect, table, template);
        let insert = "INSERT INTO {t} (name, holder, owner, token, why, acquired_at, expires_at) \
                      VALUES (?1, NULL, NULL, 1, NULL, 0, 0)";
        let (upsert, lock, unlock) = match dialect {
            Dialect::MySql => (
                format!("{insert} ON DUPLICATE KEY UPDATE token = token + 1"),
                format!("SELECT GET_LOCK(?1, {GET_LOCK_WAIT_S})"),
                "SELECT RELEASE_LOCK(?1)".to_owned(),
            ),
            // Answers as integers: sqlx's Any driver has no `void`.
            Dialect::Postgres => (
                format!("{insert} ON CONFLICT (name) DO UPDATE SET token = {{t}}.token + 1"),
                "SELECT 1 FROM (SELECT pg_advisory_lock(hashtext(?1))) AS granted".to_owned(),
                "SELECT CAST(pg_advisory_unlock(hashtext(?1)) AS INTEGER)".to_owned(),
            ),
            Dialect::Sqlite => (
                format!("{insert} ON CONFLICT (name) DO UPDATE SET token = {{t}}.token + 1"),
                String::new(),
                String::new(),
            ),
        };
        let data = |template: &str| Sql::new(dialect, DATA_TABLE, template);
        let (key_type, write_data) = match dialect {
            Dialect::MySql => (
                "VARBINARY(255)",
                "INSERT INTO {t} (k, v) VALUES (?1, ?2) ON DUPLICATE KEY UPDATE v = VALUES(v)",
            ),
            _ => (
                "TEXT",
                "INSERT INTO {t} (k, v) VALUES (?1, ?2) ON CONFLICT (k) DO UPDATE SET v = excluded.v",
            ),
        };
        Self {
            dialect,
            upsert: sql(&upsert),
            delete: sql("DELETE FROM {t} WHERE name = ?1"),
            lock: sql(&lock),
            unlock: sql(&unlock),
            create_data: data(&format!(
                "CREATE TABLE IF NOT EXISTS {{t}} (k {key_type} NOT NULL PRIMARY KEY, v BIGINT NOT NULL)"
            )),
            write_data: data(write_data),
            delete_data: data("DELETE FROM {t} WHERE k = ?1"),
            delete_fence: Sql::new(dialect, FENCE_TABLE, "DELETE FROM {t} WHERE resource = ?1"),
        }
    }
}

/// [`Floor`] of the SQL URLs: one connection, outside any pool.
#[derive(Debug)]
pub struct SqlFloor {
    conn: Arc<Mutex<AnyConnection>>,
    sql: Arc<FloorSql>,
}

impl SqlFloor {
    /// Opens the floor of `url` (read as [`SqlBackend::connect`](crate::SqlBackend::connect)
    /// reads it) and creates the lock table if needed.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is left behind but an idempotently created table.
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        let options = SqlOptions::from_url(url)?;
        let statements = Statements::new(options.dialect, &options.table, false);
        let (conn, _) = ready_connection(&options, &statements).await?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            sql: Arc::new(FloorSql::new(options.dialect, &options.table)),
        })
    }
}

/// Runs `statement` with the one argument `key` on `conn`.
async fn execute(
    conn: &Mutex<AnyConnection>,
    sql: &FloorSql,
    statement: &Sql,
    key: &str,
) -> Result<(), Error> {
    statement
        .bind(&[Arg::Text(key)])
        .execute(&mut *conn.lock().await)
        .await
        .map(drop)
        .map_err(|e| store::map_err(sql.dialect.scheme(), e))
}

/// Runs the native lock's `statement` on `key`; `Ok` if it answers 1 (a
/// lock granted or released), else an error.
async fn native(
    conn: &Mutex<AnyConnection>,
    sql: &FloorSql,
    statement: &Sql,
    key: &str,
) -> Result<(), Error> {
    let scheme = sql.dialect.scheme();
    let row = statement
        .bind(&[Arg::Text(key)])
        .fetch_one(&mut *conn.lock().await)
        .await
        .map_err(|e| store::map_err(scheme, e))?;
    if row.try_get::<Option<i64>, _>(0).ok().flatten() == Some(1) {
        Ok(())
    } else {
        Err(Error::protocol(
            scheme,
            format!("the native lock {key:?} was not granted or not held"),
        ))
    }
}

#[async_trait]
impl Floor for SqlFloor {
    fn operations(&self) -> &'static str {
        match self.sql.dialect {
            Dialect::MySql => "INSERT … ON DUPLICATE KEY UPDATE + DELETE",
            _ => "INSERT … ON CONFLICT DO UPDATE + DELETE",
        }
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let key = floor_key(key);
        execute(&self.conn, &self.sql, &self.sql.upsert, &key).await?;
        execute(&self.conn, &self.sql, &self.sql.delete, &key).await
    }

    fn native(&self) -> Option<&dyn NativeLock> {
        (self.sql.dialect != Dialect::Sqlite).then_some(self as &dyn NativeLock)
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

/// The fenced-write measure's fence.
fn floor_fence() -> SqlFence {
    SqlFence::new(FENCE_TABLE).expect("a valid table name")
}

impl SqlFloor {
    /// One write of the measure's row `key` in a transaction of its own,
    /// after `SqlFence::check` with `token` if one is given.
    async fn write(&self, key: &str, token: Option<FencingToken>, value: u64) -> Result<(), Error> {
        let scheme = self.sql.dialect.scheme();
        let db = |e| store::map_err(scheme, e);
        let value = i64::try_from(value).unwrap_or(i64::MAX);
        let mut conn = self.conn.lock().await;
        let mut tx = conn.begin().await.map_err(db)?;
        if let Some(token) = token {
            floor_fence()
                .check(&mut *tx, key, token)
                .await
                .map_err(|e| Error::protocol(scheme, format!("floor: {e}")))?;
        }
        self.sql
            .write_data
            .bind(&[Arg::Text(key), Arg::Int(value)])
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        tx.commit().await.map_err(db)
    }
}

#[async_trait]
impl FencedWrite for SqlFloor {
    fn operations(&self) -> &'static str {
        "BEGIN + upsert + COMMIT, against the same with SqlFence::check first"
    }

    async fn prepare(&self, _key: &LockName) -> Result<(), Error> {
        let scheme = self.sql.dialect.scheme();
        let mut conn = self.conn.lock().await;
        floor_fence()
            .create_table(&mut *conn)
            .await
            .map_err(|e| store::map_err(scheme, e))?;
        self.sql
            .create_data
            .bind(&[])
            .execute(&mut *conn)
            .await
            .map(drop)
            .map_err(|e| store::map_err(scheme, e))
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        self.write(&floor_key(key), None, value).await
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        self.write(&floor_key(key), Some(token), value).await
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        let key = floor_key(key);
        execute(&self.conn, &self.sql, &self.sql.delete_data, &key).await?;
        execute(&self.conn, &self.sql, &self.sql.delete_fence, &key).await
    }
}

#[async_trait]
impl NativeLock for SqlFloor {
    fn name(&self) -> &'static str {
        match self.sql.dialect {
            Dialect::MySql => "GET_LOCK",
            _ => "pg_advisory_lock",
        }
    }

    async fn lock(&self, key: &LockName) -> Result<Box<dyn NativeGuard>, Error> {
        let key = floor_key(key);
        native(&self.conn, &self.sql, &self.sql.lock, &key).await?;
        Ok(Box::new(Held {
            conn: self.conn.clone(),
            sql: self.sql.clone(),
            key,
        }))
    }
}

/// A native lock held on a floor's connection.
struct Held {
    conn: Arc<Mutex<AnyConnection>>,
    sql: Arc<FloorSql>,
    key: String,
}

#[async_trait]
impl NativeGuard for Held {
    async fn release(self: Box<Self>) -> Result<(), Error> {
        native(&self.conn, &self.sql, &self.sql.unlock, &self.key).await
    }
}
