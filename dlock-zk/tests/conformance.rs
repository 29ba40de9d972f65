//! The conformance suite on a real standalone ZooKeeper and on a real
//! 3-node ensemble, both from `scripts/services`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Harness, Profile, conformance_tests};
use dlock_core::{Backend, Error};
use dlock_zk::{ZkAdapter, ZkBackend};

struct ZkHarness {
    store: &'static str,
    url: String,
}

impl ZkHarness {
    fn standalone() -> Self {
        let url =
            std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:12181".into());
        Self {
            store: "zk",
            url: format!("{url}/dlock-test"),
        }
    }

    fn ensemble() -> Self {
        let url = std::env::var("DLOCK_TEST_ZK_ENSEMBLE_URL")
            .unwrap_or_else(|_| "zk://127.0.0.1:22181,127.0.0.1:23181,127.0.0.1:24181".into());
        Self {
            store: "zk-ensemble",
            url: format!("{url}/dlock-test"),
        }
    }
}

#[async_trait]
impl Harness for ZkHarness {
    fn store(&self) -> &str {
        self.store
    }

    fn profile(&self) -> Profile {
        // The test servers run with tickTime 100 ms (sessions from 200 ms).
        let ttl = if self.store == "zk-ensemble" { 2 } else { 1 };
        Profile::new(Duration::from_secs(ttl), ZkAdapter.capabilities())
    }

    fn endpoints(&self) -> Vec<String> {
        hosts_of(&self.url)
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        let url = with_hosts(&self.url, via);
        Ok(Arc::new(ZkBackend::connect(&url).await?))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");
        Some(Arc::new(if self.store == "zk-ensemble" {
            ServicesCommand::new(SERVICES, ["zk-e1", "zk-e2", "zk-e3"]).group("zk-ensemble")
        } else {
            ServicesCommand::new(SERVICES, ["zk"])
        }))
    }

    fn start_hint(&self) -> String {
        match self.store {
            "zk-ensemble" => "scripts/services up zk-ensemble".into(),
            _ => "scripts/services up zk".into(),
        }
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = ZkBackend::connect(&self.url).await?;
        // Every case checks that the backend promises what it is tested for.
        assert_eq!(backend.capabilities(), self.profile().store);
        Ok(Arc::new(backend))
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(
            ZkBackend::connect(url)
                .await
                .map(|b| Arc::new(b) as Arc<dyn Backend>),
        )
    }

    fn bad_urls(&self) -> Vec<String> {
        [
            "zk://",
            "zk://127.0.0.1",
            "zk://u:secret@127.0.0.1:12181/bad root",
            "zk://127.0.0.1:12181/zookeeper",
            "zookeeper://127.0.0.1:12181",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        Some(match ZkBackend::connect(&self.url).await {
            Ok(b) => b.nodes_under(prefix).await,
            Err(e) => Err(e),
        })
    }
}

mod zk {
    use super::*;
    conformance_tests!(ZkHarness::standalone());
}

mod zk_ensemble {
    use super::*;
    conformance_tests!(ZkHarness::ensemble());
}
