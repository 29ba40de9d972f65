//! The conformance suite on a real standalone ZooKeeper and on a real 3-node
//! ensemble (test servers: tickTime 100 ms, sessions from 200 ms), under the
//! root `/dlock-test`.

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_zk::{ZkAdapter, ZkBackend};

const ENSEMBLE: &str = "zk://127.0.0.1:22181,127.0.0.1:23181,127.0.0.1:24181";

fn zk(store: &str, url: &str, ttl: u64) -> AdapterHarness {
    AdapterHarness::new(store, ZkAdapter)
        .default_url(url)
        .url_path("/dlock-test")
        .ttl(Duration::from_secs(ttl))
        .leftovers(|u, p| async move { ZkBackend::connect(&u).await?.nodes_under(&p).await })
        .bad_urls([
            "zk://",
            "zk://127.0.0.1",
            "zk://u:secret@127.0.0.1:12181/bad root",
            "zk://127.0.0.1:12181/zookeeper",
            "zookeeper://127.0.0.1:12181",
        ])
}

conformance_tests!(mod zk, zk("zk", "zk://127.0.0.1:12181", 1).services(["zk"]));
conformance_tests!(mod zk_ensemble, zk("zk-ensemble", ENSEMBLE, 2)
    .services(["zk-e1", "zk-e2", "zk-e3"]).group("zk-ensemble"));
