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
/// it (COMMIT, ROLLBACK, BEGIN; on MySQL any DDL, LOCK TABLES, a procedure)
/// would let what follows land unfenced, so such statements are refused
/// before anything runs, each argument runs as one prepared statement (no
/// `;`-separated lists), and on PostgreSQL and MySQL the transaction is
/// checked to be the one that took the fence before it commits.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn sql(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::sql::sqlx::{self, Connection};
    let scheme = url.scheme().to_owned();
    let mysql = matches!(scheme.as_str(), "mysql" | "mariadb");
    for statement in w.words {
        sql_statement_allowed(statement, mysql).map_err(Failure::usage)?;
    }
    let db = |e: sqlx::Error| Failure::new(FAILURE, format!("{scheme}: {e}"));
    let fence = dlocks::sql::SqlFence::new(w.fence.unwrap_or("dlock_fences"))?;
    let mut conn = dlocks::sql::connect_data(&url).await?;
    // Created only when missing: a role that may write data but not create
    // tables still writes through an existing fence table.
    if fence.highest(&mut conn, w.resource).await.is_err() {
        fence.create_table(&mut conn).await.map_err(db)?;
    }
    let mut tx = conn.begin().await.map_err(db)?;
    fence
        .check(&mut *tx, w.resource, w.token)
        .await
        .map_err(refused)?;
    let taken = transaction_id(&mut tx, &scheme).await.map_err(db)?;
    for statement in w.words {
        sqlx::query(statement).execute(&mut *tx).await.map_err(db)?;
    }
    if transaction_id(&mut tx, &scheme).await.map_err(db)? != taken {
        return Err(Failure::new(
            FAILURE,
            format!(
                "{scheme}: WRITE ended the transaction that held the fence: what it wrote \
                 after that point was not fenced"
            ),
        ));
    }
    tx.commit().await.map_err(db)?;
    Ok(None)
}

/// The server's id of the open transaction (PostgreSQL, MySQL/MariaDB),
/// `None` where there is none or the database cannot say (SQLite).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn transaction_id(
    conn: &mut dlocks::sql::sqlx::AnyConnection,
    scheme: &str,
) -> Result<Option<String>, dlocks::sql::sqlx::Error> {
    let id = |query| async move {
        dlocks::sql::sqlx::query_scalar::<_, Option<String>>(query)
            .fetch_optional(conn)
            .await
            .map(Option::flatten)
    };
    match scheme {
        "postgres" | "postgresql" => id("SELECT CAST(txid_current_if_assigned() AS TEXT)").await,
        // (needs the PROCESS privilege on MySQL 8: without it the database
        // cannot say, and a failed SELECT leaves a MySQL transaction open)
        "mysql" | "mariadb" => Ok(id(
            "SELECT CAST(trx_id AS CHAR) FROM information_schema.innodb_trx \
             WHERE trx_mysql_thread_id = CONNECTION_ID()",
        )
        .await
        .unwrap_or(None)),
        _ => Ok(None),
    }
}

/// Whether `statement` may run inside the fence's transaction: one
/// statement that does not end it. (A first keyword is enough: each
/// argument is prepared as exactly one statement.)
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
fn sql_statement_allowed(statement: &str, mysql: bool) -> Result<(), String> {
    let words: Vec<String> = strip_comments(statement)
        .split(|c: char| c.is_whitespace() || c == '(' || c == ';')
        .filter(|w| !w.is_empty())
        .take(2)
        .map(str::to_ascii_uppercase)
        .collect();
    if let Some(end) = statement_end(statement)
        && !strip_comments(&statement[end + 1..]).is_empty()
    {
        return Err(format!(
            "{:?} holds several statements: give each its own argument",
            statement.trim()
        ));
    }
    let first = words.first().map(String::as_str).unwrap_or("");
    let second = words.get(1).map(String::as_str).unwrap_or("");
    let ends_transaction = match first {
        "" => return Err("an empty SQL statement".to_owned()),
        "BEGIN" | "START" | "COMMIT" | "END" | "ROLLBACK" | "ABORT" => true,
        "PREPARE" => second == "TRANSACTION",
        // MySQL commits implicitly before DDL, account and admin statements,
        // and a procedure may commit.
        "CREATE" | "ALTER" | "DROP" | "TRUNCATE" | "RENAME" | "LOCK" | "UNLOCK" | "GRANT"
        | "REVOKE" | "ANALYZE" | "OPTIMIZE" | "REPAIR" | "FLUSH" | "RESET" | "INSTALL"
        | "UNINSTALL" | "CACHE" | "LOAD" | "CALL" | "CHANGE" | "STOP" => mysql,
        "SET" => mysql && statement.to_ascii_lowercase().contains("autocommit"),
        _ => false,
    };
    if ends_transaction {
        return Err(format!(
            "{:?} would end the transaction that holds the fence (run it outside dlock fence)",
            statement.trim()
        ));
    }
    Ok(())
}

/// The byte offset of the first `;` outside quotes and comments.
fn statement_end(sql: &str) -> Option<usize> {
    let bytes = sql.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b';' => return Some(i),
            quote @ (b'\'' | b'"' | b'`') => {
                // (a doubled quote inside is two quoted parts in a row)
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += 1;
                }
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// `sql` without its leading `--` and `/* */` comments.
fn strip_comments(sql: &str) -> &str {
    let mut rest = sql.trim_start();
    loop {
        if let Some(line) = rest.strip_prefix("--") {
            rest = line.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(block) = rest.strip_prefix("/*") {
            rest = block.split_once("*/").map_or("", |(_, r)| r).trim_start();
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
    use super::sql_statement_allowed;

    #[test]
    fn statements_that_would_end_the_fence_are_refused() {
        for (statement, mysql) in [
            ("COMMIT", false),
            ("  commit work", false),
            ("-- a comment\nROLLBACK", false),
            ("/* x */ BEGIN", false),
            ("START TRANSACTION", false),
            ("END", false),
            ("PREPARE TRANSACTION 'x'", false),
            ("UPDATE t SET v = 1; COMMIT", false),
            ("UPDATE t SET v = 1;COMMIT", true),
            ("UPDATE t SET s = 'it''s';COMMIT", false),
            ("UPDATE t SET s = '/*'; COMMIT", false),
            ("CREATE TABLE t (v INT)", true),
            ("drop table t", true),
            ("LOCK TABLES t WRITE", true),
            ("CALL p()", true),
            ("SET autocommit = 1", true),
            ("", false),
            ("   ", false),
        ] {
            assert!(
                sql_statement_allowed(statement, mysql).is_err(),
                "{statement:?}"
            );
        }
        for (statement, mysql) in [
            ("UPDATE t SET v = 1 WHERE id = 2", true),
            ("INSERT INTO t VALUES (1);", true),
            ("CREATE TABLE t (v INT)", false),
            ("SET LOCAL lock_timeout = '1s'", false),
            ("SAVEPOINT a", true),
            ("DELETE FROM t -- trailing comment", true),
            ("SELECT ';'", false),
            (
                "UPDATE t SET s = 'a;b' /* ; */ WHERE n = \"x;y\" -- ;",
                true,
            ),
        ] {
            assert!(
                sql_statement_allowed(statement, mysql).is_ok(),
                "{statement:?}"
            );
        }
    }
}
