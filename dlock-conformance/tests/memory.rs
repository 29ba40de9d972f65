//! The whole conformance suite on the in-memory reference backend, in both
//! of its lease models, with its in-process links and server control.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{MemoryServers, Servers};
use dlock_conformance::wire::{Link, MemoryLink};
use dlock_conformance::{Harness, Profile, conformance_tests};
use dlock_core::memory::MemoryBackend;
use dlock_core::{Backend, Error};

/// Each test gets its own private service, so cases cannot disturb each other.
struct Memory {
    store: &'static str,
    server: MemoryBackend,
}

impl Memory {
    fn per_hold() -> Self {
        Memory {
            store: "memory",
            server: MemoryBackend::new(),
        }
    }

    fn session_leases() -> Self {
        Memory {
            store: "memory-leases",
            server: MemoryBackend::new().session_leases(),
        }
    }
}

#[async_trait]
impl Harness for Memory {
    fn store(&self) -> &str {
        self.store
    }

    fn profile(&self) -> Profile {
        Profile::new(Duration::from_millis(300), self.server.capabilities())
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        Ok(Arc::new(self.server.linked().0))
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
        Some(Ok(self.server.objects(prefix)))
    }

    async fn link(&self) -> Option<Result<Arc<dyn Link>, Error>> {
        Some(Ok(Arc::new(MemoryLink(dlock_core::memory::Link::new()))))
    }

    async fn connect_over(&self, link: &dyn Link) -> Result<Arc<dyn Backend>, Error> {
        let link = link
            .as_any()
            .downcast_ref::<MemoryLink>()
            .ok_or_else(|| Error::Config("not a memory link".into()))?;
        Ok(Arc::new(self.server.with_link(link.0.clone())))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        Some(Arc::new(MemoryServers(self.server.clone())))
    }
}

mod per_hold {
    use super::*;
    conformance_tests!(Memory::per_hold());
}

mod session_leases {
    use super::*;
    conformance_tests!(Memory::session_leases());
}
