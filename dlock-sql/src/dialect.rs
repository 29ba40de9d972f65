//! The SQL text of every operation, per dialect.
//!
//! Statements are written once with numbered parameters `?1 ?2 ...` and the
//! markers `{t}` (table) and `{now}` (the database clock in milliseconds since
//! the Unix epoch, invariant S6); [`Sql::new`] turns them into each dialect's
//! spelling and records the bind order (MySQL only has positional `?`).

use sqlx::any::AnyArguments;
use sqlx::query::Query;
use sqlx::{Any, Arguments};

/// The three SQL families dlock speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

impl Dialect {
    pub(crate) fn scheme(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
            Dialect::Sqlite => "sqlite",
        }
    }

    /// The database clock in milliseconds since the epoch, constant within
    /// one statement in all three.
    fn now_ms(self) -> &'static str {
        match self {
            Dialect::Postgres => "CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)",
            Dialect::MySql => "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
            Dialect::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
        }
    }
}

/// A bind value.
#[derive(Debug, Clone)]
pub(crate) enum Arg<'a> {
    Text(&'a str),
    OptText(Option<&'a str>),
    Int(i64),
}

/// One statement in one dialect.
#[derive(Debug, Clone)]
pub(crate) struct Sql {
    text: String,
    /// For each placeholder in the text, which argument (0-based) it takes.
    order: Vec<usize>,
    /// Postgres and SQLite number their parameters: each argument is bound once.
    numbered: bool,
}

impl Sql {
    pub(crate) fn new(dialect: Dialect, table: &str, template: &str) -> Self {
        let template = template
            .replace("{t}", table)
            .replace("{now}", dialect.now_ms());
        let mut text = String::with_capacity(template.len());
        let mut order = Vec::new();
        let mut chars = template.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '?' && chars.peek().is_some_and(char::is_ascii_digit) {
                let mut n = 0usize;
                while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                    n = n * 10 + d as usize;
                    chars.next();
                }
                order.push(n - 1);
                match dialect {
                    Dialect::Postgres => text.push_str(&format!("${n}")),
                    Dialect::Sqlite => text.push_str(&format!("?{n}")),
                    Dialect::MySql => text.push('?'),
                }
            } else {
                text.push(c);
            }
        }
        Self {
            text,
            order,
            numbered: dialect != Dialect::MySql,
        }
    }

    /// The statement with `args` bound in the dialect's order.
    pub(crate) fn bind<'q>(&'q self, args: &[Arg<'q>]) -> Query<'q, Any, AnyArguments<'q>> {
        let mut bound = AnyArguments::default();
        let order: Vec<usize> = if self.numbered {
            (0..args.len()).collect()
        } else {
            self.order.clone()
        };
        for i in order {
            let ok = match &args[i] {
                Arg::Text(s) => bound.add(*s),
                Arg::OptText(s) => bound.add(*s),
                Arg::Int(n) => bound.add(*n),
            };
            debug_assert!(ok.is_ok());
        }
        sqlx::query_with(&self.text, bound)
    }

    #[cfg(test)]
    pub(crate) fn text(&self) -> &str {
        &self.text
    }
}

/// Every statement the adapter runs, prepared for one dialect and table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) dialect: Dialect,
    pub(crate) create: Vec<Sql>,
    /// Take if free or expired; returns the new token where the dialect has
    /// `RETURNING` (otherwise follow with `state`).
    pub(crate) take: Sql,
    /// owner, token, expires_at - now.
    pub(crate) state: Sql,
    pub(crate) release: Sql,
    /// Extends an attempt's own live hold (a retried take after a lost reply).
    pub(crate) extend: Sql,
    pub(crate) abandon: Sql,
    /// Extends all live holds of a session; returns (name, token) where the
    /// dialect has `RETURNING`.
    pub(crate) renew: Sql,
    /// (name, token) of a session's live holds (MySQL, after `renew`).
    pub(crate) held_by: Sql,
    pub(crate) close: Sql,
    pub(crate) inspect: Sql,
    pub(crate) list: Sql,
    pub(crate) validate: Sql,
    pub(crate) force: Sql,
    pub(crate) count_held: Sql,
}

impl Statements {
    pub(crate) fn new(dialect: Dialect, table: &str) -> Self {
        let sql = |template: &str| Sql::new(dialect, table, template);
        // Postgres wakes waiters in the same statement that frees a lock.
        let notify = match dialect {
            Dialect::Postgres => format!(" RETURNING pg_notify('dlock_{table}', name)"),
            _ => String::new(),
        };
        let free = "holder = NULL, owner = NULL, expires_at = 0";
        let create = match dialect {
            Dialect::Postgres => vec![
                sql(
                    "CREATE TABLE IF NOT EXISTS {t} (name TEXT COLLATE \"C\" PRIMARY KEY, \
                     holder TEXT, owner TEXT, token BIGINT NOT NULL, why TEXT, \
                     acquired_at BIGINT NOT NULL, expires_at BIGINT NOT NULL)",
                ),
                sql("CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)"),
            ],
            Dialect::MySql => vec![sql("CREATE TABLE IF NOT EXISTS {t} (\
                 name VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
                 holder VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL, \
                 owner VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL, \
                 token BIGINT NOT NULL, why VARCHAR(512) CHARACTER SET utf8mb4 NULL, \
                 acquired_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, \
                 KEY {t}_holder (holder)) ENGINE=InnoDB")],
            Dialect::Sqlite => vec![
                sql(
                    "CREATE TABLE IF NOT EXISTS {t} (name TEXT NOT NULL PRIMARY KEY, \
                     holder TEXT, owner TEXT, token INTEGER NOT NULL, why TEXT, \
                     acquired_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)",
                ),
                sql("CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)"),
            ],
        };
        let insert = "INSERT INTO {t} (name, holder, owner, token, why, acquired_at, expires_at) \
                      VALUES (?1, ?2, ?3, 1, ?4, {now}, {now} + ?5)";
        let take = match dialect {
            Dialect::MySql => sql(&format!(
                // Every condition reads the old expires_at, assigned last.
                "{insert} ON DUPLICATE KEY UPDATE \
                 token = IF(expires_at <= {{now}}, token + 1, token), \
                 holder = IF(expires_at <= {{now}}, VALUES(holder), holder), \
                 owner = IF(expires_at <= {{now}}, VALUES(owner), owner), \
                 why = IF(expires_at <= {{now}}, VALUES(why), why), \
                 acquired_at = IF(expires_at <= {{now}}, VALUES(acquired_at), acquired_at), \
                 expires_at = IF(expires_at <= {{now}}, VALUES(expires_at), expires_at)"
            )),
            _ => sql(&format!(
                "{insert} ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, \
                 owner = excluded.owner, token = {{t}}.token + 1, why = excluded.why, \
                 acquired_at = excluded.acquired_at, expires_at = excluded.expires_at \
                 WHERE {{t}}.expires_at <= {{now}} RETURNING token"
            )),
        };
        let returning_held = match dialect {
            Dialect::MySql => "",
            _ => " RETURNING name, token",
        };
        Self {
            dialect,
            create,
            take,
            state: sql("SELECT owner, token, expires_at - {now} FROM {t} WHERE name = ?1"),
            release: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND owner = ?2 AND token = ?3 \
                 AND holder = ?4 AND expires_at > {{now}}{notify}"
            )),
            extend: sql(
                "UPDATE {t} SET expires_at = {now} + ?3 WHERE name = ?1 AND owner = ?2 \
                 AND expires_at > {now}",
            ),
            abandon: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND owner = ?2 AND expires_at > {{now}}{notify}"
            )),
            renew: sql(&format!(
                "UPDATE {{t}} SET expires_at = {{now}} + ?2 WHERE holder = ?1 \
                 AND expires_at > {{now}}{returning_held}"
            )),
            held_by: sql("SELECT name, token FROM {t} WHERE holder = ?1 AND expires_at > {now}"),
            close: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE holder = ?1 AND expires_at > {{now}}{notify}"
            )),
            inspect: sql(
                "SELECT holder, token, why, acquired_at, expires_at, {now} FROM {t} \
                 WHERE name = ?1 AND expires_at > {now}",
            ),
            list: sql(
                "SELECT name, holder, token, why, acquired_at, expires_at, {now} FROM {t} \
                 WHERE name >= ?1 AND name < ?2 AND expires_at > {now} ORDER BY name",
            ),
            validate: sql(
                "SELECT COUNT(*) FROM {t} WHERE name = ?1 AND token = ?2 AND expires_at > {now}",
            ),
            force: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND expires_at > {{now}}{notify}"
            )),
            count_held: sql(
                "SELECT COUNT(*) FROM {t} WHERE name >= ?1 AND name < ?2 AND expires_at > {now}",
            ),
        }
    }

    pub(crate) fn has_returning(&self) -> bool {
        self.dialect != Dialect::MySql
    }
}

/// The exclusive upper bound of names starting with `prefix`: names use only
/// ASCII below `~`, so appending `~` bounds them (binary collation).
pub(crate) fn prefix_end(prefix: &str) -> String {
    format!("{prefix}~")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_per_dialect() {
        let t = "SELECT ?1, ?2, ?1";
        assert_eq!(
            Sql::new(Dialect::Postgres, "x", t).text(),
            "SELECT $1, $2, $1"
        );
        assert_eq!(
            Sql::new(Dialect::Sqlite, "x", t).text(),
            "SELECT ?1, ?2, ?1"
        );
        let my = Sql::new(Dialect::MySql, "x", t);
        assert_eq!(my.text(), "SELECT ?, ?, ?");
        assert_eq!(my.order, vec![0, 1, 0]);
    }

    #[test]
    fn table_and_clock_are_substituted() {
        let s = Statements::new(Dialect::Postgres, "locks");
        assert!(s.take.text().contains("INSERT INTO locks"));
        assert!(s.take.text().contains("EXTRACT(EPOCH FROM now())"));
        assert!(s.release.text().contains("pg_notify('dlock_locks', name)"));
        let m = Statements::new(Dialect::MySql, "locks");
        assert!(m.take.text().contains("ON DUPLICATE KEY UPDATE"));
        assert!(!m.release.text().contains("pg_notify"));
        assert!(!m.take.text().contains('{'), "{}", m.take.text());
    }

    #[test]
    fn mysql_take_assigns_expires_at_last() {
        let m = Statements::new(Dialect::MySql, "l");
        let text = m.take.text();
        let update = &text[text.find("UPDATE").unwrap()..];
        assert!(update.trim_end().starts_with("UPDATE token"));
        assert!(
            update.rfind("expires_at = IF").unwrap() > update.rfind("acquired_at = IF").unwrap()
        );
    }
}
