//! The conformance suite on a real `nats-server` with JetStream:
//! `DLOCK_TEST_NATS_URL`, default the one `scripts/services up nats` runs.
//! The bucket keeps holds 5 s (`max_age`, the backend's `max_ttl`: the
//! case of 10,000 names renews with that TTL, one write per hold), the
//! other cases use sessions of 1 s; a crashed holder's lock is then free
//! `max_age` after its last renewal, which the recovery bound says.

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_nats::{NatsAdapter, NatsBackend};

fn nats() -> AdapterHarness {
    AdapterHarness::new("nats", NatsAdapter)
        .default_url("nats://127.0.0.1:14222/dlock_test?max_age=5s")
        .url_option("max_age", "5s")
        .ttl(Duration::from_secs(1))
        .services(["nats"])
        .leftovers(|u, p| async move { NatsBackend::connect(&u).await?.keys_under(&p).await })
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
