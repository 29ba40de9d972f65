//! Kill the 3-node cluster's leader while a lock is held and waiters queue:
//! no double grant (fenced register + history), tokens keep increasing, and
//! the queue drains in order after a new leader is elected.
//!
//! Runs in its own test binary (cargo runs binaries one after another), so
//! no other test uses the cluster while a member is down.

use std::sync::Arc;
use std::time::Duration;

use dlock_conformance::checker::{FencedRegister, History, Op, Phase};
use dlock_conformance::services;
use dlock_core::{Backend, SessionOptions};
use dlock_etcd::EtcdBackend;
use tokio::time::Instant;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_with_a_held_lock_and_waiters() {
    if services::skipped("etcd-cluster", "leader_kill_with_a_held_lock_and_waiters") {
        return;
    }
    let url = std::env::var("DLOCK_TEST_ETCD_CLUSTER_URL")
        .unwrap_or_else(|_| "etcd://127.0.0.1:22379,127.0.0.1:23379,127.0.0.1:24379".into());
    let name =
        dlock_core::LockName::new(format!("failover/{:08x}", rand::random::<u32>())).unwrap();
    let options = SessionOptions::new().ttl(Duration::from_secs(3));
    let register = Arc::new(FencedRegister::new());
    let history = Arc::new(History::new());

    let holder = EtcdBackend::connect(&url).await.expect("cluster up");
    let holder = holder.session(options.clone()).await.unwrap();
    history.record(0, Op::Acquire, Phase::Invoke, None);
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    history.record(0, Op::Acquire, Phase::Ok, Some(held.token()));
    assert!(register.write(0, held.token()));

    let admin = EtcdBackend::connect(&url).await.unwrap();
    let granted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for client in 1..=4usize {
        let backend = EtcdBackend::connect(&url).await.unwrap();
        let session = backend.session(options.clone()).await.unwrap();
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
            Ok::<_, dlock_core::Error>((client, accepted, Instant::now()))
        }));
        // Queue them in a known order.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let queued = admin
                .inspect(&name)
                .await
                .ok()
                .flatten()
                .and_then(|i| i.waiters);
            if queued >= Some(client) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    let leader = services::run(&["leader", "etcd-cluster"]);
    assert!(leader.starts_with("etcd-c"), "leader: {leader:?}");
    let killed = Instant::now();
    services::run(&["kill", &leader]);
    let _restore = services::Restore(leader.clone());
    // Recovery: a write (a lease grant) through the surviving members
    // succeeds again.
    loop {
        let probe = match EtcdBackend::connect(&url).await {
            Ok(b) => b.session(options.clone()).await,
            Err(e) => Err(e),
        };
        match probe {
            Ok(_) => break,
            Err(e) if killed.elapsed() < Duration::from_secs(15) => {
                eprintln!("probe after {:?}: {e}", killed.elapsed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("no write accepted 15 s after the leader was killed: {e}"),
        }
    }
    let recovered = killed.elapsed();
    eprintln!("etcd leader kill: writes succeed again after {recovered:?}");

    // The holder kept its lease through the election (etcd extends leases on
    // a leader change) and still holds the lock.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        held.is_held(),
        "holder lost the lock in the election: {:?}",
        held.lost_reason()
    );
    assert!(admin.validate(&name, held.token()).await.unwrap());
    history.record(0, Op::Release, Phase::Invoke, None);
    held.release().await.unwrap();

    for w in waiters {
        let (client, accepted, _) = tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("queue drains")
            .unwrap()
            .expect("waiter got the lock");
        assert!(accepted, "register refused client {client}'s write");
    }
    let order = granted.lock().unwrap().clone();
    assert_eq!(order, [1, 2, 3, 4], "FIFO order after failover");
    register.check().unwrap();
    history.check().unwrap();
    assert_eq!(register.accepted(), 5);
}
