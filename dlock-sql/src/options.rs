//! URL reading: the dialect, dlock's own query options, the driver's URL.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use dlock_core::url::StoreUrl;
use dlock_core::{Capabilities, Error};
use sqlx::any::AnyConnectOptions;

use crate::dialect::Dialect;

/// Where and how to keep locks in a SQL database.
///
/// ```
/// use dlock_sql::SqlOptions;
/// let o = SqlOptions::from_url("postgres://app:secret@db/x?dlock_table=locks&sslmode=disable")?;
/// assert_eq!(o.table(), "locks");
/// assert_eq!(o.to_string(), "postgres://app:***@db/x?sslmode=disable");
/// assert!(!format!("{o:?}").contains("secret"));
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Clone)]
pub struct SqlOptions {
    pub(crate) dialect: Dialect,
    /// The URL for sqlx: the canonical scheme, dlock's options taken out.
    url: StoreUrl,
    pub(crate) table: String,
    pub(crate) pool: u32,
    /// Connections that wait in the database's lock queue (and keep a
    /// contended hold's place), beyond `pool`; 0 turns the queue off.
    pub(crate) queue: u32,
}

/// How many waiters per backend queue in the database by default (see
/// [`SqlOptions::capabilities`]).
pub const DEFAULT_QUEUE: u32 = 16;

/// The default lock table.
pub const DEFAULT_TABLE: &str = "dlock_locks";

/// The prefix of dlock's own query options; sqlx has none that starts so.
const OWN_PREFIX: &str = "dlock_";

/// The URL options sqlx 0.8 reads for PostgreSQL and MySQL. Any other is
/// refused here: sqlx-postgres logs an unknown one *with its value* (a
/// secret such as `sslpassword` would land in the log, S9) and sqlx-mysql
/// ignores it silently (a misspelt `ssl-mode` would fall back to
/// unverified TLS). SQLite's parser refuses unknown options itself.
const POSTGRES_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];
const MYSQL_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "charset",
    "collation",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "socket",
    "timezone",
    "time-zone",
];

/// Whether the driver of `dialect` reads the URL option `key`.
fn driver_reads(dialect: Dialect, key: &str) -> bool {
    match dialect {
        Dialect::Postgres => POSTGRES_OPTIONS.contains(&key) || key.starts_with("options["),
        Dialect::MySql => MYSQL_OPTIONS.contains(&key),
        Dialect::Sqlite => !key.starts_with(OWN_PREFIX),
    }
}

impl SqlOptions {
    /// Reads `postgres://`, `postgresql://`, `mysql://`, `mariadb://` or
    /// `sqlite://` URLs, taking out `dlock_table` and `dlock_pool`.
    ///
    /// The other query options belong to sqlx (`sslmode`, `sslrootcert`,
    /// `ssl-mode`, `charset`, `statement-cache-capacity`, SQLite's `mode`
    /// and `cache`, ...) and are left in the URL handed to it. For
    /// PostgreSQL and MySQL only the options sqlx reads pass (see
    /// `POSTGRES_OPTIONS`): its parsers log or ignore the others. SQLite's
    /// refuses unknown options itself. An unknown `dlock_…` option is always
    /// refused: a misspelt `dlock_tabel` must not leave the locks in the
    /// default table.
    pub fn from_url<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url = url.try_into().map_err(explain_in_memory)?;
        let expected = || url.invalid("expected postgres://, mysql:// or sqlite://");
        let (dialect, canonical) = match url.scheme() {
            "postgres" | "postgresql" => (Dialect::Postgres, "postgres"),
            "mysql" | "mariadb" => (Dialect::MySql, "mysql"),
            "sqlite" => (Dialect::Sqlite, "sqlite"),
            _ => return Err(expected()),
        };
        check_compiled(dialect)?;
        // `vfs=memdb` gives each pooled connection a private database: two
        // sessions of one process could both hold a lock (S1).
        let in_memory = dialect == Dialect::Sqlite
            && (url.path().contains(":memory:")
                || url
                    .query_pairs()
                    .any(|(k, v)| (k == "mode" && v == "memory") || (k == "vfs" && v == "memdb")));
        if in_memory {
            return Err(url.invalid(IN_MEMORY));
        }
        if !url.has_authority() {
            return Err(url.invalid("expected '//' after the scheme"));
        }
        if url.hosts().is_empty() && url.path().is_empty() {
            return Err(url.invalid("no host or path"));
        }
        if url.fragment().is_some() {
            return Err(url.invalid("a #fragment means nothing to the database"));
        }
        let mut options = url.options();
        let table = options
            .string("dlock_table")?
            .unwrap_or_else(|| DEFAULT_TABLE.to_owned());
        check_table(&table).map_err(|reason| url.invalid(reason))?;
        let pool = options
            .parse::<u32>("dlock_pool", "a number from 1 to 256")?
            .unwrap_or(4);
        if !(1..=256).contains(&pool) {
            return Err(url.invalid(format!(
                "dlock_pool must be a number from 1 to 256, not {pool}"
            )));
        }
        let queue = options
            .parse::<u32>("dlock_queue", "a number from 0 to 1024")?
            .unwrap_or(DEFAULT_QUEUE);
        if queue > 1024 {
            return Err(url.invalid(format!(
                "dlock_queue must be a number from 0 to 1024, not {queue}"
            )));
        }
        let queue = if dialect == Dialect::Sqlite { 0 } else { queue };
        for key in options.unread() {
            if driver_reads(dialect, key) {
                options.pass(key);
            }
        }
        options.finish()?;
        let url = url
            .with_query_filtered(|key| !key.starts_with(OWN_PREFIX))?
            .with_scheme(canonical)?;
        Ok(Self {
            dialect,
            url,
            table,
            pool,
            queue,
        })
    }

    /// The lock table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Sets the lock table (validated).
    pub fn with_table(mut self, table: &str) -> Result<Self, Error> {
        check_table(table).map_err(Error::Config)?;
        self.table = table.to_owned();
        Ok(self)
    }

    /// What a backend opened with these options promises (the values the
    /// conformance suite holds it to):
    ///
    /// * tokens are rows of the lock table, committed before a grant is
    ///   answered, so they survive a restart of the database (S2);
    /// * PostgreSQL wakes waiters by `LISTEN`/`NOTIFY` (150 ms bound);
    ///   MySQL and SQLite poll with a backoff capped at 100 ms (300 ms
    ///   bound);
    /// * expiry is judged by the database clock in the take statement
    ///   itself: a crashed holder's lock is free within 1 s of its TTL;
    /// * a session is a set of rows, not a connection: it survives a
    ///   dropped connection re-established within its TTL.
    ///
    /// * PostgreSQL and MySQL waiters queue in the database's own lock
    ///   manager (`dlock_queue`, on by default): they are granted in
    ///   arrival order and one release wakes one of them, so both are
    ///   declared fair and herd-free. SQLite, or `dlock_queue=0`, has no
    ///   queue: whoever asks first after a release wins, and one release
    ///   may wake one waiter per process.
    /// * An attempt that ends while a take of it may still be on the wire
    ///   leaves a tombstone row in the table `<table>$ended` for two
    ///   minutes, or a TTL if longer: the take refuses to insert or update
    ///   anything while it lives.
    pub fn capabilities(&self) -> Capabilities {
        let listens = self.dialect == Dialect::Postgres;
        let mut caps = Capabilities::default();
        (caps.fair, caps.no_herd) = (self.queue > 0, self.queue > 0);
        // Held locks survive a restart: a committed row survives a restart.
        caps.restart_loses_locks = false;
        (caps.durable_tokens, caps.survives_reconnect) = (true, true);
        caps.notify_wakeup = listens;
        caps.wakeup_bound = Duration::from_millis(if listens { 150 } else { 300 });
        caps.recovery_bound = Duration::from_secs(1);
        // A doubtful attempt's end leaves a tombstone row that its late
        // take meets (`Statements::tombstone`).
        caps.refuses_late_takes = true;
        caps
    }

    /// The URL handed to the driver (with the password; never log it).
    pub(crate) fn driver_url(&self) -> &str {
        self.url.expose()
    }

    /// sqlx's options for [`driver_url`](Self::driver_url); a SQLite file
    /// is created if missing unless the URL gives its own `mode`.
    pub(crate) fn connect_options(&self) -> Result<AnyConnectOptions, sqlx::Error> {
        let mut options = AnyConnectOptions::from_str(self.driver_url())?;
        if self.dialect == Dialect::Sqlite && !self.url.query_pairs().any(|(k, _)| k == "mode") {
            options
                .database_url
                .query_pairs_mut()
                .append_pair("mode", "rwc");
        }
        Ok(options)
    }
}

const IN_MEMORY: &str =
    "an in-memory SQLite database is private to one connection; use memory:// for in-process locks";

/// `sqlite://:memory:` is no URL (`:memory:` is no host): say what it
/// would have been instead.
fn explain_in_memory(e: Error) -> Error {
    match e {
        Error::InvalidUrl { url, .. } if url.starts_with("sqlite:") && url.contains(":memory:") => {
            Error::InvalidUrl {
                url,
                reason: IN_MEMORY.to_owned(),
            }
        }
        // `sqlite://:memory:` reads as a malformed host, which StoreUrl does
        // not show (it could be a password missing its `@`).
        Error::InvalidUrl { url, reason } if url == "sqlite://***" => Error::InvalidUrl {
            url,
            reason: format!("{reason}; if this is :memory:, {IN_MEMORY}"),
        },
        e => e,
    }
}

fn check_compiled(dialect: Dialect) -> Result<(), Error> {
    let compiled = match dialect {
        Dialect::Postgres => cfg!(feature = "postgres"),
        Dialect::MySql => cfg!(feature = "mysql"),
        Dialect::Sqlite => cfg!(feature = "sqlite"),
    };
    if compiled {
        Ok(())
    } else {
        Err(Error::FeatureDisabled {
            scheme: dialect.scheme().to_owned(),
            feature: dialect.scheme(),
        })
    }
}

pub(crate) fn check_table(table: &str) -> Result<(), String> {
    let mut chars = table.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && table.len() <= 48;
    if ok {
        Ok(())
    } else {
        Err(format!(
            "table name {table:?} must match [A-Za-z_][A-Za-z0-9_]{{0,47}}"
        ))
    }
}

impl fmt::Display for SqlOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.url, f)
    }
}

impl fmt::Debug for SqlOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlOptions")
            .field("url", &self.url)
            .field("table", &self.table)
            .field("pool", &self.pool)
            .field("queue", &self.queue)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver(url: &str) -> String {
        let o = SqlOptions::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        o.connect_options().unwrap().database_url.to_string()
    }

    #[test]
    fn parses_and_strips_dlock_options() {
        let o = SqlOptions::from_url("mysql://u:p@h:1/db?dlock_pool=9&charset=utf8mb4").unwrap();
        assert_eq!((o.pool, o.table.as_str()), (9, DEFAULT_TABLE));
        assert_eq!(o.driver_url(), "mysql://u:p@h:1/db?charset=utf8mb4");
        let o = SqlOptions::from_url("sqlite://dlock.db").unwrap();
        assert_eq!(o.driver_url(), "sqlite://dlock.db");
        assert_eq!(o.to_string(), "sqlite://dlock.db");
        assert_eq!(driver("sqlite://dlock.db"), "sqlite://dlock.db?mode=rwc");
    }

    /// The drivers' options, and every SQLite file form, reach sqlx as
    /// written; the aliases get the canonical scheme.
    #[test]
    fn driver_urls_keep_the_drivers_options() {
        for (url, expected) in [
            (
                "postgresql://u:p%40ss@h:5432/db?sslmode=verify-full&dlock_table=t&sslrootcert=%2Fca.pem",
                "postgres://u:p%40ss@h:5432/db?sslmode=verify-full&sslrootcert=%2Fca.pem",
            ),
            (
                "mariadb://u:p@h/db?ssl-mode=required&statement-cache-capacity=10",
                "mysql://u:p@h/db?ssl-mode=required&statement-cache-capacity=10",
            ),
            ("postgres:///db?host=/run/pg", "postgres:///db?host=/run/pg"),
            ("sqlite:///abs/path.db", "sqlite:///abs/path.db?mode=rwc"),
            ("sqlite://./rel.db?mode=rwc", "sqlite://./rel.db?mode=rwc"),
            (
                "sqlite://data/x.db?mode=ro&dlock_pool=2",
                "sqlite://data/x.db?mode=ro",
            ),
        ] {
            assert_eq!(driver(url), expected, "{url}");
        }
        let o = SqlOptions::from_url("postgresql://u:p@h/db?sslmode=require").unwrap();
        assert_eq!(o.to_string(), "postgres://u:***@h/db?sslmode=require");
    }

    #[test]
    fn refuses_bad_urls_without_leaking_passwords() {
        for (url, says) in [
            ("postgres://u:hunter2@h/db?dlock_table=1bad", "table name"),
            ("postgres://u:hunter2@h/db?dlock_table=a;drop", "table name"),
            ("mysql://u:hunter2@h/db?dlock_pool=0", "dlock_pool"),
            ("mysql://u:hunter2@h/db?dlock_pool=many", "dlock_pool"),
            ("mysql://u:hunter2@h/db?dlock_tabel=x", "\"dlock_tabel\""),
            (
                "mysql://u:hunter2@h/db?dlock_table=a&dlock_table=b",
                "twice",
            ),
            ("mysql://u:hunter2@h/db#x", "fragment"),
            ("redis://u:hunter2@h", "expected postgres://"),
            ("postgres:u:hunter2@h", "'//'"),
            ("postgres://", "no host or path"),
            ("sqlite://", "no host or path"),
            ("sqlite:relative.db", "'//'"),
            ("sqlite::memory:", "in-memory"),
            ("sqlite:///:memory:", "in-memory"),
            ("sqlite://x.db?mode=memory", "in-memory"),
            ("sqlite://:memory:", "in-memory"),
            ("nonsense", ""),
        ] {
            dlock_conformance::unit::assert_refused(url, SqlOptions::from_url(url), says);
        }
    }

    /// From the review of the StoreUrl port: options sqlx-postgres would log
    /// with their value, or sqlx-mysql would silently ignore, and an SQLite
    /// VFS that gives each connection its own database.
    #[test]
    fn options_the_driver_would_log_or_ignore_are_refused() {
        for (url, says) in [
            (
                "postgres://u@h/db?sslpassword=s3cret",
                "unknown option \"sslpassword\"",
            ),
            (
                "mysql://u@h/db?ssl_mode=VERIFY_IDENTITY",
                "unknown option \"ssl_mode\"",
            ),
            (
                "mysql://u@h/db?sslmdoe=verify-full",
                "unknown option \"sslmdoe\"",
            ),
            ("sqlite:///tmp/x.db?vfs=memdb", "in-memory"),
        ] {
            let e = SqlOptions::from_url(url).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("s3cret"), "{url}: {e}");
        }
        SqlOptions::from_url("postgres://u@h/db?sslmode=verify-full&options[search_path]=x")
            .unwrap();
        SqlOptions::from_url("mysql://u@h/db?ssl-mode=VERIFY_IDENTITY&charset=utf8mb4").unwrap();
    }

    #[test]
    fn capabilities_follow_the_dialect() {
        let caps = |url: &str| SqlOptions::from_url(url).unwrap().capabilities();
        for url in [
            "postgres://u:p@h/db",
            "postgresql://h/db",
            "mysql://h/db",
            "mariadb://h/db",
            "sqlite://dlock.db",
            "sqlite:///abs/dlock.db",
        ] {
            let c = caps(url);
            let notify = url.starts_with("postgres");
            assert_eq!(c.notify_wakeup, notify, "{url}");
            let bound = if notify { 150 } else { 300 };
            assert_eq!(c.wakeup_bound, Duration::from_millis(bound), "{url}");
            assert!(c.durable_tokens && c.survives_reconnect, "{url}");
            // The database's lock queue: PostgreSQL and MySQL only.
            let queue = !url.starts_with("sqlite");
            assert_eq!((c.fair, c.no_herd), (queue, queue), "{url}");
            assert!(!c.restart_loses_locks, "{url}");
            assert_eq!(c.recovery_bound, Duration::from_secs(1), "{url}");
        }
        let off = caps("postgres://h/db?dlock_queue=0");
        assert!(!off.fair && !off.no_herd);
    }
}
