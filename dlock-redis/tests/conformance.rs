//! The conformance suite on a real Redis (plain, and with the opt-in restart
//! guard) and on Redlock over five real Redis servers, all from
//! `scripts/services`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Capabilities, Harness, conformance_tests};
use dlock_core::{Backend, Error};
use dlock_redis::RedisBackend;

struct RedisHarness {
    store: &'static str,
    url: String,
    nodes: Vec<&'static str>,
    /// Whether the restart guard is on (always for Redlock).
    guarded: bool,
}

const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");

impl RedisHarness {
    fn single() -> Self {
        let url = std::env::var("DLOCK_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:16379".into());
        Self {
            store: "redis",
            url,
            nodes: vec!["redis"],
            guarded: false,
        }
    }

    /// Plain Redis with `restart_guard=true`: a restarted (or restored, or
    /// promoted) server grants nothing for `max_ttl`, so a restart does not
    /// lose held locks to another client. Short `max_ttl` for fast tests.
    fn guarded() -> Self {
        let mut harness = Self::single();
        let sep = if harness.url.contains('?') { '&' } else { '?' };
        harness.url = format!("{}{sep}restart_guard=true&max_ttl=2s", harness.url);
        harness.guarded = true;
        harness
    }

    fn redlock() -> Self {
        let url = std::env::var("DLOCK_TEST_REDLOCK_URL").unwrap_or_else(|_| {
            "redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382,127.0.0.1:16383,127.0.0.1:16384"
                .into()
        });
        // Short max_ttl so a fresh node accepts grants soon after start.
        let sep = if url.contains('?') { '&' } else { '?' };
        Self {
            store: "redlock",
            url: format!("{url}{sep}max_ttl=2s"),
            nodes: vec!["redis-r1", "redis-r2", "redis-r3", "redis-r4", "redis-r5"],
            guarded: true,
        }
    }
}

#[async_trait]
impl Harness for RedisHarness {
    fn store(&self) -> &str {
        self.store
    }

    /// The test TTL and what `RedisBackend::capabilities` promises for this
    /// URL (the `declared_capabilities` tests below compare the two).
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::new(Duration::from_millis(500));
        caps.notify_wakeup = true;
        caps.wakeup_bound = Duration::from_millis(100);
        // No persistence in the test servers, and tokens still survive a
        // restart (TIME floor): proven by the adapter's restart test.
        caps.durable_tokens = true;
        caps.recovery_bound = Duration::from_millis(500);
        caps.survives_reconnect = true;
        // No persistence in the test servers: a restart forgets held locks
        // (plain Redis without the guard; the restart guard keeps a
        // restarted node from granting until they have expired).
        caps.restart_loses_locks = !self.guarded;
        caps
    }

    fn endpoints(&self) -> Vec<String> {
        hosts_of(&self.url)
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        let backend = RedisBackend::connect(&with_hosts(&self.url, via)).await?;
        backend.wait_ready(Duration::from_secs(10)).await?;
        Ok(Arc::new(backend))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        Some(Arc::new(ServicesCommand::new(SERVICES, self.nodes.clone())))
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = RedisBackend::connect(&self.url).await?;
        Backend::ping(&backend).await?;
        backend.wait_ready(Duration::from_secs(10)).await?;
        Ok(Arc::new(backend))
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(
            RedisBackend::connect(url)
                .await
                .map(|b| Arc::new(b) as Arc<dyn Backend>),
        )
    }

    fn bad_urls(&self) -> Vec<String> {
        [
            "redis://",
            "redis://:secret@127.0.0.1:16379?dlock_prefix=no{braces}",
            "redis://127.0.0.1:1,127.0.0.1:2",
            "redlock://127.0.0.1:1,127.0.0.1:2",
            "redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382?max_ttl=soon",
            "http://127.0.0.1:16379",
            "redis://:secret@127.0.0.1:16379?max_tll=5s",
            "redis://127.0.0.1:16379?tls_ca=/etc/ca.pem",
            "redis://127.0.0.1:16379?max_ttl=5s",
            "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?restart_guard=false",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        Some(match RedisBackend::connect(&self.url).await {
            Ok(b) => b.leftovers(prefix).await,
            Err(e) => Err(e),
        })
    }
}

mod redis {
    use super::*;
    conformance_tests!(RedisHarness::single());
}

mod redis_guarded {
    use super::*;
    conformance_tests!(RedisHarness::guarded());
}

mod redlock {
    use super::*;
    conformance_tests!(RedisHarness::redlock());
}

/// The harness declares what the backend itself promises, for each URL form.
mod declared_capabilities {
    use super::*;

    async fn check(harness: RedisHarness, case: &str) {
        if dlock_conformance::skip_requested(harness.store, case) {
            return;
        }
        let declared = harness.capabilities();
        // Errors and messages show the URL without its password.
        let shown = dlock_core::url::redact(&harness.url);
        let backend = RedisBackend::connect(&harness.url)
            .await
            .unwrap_or_else(|e| panic!("{e}; is it up (scripts/services up)?"));
        let promised = backend.capabilities();
        // The fields the two types share (the harness adds the test TTL).
        macro_rules! promises {
            ($c:expr) => {
                (
                    $c.fair,
                    $c.durable_tokens,
                    $c.notify_wakeup,
                    $c.no_herd,
                    $c.survives_reconnect,
                    $c.restart_loses_locks,
                    $c.wakeup_bound,
                    $c.recovery_bound,
                )
            };
        }
        assert_eq!(promises!(declared), promises!(promised), "{shown}");
    }

    #[tokio::test]
    async fn redis() {
        check(RedisHarness::single(), "declared_capabilities").await;
    }

    #[tokio::test]
    async fn redis_guarded() {
        check(RedisHarness::guarded(), "declared_capabilities").await;
    }

    #[tokio::test]
    async fn redlock() {
        check(RedisHarness::redlock(), "declared_capabilities").await;
    }
}
