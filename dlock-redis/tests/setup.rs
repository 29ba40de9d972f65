//! How the adapter meets the server's own setup, on the real servers of
//! `scripts/services`: credentials (ACL users), an evicting
//! `maxmemory-policy`, a replica that is promoted (a failover), and, where
//! their servers are given, TLS and Redis Cluster.
//!
//! These tests change server settings (an ACL user, `maxmemory-policy`,
//! `REPLICAOF`) and put them back, also when they fail. They run in their own
//! test binary and one at a time.

mod common;

use std::time::Duration;

use common::{command, loud, node_url, redis_url, redlock_url, skipped, unique, with_options};
use dlock_core::url::StoreUrl;
use dlock_core::{Backend, Error, SessionOptions};
use dlock_redis::RedisBackend;
use tokio::time::Instant;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `restore` (server commands on `url`) when dropped.
struct Undo {
    url: String,
    commands: Vec<Vec<String>>,
}

impl Drop for Undo {
    fn drop(&mut self) {
        let url = self.url.clone();
        let commands = std::mem::take(&mut self.commands);
        dlock_conformance::process::run_aside(async move {
            for c in commands {
                let args: Vec<&str> = c.iter().map(String::as_str).collect();
                let _: redis::Value = command(&url, &args).await;
            }
        });
    }
}

fn undo(url: &str, commands: &[&[&str]]) -> Undo {
    Undo {
        url: url.to_owned(),
        commands: commands
            .iter()
            .map(|c| c.iter().map(|s| (*s).to_owned()).collect())
            .collect(),
    }
}

/// `CONFIG SET maxmemory <limit> maxmemory-policy <policy>` on `url`.
async fn set_maxmemory(url: &str, limit: &str, policy: &str) {
    let _: () = command(
        url,
        &[
            "CONFIG",
            "SET",
            "maxmemory",
            limit,
            "maxmemory-policy",
            policy,
        ],
    )
    .await;
}

/// Puts `url` back to no memory limit and `noeviction` when dropped.
fn undo_maxmemory(url: &str) -> Undo {
    undo(
        url,
        &[&[
            "CONFIG",
            "SET",
            "maxmemory",
            "0",
            "maxmemory-policy",
            "noeviction",
        ]],
    )
}

/// `redis://user:password@host:port` for the host of `url`.
fn as_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("scheme");
    format!("{scheme}://{user}:{password}@{rest}")
}

/// Two backends on `url`: one holds a fresh lock (named after `what`), the
/// other waits for it and must be woken (pub/sub) within 200 ms of the
/// release. Returns the holder's session and the lock's name.
async fn waiter_is_woken(url: &str, what: &str) -> (dlock_core::Session, String) {
    let backend = RedisBackend::connect(url).await.expect(what);
    let other = RedisBackend::connect(url).await.expect(what);
    let opts = SessionOptions::new().ttl(Duration::from_millis(500));
    let (a, b) = (
        backend.session(opts.clone()).await.unwrap(),
        other.session(opts).await.unwrap(),
    );
    let name = unique(what);
    let g = a.lock(&name).unwrap().acquire().await.unwrap();
    let waiter = {
        let lock = b.lock(&name).unwrap();
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let released = Instant::now();
    g.release().await.unwrap();
    let gb = waiter.await.unwrap().expect("the waiter gets the lock");
    assert!(
        released.elapsed() < Duration::from_millis(200),
        "{what}: woken after {:?}: no notification through pub/sub?",
        released.elapsed()
    );
    gb.release().await.unwrap();
    (a, name)
}

/// Item 20: a wrong password is `Error::Auth` (not retryable, the password
/// not shown), at once, not `Unavailable` retried until a timeout; the right
/// one works, also for Redlock and for the pub/sub connection; a password
/// changed under a live backend is `Auth` at the next reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_an_auth_error() {
    let _serial = SERIAL.lock().await;
    if skipped("redis", "wrong_password_is_an_auth_error") {
        return;
    }
    const USER: &str = "dlock-test-user";
    let admin = redis_url();
    let _: () = command(
        &admin,
        &[
            "ACL",
            "SETUSER",
            USER,
            "reset",
            "on",
            ">right-pa$$",
            "~*",
            "&*",
            "+@all",
        ],
    )
    .await;
    let _undo = undo(&admin, &[&["ACL", "DELUSER", USER]]);

    for wrong in [
        as_user(&redis_url(), USER, "wrong-pa%24%24"),
        as_user(&redis_url(), "no-such-user", "wrong-pa%24%24"),
    ] {
        let connect = RedisBackend::connect(&wrong);
        let within = Duration::from_secs(3);
        dlock_conformance::unit::assert_auth_refused(
            "wrong credentials",
            connect,
            within,
            &["wrong-pa"],
        )
        .await;
    }

    // The right password works end to end, waiting (pub/sub) included.
    let right = as_user(&redis_url(), USER, "right-pa%24%24");
    let (a, name) = waiter_is_woken(&right, "auth").await;

    // The password changes and the connections drop: the next request
    // reconnects and is refused as Auth, not retried as Unavailable.
    let _: () = command(&admin, &["ACL", "SETUSER", USER, "resetpass", ">new-pass"]).await;
    let _: redis::Value = command(&admin, &["CLIENT", "KILL", "USER", USER]).await;
    // The first request may still meet the dropped connection
    // (`Unavailable`); the reconnect after it must be refused as `Auth`.
    let until = Instant::now() + Duration::from_secs(3);
    loop {
        match a.lock(&name).unwrap().try_acquire().await {
            Err(Error::Auth { .. }) => break,
            Err(e) if e.is_retryable() && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("after the password changed: {other:?}"),
        }
    }

    // Redlock: the same credentials go to every node.
    if !skipped("redlock", "wrong_password_is_an_auth_error (redlock)") {
        let url = as_user(&redlock_url(), "no-such-user", "wrong");
        let e = RedisBackend::connect(&url).await.unwrap_err();
        assert!(matches!(e, Error::Auth { .. }), "{e:?}");
    }
}

/// Item 12: lock keys carry a TTL, so with a `maxmemory` any policy but
/// `noeviction` (`volatile-*` as much as `allkeys-*`) can evict a held lock.
/// Such a server is refused with `Error::Config` naming the policy, unless
/// the URL says `allow_eviction=true`; on a Redlock node too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_policy_is_refused() {
    let _serial = SERIAL.lock().await;
    if skipped("redis", "evicting_policy_is_refused") {
        return;
    }
    let url = redis_url();
    let _undo = undo_maxmemory(&url);
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        set_maxmemory(&url, "1gb", policy).await;
        let e = RedisBackend::connect(&url).await.unwrap_err();
        assert!(
            matches!(e, Error::Config(ref m) if m.contains(policy) && m.contains("evict")),
            "{policy}: {e:?}"
        );
        RedisBackend::connect(&with_options(&url, "allow_eviction=true"))
            .await
            .expect("allow_eviction=true accepts the risk");
    }
    // No memory limit: nothing is evicted (a warning only).
    set_maxmemory(&url, "0", "allkeys-lru").await;
    RedisBackend::connect(&url)
        .await
        .expect("no maxmemory: nothing to evict");

    if !skipped("redlock", "evicting_policy_is_refused (redlock)") {
        let node = node_url(2);
        let _undo = undo_maxmemory(&node);
        set_maxmemory(&node, "1gb", "volatile-lfu").await;
        let e = RedisBackend::connect(&with_options(&redlock_url(), "max_ttl=1s"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::Config(ref m) if m.contains("volatile-lfu")),
            "{e:?}"
        );
    }
}

/// Item 18 and failover: a client pointed at a replica gets `READONLY`,
/// which is retryable (`Unavailable`, after a failover a new connection may
/// reach the new master); once the replica is promoted, the restart guard
/// sees a server process that is not the one its record (replicated from
/// the old master) names, and grants only after `max_ttl`, with a larger
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_then_failover() {
    let _serial = SERIAL.lock().await;
    if skipped("redlock", "replica_then_failover") {
        return;
    }
    // Two of the Redlock masters, used as a plain master and its replica.
    let (master, replica) = (node_url(3), node_url(4));
    let guarded = "restart_guard=true&max_ttl=2s";
    let a = RedisBackend::connect(&with_options(&master, guarded))
        .await
        .expect("master up");
    a.wait_ready(Duration::from_secs(10)).await.unwrap();
    let opts = SessionOptions::new().ttl(Duration::from_millis(500));
    let sa = a.session(opts.clone()).await.unwrap();
    let name = unique("failover");
    let g = sa.lock(&name).unwrap().acquire().await.unwrap();
    let before = g.token();
    g.release().await.unwrap();

    // Held while the replica attaches: a master given its first replica
    // draws a new replication id, which is no new term for the guard.
    let kept = sa.lock(unique("kept")).unwrap().acquire().await.unwrap();

    let host = master.trim_start_matches("redis://");
    let (h, p) = host.rsplit_once(':').expect("host:port");
    let _undo = undo(&replica, &[&["REPLICAOF", "NO", "ONE"]]);
    let _: () = command(&replica, &["REPLICAOF", h, p]).await;
    common::eventually(Duration::from_secs(10), "the replica syncs", || async {
        let info: String = command(&replica, &["INFO", "replication"]).await;
        info.contains("master_link_status:up")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        kept.is_held(),
        "a replica attaching to a guarded master cost its holds: {:?}",
        kept.lost_reason()
    );
    kept.release().await.unwrap();

    let b = RedisBackend::connect(&with_options(&replica, guarded))
        .await
        .expect("a replica accepts connections");
    let sb = b.session(opts).await.unwrap();
    let r = sb.lock(&name).unwrap().try_acquire().await;
    match r {
        Err(ref e @ Error::Unavailable { .. }) => {
            assert!(e.to_string().to_lowercase().contains("readonly"), "{e}");
        }
        other => panic!("a take on a replica gave {other:?}"),
    }

    // The failover: the replica becomes a master.
    let _: () = command(&replica, &["REPLICAOF", "NO", "ONE"]).await;
    let start = Instant::now();
    assert!(
        sb.lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a promoted replica granted at once"
    );
    let g = sb
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(10))
        .await
        .expect("the new master grants after max_ttl");
    assert!(
        start.elapsed() >= Duration::from_millis(1500),
        "granted {:?} after the promotion",
        start.elapsed()
    );
    assert!(g.token() > before, "token {} after {before}", g.token());
    g.release().await.unwrap();
}

/// Item 18: a Redis Cluster node is refused with a clear `Error::Config`
/// naming Redis Cluster (not `Unavailable` retried forever). Needs a
/// cluster-enabled server: `DLOCK_TEST_REDIS_CLUSTER_URL` (see the README of
/// `scripts/services`); skipped loudly without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_is_refused() {
    let _serial = SERIAL.lock().await;
    let Ok(url) = std::env::var("DLOCK_TEST_REDIS_CLUSTER_URL") else {
        loud("SKIPPED redis::redis_cluster_is_refused: DLOCK_TEST_REDIS_CLUSTER_URL is not set");
        return;
    };
    let e = RedisBackend::connect(&url).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("Redis Cluster")),
        "{e:?}"
    );
    assert!(!e.is_retryable());
}

/// `redis+cluster://` given a standalone server is refused, typed, naming
/// what to use instead; so is `redis://` given a node of a real cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_and_standalone_urls_are_not_mixed_up() {
    let _serial = SERIAL.lock().await;
    if skipped("redis", "cluster_and_standalone_urls_are_not_mixed_up") {
        return;
    }
    let standalone = redis_url().replacen("redis://", "redis+cluster://", 1);
    let e = RedisBackend::connect(&standalone).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("not a Redis Cluster node") && m.contains("redis://host")),
        "{e:?}"
    );
    let Ok(cluster) = std::env::var("DLOCK_TEST_REDIS_CLUSTER3_URL") else {
        loud(
            "SKIPPED redis::cluster_and_standalone_urls_are_not_mixed_up (a cluster node given as redis://): DLOCK_TEST_REDIS_CLUSTER3_URL is not set",
        );
        return;
    };
    let first = StoreUrl::parse(&cluster).unwrap().hosts()[0].to_string();
    let e = RedisBackend::connect(format!("redis://{first}").as_str())
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("redis+cluster://")),
        "{e:?}"
    );
}

/// Item 20: TLS from the URL (`rediss://`, a private CA by `tls_ca`), end to
/// end; a CA that did not sign the server's certificate is refused. Needs a
/// TLS server: `DLOCK_TEST_REDIS_TLS_URL`, e.g.
/// `rediss://127.0.0.1:16390?tls_ca=/path/ca.pem`; skipped loudly without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_from_the_url() {
    let _serial = SERIAL.lock().await;
    let Ok(url) = std::env::var("DLOCK_TEST_REDIS_TLS_URL") else {
        loud("SKIPPED redis::tls_from_the_url: DLOCK_TEST_REDIS_TLS_URL is not set");
        return;
    };
    waiter_is_woken(&url, "tls").await;
    // Without the private CA the server's certificate is not trusted.
    let untrusted = url.split(['?', '#']).next().expect("a URL").to_owned();
    let e = RedisBackend::connect(&untrusted).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("tls_ca")),
        "an untrusted certificate gave {e:?}"
    );
}

/// S1: a Redlock listing one server twice under two spellings (the text
/// differs, the server is the same) is refused at connect: its "majority"
/// would count one server twice. Red before the run_id check: the connect
/// succeeded and two of three "nodes" were one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_one_server_listed_twice() {
    let _serial = SERIAL.lock().await;
    if skipped("redlock", "redlock_refuses_one_server_listed_twice") {
        return;
    }
    let url = dlock_core::url::StoreUrl::parse(&redlock_url()).unwrap();
    let first = url.hosts()[0].clone();
    let port = first.port.unwrap_or(6379);
    let mut hosts = url.hosts()[..3].to_vec();
    // 127.0.0.1 and 127.1 name one address; localhost resolves to it.
    hosts[1] = dlock_core::url::HostPort {
        host: if first.host == "127.0.0.1" {
            "127.1".into()
        } else {
            "localhost".into()
        },
        port: Some(port),
    };
    let twice = url.with_hosts(&hosts).unwrap();
    let e = RedisBackend::connect(&twice).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("same Redis server")),
        "{e:?}"
    );
    let distinct = url.with_hosts(&url.hosts()[..3]).unwrap();
    RedisBackend::connect(&distinct).await.unwrap();
}

/// Issue 18 (readiness): a Redlock deployment that dlock has just met says
/// how long its restart guard still refuses grants (`ready_in`), instead of
/// a first acquire that looks like a busy lock; after `wait_ready` it is
/// zero and a lock is granted at once. Red before: `ready_in` was the
/// trait's default, zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_says_how_long_its_guard_refuses() {
    // (serial: evicting_policy_is_refused sets an evicting policy on a
    // Redlock node, which refuses this test's connect meanwhile)
    let _serial = SERIAL.lock().await;
    if skipped("redlock", "redlock_says_how_long_its_guard_refuses") {
        return;
    }
    // A prefix of its own: the guard's clock starts on first sight.
    let prefix = format!("ready{:08x}", rand::random::<u32>());
    let url = with_options(&redlock_url(), &format!("dlock_prefix={prefix}&max_ttl=2s"));
    let backend = RedisBackend::connect(&url).await.unwrap();
    let first = backend.ready_in().await.unwrap();
    assert!(
        first > Duration::ZERO && first <= Duration::from_secs(2),
        "{first:?}"
    );
    backend.wait_ready(Duration::from_secs(10)).await.unwrap();
    assert_eq!(backend.ready_in().await.unwrap(), Duration::ZERO);
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(1)))
        .await
        .unwrap();
    let guard = session.lock(unique("ready")).unwrap().try_acquire().await;
    assert!(matches!(guard, Ok(Some(_))), "{guard:?}");
}
