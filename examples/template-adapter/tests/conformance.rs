//! The whole conformance suite on `tenant+redis://`: one macro call over an
//! `AdapterHarness`. The server: `$DLOCK_TEST_TENANT_REDIS_URL`, else the
//! Redis that the dlock repository's `scripts/services up redis` runs.

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_template_adapter::{TenantAdapter, TenantBackend};

fn tenant_redis() -> AdapterHarness {
    AdapterHarness::new("tenant-redis", TenantAdapter)
        .default_url("tenant+redis://127.0.0.1:16379?tenant=conformance")
        .ttl(Duration::from_millis(500))
        .services(["redis"]) // kill, pause, restart through $DLOCK_SERVICES
        .leftovers(|url, prefix| async move {
            TenantBackend::connect(&url).await?.leftovers(&prefix).await
        })
        .bad_urls([
            "tenant+redis://127.0.0.1:16379",
            "tenant+redis://h:1?tenant=a&tenat=b",
            "tenant+redis://127.0.0.1:16379?tenant=a&max_ttl=2s", // dlock-redis refuses it
        ])
}

conformance_tests!(tenant_redis());
