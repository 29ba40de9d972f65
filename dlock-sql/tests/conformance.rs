//! The conformance suite on PostgreSQL, MariaDB/MySQL and SQLite, against the
//! real servers from `scripts/services` (SQLite on a temporary file).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Capabilities, Harness, conformance_tests};
use dlock_core::{Backend, Error};
use dlock_sql::{SqlBackend, SqlOptions};

struct SqlHarness {
    store: &'static str,
    url: String,
}

impl SqlHarness {
    fn from_env(store: &'static str, default: &str) -> Self {
        let var = format!("DLOCK_TEST_{}_URL", store.to_uppercase());
        let url = std::env::var(var).unwrap_or_else(|_| default.to_owned());
        let url = format!(
            "{url}{}dlock_table=dlock_test_locks",
            if url.contains('?') { '&' } else { '?' }
        );
        Self { store, url }
    }

    fn postgres() -> Self {
        Self::from_env("postgres", "postgres://dlock:dlock@127.0.0.1:15432/dlock")
    }

    fn mysql() -> Self {
        Self::from_env("mysql", "mysql://dlock:dlock@127.0.0.1:13306/dlock")
    }

    fn sqlite() -> Self {
        let file =
            std::env::temp_dir().join(format!("dlock-conformance-{}.db", std::process::id()));
        Self::from_env("sqlite", &format!("sqlite://{}", file.display()))
    }
}

#[async_trait]
impl Harness for SqlHarness {
    fn store(&self) -> &str {
        self.store
    }

    /// What the backend declares for this URL ([`SqlOptions::capabilities`],
    /// which its `Backend::capabilities` returns), with the test TTL.
    fn capabilities(&self) -> Capabilities {
        let own = SqlOptions::from_url(&self.url)
            .expect("the test URL")
            .capabilities();
        let mut caps = Capabilities::new(Duration::from_secs(1));
        (caps.fair, caps.durable_tokens, caps.no_herd) =
            (own.fair, own.durable_tokens, own.no_herd);
        (caps.notify_wakeup, caps.wakeup_bound) = (own.notify_wakeup, own.wakeup_bound);
        (caps.survives_reconnect, caps.restart_loses_locks) =
            (own.survives_reconnect, own.restart_loses_locks);
        caps.recovery_bound = own.recovery_bound;
        caps
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        Ok(Arc::new(SqlBackend::connect(&self.url).await?))
    }

    fn endpoints(&self) -> Vec<String> {
        match self.store {
            "sqlite" => Vec::new(), // a file: no wire
            _ => hosts_of(&self.url),
        }
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        Ok(Arc::new(
            SqlBackend::connect(&with_hosts(&self.url, via)).await?,
        ))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");
        match self.store {
            "sqlite" => None,
            store => Some(Arc::new(ServicesCommand::new(SERVICES, [store]))),
        }
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(
            SqlBackend::connect(url)
                .await
                .map(|b| Arc::new(b) as Arc<dyn Backend>),
        )
    }

    fn bad_urls(&self) -> Vec<String> {
        [
            "postgres://",
            "postgres://dlock:secret@127.0.0.1:15432/dlock?dlock_table=no-dashes",
            "mysql://dlock:secret@127.0.0.1:13306/dlock?dlock_pool=0",
            "postgres://dlock:secret@127.0.0.1:15432/dlock?dlock_tabel=misspelt",
            "sqlite://:memory:",
            "sqlite::memory:",
            "sqlite:relative.db",
            "oracle://x",
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        let backend = match SqlBackend::connect(&self.url).await {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        Some(backend.held_rows(prefix).await)
    }
}

mod postgres {
    use super::*;
    conformance_tests!(SqlHarness::postgres());
}

mod mysql {
    use super::*;
    conformance_tests!(SqlHarness::mysql());
}

mod sqlite {
    use super::*;
    conformance_tests!(SqlHarness::sqlite());
}

/// The harness runs the suite with what a connected backend declares: the
/// suite's expectations cannot drift from `Backend::capabilities`.
#[tokio::test]
async fn harness_declares_the_backends_capabilities() {
    for h in [
        SqlHarness::sqlite(),
        SqlHarness::postgres(),
        SqlHarness::mysql(),
    ] {
        if h.store != "sqlite" && dlock_conformance::skip_requested(h.store, "capabilities") {
            continue;
        }
        let backend = h
            .connect()
            .await
            .expect("start the servers (scripts/services up)");
        let (own, declared) = (backend.capabilities(), h.capabilities());
        let notify = h.store == "postgres";
        assert_eq!(own.notify_wakeup, notify, "{}", h.store);
        let pairs = [
            (own.fair, declared.fair),
            (own.durable_tokens, declared.durable_tokens),
            (own.notify_wakeup, declared.notify_wakeup),
            (own.no_herd, declared.no_herd),
            (own.survives_reconnect, declared.survives_reconnect),
            (own.restart_loses_locks, declared.restart_loses_locks),
        ];
        assert!(pairs.iter().all(|(a, b)| a == b), "{}: {pairs:?}", h.store);
        assert_eq!(own.wakeup_bound, declared.wakeup_bound, "{}", h.store);
        assert_eq!(own.recovery_bound, declared.recovery_bound, "{}", h.store);
    }
}
