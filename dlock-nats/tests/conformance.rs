//! The conformance suite on a real `nats-server` with JetStream:
//! `DLOCK_TEST_NATS_URL`, default the one `scripts/services up nats` runs.
//! The bucket's `max_age` is the suite's TTL (see the crate docs).

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_nats::NatsAdapter;

fn nats() -> AdapterHarness {
    AdapterHarness::new("nats", NatsAdapter)
        .default_url("nats://127.0.0.1:14222/dlock_test")
        .url_option("max_age", "5s")
        .ttl(Duration::from_secs(1))
        .services(["nats"])
        .bad_urls([
            "nats://",
            "nats://127.0.0.1:14222/bad.bucket",
            "nats://127.0.0.1:14222/dlock_test?max_age=soon",
            "nats://127.0.0.1:14222/dlock_test?max_age=10ms",
            "nats://127.0.0.1:14222/dlock_test?max_aeg=1s",
            "http://127.0.0.1:14222",
        ])
}

conformance_tests!(mod nats, nats());
