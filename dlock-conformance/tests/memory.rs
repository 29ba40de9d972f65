//! The whole conformance suite on the in-memory reference backend.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::{Capabilities, Harness, conformance_tests};
use dlock_core::memory::MemoryBackend;
use dlock_core::{Backend, Error};

/// Each test gets its own private service, so cases cannot disturb each other.
struct Memory(MemoryBackend);

impl Memory {
    fn new() -> Self {
        Memory(MemoryBackend::new())
    }
}

#[async_trait]
impl Harness for Memory {
    fn store(&self) -> &str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new(Duration::from_millis(300));
        caps.fair = true;
        caps.durable_tokens = true;
        caps.notify_wakeup = true;
        caps.no_herd = true;
        caps.wakeup_bound = Duration::from_millis(50);
        caps.recovery_bound = Duration::from_millis(300);
        caps
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        Ok(Arc::new(self.0.clone()))
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(MemoryBackend::connect(url).map(|b| Arc::new(b) as Arc<dyn Backend>))
    }

    fn bad_urls(&self) -> Vec<String> {
        [
            "memory:/x",
            "memory://a b",
            "memory://x/y",
            "memory://u:p@x",
            "memory://x?fair=1",
            "redis://x",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        Some(Ok(self.0.objects(prefix)))
    }

    async fn restart_server(&self) -> Option<Result<(), Error>> {
        self.0.restart();
        Some(Ok(()))
    }
}

conformance_tests!(Memory::new());
