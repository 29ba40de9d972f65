//! Faults on real ZooKeeper servers from `scripts/services`: a session that
//! expires while it holds a lock, and the ensemble losing its leader while a
//! lock is held and waiters queue.
//!
//! Runs in its own test binary (cargo runs binaries one after another); the
//! tests take a process-wide lock because they pause or kill servers.

use std::sync::Arc;
use std::time::Duration;

use dlock_conformance::checker::{FencedRegister, History, Op, Phase};
use dlock_conformance::services;
use dlock_core::{Backend, LockName, LostReason, SessionOptions};
use dlock_zk::ZkBackend;
use tokio::time::Instant;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A holder whose session expires (the server was paused past its timeout)
/// learns of it by its local deadline; its node disappears; a waiter with a
/// longer session gets the lock with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_frees_the_lock_for_a_waiter() {
    let _serial = SERIAL.lock().await;
    if services::skipped("zk", "fault test") {
        return;
    }
    let url = std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:12181".into());
    let url = format!("{url}/dlock-test");
    let name = LockName::new(format!("expiry/{:08x}", rand::random::<u32>())).unwrap();
    let a = ZkBackend::connect(&url).await.expect("zk up");
    let a = a
        .session(SessionOptions::new().ttl(Duration::from_secs(1)))
        .await
        .unwrap();
    let ga = a.lock(&name).unwrap().acquire().await.unwrap();
    let b = ZkBackend::connect(&url).await.unwrap();
    let b = b
        .session(SessionOptions::new().ttl(Duration::from_secs(8)))
        .await
        .unwrap();
    let lock = b.lock(&name).unwrap();
    let waiter = tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let pid = services::pid("zk");
    services::signal(&pid, "-STOP");
    let resume = services::Resume(pid);
    let reason = tokio::time::timeout(Duration::from_secs(3), ga.lost())
        .await
        .expect("lost() fired by the local deadline while the server was paused");
    assert_eq!(reason, LostReason::Expired);
    tokio::time::sleep(Duration::from_millis(1500)).await; // past A's session timeout
    drop(resume); // SIGCONT: the server expires A's session and its node

    let gb = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter got the lock")
        .unwrap()
        .expect("the waiter's session survived");
    assert!(
        gb.token() > ga.token(),
        "token {} after {}",
        gb.token(),
        ga.token()
    );
    let admin = ZkBackend::connect(&url).await.unwrap();
    let info = admin.inspect(&name).await.unwrap().expect("held by B");
    assert_eq!(info.holder, b.id().as_str());
    assert_eq!(info.waiters, Some(0), "A's node is still there");
    gb.release().await.unwrap();
}

/// `survives_reconnect`: the standalone server restarts (ZooKeeper keeps
/// sessions across a restart) while a lock is held; the client reconnects
/// within its session timeout, and the lock is still held and valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_survives_a_reconnect_within_the_session() {
    let _serial = SERIAL.lock().await;
    if services::skipped("zk", "fault test") {
        return;
    }
    let url = std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:12181".into());
    let url = format!("{url}/dlock-test");
    let name = LockName::new(format!("reconnect/{:08x}", rand::random::<u32>())).unwrap();
    let a = ZkBackend::connect(&url).await.expect("zk up");
    let a = a
        .session(SessionOptions::new().ttl(Duration::from_secs(12)))
        .await
        .unwrap();
    let held = a.lock(&name).unwrap().acquire().await.unwrap();
    let renewals_before = a.stats().renewals;
    let restarted = Instant::now();
    services::run(&["restart", "zk"]);
    eprintln!("zk restart took {:?}", restarted.elapsed());
    // Wait for a renewal after the restart: it proves the session reconnected.
    let deadline = Instant::now() + Duration::from_secs(15);
    while a.stats().renewals <= renewals_before + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        a.stats().renewals > renewals_before + 1,
        "no renewal succeeded after the restart"
    );
    assert!(
        held.is_held(),
        "lost after a reconnect: {:?}",
        held.lost_reason()
    );
    let admin = ZkBackend::connect(&url).await.unwrap();
    assert!(
        admin.validate(&name, held.token()).await.unwrap(),
        "the node did not survive"
    );
    held.release().await.unwrap();
}

/// Kill the ensemble's leader while a lock is held and waiters queue: the
/// holder's session survives the reconnection, nobody gets a double grant,
/// tokens increase, and the queue drains in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_with_a_held_lock_and_waiters() {
    let _serial = SERIAL.lock().await;
    if services::skipped("zk-ensemble", "fault test") {
        return;
    }
    let url = std::env::var("DLOCK_TEST_ZK_ENSEMBLE_URL")
        .unwrap_or_else(|_| "zk://127.0.0.1:22181,127.0.0.1:23181,127.0.0.1:24181".into());
    let url = format!("{url}/dlock-test");
    let name = LockName::new(format!("failover/{:08x}", rand::random::<u32>())).unwrap();
    let options = SessionOptions::new().ttl(Duration::from_secs(6));
    let register = Arc::new(FencedRegister::new());
    let history = Arc::new(History::new());
    let granted = Arc::new(std::sync::Mutex::new(Vec::new()));

    let holder = ZkBackend::connect(&url).await.expect("ensemble up");
    let holder = holder.session(options.clone()).await.unwrap();
    history.record(0, Op::Acquire, Phase::Invoke, None);
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    history.record(0, Op::Acquire, Phase::Ok, Some(held.token()));
    assert!(register.write(0, held.token()));

    let admin = ZkBackend::connect(&url).await.unwrap();
    let mut waiters = Vec::new();
    for client in 1..=4usize {
        let session = ZkBackend::connect(&url)
            .await
            .unwrap()
            .session(options.clone())
            .await
            .unwrap();
        let lock = session.lock(&name).unwrap();
        let (register, history, granted) = (register.clone(), history.clone(), granted.clone());
        waiters.push(tokio::spawn(async move {
            history.record(client, Op::Acquire, Phase::Invoke, None);
            let g = lock.acquire_timeout(Duration::from_secs(60)).await?;
            history.record(client, Op::Acquire, Phase::Ok, Some(g.token()));
            granted.lock().unwrap().push(client);
            let accepted = register.write(client, g.token());
            history.record(client, Op::Release, Phase::Invoke, None);
            g.release().await?;
            drop(session);
            Ok::<_, dlock_core::Error>(accepted)
        }));
        let deadline = Instant::now() + Duration::from_secs(10);
        while admin
            .inspect(&name)
            .await
            .ok()
            .flatten()
            .and_then(|i| i.waiters)
            < Some(client)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    let leader = services::run(&["leader", "zk-ensemble"]);
    assert!(leader.starts_with("zk-e"), "leader: {leader:?}");
    let killed = Instant::now();
    services::run(&["kill", &leader]);
    let _restore = services::Restore(leader);
    // Recovery: a new session (a write) succeeds through the survivors.
    loop {
        let probe = match ZkBackend::connect(&url).await {
            Ok(b) => b.session(options.clone()).await,
            Err(e) => Err(e),
        };
        match probe {
            Ok(_) => break,
            Err(e) if killed.elapsed() < Duration::from_secs(20) => {
                eprintln!("probe after {:?}: {e}", killed.elapsed());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no session 20 s after the leader was killed: {e}"),
        }
    }
    eprintln!(
        "zk leader kill: sessions open again after {:?}",
        killed.elapsed()
    );

    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        held.is_held(),
        "holder lost the lock in the failover: {:?}",
        held.lost_reason()
    );
    assert!(admin.validate(&name, held.token()).await.unwrap());
    history.record(0, Op::Release, Phase::Invoke, None);
    held.release().await.unwrap();
    for w in waiters {
        let accepted = tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("queue drains")
            .unwrap()
            .expect("waiter got the lock");
        assert!(accepted, "the register refused a write");
    }
    assert_eq!(
        *granted.lock().unwrap(),
        [1, 2, 3, 4],
        "FIFO order after failover"
    );
    register.check().unwrap();
    history.check().unwrap();
    assert_eq!(register.accepted(), 5);
}
