//! The store primitives on SQL: sessions, attempts, error mapping.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Attempt, Busy, ExpiryModel, Hold, RawSession, Take};
use dlock_core::wake::{PollBackoff, Waiter};
use dlock_core::{Error, LockName, SessionId};
use sqlx::Row;
use tokio::time::{Instant, sleep_until};

use crate::dialect::{Arg, Dialect};
use crate::{Inner, token_of};

/// Maps a driver error to the meaning-based core error.
pub(crate) fn map_err(scheme: &'static str, e: sqlx::Error) -> Error {
    use sqlx::Error as E;
    match e {
        E::Io(_) | E::Tls(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
            Error::unavailable(scheme, e)
        }
        E::Configuration(_) => Error::Config(format!("{scheme}: {e}")),
        E::Database(ref d) => {
            let code = d.code().unwrap_or_default();
            let transient = matches!(
                code.as_ref(),
                // Postgres: serialization, deadlock, shutdown, connection.
                "40001" | "40P01" | "57P01" | "57P02" | "57P03" | "53300"
                // MySQL: deadlock, lock wait timeout, too many connections.
                | "1213" | "1205" | "1040"
                // SQLite: BUSY, LOCKED (and their extended codes).
                | "5" | "6" | "261" | "262" | "517"
            ) || code.starts_with("08");
            if transient {
                Error::unavailable(scheme, e)
            } else {
                Error::backend(scheme, e)
            }
        }
        other => Error::protocol(scheme, other.to_string()),
    }
}

pub(crate) struct SqlSession {
    inner: Arc<Inner>,
    id: SessionId,
    ttl: Duration,
}

impl SqlSession {
    pub(crate) fn new(inner: Arc<Inner>, id: SessionId, ttl: Duration) -> Self {
        Self { inner, id, ttl }
    }

    fn scheme(&self) -> &'static str {
        self.inner.sql.dialect.scheme()
    }

    fn ttl_ms(&self) -> i64 {
        self.ttl.as_millis() as i64
    }
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

    async fn attempt(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Attempt>, Error> {
        Ok(Box::new(SqlAttempt {
            waiter: self.inner.hub.subscribe(name.as_str()),
            inner: self.inner.clone(),
            session: self.id.clone(),
            name: name.clone(),
            owner: format!("{}#{:016x}", self.id, rand::random::<u64>()),
            why: why.map(str::to_owned),
            ttl_ms: self.ttl_ms(),
            sent: false,
            backoff: PollBackoff::default(),
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        let sql = &self.inner.sql;
        let pool = &self.inner.pool;
        let args = [Arg::Text(self.id.as_str()), Arg::Int(self.ttl_ms())];
        let rows = if sql.has_returning() {
            sql.renew.bind(&args).fetch_all(pool).await
        } else {
            match sql.renew.bind(&args).execute(pool).await {
                Ok(_) => sql.held_by.bind(&args[..1]).fetch_all(pool).await,
                Err(e) => Err(e),
            }
        }
        .map_err(|e| map_err(self.scheme(), e))?;
        let mut live = HashSet::new();
        for row in rows {
            let name: String = row.try_get(0).map_err(|e| map_err(self.scheme(), e))?;
            let token: i64 = row.try_get(1).map_err(|e| map_err(self.scheme(), e))?;
            live.insert((name, token));
        }
        Ok(holds
            .iter()
            .map(|h| live.contains(&(h.name.to_string(), h.token.get() as i64)))
            .collect())
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let done = self
            .inner
            .sql
            .release
            .bind(&[
                Arg::Text(hold.name.as_str()),
                Arg::Text(&hold.key),
                Arg::Int(hold.token.get() as i64),
                Arg::Text(self.id.as_str()),
            ])
            .execute(&self.inner.pool)
            .await
            .map_err(|e| map_err(self.scheme(), e))?;
        if done.rows_affected() == 0 {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        self.inner.hub.wake_all(hold.name.as_str());
        Ok(())
    }

    async fn close(&self, _holds: &[Hold]) -> Result<(), Error> {
        self.inner
            .sql
            .close
            .bind(&[Arg::Text(self.id.as_str())])
            .execute(&self.inner.pool)
            .await
            .map_err(|e| map_err(self.scheme(), e))?;
        Ok(())
    }
}

/// One try to take one lock. There is no queue in SQL: a busy attempt
/// polls (or, on PostgreSQL, waits for `NOTIFY`) and tries again.
struct SqlAttempt {
    inner: Arc<Inner>,
    session: SessionId,
    name: LockName,
    /// This attempt's identity in the `owner` column.
    owner: String,
    why: Option<String>,
    ttl_ms: i64,
    waiter: Waiter,
    /// Whether a take was sent (so a grant may exist that abandon must free).
    sent: bool,
    backoff: PollBackoff,
}

impl fmt::Debug for SqlAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlAttempt")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish()
    }
}

impl SqlAttempt {
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
}

#[async_trait]
impl Attempt for SqlAttempt {
    async fn try_take(&mut self) -> Result<Take, Error> {
        let sql = &self.inner.sql;
        let pool = &self.inner.pool;
        let scheme = self.scheme();
        self.sent = true;
        let args = [
            Arg::Text(self.name.as_str()),
            Arg::Text(self.session.as_str()),
            Arg::Text(&self.owner),
            Arg::OptText(self.why.as_deref()),
            Arg::Int(self.ttl_ms),
        ];
        if sql.has_returning() {
            let row = sql
                .take
                .bind(&args)
                .fetch_optional(pool)
                .await
                .map_err(|e| map_err(scheme, e))?;
            if let Some(row) = row {
                let token: i64 = row.try_get(0).map_err(|e| map_err(scheme, e))?;
                return self.granted(token);
            }
        } else {
            sql.take
                .bind(&args)
                .execute(pool)
                .await
                .map_err(|e| map_err(scheme, e))?;
        }
        // Not taken by this statement: held by someone, or already ours (a
        // take whose reply was lost, or MySQL, which cannot say which).
        let row = sql
            .state
            .bind(&[Arg::Text(self.name.as_str())])
            .fetch_optional(pool)
            .await
            .map_err(|e| map_err(scheme, e))?;
        let Some(row) = row else {
            return Ok(Take::Busy(Busy { retry_after: None }));
        };
        let owner: Option<String> = row.try_get(0).map_err(|e| map_err(scheme, e))?;
        let token: i64 = row.try_get(1).map_err(|e| map_err(scheme, e))?;
        let remaining: i64 = row.try_get(2).map_err(|e| map_err(scheme, e))?;
        if remaining > 0 && owner.as_deref() == Some(self.owner.as_str()) {
            // A retry after a lost reply: the core counts validity from this
            // retry, so the store's expiry must be extended to match.
            let extended = sql
                .extend
                .bind(&[
                    Arg::Text(self.name.as_str()),
                    Arg::Text(&self.owner),
                    Arg::Int(self.ttl_ms),
                ])
                .execute(pool)
                .await
                .map_err(|e| map_err(scheme, e))?;
            if extended.rows_affected() == 1 {
                return self.granted(token);
            }
            return Ok(Take::Busy(Busy { retry_after: None }));
        }
        Ok(Take::Busy(Busy {
            retry_after: Some(Duration::from_millis(remaining.max(0) as u64)),
        }))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let until = if self.inner.sql.dialect == Dialect::Postgres {
            until
        } else {
            self.backoff.next_wake(until)
        };
        tokio::select! {
            _ = self.waiter.notified() => {}
            _ = sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        if !self.sent {
            return Ok(());
        }
        let inner = &self.inner;
        let done = inner
            .sql
            .abandon
            .bind(&[Arg::Text(self.name.as_str()), Arg::Text(&self.owner)])
            .execute(&inner.pool)
            .await
            .map_err(|e| map_err(inner.sql.dialect.scheme(), e))?;
        if done.rows_affected() > 0 {
            inner.hub.wake_all(self.name.as_str());
        }
        Ok(())
    }
}
