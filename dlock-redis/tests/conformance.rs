//! The conformance suite on a real Redis (plain, and with the opt-in restart
//! guard: a restarted server grants nothing for `max_ttl`, short here for
//! fast tests), on Redlock over five real Redis servers, and on a Redis
//! Cluster of three masters with a replica each (its wire faults through a
//! proxy per node: `address_map` sends the driver's connections to the
//! nodes the cluster announces through them). What the cases
//! expect is what `RedisBackend::capabilities` declares for each URL; server
//! faults go through the supervisor in `DLOCK_SERVICES`.

use std::time::Duration;

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_redis::{RedisAdapter, RedisBackend};

const REDIS: &str = "redis://127.0.0.1:16379";
const CLUSTER: &str = "redis+cluster://127.0.0.1:16401,127.0.0.1:16402,127.0.0.1:16403,\
                       127.0.0.1:16404,127.0.0.1:16405,127.0.0.1:16406";
const REDLOCK: &str =
    "redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382,127.0.0.1:16383,127.0.0.1:16384";

fn redis(store: &str, url: &str) -> AdapterHarness {
    AdapterHarness::new(store, RedisAdapter)
        .default_url(url)
        .ttl(Duration::from_millis(500))
        .leftovers(|u, p| async move { RedisBackend::connect(&u).await?.leftovers(&p).await })
        .bad_urls([
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
            "redis+cluster://127.0.0.1:16401/3",
            "redis+cluster://127.0.0.1:16401?tls=true",
        ])
}

conformance_tests!(mod redis, redis("redis", REDIS).services(["redis"]));
conformance_tests!(mod redis_guarded, redis("redis", REDIS).url_option("restart_guard", "true")
    .url_option("max_ttl", "2s").services(["redis"]));
// DLOCK_TEST_REDIS_CLUSTER_URL names the one-node cluster that
// `redis_cluster_is_refused` (setup.rs) connects to with redis://.
conformance_tests!(mod redis_cluster, redis("redis-cluster", CLUSTER)
    .url_from_env("DLOCK_TEST_REDIS_CLUSTER3_URL", CLUSTER)
    // The driver connects to the nodes the cluster announces: the map sends
    // each through its proxy.
    .proxy_map_option("address_map")
    .services(["redis-c1", "redis-c2", "redis-c3", "redis-c4", "redis-c5", "redis-c6"]));
conformance_tests!(mod redlock, redis("redlock", REDLOCK).url_option("max_ttl", "2s")
    .services(["redis-r1", "redis-r2", "redis-r3", "redis-r4", "redis-r5"]));
