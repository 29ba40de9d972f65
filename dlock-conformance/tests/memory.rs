//! The whole conformance suite on the in-memory reference backend, in both
//! of its lease models, with its in-process links and server control. Each
//! test gets its own private server, so cases cannot disturb each other.

use std::time::Duration;

use dlock_conformance::servers::MemoryServers;
use dlock_conformance::wire::MemoryLink;
use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_core::memory::{Link, MemoryAdapter, MemoryBackend};

fn memory(store: &str, server: MemoryBackend) -> AdapterHarness {
    let (plain, linked, counted) = (server.clone(), server.clone(), server.clone());
    AdapterHarness::new(store, MemoryAdapter)
        .url("memory://")
        .ttl(Duration::from_millis(300))
        .connect_with(move |_| std::future::ready(Ok(plain.linked().0)))
        .links(
            || MemoryLink(Link::new()),
            move |link| std::future::ready(Ok(linked.with_link(link.0))),
        )
        .servers(Some(MemoryServers(server)))
        .leftovers(move |_, prefix| std::future::ready(Ok(counted.objects(&prefix))))
        .bad_urls([
            "memory:/x",
            "memory://a b",
            "memory://x/y",
            "memory://u:p@x",
            "memory://x?fair=1",
            "redis://x",
        ])
}

conformance_tests!(mod per_hold, memory("memory", MemoryBackend::new()));
conformance_tests!(mod session_leases, memory("memory-leases", MemoryBackend::new().session_leases()));
