//! URL parsing: the dialect, dlock's own query options, a redacted display.

use std::fmt;

use dlock_core::Error;
use dlock_core::url::redact;

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
    url: String,
    pub(crate) table: String,
    pub(crate) pool: u32,
}

/// The default lock table.
pub const DEFAULT_TABLE: &str = "dlock_locks";

impl SqlOptions {
    /// Parses `postgres://`, `postgresql://`, `mysql://`, `mariadb://` or
    /// `sqlite://` URLs, taking out `dlock_table` and `dlock_pool`.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::invalid_url(url, reason);
        let (scheme, rest) = url
            .split_once(':')
            .ok_or_else(|| bad("expected postgres://, mysql:// or sqlite://"))?;
        let (dialect, canonical) = match scheme {
            "postgres" | "postgresql" => (Dialect::Postgres, "postgres"),
            "mysql" | "mariadb" => (Dialect::MySql, "mysql"),
            "sqlite" => (Dialect::Sqlite, "sqlite"),
            _ => return Err(bad("expected postgres://, mysql:// or sqlite://")),
        };
        check_compiled(dialect)?;
        let rest = rest
            .strip_prefix("//")
            .ok_or_else(|| bad("expected '//' after the scheme"))?;
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        if base.is_empty() {
            return Err(bad("no host or path"));
        }
        if dialect == Dialect::Sqlite && base.contains(":memory:") {
            return Err(bad(
                "an in-memory SQLite database is private to one connection; use memory:// for in-process locks",
            ));
        }
        let mut table = DEFAULT_TABLE.to_owned();
        let mut pool = 4;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "dlock_table" => table = v.to_owned(),
                "dlock_pool" => {
                    pool = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=256).contains(n))
                        .ok_or_else(|| bad("dlock_pool must be a number from 1 to 256"))?;
                }
                _ => kept.push(pair),
            }
        }
        check_table(&table).map_err(|reason| bad(&reason))?;
        if dialect == Dialect::Sqlite && !kept.iter().any(|p| p.starts_with("mode=")) {
            kept.push("mode=rwc");
        }
        let mut url = format!("{canonical}://{base}");
        if !kept.is_empty() {
            url.push('?');
            url.push_str(&kept.join("&"));
        }
        Ok(Self {
            dialect,
            url,
            table,
            pool,
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

    /// The URL handed to the driver (with the password; never log it).
    pub(crate) fn driver_url(&self) -> &str {
        &self.url
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

fn check_table(table: &str) -> Result<(), String> {
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
        let shown = redact(&self.url);
        let shown = shown
            .strip_suffix("?mode=rwc")
            .or_else(|| shown.strip_suffix("&mode=rwc"))
            .unwrap_or(&shown);
        f.write_str(shown)
    }
}

impl fmt::Debug for SqlOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlOptions")
            .field("url", &self.to_string())
            .field("table", &self.table)
            .field("pool", &self.pool)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_strips_dlock_options() {
        let o = SqlOptions::from_url("mysql://u:p@h:1/db?dlock_pool=9&charset=utf8mb4").unwrap();
        assert_eq!((o.pool, o.table.as_str()), (9, DEFAULT_TABLE));
        assert_eq!(o.driver_url(), "mysql://u:p@h:1/db?charset=utf8mb4");
        let o = SqlOptions::from_url("sqlite://dlock.db").unwrap();
        assert_eq!(o.driver_url(), "sqlite://dlock.db?mode=rwc");
        assert_eq!(o.to_string(), "sqlite://dlock.db");
    }

    #[test]
    fn refuses_bad_urls_without_leaking_passwords() {
        for url in [
            "postgres://u:hunter2@h/db?dlock_table=1bad",
            "postgres://u:hunter2@h/db?dlock_table=a;drop",
            "mysql://u:hunter2@h/db?dlock_pool=0",
            "redis://u:hunter2@h",
            "postgres:u:hunter2@h",
            "sqlite://",
            "sqlite://:memory:",
            "nonsense",
        ] {
            let e = SqlOptions::from_url(url).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
