//! Fencing where the data lives, on the real servers (issue 16): a holder
//! paused past its TTL cannot write to PostgreSQL, MySQL/MariaDB or SQLite
//! behind [`SqlFence`], nor to Redis behind [`RedisFence`], etcd behind
//! [`EtcdFence`], ZooKeeper behind [`ZkFence`], MongoDB behind
//! [`MongoFence`] or a NATS KV bucket behind [`NatsFence`], once a newer
//! holder wrote, whichever backend holds the lock; and 16 concurrent writers
//! with tokens out of order never let an older token overwrite a newer one.
//!
//! A store whose `DLOCK_TEST_<NAME>_URL` is unset prints a SKIPPED line
//! (scripts/test lists them).
#![cfg(feature = "all")]

use std::sync::Arc;
use std::time::Duration;

use dlock_conformance::process::Process;
use dlocks::FenceError;
use dlocks::etcd::EtcdFence;
use dlocks::mongo::MongoFence;
use dlocks::nats::NatsFence;
use dlocks::redis::RedisFence;
use dlocks::sql::SqlFence;
use dlocks::zk::ZkFence;
use dlocks::{FencingToken, SessionOptions};
use etcd_client::{PutOptions, TxnOp, TxnOpResponse};
use mongodb::bson::{Document, doc};
use redis::aio::MultiplexedConnection;
use sqlx::{Connection, MySqlPool, PgPool, SqlitePool};

/// The protected data: one row per test run in each store.
const DATA: &str = "dlock_fence_test_data";
const FENCES: &str = "dlock_fence_test";

/// Where the protected data lives.
enum Data {
    Pg(PgPool),
    My(MySqlPool),
    Lite(SqlitePool),
    /// The row is a hash; its fence key is `<row>:fence`.
    Redis(MultiplexedConnection),
    /// The row is the key `dlock-fence-test/<row>` (`token:writer`), its
    /// fence key that plus `/fence`.
    Etcd(Box<etcd_client::Client>),
    /// The row is the znode `/dlock-fence-test/<row>` (`token:writer`), its
    /// fence `/dlock-fence-test/<row>-fence`.
    Zk(zookeeper_client::Client),
    /// The row is the document `{_id: <row>, token, writer}` of
    /// `dlock_fence_test.data`, its fence the document's `fence` field.
    Mongo(mongodb::Collection<Document>),
    /// The row is the key `<row>` (`token:writer`) of the KV bucket
    /// `dlock_fence_data` (no `max_age`), its token in the value's header.
    Nats(
        async_nats::jetstream::Context,
        Box<async_nats::jetstream::kv::Store>,
    ),
}

/// NATS's accepted writes: (row, stream sequence of the write, token).
static NATS_WRITES: std::sync::Mutex<Vec<(String, u64, i64)>> = std::sync::Mutex::new(Vec::new());

/// The NATS data bucket: made with a raw request (async-nats cannot read
/// nats-server 2.9's answer to its own), without `max_age`.
const NATS_BUCKET: &str = "dlock_fence_data";

fn zk_path(row: &str) -> String {
    format!("/dlock-fence-test/{row}")
}

fn zk_fence(row: &str) -> ZkFence {
    ZkFence::new(format!("{}-fence", zk_path(row)))
}

fn etcd_key(row: &str) -> String {
    format!("dlock-fence-test/{row}")
}

fn etcd_fence(row: &str) -> EtcdFence {
    EtcdFence::new(format!("{}/fence", etcd_key(row)))
}

/// ZooKeeper's accepted writes: (row, mzxid of the data write, token).
static ZK_WRITES: std::sync::Mutex<Vec<(String, i64, i64)>> = std::sync::Mutex::new(Vec::new());

/// Tokens of one row's accepted writes, in the order the store applied them
/// (ZooKeeper and MongoDB, whose writes cannot check the row's previous
/// token inside themselves), or `None` where the write checks that itself.
async fn applied_order(store: &Data, row: &str) -> Option<Vec<i64>> {
    match store {
        Data::Zk(_) => {
            let mut writes: Vec<(i64, i64)> = ZK_WRITES
                .lock()
                .unwrap()
                .iter()
                .filter(|(r, _, _)| r == row)
                .map(|(_, mzxid, t)| (*mzxid, *t))
                .collect();
            writes.sort();
            Some(writes.into_iter().map(|(_, t)| t).collect())
        }
        Data::Nats(..) => {
            let mut writes: Vec<(u64, i64)> = NATS_WRITES
                .lock()
                .unwrap()
                .iter()
                .filter(|(r, _, _)| r == row)
                .map(|(_, seq, t)| (*seq, *t))
                .collect();
            writes.sort();
            Some(writes.into_iter().map(|(_, t)| t).collect())
        }
        Data::Mongo(c) => {
            let found = c.find_one(doc! { "_id": row }).await.unwrap().unwrap();
            let history = found.get_array("history").unwrap();
            Some(history.iter().map(|t| t.as_i64().unwrap()).collect())
        }
        _ => None,
    }
}

/// Redis: the write as the user's own Lua under the fence, with the same
/// "never goes back" check inside.
const REDIS_WRITE: &str = "local before = tonumber(redis.call('HGET', KEYS[1], 'token') or '0') \
    if before > tonumber(ARGV[1]) then return redis.error_reply('WENT_BACK ' .. before) end \
    redis.call('HSET', KEYS[1], 'token', ARGV[1], 'writer', ARGV[2]) return 1";

impl Data {
    fn name(&self) -> &'static str {
        match self {
            Data::Pg(_) => "postgres",
            Data::My(_) => "mysql",
            Data::Lite(_) => "sqlite",
            Data::Redis(_) => "redis",
            Data::Etcd(_) => "etcd",
            Data::Zk(_) => "zk",
            Data::Mongo(_) => "mongodb",
            Data::Nats(..) => "nats",
        }
    }

    /// Creates the fence and data tables and this run's row.
    async fn prepare(&self, fence: &SqlFence, row: &str) {
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {DATA} (id VARCHAR(64) PRIMARY KEY, token BIGINT NOT NULL, writer VARCHAR(64) NOT NULL)"
        );
        let insert = format!("INSERT INTO {DATA} (id, token, writer) VALUES ('{row}', 0, '')");
        if let Data::Mongo(c) = self {
            // Born fenced (a document without the field accepts any token).
            MongoFence::new()
                .insert_one(
                    c,
                    doc! { "_id": row, "token": 0i64, "writer": "" },
                    FencingToken::new(1),
                )
                .await
                .unwrap();
            return;
        }
        if let Data::Zk(c) = self {
            let persistent = zookeeper_client::CreateMode::Persistent
                .with_acls(zookeeper_client::Acls::anyone_all());
            match c.create("/dlock-fence-test", b"", &persistent).await {
                Ok(_) | Err(zookeeper_client::Error::NodeExists) => {}
                Err(e) => panic!("zk: {e}"),
            }
            c.create(&zk_path(row), b"0:", &persistent).await.unwrap();
            return;
        }
        if let Data::Etcd(c) = self {
            c.clone().put(etcd_key(row), "0:", None).await.unwrap();
            return;
        }
        if let Data::Nats(_, kv) = self {
            kv.put(row, "0:".into()).await.unwrap();
            return;
        }
        if let Data::Redis(c) = self {
            let mut c = c.clone();
            let _: () = redis::cmd("HSET")
                .arg(row)
                .arg("token")
                .arg(0)
                .arg("writer")
                .arg("")
                .query_async(&mut c)
                .await
                .unwrap();
            return;
        }
        // (the tests run at once: one creates the tables at a time)
        static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _creating = CREATING.lock().await;
        match self {
            Data::Pg(p) => {
                let mut c = p.acquire().await.unwrap();
                fence.create_table(&mut *c).await.unwrap();
                sqlx::query(&create).execute(&mut *c).await.unwrap();
                sqlx::query(&insert).execute(&mut *c).await.unwrap();
            }
            Data::My(p) => {
                let mut c = p.acquire().await.unwrap();
                fence.create_table(&mut *c).await.unwrap();
                sqlx::query(&create).execute(&mut *c).await.unwrap();
                sqlx::query(&insert).execute(&mut *c).await.unwrap();
            }
            Data::Lite(p) => {
                let mut c = p.acquire().await.unwrap();
                fence.create_table(&mut *c).await.unwrap();
                sqlx::query(&create).execute(&mut *c).await.unwrap();
                sqlx::query(&insert).execute(&mut *c).await.unwrap();
            }
            Data::Redis(_) | Data::Etcd(_) | Data::Zk(_) | Data::Mongo(_) | Data::Nats(..) => {
                unreachable!()
            }
        }
    }

    /// One fenced write of `row` by `writer` with `token`, in a transaction:
    /// the fence check, then a read of the row (whose token must not be
    /// newer: the fence row's lock orders the writers), then the write.
    async fn write(
        &self,
        fence: &SqlFence,
        row: &str,
        writer: &str,
        token: FencingToken,
    ) -> Result<(), FenceError> {
        let t = token.get() as i64;
        let read = format!("SELECT token FROM {DATA} WHERE id = '{row}'");
        let write =
            format!("UPDATE {DATA} SET token = {t}, writer = '{writer}' WHERE id = '{row}'");
        macro_rules! fenced_write {
            ($pool:expr) => {{
                let mut tx = $pool.begin().await.unwrap();
                fence.check(&mut *tx, row, token).await?;
                let (before,): (i64,) = sqlx::query_as(&read).fetch_one(&mut *tx).await.unwrap();
                assert!(
                    before <= t,
                    "{}: the row holds token {before}, newer than the accepted {t}",
                    self.name()
                );
                sqlx::query(&write).execute(&mut *tx).await.unwrap();
                tx.commit().await.unwrap();
                Ok(())
            }};
        }
        match self {
            Data::Pg(p) => fenced_write!(p),
            Data::My(p) => fenced_write!(p),
            Data::Lite(p) => fenced_write!(p),
            Data::Redis(c) => {
                let fence = RedisFence::new(format!("{row}:fence"));
                let written: i64 = fence
                    .eval(
                        &mut c.clone(),
                        token,
                        REDIS_WRITE,
                        &[row],
                        &[&t.to_string(), writer],
                    )
                    .await?;
                assert_eq!(written, 1);
                Ok(())
            }
            Data::Mongo(c) => {
                // `history`: every accepted token in the order applied.
                let update = doc! {
                    "$set": { "token": t, "writer": writer },
                    "$push": { "history": t },
                };
                let done = MongoFence::new()
                    .update_one(c, doc! { "_id": row }, update, token)
                    .await?;
                assert_eq!(done.matched_count, 1, "mongodb: the row is gone");
                Ok(())
            }
            Data::Nats(js, kv) => {
                let value = format!("{t}:{writer}");
                let seq = NatsFence::new(row).put(js, kv, token, value.into()).await?;
                // The write's place in the stream, for the check that
                // tokens never go back.
                NATS_WRITES.lock().unwrap().push((row.to_owned(), seq, t));
                Ok(())
            }
            Data::Zk(c) => {
                let (path, value) = (zk_path(row), format!("{t}:{writer}"));
                let results = zk_fence(row)
                    .commit(c, token, |multi| {
                        multi.add_set_data(&path, value.as_bytes(), None)
                    })
                    .await?;
                // The data znode's write, in the order the ensemble applied
                // it (its mzxid), for the check that tokens never go back.
                let Some(zookeeper_client::MultiWriteResult::SetData { stat }) = results.get(1)
                else {
                    panic!("zk: the multi answered {results:?}");
                };
                ZK_WRITES
                    .lock()
                    .unwrap()
                    .push((row.to_owned(), stat.mzxid, t));
                Ok(())
            }
            Data::Etcd(c) => {
                let put = TxnOp::put(
                    etcd_key(row),
                    format!("{t}:{writer}"),
                    Some(PutOptions::new().with_prev_key()),
                );
                let done = etcd_fence(row).commit(&mut c.clone(), token, [put]).await?;
                // The row's value before this write, read atomically with it.
                let before = done
                    .op_responses()
                    .into_iter()
                    .filter_map(|r| match r {
                        TxnOpResponse::Put(p) => p.prev_key().map(|kv| kv.value().to_vec()),
                        _ => None,
                    })
                    .next_back()
                    .expect("the row existed");
                let before: i64 = String::from_utf8(before)
                    .unwrap()
                    .split(':')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(
                    before <= t,
                    "etcd: the row held token {before}, newer than the accepted {t}"
                );
                Ok(())
            }
        }
    }

    /// The highest token the fence accepted for `row`.
    async fn highest(&self, fence: &SqlFence, row: &str) -> FencingToken {
        let highest = match self {
            Data::Pg(p) => fence.highest(&mut *p.acquire().await.unwrap(), row).await,
            Data::My(p) => fence.highest(&mut *p.acquire().await.unwrap(), row).await,
            Data::Lite(p) => fence.highest(&mut *p.acquire().await.unwrap(), row).await,
            Data::Mongo(c) => {
                let found = c.find_one(doc! { "_id": row }).await.unwrap().unwrap();
                return FencingToken::new(
                    found.get_i64("fence").expect("a token was accepted") as u64
                );
            }
            Data::Nats(_, kv) => {
                return NatsFence::new(row)
                    .highest(kv)
                    .await
                    .unwrap()
                    .expect("a token was accepted");
            }
            Data::Zk(c) => {
                return zk_fence(row)
                    .highest(c)
                    .await
                    .unwrap()
                    .expect("a token was accepted");
            }
            Data::Etcd(c) => {
                return etcd_fence(row)
                    .highest(&mut c.clone())
                    .await
                    .unwrap()
                    .expect("a token was accepted");
            }
            Data::Redis(c) => {
                return RedisFence::new(format!("{row}:fence"))
                    .highest(&mut c.clone())
                    .await
                    .unwrap()
                    .expect("a token was accepted");
            }
        };
        highest.unwrap().expect("a token was accepted")
    }

    /// The row's token and writer.
    async fn row(&self, row: &str) -> (i64, String) {
        let read = format!("SELECT token, writer FROM {DATA} WHERE id = '{row}'");
        match self {
            Data::Pg(p) => sqlx::query_as(&read).fetch_one(p).await.unwrap(),
            Data::My(p) => sqlx::query_as(&read).fetch_one(p).await.unwrap(),
            Data::Lite(p) => sqlx::query_as(&read).fetch_one(p).await.unwrap(),
            Data::Mongo(c) => {
                let found = c.find_one(doc! { "_id": row }).await.unwrap().unwrap();
                (
                    found.get_i64("token").unwrap(),
                    found.get_str("writer").unwrap().to_owned(),
                )
            }
            Data::Zk(c) => {
                let (data, _) = c.get_data(&zk_path(row)).await.unwrap();
                let value = String::from_utf8(data).unwrap();
                let (token, writer) = value.split_once(':').unwrap();
                (token.parse().unwrap(), writer.to_owned())
            }
            Data::Nats(_, kv) => {
                let value = kv.get(row).await.unwrap().expect("the row exists");
                let value = String::from_utf8(value.to_vec()).unwrap();
                let (token, writer) = value.split_once(':').unwrap();
                (token.parse().unwrap(), writer.to_owned())
            }
            Data::Etcd(c) => {
                let got = c.clone().get(etcd_key(row), None).await.unwrap();
                let value = std::str::from_utf8(got.kvs()[0].value())
                    .unwrap()
                    .to_owned();
                let (token, writer) = value.split_once(':').unwrap();
                (token.parse().unwrap(), writer.to_owned())
            }
            Data::Redis(c) => {
                let (token, writer): (i64, String) = redis::cmd("HMGET")
                    .arg(row)
                    .arg("token")
                    .arg("writer")
                    .query_async(&mut c.clone())
                    .await
                    .unwrap();
                (token, writer)
            }
        }
    }
}

/// Every data store reachable here (SQLite always, in a temporary file).
async fn data_stores() -> Vec<Data> {
    let mut stores = Vec::new();
    match std::env::var("DLOCK_TEST_POSTGRES_URL") {
        Ok(url) => stores.push(Data::Pg(PgPool::connect(&url).await.unwrap())),
        Err(_) => println!("SKIPPED fenced_data postgres data: DLOCK_TEST_POSTGRES_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_MYSQL_URL") {
        Ok(url) => stores.push(Data::My(MySqlPool::connect(&url).await.unwrap())),
        Err(_) => println!("SKIPPED fenced_data mysql data: DLOCK_TEST_MYSQL_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_REDIS_URL") {
        Ok(url) => {
            let client = redis::Client::open(url).unwrap();
            let conn = client.get_multiplexed_async_connection().await.unwrap();
            stores.push(Data::Redis(conn));
        }
        Err(_) => println!("SKIPPED fenced_data redis data: DLOCK_TEST_REDIS_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_MONGO_URL") {
        Ok(url) => {
            // (the driver does not know dlock's own option)
            let url = url.replace("&dlock_mongos=allow", "");
            let client = mongodb::Client::with_uri_str(&url).await.unwrap();
            stores.push(Data::Mongo(
                client.database("dlock_fence_test").collection("data"),
            ));
        }
        Err(_) => println!("SKIPPED fenced_data mongodb data: DLOCK_TEST_MONGO_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_ZK_URL") {
        Ok(url) => {
            let hosts = url
                .trim_start_matches("zk://")
                .split('/')
                .next()
                .unwrap()
                .to_owned();
            let client = zookeeper_client::Client::connector()
                .connect(&hosts)
                .await
                .unwrap();
            stores.push(Data::Zk(client));
        }
        Err(_) => println!("SKIPPED fenced_data zk data: DLOCK_TEST_ZK_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_ETCD_URL") {
        Ok(url) => {
            let endpoint = url
                .trim_start_matches("etcd://")
                .split('/')
                .next()
                .unwrap()
                .to_owned();
            let client = etcd_client::Client::connect([endpoint], None)
                .await
                .unwrap();
            stores.push(Data::Etcd(Box::new(client)));
        }
        Err(_) => println!("SKIPPED fenced_data etcd data: DLOCK_TEST_ETCD_URL is not set"),
    }
    match std::env::var("DLOCK_TEST_NATS_URL") {
        Ok(url) => {
            let server = url
                .trim_start_matches("nats://")
                .split(['/', '?'])
                .next()
                .unwrap()
                .to_owned();
            let client = async_nats::connect(format!("nats://{server}"))
                .await
                .unwrap();
            let config = format!(
                r#"{{"name":"KV_{NATS_BUCKET}","subjects":["$KV.{NATS_BUCKET}.>"],
"max_msgs_per_subject":1,"storage":"file","num_replicas":1,"discard":"new",
"allow_rollup_hdrs":true,"allow_direct":true}}"#
            );
            let reply = client
                .request(
                    format!("$JS.API.STREAM.CREATE.KV_{NATS_BUCKET}"),
                    config.into(),
                )
                .await
                .unwrap();
            // Made, or made before (10058); the fence refuses a bucket with
            // other settings (max_age, replicas) itself.
            let reply = String::from_utf8_lossy(&reply.payload);
            assert!(
                !reply.contains("\"error\"") || reply.contains("10058"),
                "{reply}"
            );
            let js = async_nats::jetstream::new(client);
            let kv = js.get_key_value(NATS_BUCKET).await.unwrap();
            stores.push(Data::Nats(js, Box::new(kv)));
        }
        Err(_) => println!("SKIPPED fenced_data nats data: DLOCK_TEST_NATS_URL is not set"),
    }
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dlock-fence-{:016x}.db", rand::random::<u64>()));
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    stores.push(Data::Lite(SqlitePool::connect_with(options).await.unwrap()));
    stores
}

/// The lock backends under test: every `DLOCK_TEST_*_URL` that is set, and
/// SQLite.
fn lock_urls() -> Vec<(&'static str, String)> {
    let mut urls = Vec::new();
    for (name, var, extra) in [
        ("postgres", "DLOCK_TEST_POSTGRES_URL", ""),
        ("mysql", "DLOCK_TEST_MYSQL_URL", ""),
        ("redis", "DLOCK_TEST_REDIS_URL", ""),
        // A node dlock has not seen waits max_ttl before it grants.
        ("redlock", "DLOCK_TEST_REDLOCK_URL", "max_ttl=3s"),
        ("etcd", "DLOCK_TEST_ETCD_URL", ""),
        ("zk", "DLOCK_TEST_ZK_URL", ""),
        ("mongo", "DLOCK_TEST_MONGO_URL", ""),
        ("nats", "DLOCK_TEST_NATS_URL", ""),
    ] {
        match std::env::var(var) {
            Ok(url) if extra.is_empty() => urls.push((name, url)),
            Ok(url) => {
                let sep = if url.contains('?') { '&' } else { '?' };
                urls.push((name, format!("{url}{sep}{extra}")));
            }
            Err(_) => println!("SKIPPED fenced_data lock on {name}: {var} is not set"),
        }
    }
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "dlock-fence-lock-{:016x}.db",
        rand::random::<u64>()
    ));
    urls.push(("sqlite", format!("sqlite://{}", file.display())));
    urls
}

/// Item 4: A holds and writes, is paused past its TTL, B takes the lock and
/// writes, A resumes and writes: every data store refuses A's write, and
/// keeps B's. For every lock backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_holder_cannot_write_after_the_next_one() {
    let stores = data_stores().await;
    let fence = SqlFence::new(FENCES).unwrap();
    let ttl = Duration::from_secs(2);
    for (backend, url) in lock_urls() {
        let row = format!("pause-{backend}-{:08x}", rand::random::<u32>());
        for store in &stores {
            store.prepare(&fence, &row).await;
        }
        let lock_name = format!("fenced/{row}");
        // A, in a process of its own that can really be stopped.
        let a = Process::start().unwrap();
        let a_url = url.clone();
        let a_name = lock_name.clone();
        let (a_guard, a_session) = a.enter(async move {
            let backend = dlocks::connect(&a_url).await.unwrap();
            let session = backend
                .session(SessionOptions::new().ttl(ttl))
                .await
                .unwrap();
            let guard = session
                .lock(&a_name)
                .unwrap()
                .acquire_timeout(Duration::from_secs(30))
                .await
                .unwrap();
            (guard, session)
        });
        let a_token = a_guard.token();
        for store in &stores {
            store.write(&fence, &row, "A", a_token).await.unwrap();
        }
        a.pause();
        // B gets the lock once A's hold expired in the store.
        let b_backend = dlocks::connect(&url).await.unwrap();
        let b_session = b_backend
            .session(SessionOptions::new().ttl(ttl))
            .await
            .unwrap();
        let b_guard = b_session
            .lock(&lock_name)
            .unwrap()
            .acquire_timeout(Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("{backend}: B's acquire: {e}"));
        assert!(
            b_guard.token() > a_token,
            "{backend}: B's token {} is not newer than A's {a_token}",
            b_guard.token()
        );
        for store in &stores {
            store
                .write(&fence, &row, "B", b_guard.token())
                .await
                .unwrap();
        }
        a.resume();
        // A writes as if it still held the lock: every store refuses it.
        for store in &stores {
            match store.write(&fence, &row, "A", a_token).await {
                Err(FenceError::Stale { stale, .. }) => {
                    assert_eq!(stale.token, a_token);
                    assert_eq!(stale.highest, b_guard.token(), "{backend}/{}", store.name());
                }
                other => panic!(
                    "{backend}/{}: A's stale write was not refused: {other:?}",
                    store.name()
                ),
            }
            let (token, writer) = store.row(&row).await;
            assert_eq!(
                (token as u64, writer.as_str()),
                (b_guard.token().get(), "B"),
                "{backend}/{}: B's write was overwritten",
                store.name()
            );
        }
        b_guard.release().await.unwrap();
        b_session.close().await.unwrap();
        a.enter(async move {
            drop(a_guard);
            let _ = a_session.close().await;
        });
        eprintln!("{backend}: A's stale writes refused by every store");
    }
}

/// Done-means: 16 writers under contention with tokens in any order; the
/// fence lets through only tokens at least as new as every accepted one,
/// and the row never goes back (checked inside each accepted transaction
/// and at the end).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_writers_never_go_back() {
    let stores = Arc::new(data_stores().await);
    let fence = SqlFence::new(FENCES).unwrap();
    for i in 0..stores.len() {
        let row = format!("sixteen-{:08x}", rand::random::<u32>());
        stores[i].prepare(&fence, &row).await;
        let mut writers = tokio::task::JoinSet::new();
        for w in 0..16u64 {
            let (stores, fence, row) = (stores.clone(), fence.clone(), row.clone());
            writers.spawn(async move {
                let mut accepted = 0u32;
                let mut refused = 0u32;
                for k in 0..12u64 {
                    // Tokens interleaved across writers, each writer's own
                    // rising: plenty arrive after a newer one was accepted.
                    let token = FencingToken::new(1 + k * 16 + (w * 7) % 16);
                    match stores[i].write(&fence, &row, &format!("w{w}"), token).await {
                        Ok(()) => {
                            accepted += 1;
                            // The same holder writes again with its token: an
                            // equal token is accepted unless a newer one won
                            // meanwhile.
                            match stores[i].write(&fence, &row, &format!("w{w}"), token).await {
                                Ok(()) => accepted += 1,
                                Err(FenceError::Stale { stale, .. }) => {
                                    assert!(
                                        stale.highest > token,
                                        "{}: an equal token refused",
                                        stores[i].name()
                                    );
                                    refused += 1;
                                }
                                Err(e) => panic!("{}: {e}", stores[i].name()),
                            }
                        }
                        Err(FenceError::Stale { stale, .. }) => {
                            assert!(stale.highest > stale.token);
                            refused += 1;
                        }
                        Err(e) => panic!("{}: {e}", stores[i].name()),
                    }
                }
                (accepted, refused)
            });
        }
        let (mut accepted, mut refused) = (0, 0);
        while let Some(done) = writers.join_next().await {
            let (a, r) = done.unwrap();
            accepted += a;
            refused += r;
        }
        let highest = stores[i].highest(&fence, &row).await;
        if let Some(order) = applied_order(&stores[i], &row).await {
            assert!(
                order.windows(2).all(|w| w[0] <= w[1]),
                "{}: an older token was applied after a newer one: {order:?}",
                stores[i].name()
            );
            assert!(order.len() >= 2, "{}: {order:?}", stores[i].name());
        }
        let (token, _) = stores[i].row(&row).await;
        assert_eq!(
            token as u64,
            highest.get(),
            "{}: the row is not the newest accepted write",
            stores[i].name()
        );
        assert!(
            accepted > 0 && refused > 0,
            "{}: {accepted} accepted, {refused} refused",
            stores[i].name()
        );
        eprintln!(
            "{}: {accepted} writes accepted, {refused} stale ones refused",
            stores[i].name()
        );
    }
}

/// Bad input is a typed error, not a panic or a silent pass.
#[tokio::test]
async fn bad_fence_input_is_typed() {
    assert!(matches!(
        SqlFence::new("no spaces"),
        Err(dlocks::Error::Config(_))
    ));
    let fence = SqlFence::new(FENCES).unwrap();
    let mut conn = sqlx::SqliteConnection::connect("sqlite::memory:")
        .await
        .unwrap();
    fence.create_table(&mut conn).await.unwrap();
    // Outside a transaction the row lock would end with the statement.
    assert!(matches!(
        fence.check(&mut conn, "r", FencingToken::new(1)).await,
        Err(FenceError::NotInTransaction { .. })
    ));
    let mut tx = conn.begin().await.unwrap();
    let conn = &mut *tx;
    let long = "r".repeat(256);
    for resource in ["", long.as_str()] {
        assert!(matches!(
            fence.check(conn, resource, FencingToken::new(1)).await,
            Err(FenceError::InvalidResource { .. })
        ));
    }
    assert!(matches!(
        fence.check(conn, "r", FencingToken::new(u64::MAX)).await,
        Err(FenceError::TokenTooLarge { .. })
    ));
    fence.check(conn, "r", FencingToken::new(7)).await.unwrap();
    fence.check(conn, "r", FencingToken::new(7)).await.unwrap();
    let err = fence
        .check(conn, "r", FencingToken::new(6))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "fence on \"r\": stale fencing token 6: the resource has already seen 7"
    );
    let other = SqlFence::new("missing_table").unwrap();
    assert!(matches!(
        other.check(conn, "r", FencingToken::new(1)).await,
        Err(FenceError::Store { .. })
    ));
}

/// Redis compares tokens exactly beyond 2^53 (Lua's numbers are doubles,
/// which would take 2^60 for 2^60 + 1), and across digit counts.
#[tokio::test]
async fn redis_fence_compares_large_tokens_exactly() {
    let Ok(url) = std::env::var("DLOCK_TEST_REDIS_URL") else {
        println!(
            "SKIPPED redis_fence_compares_large_tokens_exactly: DLOCK_TEST_REDIS_URL is not set"
        );
        return;
    };
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let fence = RedisFence::new(format!("fence-test-{:016x}", rand::random::<u64>()));
    let data = format!("{}:data", fence.key());
    let big = 1u64 << 60;
    fence
        .set(&mut conn, FencingToken::new(9), &data, "a")
        .await
        .unwrap();
    fence
        .set(&mut conn, FencingToken::new(10), &data, "b")
        .await
        .unwrap();
    fence
        .set(&mut conn, FencingToken::new(big + 1), &data, "c")
        .await
        .unwrap();
    for older in [big, 10, 9] {
        match fence
            .set(&mut conn, FencingToken::new(older), &data, "x")
            .await
        {
            Err(FenceError::Stale { stale, .. }) => {
                assert_eq!(stale.highest, FencingToken::new(big + 1))
            }
            other => panic!("token {older} after {}: {other:?}", big + 1),
        }
    }
    fence
        .set(&mut conn, FencingToken::new(big + 1), &data, "d")
        .await
        .unwrap();
    let value: String = redis::cmd("GET")
        .arg(&data)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(value, "d");
    let _: () = redis::cmd("DEL")
        .arg(fence.key())
        .arg(&data)
        .query_async(&mut conn)
        .await
        .unwrap();
}
