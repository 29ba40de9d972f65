//! The conformance suite on a real single-node etcd and on a real 3-node
//! etcd cluster. etcd counts lease TTLs in whole seconds: 1 s is its minimum
//! with the test servers' 500 ms election timeout; the cluster gets 2 s
//! (etcd's default minimum: a raft write on two loaded cores can leave a 1 s
//! renewal too little room). Every client answers a ping before a case uses
//! it, also one behind the fault proxies.

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_etcd::{EtcdAdapter, EtcdBackend};

const CLUSTER: &str = "etcd://127.0.0.1:22379,127.0.0.1:23379,127.0.0.1:24379";

fn etcd(store: &str, url: &str, ttl: u64) -> AdapterHarness {
    AdapterHarness::new(store, EtcdAdapter)
        .default_url(url)
        .ttl(Duration::from_secs(ttl))
        .ready(|backend| async move { backend.ping().await })
        .leftovers(|u, p| async move { EtcdBackend::connect(&u).await?.keys_under(&p).await })
        .bad_urls([
            "etcd://",
            "etcd://127.0.0.1",
            "etcd://u:secret@127.0.0.1:12379/bad prefix",
            "etcd://127.0.0.1:12379?opt=1",
            "consul://127.0.0.1:8500",
        ])
}

conformance_tests!(mod etcd, etcd("etcd", "etcd://127.0.0.1:12379", 1).services(["etcd"]));
conformance_tests!(mod etcd_cluster, etcd("etcd-cluster", CLUSTER, 2)
    .services(["etcd-c1", "etcd-c2", "etcd-c3"]).group("etcd-cluster"));
