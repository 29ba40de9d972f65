//! etcd-specific behaviour the conformance suite does not cover, against the
//! real servers from `scripts/services`.

use std::time::Duration;

use dlock_conformance::wire::{Fault, Link, ProxyLink};
use dlock_core::url::StoreUrl;
use dlock_core::{Backend, SessionOptions};
use dlock_etcd::EtcdBackend;

fn cluster_url() -> Option<String> {
    if dlock_conformance::skip_requested("etcd-cluster", "adapter tests") {
        return None;
    }
    Some(
        std::env::var("DLOCK_TEST_ETCD_CLUSTER_URL")
            .unwrap_or_else(|_| "etcd://127.0.0.1:22379,127.0.0.1:23379,127.0.0.1:24379".into()),
    )
}

/// A client connects, and works, while one member of three refuses
/// connections (a majority is reachable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_while_a_minority_is_unreachable() {
    let Some(url) = cluster_url() else { return };
    let url = StoreUrl::parse(&url).unwrap();
    let hosts: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
    let link = ProxyLink::start(&hosts).await.unwrap();
    for dead in 0..3 {
        link.heal();
        link.set(dead, Fault::Cut);
        let via = url.with_hosts(&link.addrs().unwrap()).unwrap();
        for round in 0..5 {
            let backend = EtcdBackend::connect(&via)
                .await
                .unwrap_or_else(|e| panic!("member {dead} cut, round {round}: {e}"));
            let session = backend
                .session(SessionOptions::new().ttl(Duration::from_secs(2)))
                .await
                .unwrap_or_else(|e| panic!("member {dead} cut, round {round}: session: {e}"));
            let guard = session
                .lock(format!("adapter/minority-{:08x}", rand::random::<u32>()))
                .unwrap()
                .acquire_timeout(Duration::from_secs(2))
                .await
                .unwrap_or_else(|e| panic!("member {dead} cut, round {round}: acquire: {e}"));
            guard.release().await.unwrap();
            session.close().await.unwrap();
        }
    }
}

/// Issue 18: `inspect` (what `dlock status` shows) tells when a hold
/// expires unless renewed, from the holder's lease; red before: `None`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_tells_when_the_hold_expires() {
    if dlock_conformance::skip_requested("etcd", "adapter tests") {
        return;
    }
    let url =
        std::env::var("DLOCK_TEST_ETCD_URL").unwrap_or_else(|_| "etcd://127.0.0.1:12379".into());
    let backend = EtcdBackend::connect(&url).await.unwrap();
    let ttl = Duration::from_secs(5);
    let session = backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let name =
        dlock_core::LockName::new(format!("adapter/expiry-{:08x}", rand::random::<u32>())).unwrap();
    let guard = session.lock(&name).unwrap().acquire().await.unwrap();
    let asked = std::time::SystemTime::now();
    let info = backend.inspect(&name).await.unwrap().expect("held");
    assert_eq!(info.token, guard.token());
    let expires = info.expires_at.expect("an expiry from the lease");
    // etcd counts whole seconds; the lease was renewed within the last TTL.
    let left = expires.duration_since(asked).unwrap_or_default();
    assert!(
        left > Duration::ZERO && left <= ttl + Duration::from_secs(1),
        "{left:?}"
    );
    guard.release().await.unwrap();
    session.close().await.unwrap();
}
