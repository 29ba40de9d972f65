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
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
async fn sql(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::sql::sqlx::{self, Connection};
    let scheme = url.scheme().to_owned();
    let db = |e: sqlx::Error| Failure::new(FAILURE, format!("{scheme}: {e}"));
    let fence = dlocks::sql::SqlFence::new(w.fence.unwrap_or("dlock_fences"))?;
    let mut conn = dlocks::sql::connect_data(&url).await?;
    fence.create_table(&mut conn).await.map_err(db)?;
    let mut tx = conn.begin().await.map_err(db)?;
    fence
        .check(&mut *tx, w.resource, w.token)
        .await
        .map_err(refused)?;
    for statement in w.words {
        sqlx::raw_sql(statement)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
    }
    tx.commit().await.map_err(db)?;
    Ok(None)
}

#[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
async fn sql(url: StoreUrl, _: &Write<'_>) -> Result<Option<String>, Failure> {
    Err(disabled(url.scheme(), "sqlite, postgres or mysql"))
}

/// Redis: the command, run by `RedisFence`'s script after the check on the
/// fence key (`--fence`, default `dlock:fence:RESOURCE`); its reply.
#[cfg(feature = "redis")]
async fn redis(url: StoreUrl, w: &Write<'_>) -> Result<Option<String>, Failure> {
    use dlocks::redis::redis::Value;
    let key = w
        .fence
        .map_or_else(|| format!("dlock:fence:{}", w.resource), str::to_owned);
    let backend = dlocks::redis::RedisBackend::connect(&url).await?;
    let mut conn = backend.data_connection().await?;
    let words: Vec<&str> = w.words.iter().map(String::as_str).collect();
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
