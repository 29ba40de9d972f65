//! Faults below the adapter, on real Redis servers from `scripts/services`:
//! restarts without persistence, a majority of Redlock nodes down, partial
//! grants, and a restarted node that must not re-grant early.
//!
//! Runs in its own test binary (cargo runs binaries one after another), and
//! its tests take a process-wide lock, so servers restart only while nothing
//! else uses them.

use std::time::Duration;

use dlock_conformance::services;
use dlock_core::{Backend, LostReason, SessionOptions};
use dlock_redis::RedisBackend;
use tokio::time::Instant;

/// One fault test at a time: they restart shared servers.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn redis_url() -> String {
    std::env::var("DLOCK_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:16379".into())
}

fn redlock_url(max_ttl: &str) -> String {
    let url = std::env::var("DLOCK_TEST_REDLOCK_URL")
        .unwrap_or_else(|_| "redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382".into());
    format!("{url}?max_ttl={max_ttl}")
}

fn node_url(i: usize) -> String {
    format!("redis://127.0.0.1:{}", 16379 + i)
}

fn unique(what: &str) -> String {
    format!("faults/{what}-{:08x}", rand::random::<u32>())
}

/// S2 across restarts without persistence: the counter is gone, the TIME floor
/// keeps tokens increasing; both a clean restart and a SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_survive_restart_without_persistence() {
    let _serial = SERIAL.lock().await;
    if services::skipped("redis", "fault test") {
        return;
    }
    let name = unique("restart");
    let mut last = 0;
    for step in ["restart", "kill"] {
        let backend = RedisBackend::connect(&redis_url()).await.expect("redis up");
        let session = backend.session(SessionOptions::new()).await.unwrap();
        let g = session.lock(&name).unwrap().acquire().await.unwrap();
        assert!(g.token().get() > last, "token {} after {last}", g.token());
        last = g.token().get();
        g.release().await.unwrap();
        session.close().await.unwrap();
        if step == "restart" {
            services::run(&["restart", "redis"]);
        } else {
            services::run(&["kill", "redis"]);
            services::run(&["up", "redis"]);
        }
    }
    let backend = RedisBackend::connect(&redis_url())
        .await
        .expect("redis back");
    let session = backend.session(SessionOptions::new()).await.unwrap();
    let g = session.lock(&name).unwrap().acquire().await.unwrap();
    assert!(
        g.token().get() > last,
        "token {} after a restart, {last} before",
        g.token()
    );
    g.release().await.unwrap();
}

/// With two of three Redlock nodes down, acquiring fails with a retryable
/// error (never a grant); when they return, grants resume with larger tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn majority_down_fails_then_recovers() {
    let _serial = SERIAL.lock().await;
    if services::skipped("redlock", "fault test") {
        return;
    }
    let name = unique("majority");
    let backend = RedisBackend::connect(&redlock_url("1s"))
        .await
        .expect("redlock up");
    backend.wait_ready(Duration::from_secs(10)).await.unwrap();
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_millis(500)))
        .await
        .unwrap();
    let g = session.lock(&name).unwrap().acquire().await.unwrap();
    let before = g.token();
    g.release().await.unwrap();

    services::run(&["kill", "redis-r1"]);
    services::run(&["kill", "redis-r2"]);
    let r = session.lock(&name).unwrap().try_acquire().await;
    assert!(
        matches!(r, Err(ref e) if e.is_retryable()),
        "with 2 of 3 nodes down: {r:?}"
    );
    let start = Instant::now();
    let r = session
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_millis(600))
        .await;
    assert!(r.is_err(), "acquired with a majority down: {r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "gave up only after {:?}",
        start.elapsed()
    );

    services::run(&["up", "redis-r1", "redis-r2"]);
    // Restarted without their data, they refuse grants for max_ttl.
    backend.wait_ready(Duration::from_secs(10)).await.unwrap();
    let g = session
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(10))
        .await
        .expect("grants resume once a majority is back");
    assert!(g.token() > before, "token {} after {before}", g.token());
    g.release().await.unwrap();
}

/// A client that wins only a minority of nodes releases what it won at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_acquire_is_cleaned_up() {
    let _serial = SERIAL.lock().await;
    if services::skipped("redlock", "fault test") {
        return;
    }
    let name = unique("partial");
    let key = format!("dlock:{{{name}}}");
    let backend = RedisBackend::connect(&redlock_url("1s"))
        .await
        .expect("redlock up");
    backend.wait_ready(Duration::from_secs(10)).await.unwrap();
    // Someone else holds the lock on nodes 1 and 2 (a foreign client).
    for i in [1, 2] {
        let client = redis::Client::open(node_url(i)).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::pipe()
            .cmd("HSET")
            .arg(&key)
            .arg("owner")
            .arg("someone-else#1")
            .arg("session")
            .arg("someone-else")
            .arg("token")
            .arg("1")
            .ignore()
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(5000)
            .ignore()
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_millis(500)))
        .await
        .unwrap();
    let r = session.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(r.is_none(), "granted with only 1 of 3 nodes");
    let client = redis::Client::open(node_url(3)).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "the minority grant on node 3 was left behind");
    for i in [1, 2] {
        let client = redis::Client::open(node_url(i)).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// A holds on nodes 1 and 2 (node 3 was down). Node 1 restarts without its
/// data and node 3 comes back empty: together they are a majority that knows
/// nothing of A. They must not grant before A's lease could have expired, and
/// A must learn it lost the lock before B gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_nodes_do_not_regrant_early() {
    let _serial = SERIAL.lock().await;
    if services::skipped("redlock", "fault test") {
        return;
    }
    let name = unique("regrant");
    // A renews every TTL/3 = 2 s, longer than the restarts below take, so
    // without the boot guard B would win nodes 1 and 3 before A notices.
    let url = redlock_url("6s");
    let ttl = Duration::from_secs(6);
    let a_backend = RedisBackend::connect(&url).await.expect("redlock up");
    a_backend.wait_ready(Duration::from_secs(10)).await.unwrap();
    services::run(&["kill", "redis-r3"]);
    let a = a_backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let ga = a.lock(&name).unwrap().acquire().await.unwrap();
    let lost = ga.lost();
    let watcher = tokio::spawn(async move { (lost.await, Instant::now()) });

    services::run(&["restart", "redis-r1"]);
    services::run(&["up", "redis-r3"]);
    let b_backend = RedisBackend::connect(&url).await.expect("redlock back");
    let b = b_backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let gb = b
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(20))
        .await
        .expect("B gets the lock once the restarted nodes may grant");
    let b_at = Instant::now();
    let (reason, a_lost_at) = tokio::time::timeout(Duration::from_secs(5), watcher)
        .await
        .expect("A's lost() fired")
        .unwrap();
    assert_ne!(reason, LostReason::Released);
    assert!(
        a_lost_at <= b_at,
        "B got the lock {:?} before A learned it lost it",
        a_lost_at - b_at
    );
    assert!(
        gb.token() > ga.token(),
        "token {} after {}",
        gb.token(),
        ga.token()
    );
    drop(ga);
    gb.release().await.unwrap();
}
