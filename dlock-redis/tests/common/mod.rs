//! Helpers shared by the adapter's own tests against the servers of
//! `scripts/services` (which honours `DLOCK_SERVICES_PORT_OFFSET` and
//! `DLOCK_SERVICES_DIR`; the URLs come from `scripts/services env`).

#![allow(dead_code)] // each test binary uses a part

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_core::url::StoreUrl;

/// This repository's `scripts/services`.
pub(crate) const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");

/// The plain Redis server (`redis`).
pub(crate) fn redis_url() -> String {
    std::env::var("DLOCK_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:16379".into())
}

/// The five Redlock masters (`redis-r1` .. `redis-r5`).
pub(crate) fn redlock_url() -> String {
    std::env::var("DLOCK_TEST_REDLOCK_URL").unwrap_or_else(|_| {
        "redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382,127.0.0.1:16383,127.0.0.1:16384"
            .into()
    })
}

/// `url` with `options` (`a=1&b=2`) added to its query.
pub(crate) fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{options}")
}

/// `redis://host:port` of Redlock node `i` (0-based, in URL order).
pub(crate) fn node_url(i: usize) -> String {
    let url = StoreUrl::parse(&redlock_url()).expect("DLOCK_TEST_REDLOCK_URL");
    format!("redis://{}", url.hosts()[i])
}

/// Process control of the Redlock masters, in URL order.
pub(crate) fn redlock_servers() -> Arc<dyn Servers> {
    Arc::new(ServicesCommand::new(
        SERVICES,
        ["redis-r1", "redis-r2", "redis-r3", "redis-r4", "redis-r5"],
    ))
}

/// A plain connection for setting up and checking server state.
pub(crate) async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis URL")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}; is it up (scripts/services up)?"))
}

/// Runs one command on `url`, panicking on an error.
pub(crate) async fn command<T: redis::FromRedisValue>(url: &str, args: &[&str]) -> T {
    let mut conn = raw(url).await;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("{url}: {args:?}: {e}"))
}

/// Whether `DLOCK_TEST_SKIP` names `store`; if so, says loudly that `what`
/// was skipped.
pub(crate) fn skipped(store: &str, what: &str) -> bool {
    dlock_conformance::skip_requested(store, what)
}

/// Writes past the test harness's output capture.
pub(crate) fn loud(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A fresh lock name.
pub(crate) fn unique(what: &str) -> String {
    format!("adapter-tests/{what}-{:08x}", rand::random::<u32>())
}

/// Starts every node when dropped, also when an assertion failed.
pub(crate) struct StartAll(pub Arc<dyn Servers>);

impl Drop for StartAll {
    fn drop(&mut self) {
        let servers = self.0.clone();
        dlock_conformance::process::run_aside(async move {
            let _ = servers.start_all().await;
        });
    }
}

/// What a server-fault test holds while it runs: its servers, started
/// again when it ends (also when it fails), and the lock that keeps the
/// fault tests of its binary one at a time.
pub(crate) struct Faults {
    pub(crate) servers: Arc<dyn Servers>,
    // Dropped in this order: the servers start before the next test runs.
    _restore: StartAll,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl Faults {
    /// Waits for the other fault tests of `serial`; `None` when
    /// `DLOCK_TEST_SKIP` names `store` (it says loudly that `test` was
    /// skipped).
    pub(crate) async fn begin(
        serial: &'static tokio::sync::Mutex<()>,
        store: &str,
        test: &str,
        servers: Arc<dyn Servers>,
    ) -> Option<Self> {
        let serial = serial.lock().await;
        if skipped(store, test) {
            return None;
        }
        Some(Self {
            _restore: StartAll(servers.clone()),
            servers,
            _serial: serial,
        })
    }
}

/// Polls `check` every 20 ms until it holds, at most `limit`.
pub(crate) async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < until,
            "{what}: not within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
