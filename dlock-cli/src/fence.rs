//! `dlock fence`: one write of the protected data, checked by the store that
//! keeps it against the highest fencing token recorded for the resource, in
//! one atomic step (the adapters' fenced writers: `SqlFence`, `RedisFence`,
//! `EtcdFence`). What a shell job under `dlock run` writes with
//! `$DLOCK_TOKEN`, without writing the check by hand, and with an exit
//! status that says when the write was refused.

use dlock_core::url::StoreUrl;
use dlocks::{FenceError, FencingToken};

use crate::cli::FenceArgs;
use crate::exit::{FAILURE, Failure, LOST, USAGE};

/// Runs `dlock fence` against the store `url`; returns the exit status.
pub(crate) async fn fence(url: &str, args: FenceArgs) -> Result<u8, Failure> {
    let parsed = StoreUrl::parse(url)?;
    let scheme = parsed.scheme().to_owned();
    let token = FencingToken::new(args.token);
    let write = Write {
        resource: &args.resource,
        token,
        fence: args.fence.as_deref(),
        words: &args.write,
    };
    let written = match scheme.as_str() {
        "postgres" | "postgresql" | "mysql" | "mariadb" | "sqlite" => sql(parsed, &write).await,
        "redis" | "rediss" | "redlock" => redis(parsed, &write).await,
        "etcd" | "etcds" => etcd(parsed, &write).await,
        _ => {
            return Err(Failure::usage(format!(
                "dlock fence writes to SQL databases, Redis and etcd, not to {scheme}:// \
                 (ZooKeeper and MongoDB: ZkFence and MongoFence, from Rust)"
            )));
        }
    }?;
    if let Some(reply) = written {
        println!("{reply}");
    }
    Ok(0)
}

/// One fenced write, as given on the command line.
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "etcd"
    )),
    allow(dead_code)
)]
struct Write<'a> {
    resource: &'a str,
    token: FencingToken,
    /// `--fence`: the fence table (SQL) or key (Redis, etcd).
    fence: Option<&'a str>,
    /// The write itself, in the store's terms.
    words: &'a [String],
}

/// A refused or failed check: a stale token is the lock lost (76), bad
/// input is a usage error, anything else the store's failure.
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "etcd"
    )),
    allow(dead_code)
)]
fn refused(e: FenceError) -> Failure {
    let code = match &e {
        FenceError::Stale { .. } => LOST,
        FenceError::InvalidResource { .. } | FenceError::TokenTooLarge { .. } => USAGE,
        _ => FAILURE,
    };
    let hint = match e {
        FenceError::Stale { .. } => " (a newer holder wrote first: the lock has moved on)",
        _ => "",
    };
    Failure::new(code, format!("{e}{hint}"))
}

/// The feature `scheme` needs, as a usage error.
#[cfg_attr(
    all(
        any(feature = "sqlite", feature = "postgres", feature = "mysql"),
        feature = "redis",
        feature = "etcd"
    ),
    allow(dead_code)
)]
fn disabled(scheme: &str, feature: &str) -> Failure {
    Failure::usage(format!(
        "{scheme}://: this dlock was built without the {feature} feature"
    ))
}

/// SQL: the statements in one transaction, after `SqlFence::check` on the
/// fence table (`--fence`, default `dlock_fences`, created if missing).
///
/// The fence holds only while the transaction does: a statement that ends
/// it would let what follows land unfenced. So, besides refusing such
/// statements up front ([`sql_statement_allowed`]):
/// - PostgreSQL: each argument is one prepared statement, and before each
///   next one the transaction is checked to be the one that took the fence
///   (a statement that ends it writes nothing itself; nothing runs after it);
/// - MySQL/MariaDB: autocommit is off, so whatever follows an implicit
///   commit runs in a new transaction, and the fence is checked again (same
///   token) as the last statement of the one that commits: a newer token
///   recorded meanwhile rolls the writes back;
/// - SQLite: each argument must hold one statement (SQLite runs every
///   statement of a string), found by a scanner that knows its quoting.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn sql(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::sql::sqlx::{self, Connection};
    let scheme = url.scheme().to_owned();
    let dialect = Dialect::of(&scheme);
    let fence = dlocks::sql::SqlFence::new(w.fence.unwrap_or("dlock_fences"))?;
    for statement in w.words {
        sql_statement_allowed(statement, dialect).map_err(Failure::usage)?;
        // (a write that resets the fence would let a former holder in again)
        if statement
            .to_ascii_lowercase()
            .contains(&fence.table().to_ascii_lowercase())
        {
            return Err(Failure::usage(format!(
                "{:?} names the fence table {}: a write must not touch its own fence",
                statement.trim(),
                fence.table()
            )));
        }
    }
    let db = |e: sqlx::Error| Failure::new(FAILURE, format!("{scheme}: {e}"));
    let mut conn = dlocks::sql::connect_data(&url).await?;
    // Created only when missing: a role that may write data but not create
    // tables still writes through an existing fence table.
    match fence.highest(&mut conn, w.resource).await {
        Ok(_) => {}
        Err(e) if is_undefined_table(&e) => fence.create_table(&mut conn).await.map_err(db)?,
        Err(e) => return Err(db(e)),
    }
    if dialect == Dialect::MySql {
        sqlx::query("SET autocommit = 0")
            .execute(&mut conn)
            .await
            .map_err(db)?;
    }
    let mut tx = conn.begin().await.map_err(db)?;
    fence
        .check(&mut *tx, w.resource, w.token)
        .await
        .map_err(refused)?;
    let taken = transaction_state(&mut tx, dialect).await.map_err(db)?;
    for statement in w.words {
        if transaction_state(&mut tx, dialect).await.map_err(db)? != taken {
            return Err(Failure::new(
                FAILURE,
                format!(
                    "{scheme}: a statement ended the transaction that held the fence; \
                     nothing after it ran"
                ),
            ));
        }
        sqlx::query(statement).execute(&mut *tx).await.map_err(db)?;
    }
    if dialect == Dialect::MySql {
        if transaction_state(&mut tx, dialect).await.map_err(db)? != taken {
            return Err(Failure::new(
                FAILURE,
                format!("{scheme}: a statement turned autocommit on; the writes are rolled back"),
            ));
        }
        fence
            .check(&mut *tx, w.resource, w.token)
            .await
            .map_err(refused)?;
    }
    tx.commit().await.map_err(db)?;
    Ok(None)
}

/// Whether a failed read of the fence table says that it does not exist.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
fn is_undefined_table(e: &dlocks::sql::sqlx::Error) -> bool {
    match e {
        dlocks::sql::sqlx::Error::Database(d) => {
            matches!(d.code().as_deref(), Some("42P01" | "42S02" | "1146"))
                || d.message().contains("no such table")
        }
        _ => false,
    }
}

/// What says that the fence's transaction still runs: PostgreSQL's id of
/// the open transaction; MySQL's `@@autocommit` (off while the fence's
/// transaction and any that follows an implicit commit run); `None` on
/// SQLite.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn transaction_state(
    conn: &mut dlocks::sql::sqlx::AnyConnection,
    dialect: Dialect,
) -> Result<Option<String>, dlocks::sql::sqlx::Error> {
    let query = match dialect {
        Dialect::Postgres => "SELECT CAST(txid_current_if_assigned() AS TEXT)",
        Dialect::MySql => "SELECT CAST(@@autocommit AS CHAR)",
        Dialect::Sqlite => return Ok(None),
    };
    dlocks::sql::sqlx::query_scalar::<_, Option<String>>(query)
        .fetch_one(conn)
        .await
}

/// The SQL dialect of a data URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
impl Dialect {
    fn of(scheme: &str) -> Self {
        match scheme {
            "mysql" | "mariadb" => Dialect::MySql,
            "sqlite" => Dialect::Sqlite,
            _ => Dialect::Postgres,
        }
    }
}

/// Whether `statement` may run inside the fence's transaction: one
/// statement (no `;` followed by more), whose first keyword does not end
/// the transaction.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
fn sql_statement_allowed(statement: &str, dialect: Dialect) -> Result<(), String> {
    let shown = || format!("{:?}", statement.trim());
    if dialect == Dialect::MySql && (statement.contains("/*!") || statement.contains("/*M!")) {
        return Err(format!(
            "{}: MySQL and MariaDB run what /*! ... */ comments hold; not inside the fence",
            shown()
        ));
    }
    if dialect == Dialect::MySql && statement.to_ascii_lowercase().contains("autocommit") {
        return Err(format!(
            "{} would change autocommit, which keeps the fence's transaction",
            shown()
        ));
    }
    // (PostgreSQL and MySQL prepare each argument as one statement and
    // refuse more; SQLite runs every statement of a string)
    if dialect == Dialect::Sqlite
        && let Some(end) = statement_end(statement, dialect)
        && !strip_comments(&statement[end + 1..], dialect).is_empty()
    {
        return Err(format!(
            "{} holds several statements: give each its own argument",
            shown()
        ));
    }
    let text = strip_comments(statement, dialect);
    let word = |text: &str| -> String {
        text.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<String>()
            .to_ascii_uppercase()
    };
    let first = word(text);
    let second = word(strip_comments(text[first.len()..].trim_start(), dialect));
    let mysql = dialect == Dialect::MySql;
    let ends_transaction = match first.as_str() {
        "" => return Err(format!("{}: not an SQL statement", shown())),
        "BEGIN" | "START" | "COMMIT" | "END" | "ROLLBACK" | "ABORT" => true,
        "PREPARE" => second == "TRANSACTION",
        // SQLite: a detached database, a VACUUM outside the transaction
        "VACUUM" | "DETACH" | "ATTACH" => dialect == Dialect::Sqlite,
        // MySQL commits implicitly before DDL, account and admin statements,
        // and a procedure may commit.
        "CREATE" | "ALTER" | "DROP" | "TRUNCATE" | "RENAME" | "LOCK" | "UNLOCK" | "GRANT"
        | "REVOKE" | "ANALYZE" | "OPTIMIZE" | "REPAIR" | "FLUSH" | "RESET" | "INSTALL"
        | "UNINSTALL" | "CACHE" | "LOAD" | "CALL" | "CHANGE" | "STOP" | "CHECK" => mysql,
        "SET" => {
            mysql && (second == "PASSWORD" || statement.to_ascii_lowercase().contains("autocommit"))
        }
        _ => false,
    };
    if ends_transaction {
        return Err(format!(
            "{} would end the transaction that holds the fence (run it outside dlock fence)",
            shown()
        ));
    }
    Ok(())
}

/// The byte offset of the first `;` outside quotes and comments.
fn statement_end(sql: &str, dialect: Dialect) -> Option<usize> {
    let bytes = sql.as_bytes();
    let skip_to = |from: usize, close: u8| {
        let mut i = from;
        while i < bytes.len() && bytes[i] != close {
            i += 1;
        }
        i
    };
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b';' => return Some(i),
            // (a doubled quote inside is two quoted parts in a row)
            quote @ (b'\'' | b'"' | b'`') => i = skip_to(i + 1, quote),
            b'[' if dialect == Dialect::Sqlite => i = skip_to(i + 1, b']'),
            b'-' if bytes.get(i + 1) == Some(&b'-') => i = skip_to(i, b'\n'),
            b'#' if dialect == Dialect::MySql => i = skip_to(i, b'\n'),
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = block_comment_end(sql, i, dialect).saturating_sub(1);
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// The byte offset just past the block comment starting at `from` (nested
/// on PostgreSQL), or the end of `sql`.
fn block_comment_end(sql: &str, from: usize, dialect: Dialect) -> usize {
    let bytes = sql.as_bytes();
    let (mut depth, mut i) = (0usize, from);
    while i + 1 < bytes.len() {
        if bytes[i] == b'/' && bytes[i + 1] == b'*' {
            depth = if dialect == Dialect::Postgres || depth == 0 {
                depth + 1
            } else {
                depth
            };
            i += 2;
        } else if bytes[i] == b'*' && bytes[i + 1] == b'/' {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    bytes.len()
}

/// `sql` without its leading comments (`--`, `/* */`, nested on
/// PostgreSQL; `#` on MySQL).
fn strip_comments(sql: &str, dialect: Dialect) -> &str {
    let mut rest = sql.trim_start();
    loop {
        if rest.starts_with("--") || (dialect == Dialect::MySql && rest.starts_with('#')) {
            rest = rest.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if rest.starts_with("/*") {
            rest = rest[block_comment_end(rest, 0, dialect)..].trim_start();
        } else {
            return rest;
        }
    }
}

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
async fn sql(url: StoreUrl, _: &Write<'_>) -> Result<Option<String>, Failure> {
    Err(disabled(url.scheme(), "sqlite, postgres or mysql"))
}

/// Redis: the command, run by `RedisFence`'s script after the check on the
/// fence key (`--fence`, default `dlock:fence:RESOURCE`); its reply. The
/// command's keys are not declared to the script, so this is for a single
/// Redis server, not a cluster.
#[cfg(feature = "redis")]
async fn redis(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::redis::redis::Value;
    let key = w
        .fence
        .map_or_else(|| format!("dlock:fence:{}", w.resource), str::to_owned);
    let backend = dlocks::redis::RedisBackend::connect(&url).await?;
    let mut conn = backend.data_connection().await?;
    let words: Vec<&str> = w.words.iter().map(String::as_str).collect();
    let first = words
        .first()
        .map(|w| w.to_ascii_uppercase())
        .unwrap_or_default();
    if matches!(first.as_str(), "FLUSHDB" | "FLUSHALL" | "SWAPDB") {
        return Err(Failure::usage(format!(
            "{first} would erase the fence with the data (a former holder's token would \
             pass again): run it outside dlock fence"
        )));
    }
    if words.contains(&key.as_str()) {
        return Err(Failure::usage(format!(
            "the command names the fence key {key:?}: a write must not touch its own fence"
        )));
    }
    let reply: Value = dlocks::redis::RedisFence::new(key)
        .eval(
            &mut conn,
            w.token,
            "return redis.call(unpack(ARGV))",
            &[],
            &words,
        )
        .await
        .map_err(refused)?;
    Ok(show(&reply))
}

/// A Redis reply as `redis-cli --no-raw` would show it, without types.
#[cfg(feature = "redis")]
fn show(reply: &dlocks::redis::redis::Value) -> Option<String> {
    use dlocks::redis::redis::Value;
    Some(match reply {
        Value::Nil => return None,
        Value::Okay => "OK".to_owned(),
        Value::Int(i) => i.to_string(),
        Value::SimpleString(s) => s.clone(),
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::Array(items) => items
            .iter()
            .map(|v| show(v).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n"),
        other => format!("{other:?}"),
    })
}

#[cfg(not(feature = "redis"))]
async fn redis(url: StoreUrl, _: &Write<'_>) -> Result<Option<String>, Failure> {
    Err(disabled(url.scheme(), "redis"))
}

/// etcd: `put KEY VALUE` and `del KEY`, in one transaction with
/// `EtcdFence`'s compare on the fence key (`--fence`, default
/// `dlock/fence/RESOURCE`).
#[cfg(feature = "etcd")]
async fn etcd(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::etcd::etcd_client::TxnOp;
    let mut ops = Vec::new();
    let mut words = w.words.iter().map(String::as_str);
    while let Some(verb) = words.next() {
        let mut operand = |what: &str| {
            words
                .next()
                .ok_or_else(|| Failure::usage(format!("etcd: `{verb}` needs {what}")))
        };
        match verb {
            "put" => {
                let key = operand("a KEY and a VALUE")?;
                let value = operand("a VALUE after its KEY")?;
                ops.push(TxnOp::put(key, value, None));
            }
            "del" => ops.push(TxnOp::delete(operand("a KEY")?, None)),
            other => {
                return Err(Failure::usage(format!(
                    "etcd: unknown write {other:?} (expected `put KEY VALUE` or `del KEY`)"
                )));
            }
        }
    }
    let key = w
        .fence
        .map_or_else(|| format!("dlock/fence/{}", w.resource), str::to_owned);
    let backend = dlocks::etcd::EtcdBackend::connect(&url).await?;
    let mut client = backend.data_client().await?;
    dlocks::etcd::EtcdFence::new(key)
        .commit(&mut client, w.token, ops)
        .await
        .map_err(refused)?;
    Ok(None)
}

#[cfg(not(feature = "etcd"))]
async fn etcd(url: StoreUrl, _: &Write<'_>) -> Result<Option<String>, Failure> {
    Err(disabled(url.scheme(), "etcd"))
}

#[cfg(test)]
mod tests {
    use super::{Dialect, sql_statement_allowed};

    const ALL: [Dialect; 3] = [Dialect::Postgres, Dialect::MySql, Dialect::Sqlite];

    #[test]
    fn statements_that_would_end_the_fence_are_refused() {
        let everywhere = [
            "COMMIT",
            "  commit work",
            "COMMIT/**/",
            "COMMIT--x",
            "rollback/* */",
            "-- a comment\nROLLBACK",
            "/* x */ BEGIN",
            "START TRANSACTION",
            "END",
            "PREPARE TRANSACTION 'x'",
            "",
            "   ",
            "-- only a comment",
        ];
        for dialect in ALL {
            for statement in everywhere {
                assert!(
                    sql_statement_allowed(statement, dialect).is_err(),
                    "{dialect:?}: {statement:?}"
                );
            }
        }
        for (statement, dialect) in [
            ("CREATE TABLE t (v INT)", Dialect::MySql),
            ("drop table t", Dialect::MySql),
            ("CREATE/**/TABLE t (v INT)", Dialect::MySql),
            ("LOCK TABLES t WRITE", Dialect::MySql),
            ("CALL p()", Dialect::MySql),
            ("SET autocommit = 1", Dialect::MySql),
            ("SET/**/autocommit=1", Dialect::MySql),
            ("SET PASSWORD = 'x'", Dialect::MySql),
            ("#x\nCOMMIT", Dialect::MySql),
            ("/*!CREATE TABLE t2 */ SELECT 1", Dialect::MySql),
            ("/* /* */ SELECT 1 */ COMMIT", Dialect::Postgres),
            (
                "SELECT 1 AS [it's];COMMIT;INSERT INTO t VALUES(1) -- '",
                Dialect::Sqlite,
            ),
            ("VACUUM", Dialect::Sqlite),
            ("END TRANSACTION", Dialect::Sqlite),
        ] {
            assert!(
                sql_statement_allowed(statement, dialect).is_err(),
                "{dialect:?}: {statement:?}"
            );
        }
        for (statement, dialect) in [
            ("UPDATE t SET v = 1 WHERE id = 2", Dialect::MySql),
            ("INSERT INTO t VALUES (1);", Dialect::MySql),
            ("CREATE TABLE t (v INT)", Dialect::Postgres),
            ("SET LOCAL lock_timeout = '1s'", Dialect::Postgres),
            ("SAVEPOINT a", Dialect::MySql),
            ("DELETE FROM t -- trailing comment", Dialect::MySql),
            ("SELECT ';'", Dialect::Postgres),
            (
                "UPDATE t SET s = 'a;b' /* ; */ WHERE n = \"x;y\" -- ;",
                Dialect::Sqlite,
            ),
            ("SELECT 1 AS [a;b]", Dialect::Sqlite),
            ("/* /* */ */ SELECT 1", Dialect::Postgres),
            ("UPDATE t SET v = 1 # note; COMMIT", Dialect::MySql),
            ("DO $$ BEGIN PERFORM 1; END $$", Dialect::Postgres),
        ] {
            assert!(
                sql_statement_allowed(statement, dialect).is_ok(),
                "{dialect:?}: {statement:?}"
            );
        }
    }
}
