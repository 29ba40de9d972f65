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
            // UTC_TIMESTAMP, not NOW: NOW is in the session's time zone, and
            // one with daylight saving repeats an hour (the clock would step
            // back, then forward, freeing live holds; adversarial review).
            Dialect::MySql => {
                "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000 AS SIGNED)"
            }
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

    /// The statement with `args` bound in the dialect's order. A statement
    /// binds the arguments its placeholders name and ignores the rest, so
    /// one argument list serves every dialect's variant of a statement
    /// (PostgreSQL's take has queue parameters, SQLite's has none).
    pub(crate) fn bind<'q>(&'q self, args: &[Arg<'q>]) -> Query<'q, Any, AnyArguments<'q>> {
        let mut bound = AnyArguments::default();
        let order: Vec<usize> = if self.numbered {
            (0..self.order.iter().max().map_or(0, |n| n + 1)).collect()
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

/// MySQL's take answers a busy lock with a `LAST_INSERT_ID` at or above this
/// (2^62, above any token): `MYSQL_BUSY + MYSQL_OFFSET + remaining ms`.
pub(crate) const MYSQL_BUSY: i64 = 1 << 62;

/// Keeps the holder's remaining ms (negative for a row free or expired
/// since, down to the epoch) positive in MySQL's busy answer.
pub(crate) const MYSQL_OFFSET: i64 = 1 << 50;

/// How many holds one renewal statement carries at most: a session renews
/// up to this many holds in one statement per period (one round trip),
/// more in chunks. The holds travel as one JSON array of `[name, owner,
/// token]` (about 80 bytes each: well within MySQL's default 16 MiB
/// `max_allowed_packet`).
pub(crate) const RENEW_CHUNK: usize = 16_384;

/// Every statement the adapter runs, prepared for one dialect and table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) dialect: Dialect,
    pub(crate) create: Vec<Sql>,
    /// Takes the lock if free or expired, or extends it if this attempt holds
    /// it already (a retry after a lost reply, rule 4), in one statement.
    /// PostgreSQL: one row (token if taken, the holder's remaining ms as seen
    /// before). SQLite: `RETURNING token`, no row if busy. MySQL: the token
    /// comes back as the statement's `LAST_INSERT_ID`, 0 if busy.
    pub(crate) take: Sql,
    /// The holder's remaining ms (SQLite and MySQL after a busy take).
    pub(crate) state: Sql,
    /// Leaves the tombstone of attempt `?1` (its owner), which ends while
    /// a take of it may still be on the wire, for `?2` ms: the take refuses
    /// to insert or update anything while it lives. A row of the table
    /// `<table>$ended`, not of the lock table: under REPEATABLE READ,
    /// MySQL's `INSERT … SELECT` puts a shared next-key lock where the
    /// check looks, which in the lock table's own index made the first
    /// insert of a new lock name in that gap wait for every take running.
    pub(crate) tombstone: Sql,
    /// Deletes the tombstones that have run out.
    pub(crate) sweep: Sql,
    pub(crate) release: Sql,
    pub(crate) abandon: Sql,
    /// Extends the listed live holds of a session (`?3`, see
    /// [`RENEW_CHUNK`]); returns (name, token) where the dialect has
    /// `RETURNING`.
    pub(crate) renew: Sql,
    /// (name, token) of the listed holds that are live (MySQL, when its
    /// renewal matched fewer rows than it listed).
    pub(crate) held: Option<Sql>,
    /// Frees a session's holds.
    pub(crate) close: Close,
    /// The wait queue's statements (PostgreSQL, MySQL).
    pub(crate) queue: Option<QueueSql>,
    pub(crate) inspect: Sql,
    pub(crate) list: Sql,
    pub(crate) validate: Sql,
    pub(crate) force: Sql,
    pub(crate) count_held: Sql,
    /// The held locks among the names listed in `?1`, a JSON array
    /// (SQLite: what a write to the database's files freed, see
    /// `file_wake`).
    #[cfg(feature = "sqlite")]
    pub(crate) held_among: Option<Sql>,
}

impl Statements {
    /// `queue`: whether takes consult the wait queue (`dlock_queue` > 0, and
    /// on MySQL a binary log that is not statement-based).
    pub(crate) fn new(dialect: Dialect, table: &str, queue: bool) -> Self {
        let sql = |template: &str| Sql::new(dialect, table, template);
        // Postgres wakes waiters in the same statement that frees a lock.
        let notify = match dialect {
            Dialect::Postgres => format!(" RETURNING pg_notify('dlock_{table}', name)"),
            _ => String::new(),
        };
        // A freed row keeps the owner (attempt) that last had it, with no
        // holder: that attempt's own take, should one still arrive late (a
        // take whose request timed out, retried on another connection and
        // released since), is refused instead of granting a hold no one
        // tracks (S5).
        // Its `expires_at` says when it was freed: the queue's grace period
        // counts from then.
        let free = "holder = NULL, expires_at = {now}";
        let create = match dialect {
            // No index but the primary key, and room left on each page:
            // every take, release and renewal changes only `holder`,
            // `owner`, `token`, `why` or the times, nothing indexed, so the
            // update can be HOT (heap-only: no new index entries, less WAL)
            // when its page has room. With an index on `holder` none was
            // (`pg_stat_user_tables` after a bench run: 1 HOT update in
            // 309,722). Renewal and close find the listed holds by primary
            // key (see `renew`). A table made by an earlier version keeps
            // its index (no DDL at connect: crate docs).
            Dialect::Postgres => vec![
                sql(
                    "CREATE TABLE IF NOT EXISTS {t} (name TEXT COLLATE \"C\" PRIMARY KEY, \
                     holder TEXT, owner TEXT, token BIGINT NOT NULL, why TEXT, \
                     acquired_at BIGINT NOT NULL, expires_at BIGINT NOT NULL) \
                     WITH (fillfactor = 70)",
                ),
                sql(
                    "CREATE TABLE IF NOT EXISTS {t}$ended (owner TEXT COLLATE \"C\" PRIMARY KEY, \
                     expires_at BIGINT NOT NULL)",
                ),
            ],
            Dialect::MySql => vec![
                sql("CREATE TABLE IF NOT EXISTS {t} (\
                     name VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
                     holder VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL, \
                     owner VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NULL, \
                     token BIGINT NOT NULL, why VARCHAR(512) CHARACTER SET utf8mb4 NULL, \
                     acquired_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, \
                     KEY {t}_holder (holder)) ENGINE=InnoDB"),
                sql("CREATE TABLE IF NOT EXISTS {t}$ended (\
                     owner VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
                     expires_at BIGINT NOT NULL) ENGINE=InnoDB"),
            ],
            Dialect::Sqlite => vec![
                sql(
                    "CREATE TABLE IF NOT EXISTS {t} (name TEXT NOT NULL PRIMARY KEY, \
                     holder TEXT, owner TEXT, token INTEGER NOT NULL, why TEXT, \
                     acquired_at INTEGER NOT NULL, expires_at INTEGER NOT NULL)",
                ),
                sql("CREATE INDEX IF NOT EXISTS {t}_holder ON {t} (holder)"),
                sql(
                    "CREATE TABLE IF NOT EXISTS {t}$ended (owner TEXT NOT NULL PRIMARY KEY, \
                     expires_at INTEGER NOT NULL) WITHOUT ROWID",
                ),
            ],
        };
        let columns = "INSERT INTO {t} (name, holder, owner, token, why, acquired_at, expires_at)";
        // No row to insert or update while the attempt's (`?3`) tombstone
        // lives: the attempt ended, and this is a late copy of its take
        // (see `tombstone`).
        let unended = "NOT EXISTS (SELECT 1 FROM {t}$ended AS ended \
             WHERE ended.owner = ?3 AND ended.expires_at > {now})";
        let values = format!("SELECT ?1, ?2, ?3, 1, ?4, {{now}}, {{now}} + ?5 WHERE {unended}");
        // Taken when free or expired (a new grant: token + 1, S2) unless
        // this very attempt released or abandoned it (a late copy of its
        // take), or when this attempt holds it already (same token, expiry
        // extended: rule 4).
        // A row is held while it has a holder and has not expired; a freed
        // row (no holder) is free whatever its `expires_at` says (a database
        // clock stepped back must not hold a released lock).
        let fresh = "({t}.holder IS NULL OR {t}.expires_at <= {now}) \
             AND ({t}.holder IS NOT NULL OR {t}.owner IS NULL \
             OR {t}.owner <> excluded.owner)";
        // PostgreSQL and MySQL: a fresh grant also needs the wait queue's
        // consent (see `queue`): no one waits in it, or this take comes from
        // its head, or the row has been free for the grace period ?7 (the
        // head is stuck: it may be paused, or gone without its connection
        // noticing).
        let upsert = |queue: &str| {
            format!(
                "ON CONFLICT (name) DO UPDATE SET \
                 token = CASE WHEN {fresh} THEN {{t}}.token + 1 ELSE {{t}}.token END, \
                 acquired_at = CASE WHEN {fresh} THEN excluded.acquired_at \
                 ELSE {{t}}.acquired_at END, \
                 holder = excluded.holder, owner = excluded.owner, why = excluded.why, \
                 expires_at = excluded.expires_at \
                 WHERE (({fresh}){queue}) \
                 OR ({{t}}.holder IS NOT NULL AND {{t}}.expires_at > {{now}} \
                 AND {{t}}.owner = excluded.owner) \
                 RETURNING token"
            )
        };
        let take = match dialect {
            // One round trip whatever happens: the CTE's snapshot shows the
            // holder as it was before the take. The transaction-scoped
            // advisory lock is free unless a waiter holds it (as a session
            // lock) at the head of the queue; the head's own session lock
            // lets its take through.
            Dialect::Postgres => sql(&format!(
                "WITH prior AS (SELECT CASE WHEN holder IS NULL THEN LEAST(expires_at - {{now}}, 0) \
                 ELSE expires_at - {{now}} END AS remaining FROM {{t}} WHERE name = ?1), \
                 taken AS ({columns} {values} {}) \
                 SELECT (SELECT token FROM taken), (SELECT remaining FROM prior)",
                upsert(if queue {
                    " AND (pg_try_advisory_xact_lock(?6) OR {t}.expires_at <= {now} - ?7)"
                } else {
                    ""
                })
            )),
            Dialect::Sqlite => sql(&format!("{columns} {values} {}", upsert(""))),
            // MySQL has no RETURNING: the answer comes back as the
            // statement's LAST_INSERT_ID (the OK packet carries the last
            // LAST_INSERT_ID(expr) the statement evaluated): VALUES sets 1 (a
            // new row), the update's first assignment then the token if
            // granted, or BUSY + 2^50 + the holder's remaining ms if not (one
            // round trip either way). Only that first assignment reads the
            // queue (its lock can change hands while the statement runs);
            // the others ask LAST_INSERT_ID() what it decided. `fresh`
            // reads expires_at, holder and owner, assigned after it.
            Dialect::MySql => {
                let fresh = "(holder IS NULL OR expires_at <= {now}) \
                             AND (holder IS NOT NULL OR owner IS NULL \
                             OR owner <> VALUES(owner))";
                let mine = "holder IS NOT NULL AND expires_at > {now} AND owner = VALUES(owner)";
                let queue = if queue {
                    "(IS_FREE_LOCK(?6) = 1 OR IS_USED_LOCK(?6) = CONNECTION_ID() \
                     OR expires_at <= {now} - ?7)"
                } else {
                    "TRUE"
                };
                let granted = format!("LAST_INSERT_ID() < {MYSQL_BUSY}");
                sql(&format!(
                    "{columns} SELECT ?1, ?2, ?3, LAST_INSERT_ID(1), ?4, {{now}}, {{now}} + ?5 \
                     FROM DUAL WHERE {unended} \
                     ON DUPLICATE KEY UPDATE \
                     token = IF(({fresh}) AND {queue}, LAST_INSERT_ID(token + 1), \
                     IF({mine}, LAST_INSERT_ID(token), \
                     LEAST(token, LAST_INSERT_ID({MYSQL_BUSY} + {MYSQL_OFFSET} + \
                     IF(holder IS NULL, LEAST(expires_at - {{now}}, 0), expires_at - {{now}}))))), \
                     acquired_at = IF(({fresh}) AND {granted}, VALUES(acquired_at), acquired_at), \
                     why = IF({granted}, VALUES(why), why), \
                     holder = IF({granted}, VALUES(holder), holder), \
                     owner = IF({granted}, VALUES(owner), owner), \
                     expires_at = IF({granted}, VALUES(expires_at), expires_at)"
                ))
            }
        };
        // The listed holds `?3` (a JSON array of [name, owner, token]) joined
        // to their rows by primary key.
        let (renew, held) = match dialect {
            Dialect::Postgres => (
                sql(&format!(
                    "{} UPDATE {{t}} SET expires_at = {{now}} + ?2 FROM h WHERE {} \
                     RETURNING {{t}}.name, {{t}}.token",
                    pg_listed("?3"),
                    pg_listed_rows("?1"),
                )),
                None,
            ),
            Dialect::Sqlite => (
                sql("UPDATE {t} SET expires_at = {now} + ?2 WHERE holder = ?1 \
                     AND expires_at > {now} AND (name, owner, token) IN \
                     (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), \
                     json_extract(value, '$[2]') FROM json_each(?3)) \
                     RETURNING name, token"),
                None,
            ),
            // No RETURNING: the rows matched (sqlx asks for found rows) are
            // compared with the holds listed, and only if some are missing
            // does a second statement say which are live.
            Dialect::MySql => {
                let listed = "JSON_TABLE(?3, '$[*]' COLUMNS (\
                     name VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[0]', \
                     owner VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin PATH '$[1]', \
                     token BIGINT PATH '$[2]')) AS h STRAIGHT_JOIN {t} \
                     ON {t}.name = h.name AND {t}.owner = h.owner AND {t}.token = h.token";
                (
                    sql(&format!(
                        "UPDATE {listed} SET {{t}}.expires_at = {{now}} + ?2 \
                         WHERE {{t}}.holder = ?1 AND {{t}}.expires_at > {{now}}"
                    )),
                    Some(sql(&format!(
                        "SELECT {{t}}.name, {{t}}.token FROM {listed} \
                         WHERE {{t}}.holder = ?1 AND {{t}}.expires_at > {{now}}"
                    ))),
                )
            }
        };
        Self {
            dialect,
            create,
            take,
            state: sql("SELECT expires_at - {now} FROM {t} WHERE name = ?1"),
            tombstone: sql(&format!(
                "INSERT INTO {{t}}$ended (owner, expires_at) VALUES (?1, {{now}} + ?2) {}",
                match dialect {
                    Dialect::MySql => "ON DUPLICATE KEY UPDATE expires_at = VALUES(expires_at)",
                    _ => "ON CONFLICT (owner) DO UPDATE SET expires_at = excluded.expires_at",
                }
            )),
            sweep: sql("DELETE FROM {t}$ended WHERE expires_at <= {now}"),
            release: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND owner = ?2 AND token = ?3 \
                 AND holder = ?4 AND expires_at > {{now}}{}",
                match dialect {
                    // With the wait queue on (?6 = 1), only a waiter at its
                    // head waits for a notification (the others wait in the
                    // lock manager): it is sent only if one holds the queue
                    // lock (a NOTIFY costs every listening connection a
                    // wake-up, and the commit a global lock).
                    Dialect::Postgres => format!(
                        " RETURNING (SELECT COUNT(*) FROM (SELECT pg_notify('dlock_{table}', ?1) \
                         WHERE CAST(?6 AS BIGINT) = 0 OR NOT pg_try_advisory_xact_lock(?5)) AS heard)"
                    ),
                    _ => String::new(),
                }
            )),
            abandon: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND owner = ?2 AND holder IS NOT NULL \
                 AND expires_at > {{now}}{notify}"
            )),
            renew,
            held,
            close: match dialect {
                Dialect::Postgres => Close::Listed(sql(&format!(
                    "{} UPDATE {{t}} SET {free} FROM h WHERE {}{notify}",
                    pg_listed("?2"),
                    pg_listed_rows("?1"),
                ))),
                _ => Close::Session(sql(&format!(
                    "UPDATE {{t}} SET {free} WHERE holder = ?1 AND expires_at > {{now}}{notify}"
                ))),
            },
            queue: queue.then(|| QueueSql::new(dialect, table, free)).flatten(),
            inspect: sql(
                "SELECT holder, token, why, acquired_at, expires_at, {now} FROM {t} \
                 WHERE name = ?1 AND holder IS NOT NULL AND expires_at > {now}",
            ),
            list: sql(
                "SELECT name, holder, token, why, acquired_at, expires_at, {now} FROM {t} \
                 WHERE name >= ?1 AND name < ?2 AND holder IS NOT NULL AND expires_at > {now} \
                 ORDER BY name",
            ),
            validate: sql(
                "SELECT COUNT(*) FROM {t} WHERE name = ?1 AND token = ?2 AND holder IS NOT NULL \
                 AND expires_at > {now}",
            ),
            force: sql(&format!(
                "UPDATE {{t}} SET {free} WHERE name = ?1 AND holder IS NOT NULL \
                 AND expires_at > {{now}}{notify}"
            )),
            count_held: sql(
                "SELECT COUNT(*) FROM {t} WHERE name >= ?1 AND name < ?2 AND holder IS NOT NULL \
                 AND expires_at > {now}",
            ),
            #[cfg(feature = "sqlite")]
            held_among: (dialect == Dialect::Sqlite).then(|| {
                sql(
                    "SELECT name FROM {t} WHERE name IN (SELECT value FROM json_each(?1)) \
                     AND holder IS NOT NULL AND expires_at > {now}",
                )
            }),
        }
    }

    /// The statements of a lock's life (take, release, clean-up, renewal of
    /// one or two holds), to prepare on every new connection: with them
    /// prepared, each operation is one round trip, and a request that
    /// reaches the server takes effect even if its reply is lost (sqlx
    /// prepares a statement on first use and sends it only after the
    /// prepare's reply).
    pub(crate) fn hot(&self) -> Vec<String> {
        let mut hot = vec![&self.take, &self.state, &self.release, &self.abandon];
        hot.push(&self.renew);
        hot.extend(&self.held);
        if let Some(q) = &self.queue {
            hot.extend([&q.lock, &q.unlock, q.release.sql()]);
        }
        hot.into_iter().map(|s| s.text.clone()).collect()
    }
}

/// How a session's close frees its holds (session id `?1`).
#[derive(Debug)]
pub(crate) enum Close {
    /// Every row the session holds (MySQL, SQLite: by their index on
    /// `holder`).
    Session(Sql),
    /// The listed holds `?2` (as `renew`'s `?3`), by primary key
    /// (PostgreSQL: its table has no `holder` index, see `create`).
    Listed(Sql),
}

/// PostgreSQL: the listed holds `list` (a JSON array of `[name, owner,
/// token]`) as one row `h`: `names`, an array for the primary key, and `m`,
/// each token by name and owner (a name may be listed twice: a hold
/// force-released and taken again by another handle of the session before
/// the next renewal; keyed by name alone, the stale entry could hide the
/// live one). A space joins the two: no name has one.
///
/// Why not a join of the rows to `json_array_elements(list)`, as before: the
/// planner estimates that function at 100 rows and a session's rows
/// (`holder = ?1`) at one, and on a table with stale statistics it scanned
/// the table and rescanned the list for each of the session's rows: a round
/// of 10,000 holds took 58 s (`EXPLAIN ANALYZE`), and CI lost every hold of
/// `ten_thousand_names`. Driven by `name = ANY(h.names)`, the planner finds
/// the rows by primary key at every table size and statistics tried, with
/// the default costs; it still may scan a small table (a few hundred rows,
/// where that costs a few ms) or a large one whose `random_page_cost` is set
/// far above the default (100: 9 s for 10,000 holds).
fn pg_listed(list: &str) -> String {
    format!(
        "WITH h AS (SELECT jsonb_object_agg((e->>0) || ' ' || (e->>1), e->2) AS m, \
         array_agg(e->>0) AS names \
         FROM jsonb_array_elements(CAST(CAST({list} AS TEXT) AS JSONB)) AS e)"
    )
}

/// PostgreSQL: the rows of [`pg_listed`]'s holds that `holder` holds live,
/// with the owner and token listed (S3). The holder is compared with `IS
/// NOT DISTINCT FROM` (the same for a non-null session id) so that a table
/// made by an earlier version, with an index on `holder`, is not walked by
/// that index with the list searched for each row (6 s for 10,000 holds).
fn pg_listed_rows(holder: &str) -> String {
    format!(
        "{{t}}.name = ANY(h.names) \
         AND {{t}}.token = CAST(h.m->>({{t}}.name || ' ' || {{t}}.owner) AS BIGINT) \
         AND {{t}}.holder IS NOT DISTINCT FROM {holder} AND {{t}}.expires_at > {{now}}"
    )
}

/// The statements of the wait queue in front of the lock rows (see
/// `crate::queue`): a lock of the database's own lock manager per lock name,
/// `?1` (PostgreSQL: a `bigint` session-level advisory lock; MySQL: a
/// `GET_LOCK` name).
#[derive(Debug)]
pub(crate) struct QueueSql {
    /// Waits in the lock manager's queue until the lock is this
    /// connection's; answers 1.
    pub(crate) lock: Sql,
    /// Lets the lock go.
    pub(crate) unlock: Sql,
    /// This connection's id on the server (to cancel its wait), and on
    /// PostgreSQL its TCP keepalives.
    pub(crate) pid: Sql,
    /// A lane's release (arguments as `release`) with the unlock of `?5`
    /// in the same statement.
    pub(crate) release: LaneRelease,
}

/// How a lane's release lets its queue lock go in the same statement, so
/// that the next waiter's turn starts the moment the row is freed (its
/// take, a locking write, then waits for this commit).
#[derive(Debug)]
pub(crate) enum LaneRelease {
    /// PostgreSQL: unlocks whatever it frees, answering one row with how
    /// many it freed.
    Counted(Sql),
    /// MySQL: `RELEASE_LOCK` inside the `SET` of the release's `UPDATE`,
    /// which runs only for the row it matches (the hold). Its affected
    /// rows (sqlx asks for found rows) are the rows freed; where none
    /// matched, nothing was unlocked, and the lane unlocks on its own.
    Matched(Sql),
}

impl LaneRelease {
    fn sql(&self) -> &Sql {
        match self {
            Self::Counted(sql) | Self::Matched(sql) => sql,
        }
    }
}

impl QueueSql {
    fn new(dialect: Dialect, table: &str, free: &str) -> Option<Self> {
        let sql = |template: &str| Sql::new(dialect, table, template);
        match dialect {
            Dialect::Postgres => Some(Self {
                lock: sql("SELECT COUNT(*) FROM (SELECT pg_advisory_lock(?1)) AS queued"),
                // Only if held: a lane whose wait was cut off may or may
                // not have the lock, and `pg_advisory_unlock` of a lock not
                // held sends a WARNING that sqlx logs as one. A `bigint`
                // key shows in `pg_locks` as its high and low 32 bits.
                unlock: sql(
                    "SELECT COALESCE(bool_or(pg_advisory_unlock(?1)), FALSE) FROM pg_locks \
                     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted \
                     AND objsubid = 1 \
                     AND classid = CAST((CAST(?1 AS BIGINT) >> 32) & 4294967295 AS OID) \
                     AND objid = CAST(CAST(?1 AS BIGINT) & 4294967295 AS OID)",
                ),
                // A lane may keep the queue lock while idle (a held lock):
                // if its client vanishes without a word (a partition), the
                // server notices within ~25 s instead of the system's
                // two hours, and the lock goes to the next waiter.
                pid: sql("SELECT CAST(pg_backend_pid() AS BIGINT), \
                     set_config('tcp_keepalives_idle', '10', false), \
                     set_config('tcp_keepalives_interval', '5', false), \
                     set_config('tcp_keepalives_count', '3', false)"),
                // The unlock hands the queue lock to the next waiter at once
                // (its take then waits for this commit); only if none took it
                // does a notification go to waiters outside the queue.
                release: LaneRelease::Counted(sql(&format!(
                    "WITH freed AS (UPDATE {{t}} SET {free} WHERE name = ?1 AND owner = ?2 \
                     AND token = ?3 AND holder = ?4 AND expires_at > {{now}} RETURNING name) \
                     SELECT (SELECT COUNT(*) FROM freed), pg_advisory_unlock(?5), \
                     (SELECT COUNT(*) FROM (SELECT pg_notify('dlock_{table}', ?1) \
                     WHERE pg_try_advisory_xact_lock(?5)) AS outside)"
                ))),
            }),
            // A year: GET_LOCK has no "forever" in every MariaDB version.
            Dialect::MySql => Some(Self {
                lock: sql("SELECT GET_LOCK(?1, 31536000)"),
                unlock: sql("SELECT RELEASE_LOCK(?1)"),
                pid: sql("SELECT CAST(CONNECTION_ID() AS SIGNED)"),
                // `free`, with the unlock: its answer (1, or 0 or NULL for
                // a lock not this connection's) adds nothing to
                // `expires_at`, but the server cannot know that without
                // calling it, once per matched row (after any row-lock
                // wait; a statement that fails after it leaves the row
                // held, and the next head finds it busy: a delay, not a
                // grant). The functions of the lock manager are unsafe for
                // statement-based replication, like the take's: the queue
                // is off there.
                release: LaneRelease::Matched(sql("UPDATE {t} SET holder = NULL, \
                     expires_at = {now} + 0 * COALESCE(RELEASE_LOCK(?5), 0) \
                     WHERE name = ?1 AND owner = ?2 AND token = ?3 AND holder = ?4 \
                     AND expires_at > {now}")),
            }),
            Dialect::Sqlite => None,
        }
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
        let s = Statements::new(Dialect::Postgres, "locks", true);
        assert!(s.take.text().contains("INSERT INTO locks"));
        assert!(s.take.text().contains("EXTRACT(EPOCH FROM now())"));
        assert!(s.release.text().contains("pg_notify('dlock_locks', $1)"));
        assert!(s.abandon.text().contains("pg_notify('dlock_locks', name)"));
        let m = Statements::new(Dialect::MySql, "locks", true);
        assert!(m.take.text().contains("ON DUPLICATE KEY UPDATE"));
        assert!(!m.release.text().contains("pg_notify"));
        assert!(!m.take.text().contains('{'), "{}", m.take.text());
    }

    /// The lane's release frees the row as the plain release does (its
    /// `SET` starts with it, its `WHERE` is the same) and unlocks the
    /// queue key (`?5`) once.
    #[test]
    fn mysql_lane_release_is_the_release_with_the_unlock() {
        let m = Statements::new(Dialect::MySql, "l", true);
        let LaneRelease::Matched(both) = &m.queue.as_ref().unwrap().release else {
            panic!("MySQL's lane release answers no count");
        };
        let (plain, text) = (m.release.text(), both.text());
        let (plain_set, plain_where) = plain.split_once(" WHERE ").unwrap();
        let (set, condition) = text.split_once(" WHERE ").unwrap();
        assert!(set.starts_with(plain_set), "{set}");
        assert_eq!(condition, plain_where);
        assert_eq!(set.matches("RELEASE_LOCK(?)").count(), 1, "{set}");
        assert_eq!(both.order, [4, 0, 1, 2, 3]);
    }

    #[test]
    fn mysql_take_assigns_expires_at_last() {
        let m = Statements::new(Dialect::MySql, "l", true);
        let text = m.take.text();
        let update = &text[text.find("UPDATE").unwrap()..];
        assert!(update.trim_end().starts_with("UPDATE token"));
        assert!(
            update.rfind("expires_at = IF").unwrap() > update.rfind("acquired_at = IF").unwrap()
        );
    }
}
