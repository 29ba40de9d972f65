//! Redlock faults below the adapter, on the five real Redis masters of
//! `scripts/services`: a majority down, nodes unreachable when a client
//! connects, partial grants, nodes restarted without their data or from an
//! old snapshot. Server control goes through `ServicesCommand` (the same
//! interface the conformance suite uses).
//!
//! Runs in its own test binary (cargo runs binaries one after another), and
//! its tests take a process-wide lock, so servers restart only while nothing
//! else uses them.

mod common;

use std::time::Duration;

use common::{
    Faults, command, node_url, redlock_servers, redlock_url, skipped, unique, with_options,
};
use dlock_conformance::wire::{Fault, Link, ProxyLink};
use dlock_core::url::StoreUrl;
use dlock_core::{Backend, Error, LostReason, Session, SessionOptions};
use dlock_redis::RedisBackend;
use tokio::time::{Instant, sleep};

/// One fault test at a time: they restart shared servers.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A Redlock fault test's servers and turn (see [`common::Faults`]).
async fn begin(test: &str) -> Option<Faults> {
    Faults::begin(&SERIAL, "redlock", test, redlock_servers()).await
}

/// A session on `backend` with lease `ttl`.
async fn session(backend: &RedisBackend, ttl: Duration) -> Session {
    backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap()
}

async fn connect(url: &str) -> RedisBackend {
    let backend = RedisBackend::connect(url)
        .await
        .unwrap_or_else(|e| panic!("redlock up? (scripts/services up redis-r1 .. redis-r5): {e}"));
    backend
        .wait_ready(Duration::from_secs(10))
        .await
        .expect("a majority may grant");
    backend
}

/// The lock's hash on node `i`: its `session` field, if the key exists.
async fn holder_on(i: usize, name: &str) -> Option<String> {
    command(
        &node_url(i),
        &["HGET", &format!("dlock:{{{name}}}"), "session"],
    )
    .await
}

/// With three of five nodes down, acquiring fails with a retryable error
/// (never a grant) and quickly; when they return, grants resume with larger
/// tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn majority_down_fails_then_recovers() {
    let Some(faults) = begin("majority_down_fails_then_recovers").await else {
        return;
    };
    let servers = &faults.servers;
    let name = unique("majority");
    let backend = connect(&with_options(&redlock_url(), "max_ttl=1s")).await;
    let session = session(&backend, Duration::from_millis(500)).await;
    let g = session.lock(&name).unwrap().acquire().await.unwrap();
    let before = g.token();
    g.release().await.unwrap();

    for node in 0..3 {
        servers.kill(node).await.unwrap();
    }
    let r = session.lock(&name).unwrap().try_acquire().await;
    assert!(
        matches!(r, Err(ref e) if e.is_retryable()),
        "with 3 of 5 nodes down: {r:?}"
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

    servers.start_all().await.unwrap();
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

/// Item 1 of "safety holes": the connect succeeds when a majority answers and
/// fails with a retryable `Unavailable` when not; a node unreachable at
/// connect stays part of the backend (the quorum is 3 of the 5 configured
/// nodes, not of the 3 reachable) and takes part in grants once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_needs_a_majority_and_keeps_the_others() {
    let Some(faults) = begin("connect_needs_a_majority_and_keeps_the_others").await else {
        return;
    };
    let servers = &faults.servers;
    let url = with_options(&redlock_url(), "max_ttl=1s");
    servers.kill(3).await.unwrap();
    servers.kill(4).await.unwrap();
    let backend = connect(&url).await;

    servers.kill(2).await.unwrap();
    let start = Instant::now();
    match RedisBackend::connect(&url).await {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(
                e.to_string().contains("only 2 of 5"),
                "the error should count the nodes: {e}"
            );
        }
        other => panic!("connect with 2 of 5 nodes up gave {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "a refused connect took {:?}",
        start.elapsed()
    );
    // The backend connected with 3 of 5 cannot grant on 2 of them.
    let session = session(&backend, Duration::from_millis(500)).await;
    let name = unique("reconnect");
    let r = session.lock(&name).unwrap().try_acquire().await;
    assert!(
        matches!(r, Err(ref e) if e.is_retryable()),
        "granted on 2 of 5 nodes: {r:?}"
    );

    servers.start_all().await.unwrap();
    // The restarted nodes start their guard at first contact, then grant.
    let _ = session.lock(&name).unwrap().try_acquire().await;
    sleep(Duration::from_millis(1200)).await;
    let g = session
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(5))
        .await
        .expect("grants once the nodes are back");
    for node in [2, 3, 4] {
        assert_eq!(
            holder_on(node, &name).await.as_deref(),
            Some(session.id().as_str()),
            "node {node}, down when the backend connected, holds no lock of ours"
        );
    }
    g.release().await.unwrap();
}

/// A client that wins only a minority of nodes releases what it won at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_acquire_is_cleaned_up() {
    let _serial = SERIAL.lock().await;
    if skipped("redlock", "partial_acquire_is_cleaned_up") {
        return;
    }
    let name = unique("partial");
    let key = format!("dlock:{{{name}}}");
    let backend = connect(&with_options(&redlock_url(), "max_ttl=1s")).await;
    // Someone else holds the lock on nodes 0, 1 and 2 (a foreign client).
    for i in 0..3 {
        let _: () = command(
            &node_url(i),
            &[
                "HSET",
                &key,
                "owner",
                "someone-else#1",
                "session",
                "someone-else",
                "token",
                "1",
            ],
        )
        .await;
        let _: () = command(&node_url(i), &["PEXPIRE", &key, "5000"]).await;
    }
    let session = session(&backend, Duration::from_millis(500)).await;
    let r = session.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(r.is_none(), "granted with only 2 of 5 nodes");
    for i in [3, 4] {
        let exists: i64 = command(&node_url(i), &["EXISTS", &key]).await;
        assert_eq!(exists, 0, "the minority grant on node {i} was left behind");
    }
    for i in 0..3 {
        let _: () = command(&node_url(i), &["DEL", &key]).await;
    }
}

/// A holds on nodes 0..2 (nodes 3 and 4 were down). Node 0 restarts without
/// its data, and nodes 3 and 4 come back empty: together they are a majority
/// that knows nothing of A. They must not grant before A's lease could have
/// expired, and A must learn it lost the lock before B gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_nodes_do_not_regrant_early() {
    let Some(faults) = begin("restarted_nodes_do_not_regrant_early").await else {
        return;
    };
    let servers = &faults.servers;
    let name = unique("regrant");
    // A renews every TTL/3 = 2 s, longer than the restarts below take, so
    // without the guard B would win nodes 0, 3 and 4 before A notices.
    let url = with_options(&redlock_url(), "max_ttl=6s");
    let ttl = Duration::from_secs(6);
    let a_backend = connect(&url).await;
    servers.kill(3).await.unwrap();
    servers.kill(4).await.unwrap();
    let a = session(&a_backend, ttl).await;
    let ga = a.lock(&name).unwrap().acquire().await.unwrap();
    let lost = ga.lost();
    let watcher = tokio::spawn(async move { (lost.await, Instant::now()) });

    servers.kill(0).await.unwrap();
    servers.start_all().await.unwrap();
    let b_backend = RedisBackend::connect(&url).await.expect("redlock back");
    let b = session(&b_backend, ttl).await;
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

/// Item 4 of "safety holes": nodes 0 and 1 come back from snapshots taken
/// before A's grant. The snapshots hold dlock's own restart record, so a
/// guard that trusts what the data says sees no restart; the server's
/// `run_id` is new all the same. A holds on nodes 0..2 (it cannot reach 3
/// and 4) and is cut off while the nodes restart, so it goes on believing
/// in its hold until its local deadline: B must not get the lock from nodes
/// 0, 1, 3 and 4 before then (S4), and its token is larger (S2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_restored_from_old_snapshots_do_not_regrant() {
    let Some(faults) = begin("nodes_restored_from_old_snapshots_do_not_regrant").await else {
        return;
    };
    let servers = &faults.servers;
    let url = with_options(&redlock_url(), "max_ttl=2s");
    let ttl = Duration::from_secs(2);
    let name = unique("snapshot");
    // dlock's state (restart records included) on every node, then the
    // snapshots.
    let c = connect(&url).await;
    let cs = session(&c, ttl).await;
    cs.lock(&name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for node in [0, 1] {
        servers
            .snapshot(node)
            .await
            .expect("redis snapshots")
            .unwrap();
    }

    let parsed = StoreUrl::parse(&url).unwrap();
    let hosts: Vec<String> = parsed.hosts().iter().map(ToString::to_string).collect();
    let link = ProxyLink::start(&hosts).await.unwrap();
    link.set(3, Fault::Cut);
    link.set(4, Fault::Cut);
    let a_backend = connect(parsed.with_hosts(&link.addrs().unwrap()).unwrap().expose()).await;
    let a = session(&a_backend, ttl).await;
    let ga = a.lock(&name).unwrap().acquire().await.unwrap();
    let first = ga.token();
    link.set_all(Fault::BLACKHOLE);

    for node in [0, 1] {
        servers.kill(node).await.unwrap();
        servers.start(node).await.unwrap();
    }
    let b_backend = RedisBackend::connect(&url).await.expect("redlock back");
    let b = session(&b_backend, ttl).await;
    let gb = loop {
        if let Some(gb) = b.lock(&name).unwrap().try_acquire().await.unwrap() {
            break gb;
        }
        assert!(
            Instant::now() < ga.deadline() + ttl * 3,
            "B never got the lock"
        );
        sleep(Duration::from_millis(20)).await;
    };
    let b_got = Instant::now();
    assert!(
        ga.deadline() <= b_got,
        "B got the lock {:?} before the local deadline of A, which holds it, after nodes 0 \
         and 1 came back from old snapshots (token {} vs {first})",
        ga.deadline() - b_got,
        gb.token()
    );
    assert!(gb.token() > first, "token {} after {first}", gb.token());
    link.heal();
    gb.release().await.unwrap();
    drop(ga);
    // Later restarts must not load these old snapshots.
    for node in [0, 1] {
        servers.kill(node).await.unwrap();
        servers.wipe(node).await.expect("redis wipes").unwrap();
        servers.start(node).await.unwrap();
    }
}

/// Redlock tokens across nodes whose clocks differ (adversarial review): a
/// grant's token may come from a node whose clock runs ahead (each node
/// proposes `max(last + 1, its TIME in µs)`). A later grant on a quorum that
/// shares only one node with the first must still get a larger token, also
/// after the single-Redis keep time of the last-token key (10 s) — so
/// Redlock nodes keep that key for good. Red before: the key expired 10 s
/// after the release and the later grant's token was the other nodes' clock,
/// a minute behind the first token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_ordered_whatever_the_node_clocks() {
    let Some(faults) = begin("tokens_ordered_whatever_the_node_clocks").await else {
        return;
    };
    let servers = &faults.servers;
    let backend = connect(&with_options(&redlock_url(), "max_ttl=1s")).await;
    let session = session(&backend, Duration::from_millis(500)).await;
    let name = unique("skew");
    let last_key = format!("dlock:{{{name}}}:t");
    // Node 0's clock a minute ahead: its proposal is its clock, simulated by
    // a last token a minute ahead of its real clock.
    let time: Vec<String> = command(&node_url(0), &["TIME"]).await;
    let now_us = time[0].parse::<u64>().unwrap() * 1_000_000 + time[1].parse::<u64>().unwrap();
    let ahead = now_us + 60_000_000;
    let _: String = command(&node_url(0), &["SET", &last_key, &ahead.to_string()]).await;
    let g1 = session.lock(&name).unwrap().acquire().await.unwrap();
    let t1 = g1.token().get();
    assert!(t1 > ahead, "the quorum's largest proposal: {t1} <= {ahead}");
    g1.release().await.unwrap();
    for node in 0..5 {
        let ttl: i64 = command(&node_url(node), &["PTTL", &last_key]).await;
        assert_eq!(
            ttl, -1,
            "node {node} lets the last token expire (PTTL {ttl} ms)"
        );
    }
    // Past a single Redis's keep time, nodes 0 and 1 are gone: the next
    // quorum is 2, 3, 4, whose clocks are a minute behind t1.
    sleep(Duration::from_millis(10_500)).await;
    servers.kill(0).await.unwrap();
    servers.kill(1).await.unwrap();
    let g2 = session
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(5))
        .await
        .expect("a grant on nodes 2, 3 and 4");
    assert!(
        g2.token().get() > t1,
        "token went back: {} after {t1}",
        g2.token()
    );
    g2.release().await.unwrap();
}
