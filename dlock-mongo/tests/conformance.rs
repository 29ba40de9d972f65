//! The conformance suite on a real MongoDB-wire server: `DLOCK_TEST_MONGO_URL`,
//! default the server `scripts/services up mongo` runs (the mongo-wire server,
//! which presents as a `mongos` but is one process with one clock, so dlock
//! may trust it: `dlock_mongos=allow`; or a single-node replica set where a
//! `mongod` is installed).
//!
//! Wire faults: every linked client reaches the server through a fault proxy
//! with `directConnection=true`, so the driver's topology is `Single` and
//! never opens a connection to an address the server advertises (`hello`'s
//! `hosts`, `me`, `primary`). Server faults: the supervisor in
//! `DLOCK_SERVICES`, only when the URL is the one it serves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock_conformance::{AdapterHarness, Harness, conformance_tests};
use dlock_mongo::{MongoAdapter, MongoBackend};

const URL: &str =
    "mongodb://dlock:dlock@127.0.0.1:17017/?directConnection=true&authMechanism=SCRAM-SHA-256";

fn mongo() -> AdapterHarness {
    AdapterHarness::new("mongo", MongoAdapter)
        .default_url(URL)
        .url_option("dlock_db", "dlock_test")
        .url_option("dlock_mongos", "allow")
        .proxied_option("directConnection", "true")
        .services(["mongo"])
        .leftovers(|u, p| async move { MongoBackend::connect(&u).await?.held_docs(&p).await })
        .bad_urls([
            "mongodb://",
            "mongodb://dlock:secret@127.0.0.1:17017/?dlock_db=bad.name",
            "mongodb://127.0.0.1:17017/?dlock_locks=system.locks",
            "mongodb://127.0.0.1:17017/?dlock_locks=same&dlock_sessions=same",
            "mongodb://127.0.0.1:notaport/",
            "mongodb+srv://127.0.0.1:17017/",
            "mongo://127.0.0.1:17017",
            "mongodb://127.0.0.1:17017/?dlock_mongos=sometimes",
            "mongodb://127.0.0.1:17017/?dlock_lokcs=misspelt",
            "mongodb://127.0.0.1:17017/?tls=true&tlsCAFile=/nonexistent/ca.pem",
        ])
}

conformance_tests!(mod mongo, mongo());

/// On the deployment under test, a backend declares change-stream wake-ups
/// exactly when its waiters use them, and the bounds the cases rely on.
#[tokio::test]
async fn capabilities_follow_the_deployment() {
    if dlock_conformance::skip_requested("mongo", "capabilities_follow_the_deployment") {
        return;
    }
    let streams = Arc::new(AtomicBool::new(false));
    let seen = streams.clone();
    let harness = mongo().connect_with(move |url| {
        let seen = seen.clone();
        async move {
            let backend = MongoBackend::connect(&url).await?;
            seen.store(backend.change_streams(), Ordering::SeqCst);
            Ok(backend)
        }
    });
    let backend = Harness::connect(&harness).await;
    let caps = backend
        .unwrap_or_else(|e| panic!("{e}; {}", Harness::start_hint(&harness)))
        .capabilities();
    let streams = streams.load(Ordering::SeqCst);
    assert_eq!(caps.notify_wakeup, streams);
    let bound = if streams { 150 } else { 300 };
    assert_eq!(caps.wakeup_bound, Duration::from_millis(bound));
    assert!(caps.durable_tokens && caps.survives_reconnect, "{caps:?}");
    assert!(
        !caps.fair && !caps.no_herd && !caps.restart_loses_locks,
        "{caps:?}"
    );
    assert_eq!(caps.recovery_bound, Duration::from_secs(1));
}
