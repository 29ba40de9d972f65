//! The conformance suite on PostgreSQL, MariaDB/MySQL and SQLite, against the
//! real servers from `scripts/services` (SQLite on a temporary file).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Harness, Profile, conformance_tests};
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

    /// The test TTL, and what the backend declares for this URL
    /// ([`SqlOptions::capabilities`], which its `Backend::capabilities`
    /// returns).
    fn profile(&self) -> Profile {
        let declared = SqlOptions::from_url(&self.url).expect("the test URL");
        Profile::new(Duration::from_secs(1), declared.capabilities())
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = SqlBackend::connect(&self.url).await?;
        // Every case checks that the backend promises what it is tested for.
        assert_eq!(backend.capabilities(), self.profile().store);
        Ok(Arc::new(backend))
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
