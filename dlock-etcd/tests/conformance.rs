//! The conformance suite on a real single-node etcd and on a real 3-node
//! etcd cluster, both from `scripts/services`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Harness, Profile, conformance_tests};
use dlock_core::{Backend, Error};
use dlock_etcd::{EtcdAdapter, EtcdBackend};

struct EtcdHarness {
    store: &'static str,
    url: String,
}

impl EtcdHarness {
    fn single() -> Self {
        let url = std::env::var("DLOCK_TEST_ETCD_URL")
            .unwrap_or_else(|_| "etcd://127.0.0.1:12379".into());
        Self { store: "etcd", url }
    }

    fn cluster() -> Self {
        let url = std::env::var("DLOCK_TEST_ETCD_CLUSTER_URL")
            .unwrap_or_else(|_| "etcd://127.0.0.1:22379,127.0.0.1:23379,127.0.0.1:24379".into());
        Self {
            store: "etcd-cluster",
            url,
        }
    }
}

#[async_trait]
impl Harness for EtcdHarness {
    fn store(&self) -> &str {
        self.store
    }

    fn profile(&self) -> Profile {
        // etcd counts lease TTLs in whole seconds; 1 s is its minimum with
        // the test servers' 500 ms election timeout. The 3-node cluster gets
        // 2 s (etcd's default minimum): a raft write on two loaded cores can
        // take long enough that 1 s leaves a renewal too little room.
        let ttl = if self.store == "etcd-cluster" { 2 } else { 1 };
        Profile::new(Duration::from_secs(ttl), EtcdAdapter.capabilities())
    }

    fn endpoints(&self) -> Vec<String> {
        hosts_of(&self.url)
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        let url = with_hosts(&self.url, via);
        Ok(Arc::new({
            let b = EtcdBackend::connect(&url).await?;
            b.ping().await?;
            b
        }))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");
        Some(Arc::new(if self.store == "etcd-cluster" {
            ServicesCommand::new(SERVICES, ["etcd-c1", "etcd-c2", "etcd-c3"]).group("etcd-cluster")
        } else {
            ServicesCommand::new(SERVICES, ["etcd"])
        }))
    }

    fn start_hint(&self) -> String {
        match self.store {
            "etcd-cluster" => "scripts/services up etcd-c1 etcd-c2 etcd-c3".into(),
            _ => "scripts/services up etcd".into(),
        }
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = EtcdBackend::connect(&self.url).await?;
        backend.ping().await?;
        // Every case checks that the backend promises what it is tested for.
        assert_eq!(backend.capabilities(), self.profile().store);
        Ok(Arc::new(backend))
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(
            EtcdBackend::connect(url)
                .await
                .map(|b| Arc::new(b) as Arc<dyn Backend>),
        )
    }

    fn bad_urls(&self) -> Vec<String> {
        [
            "etcd://",
            "etcd://127.0.0.1",
            "etcd://u:secret@127.0.0.1:12379/bad prefix",
            "etcd://127.0.0.1:12379?opt=1",
            "consul://127.0.0.1:8500",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        Some(match EtcdBackend::connect(&self.url).await {
            Ok(b) => b.keys_under(prefix).await,
            Err(e) => Err(e),
        })
    }
}

mod etcd {
    use super::*;
    conformance_tests!(EtcdHarness::single());
}

mod etcd_cluster {
    use super::*;
    conformance_tests!(EtcdHarness::cluster());
}
