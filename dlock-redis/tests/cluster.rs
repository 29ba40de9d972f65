//! Redis Cluster faults below the adapter, on the cluster of
//! `scripts/services` (group `redis-cluster3`: three masters and a replica
//! each, node timeout 1 s): the master of a held lock's slot killed, with
//! the restart guard and without. Server control goes through
//! `ServicesCommand` (the interface the conformance suite uses).
//!
//! What a failover may and may not do (the crate docs, "Eviction and
//! failover"): replication is asynchronous, so without the guard a failover
//! can lose a held lock; tokens never go back (S2: the new master's clock
//! floors them); with the guard, the promoted replica grants nothing in the
//! slot for `max_ttl`, so no hold it may have lost is granted again before
//! its holder's deadline (S1, S4).
//!
//! Runs in its own test binary; its tests take a process-wide lock, so the
//! servers restart only while nothing else of this binary uses them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Faults, raw, unique, with_options};
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_core::url::StoreUrl;
use dlock_core::{Backend, LockGuard, Session, SessionOptions};
use dlock_redis::RedisBackend;
use tokio::time::{Instant, sleep};

/// The cluster's nodes, in the URL's host order.
const NODES: [&str; 6] = [
    "redis-c1", "redis-c2", "redis-c3", "redis-c4", "redis-c5", "redis-c6",
];

/// One fault test at a time: they kill shared servers.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn cluster_url() -> String {
    std::env::var("DLOCK_TEST_REDIS_CLUSTER3_URL").unwrap_or_else(|_| {
        "redis+cluster://127.0.0.1:16401,127.0.0.1:16402,127.0.0.1:16403,\
         127.0.0.1:16404,127.0.0.1:16405,127.0.0.1:16406"
            .into()
    })
}

/// `redis://host:port` of node `i`.
fn node_url(i: usize) -> String {
    let url = StoreUrl::parse(&cluster_url()).expect("DLOCK_TEST_REDIS_CLUSTER3_URL");
    format!("redis://{}", url.hosts()[i])
}

/// A cluster fault test's servers and turn (see [`common::Faults`]), once
/// the cluster is whole: every node up, every slot served, every master
/// replicated (a test before may have left a killed master rejoining).
async fn begin(test: &str) -> Option<Faults> {
    let servers: Arc<dyn Servers> = Arc::new(ServicesCommand::new(common::SERVICES, NODES));
    let faults = Faults::begin(&SERIAL, "redis-cluster", test, servers).await?;
    faults
        .servers
        .start_all()
        .await
        .expect("the cluster starts");
    for i in 0..NODES.len() {
        cluster_ok(i).await;
    }
    every_master_replicated().await;
    Some(faults)
}

/// Waits until node `i` says the cluster serves every slot.
async fn cluster_ok(i: usize) {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut raw(&node_url(i)).await)
            .await
            .unwrap_or_default();
        if info.contains("cluster_state:ok") {
            return;
        }
        assert!(Instant::now() < until, "node {i}: the cluster is not ok");
        sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every master has a replica that is online (a master killed
/// by an earlier test rejoins as a replica, then syncs).
async fn every_master_replicated() {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let mut masters = 0;
        let mut replicated = 0;
        for i in 0..NODES.len() {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut raw(&node_url(i)).await)
                .await
                .unwrap_or_default();
            if info.contains("role:master") {
                masters += 1;
                if info.contains(",state=online,") {
                    replicated += 1;
                }
            }
        }
        // (node 0 answers `shard_of`: its slot map must name the replicas too,
        // which gossip brings a little after the masters see them)
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut raw(&node_url(0)).await)
            .await
            .unwrap_or_default();
        let listed = ranges
            .iter()
            .filter(|r| matches!(r, redis::Value::Array(parts) if parts.len() > 3))
            .count();
        if masters == 3 && replicated == 3 && listed == ranges.len() && listed >= 3 {
            return;
        }
        assert!(
            Instant::now() < until,
            "{replicated} of {masters} masters have an online replica"
        );
        sleep(Duration::from_millis(100)).await;
    }
}

/// The master of `name`'s slot now and its first replica (indexes in
/// [`NODES`]), from `CLUSTER SLOTS` on node `asked`.
async fn shard_of(name: &str, asked: usize) -> (usize, Option<usize>) {
    let mut conn = raw(&node_url(asked)).await;
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(format!("dlock:{{{name}}}"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .unwrap();
    let int = |v: &redis::Value| match v {
        redis::Value::Int(n) => *n,
        other => panic!("CLUSTER SLOTS: {other:?}"),
    };
    let node = |v: &redis::Value| {
        let redis::Value::Array(node) = v else {
            panic!("CLUSTER SLOTS: {v:?}");
        };
        let port = int(&node[1]);
        (0..NODES.len())
            .find(|&i| node_url(i).ends_with(&format!(":{port}")))
            .unwrap_or_else(|| panic!("port {port} is not a node of the URL"))
    };
    for range in ranges {
        let redis::Value::Array(parts) = range else {
            continue;
        };
        if (int(&parts[0])..=int(&parts[1])).contains(&slot) {
            return (node(&parts[2]), parts.get(3).map(node));
        }
    }
    panic!("slot {slot} is served by no master");
}

/// A fresh lock name whose slot another master than `master` serves.
async fn name_elsewhere(master: usize) -> String {
    loop {
        let name = unique("elsewhere");
        if shard_of(&name, 0).await.0 != master {
            return name;
        }
    }
}

async fn session(url: &str, ttl: Duration) -> (RedisBackend, Session) {
    let backend = RedisBackend::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cluster up? (scripts/services up redis-cluster3): {e}"));
    let session = backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    (backend, session)
}

/// Makes sure the replicas of `master` have everything it wrote so far
/// (replication is one ordered stream per master, so a write of ours that
/// a replica acknowledged comes after A's grant there).
async fn replicated(master: usize, name: &str) {
    let mut conn = raw(&node_url(master)).await;
    let _: () = redis::cmd("SET")
        .arg(format!("adapter-tests:{{{name}}}:sync"))
        .arg(1)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    // Short waits, tried again: a replica restarted by an earlier test may
    // still be in its first full sync.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(200)
            .query_async(&mut conn)
            .await
            .unwrap();
        if acked >= 1 {
            return;
        }
        assert!(
            Instant::now() < until,
            "no replica acknowledged the writes of node {master}"
        );
    }
}

/// Resumes a paused node when dropped, also when an assertion failed.
struct Resume(Arc<dyn Servers>, usize);

impl Drop for Resume {
    fn drop(&mut self) {
        let (servers, node) = (self.0.clone(), self.1);
        dlock_conformance::process::run_aside(async move {
            let _ = servers.resume(node).await;
        });
    }
}

/// A holds `name` with lease `ttl`; then the master of its slot is
/// killed, after its replica got A's grant (`replica_has_it`) or while the
/// replica was paused and cut off from it, so that the replica promoted in
/// its place never had it. B acquires after the failover. Returns A's guard,
/// B's guard, and how long before A's local deadline B was granted (zero:
/// not before).
async fn failover_while_held(
    faults: &Faults,
    url: &str,
    name: &str,
    ttl: Duration,
    replica_has_it: bool,
) -> (LockGuard, LockGuard, Duration) {
    let (_a_backend, a) = session(url, ttl).await;
    let (_b_backend, b) = session(url, ttl).await;
    let (master, replica) = shard_of(name, 0).await;
    let replica = replica.expect("every master has a replica (begin waited for it)");
    let mut paused = None;
    if !replica_has_it {
        // Paused, then cut from its master: nothing the master writes from
        // now on reaches it (a paused replica would otherwise still read
        // what the kernel buffered for it once resumed).
        faults.servers.pause(replica).await.unwrap();
        paused = Some(Resume(faults.servers.clone(), replica));
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .query_async(&mut raw(&node_url(master)).await)
            .await
            .unwrap();
    }
    let ga = a.lock(name).unwrap().acquire().await.unwrap();
    if replica_has_it {
        replicated(master, name).await;
    }
    faults.servers.kill(master).await.unwrap();
    let killed = Instant::now();
    drop(paused);
    let gb = b
        .lock(name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(30))
        .await
        .expect("B gets the lock after the failover");
    let granted = Instant::now();
    // Renewals only move the deadline forward, and none is confirmed once
    // the hold is lost: this is A's last deadline.
    let early = ga.deadline().saturating_duration_since(granted);
    eprintln!(
        "failover_while_held: B granted {:?} after the kill (A's lease {ttl:?}), {early:?} \
         before A's deadline",
        killed.elapsed()
    );
    (ga, gb, early)
}

/// Without the guard, the replica promoted had A's hold: A's renewals go
/// on against it after the failover (L3), B waits for A's release, and B's
/// token is larger (S2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_hold_survives_a_failover() {
    let Some(faults) = begin("a_replicated_hold_survives_a_failover").await else {
        return;
    };
    let name = unique("failover");
    let ttl = Duration::from_secs(8);
    let (_a_backend, a) = session(&cluster_url(), ttl).await;
    let (_b_backend, b) = session(&cluster_url(), ttl).await;
    let (master, _) = shard_of(&name, 0).await;
    let ga = a.lock(&name).unwrap().acquire().await.unwrap();
    replicated(master, &name).await;
    faults.servers.kill(master).await.unwrap();
    // Until the replica is promoted (another node's slot map names a new
    // master for the slot), then a full lease: A has renewed there.
    let other = (0..NODES.len()).find(|&i| i != master).unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while shard_of(&name, other).await.0 == master {
        assert!(Instant::now() < until, "no failover within 30 s");
        sleep(Duration::from_millis(100)).await;
    }
    sleep(ttl).await;
    assert!(ga.is_held(), "A lost its hold in a failover that kept it");
    assert!(
        b.lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "B took the lock A holds after the failover"
    );
    let before = ga.token();
    ga.release().await.unwrap();
    let gb = b
        .lock(&name)
        .unwrap()
        .acquire_timeout(Duration::from_secs(5))
        .await
        .unwrap();
    assert!(gb.token() > before, "token {} after {before}", gb.token());
    gb.release().await.unwrap();
}

/// Without the guard, the replica promoted never had A's hold: the lock is
/// lost in the failover, as the docs declare (`restart_loses_locks`). B
/// may be granted while A still believes it holds the lock, but B's token
/// is larger (S2: the new master's clock floors it), and A hears of the
/// loss at its next renewal, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_lost_in_a_failover_is_heard_of_and_tokens_increase() {
    let Some(faults) = begin("a_hold_lost_in_a_failover").await else {
        return;
    };
    let name = unique("lost-in-failover");
    let ttl = Duration::from_secs(8);
    let (ga, gb, early) = failover_while_held(&faults, &cluster_url(), &name, ttl, false).await;
    // What the guard (next test) is for: without it, B was granted while
    // A's deadline had not passed. Checked so that this fault is known to
    // lose the hold; if it ever did not, the next test would prove nothing.
    assert!(
        early > Duration::ZERO,
        "B was granted only after A's deadline: the promoted replica had A's hold after all"
    );
    assert!(
        gb.token() > ga.token(),
        "B's token {} is not above A's {} after the failover",
        gb.token(),
        ga.token()
    );
    let heard = tokio::time::timeout(ttl / 3 + Duration::from_secs(1), ga.lost()).await;
    assert!(
        heard.is_ok(),
        "A did not hear within a renewal period that its hold was lost"
    );
    gb.release().await.unwrap();
}

/// With the restart guard, the same fault: the promoted replica, which
/// never had A's hold, grants nothing in the slot for `max_ttl` (A's
/// lease), so A's deadline has passed before B is granted (S1), and B's
/// token is larger (S2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_guard_a_lost_hold_is_not_granted_before_its_deadline() {
    let Some(faults) = begin("with_the_guard_a_lost_hold").await else {
        return;
    };
    let ttl = Duration::from_secs(8);
    let url = with_options(&cluster_url(), "restart_guard=true&max_ttl=8s");
    // The guard's records exist for every slot before A's grant (a slot
    // seen for the first time waits max_ttl).
    let (backend, _) = session(&url, ttl).await;
    backend.wait_ready(Duration::from_secs(20)).await.unwrap();
    let name = unique("guarded-failover");
    let (ga, gb, early) = failover_while_held(&faults, &url, &name, ttl, false).await;
    assert!(
        gb.token() > ga.token(),
        "B's token {} is not above A's {} after the failover",
        gb.token(),
        ga.token()
    );
    assert_eq!(
        early,
        Duration::ZERO,
        "B was granted before A's deadline: the promoted replica granted within the guard's \
         max_ttl"
    );
    gb.release().await.unwrap();
}

/// A master stopped without closing its connections (SIGSTOP: a hung host)
/// is replaced by its replica; a client that keeps talking to the other
/// masters meanwhile (a renewal of another lock) must still find the new
/// master of the stopped one's slots, not wait for the stopped one to
/// answer (L1: the lock is free again once its master is replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_master_is_replaced_for_a_busy_client() {
    let Some(faults) = begin("a_stopped_master_is_replaced").await else {
        return;
    };
    let (_backend, b) = session(&cluster_url(), Duration::from_secs(3)).await;
    let wanted = unique("behind-stopped-master");
    let (master, _) = shard_of(&wanted, 0).await;
    // A lock on another master, renewed every second meanwhile.
    let other = name_elsewhere(master).await;
    let elsewhere = b.lock(&other).unwrap().acquire().await.unwrap();
    faults.servers.pause(master).await.unwrap();
    let _resume = Resume(faults.servers.clone(), master);
    let start = Instant::now();
    let got = b
        .lock(&wanted)
        .unwrap()
        .acquire_timeout(Duration::from_secs(20))
        .await;
    assert!(
        got.is_ok(),
        "no grant {:?} after the master was stopped (its replica took over after ~2.5 s): {got:?}",
        start.elapsed()
    );
    assert!(elsewhere.is_held(), "the lock on another master was lost");
    got.unwrap().release().await.unwrap();
    elsewhere.release().await.unwrap();
}

/// A session with holds on two masters, one of which dies: its failover
/// takes longer than the lease, so that master's hold is lost (its
/// deadline passes), but the renewals the other master answers keep the
/// other hold (L3: one failing master does not cost the holds the others
/// confirm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_on_other_masters_outlive_a_failover_longer_than_the_lease() {
    let Some(faults) = begin("holds_on_other_masters_outlive_a_failover").await else {
        return;
    };
    // The failover takes ~2.5 s here (node timeout 1 s): longer than the
    // lease.
    let (_backend, s) = session(&cluster_url(), Duration::from_secs(2)).await;
    let doomed = unique("on-the-killed-master");
    let (master, _) = shard_of(&doomed, 0).await;
    let other = name_elsewhere(master).await;
    let g_doomed = s.lock(&doomed).unwrap().acquire().await.unwrap();
    let g_other = s.lock(&other).unwrap().acquire().await.unwrap();
    faults.servers.kill(master).await.unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(5), g_doomed.lost()).await;
    assert!(
        lost.is_ok(),
        "the hold on the killed master outlived its lease"
    );
    sleep(Duration::from_secs(3)).await;
    assert!(
        g_other.is_held(),
        "the hold on a healthy master was lost with the killed master's: {:?}",
        g_other.lost_reason()
    );
    g_other.release().await.unwrap();
}
