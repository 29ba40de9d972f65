//! The conformance suite on a real MongoDB-wire server: `DLOCK_TEST_MONGO_URL`,
//! default the server `scripts/services up mongo` runs (the mongo-wire server,
//! found as its header says, or a single-node replica set where a `mongod`
//! is installed).
//!
//! A server that is down fails every case with the command that starts it
//! (`dlock_conformance::run`), like every other store's; `DLOCK_TEST_SKIP=mongo`
//! skips them, loudly.
//!
//! Wire faults: every linked client reaches the server through a fault proxy
//! with `directConnection=true` to the proxy's address, so the driver's
//! topology is `Single` and never opens a connection to an address the server
//! advertises (`hello`'s `hosts`, `me`, `primary`). Server faults: kill, start,
//! pause and resume of `scripts/services`' `mongo` (the gateway and its
//! PostgreSQL together), only when the URL is the one `scripts/services`
//! serves.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::wire::{hosts_of, with_hosts};
use dlock_conformance::{Harness, Profile, conformance_tests};
use dlock_core::{Backend, Capabilities, Error};
use dlock_mongo::MongoBackend;
use tokio::sync::OnceCell;

/// What `scripts/services env` prints for mongo-wire.
const DEFAULT_URL: &str =
    "mongodb://dlock:dlock@127.0.0.1:17017/?directConnection=true&authMechanism=SCRAM-SHA-256";

const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");

fn base_url() -> String {
    std::env::var("DLOCK_TEST_MONGO_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// `url` with `key=value` set: an existing `key=...` is replaced.
fn with_option(url: &str, key: &str, value: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base.to_owned(), query),
        None if url
            .split_once("://")
            .is_some_and(|(_, rest)| rest.contains('/')) =>
        {
            (url.to_owned(), "")
        }
        None => (format!("{url}/"), ""),
    };
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some(key))
        .map(str::to_owned)
        .collect();
    pairs.push(format!("{key}={value}"));
    format!("{base}?{}", pairs.join("&"))
}

/// The URL of a client that reaches the one server at `via` (a proxy) and
/// nothing else: `directConnection=true` makes the driver's topology
/// `Single`, which never adds the hosts a server advertises.
fn direct_url(url: &str, via: &[SocketAddr]) -> Result<String, Error> {
    if url.starts_with("mongodb+srv://") || via.len() != 1 {
        return Err(Error::Config(format!(
            "the mongo harness routes one server through one proxy ({} given; \
             a multi-node deployment would need one direct client per node)",
            via.len()
        )));
    }
    Ok(with_option(
        &with_hosts(url, via),
        "directConnection",
        "true",
    ))
}

/// The `scripts/services` port of `mongo` (with its port offset).
fn services_endpoint() -> String {
    let offset: u16 = std::env::var("DLOCK_SERVICES_PORT_OFFSET")
        .ok()
        .and_then(|o| o.parse().ok())
        .unwrap_or(0);
    format!("127.0.0.1:{}", 17017 + offset)
}

/// What a backend on this deployment declares (whether wake-ups use change
/// streams depends on the deployment), found once per test binary; the
/// weakest promises if the server cannot be reached (every case then fails
/// in `dlock_conformance::run` with the command that starts it).
static DECLARED: OnceCell<Capabilities> = OnceCell::const_new();

struct MongoHarness {
    url: String,
    declared: Capabilities,
}

impl MongoHarness {
    async fn from_env() -> Self {
        // The mongo-wire server presents as a `mongos`; it is one process,
        // one clock, so dlock may trust it (see `MongosPolicy`).
        let url = with_option(
            &with_option(&base_url(), "dlock_db", "dlock_test"),
            "dlock_mongos",
            "allow",
        );
        let declared = DECLARED
            .get_or_init(|| async {
                match MongoBackend::connect(&url).await {
                    Ok(backend) => backend.capabilities(),
                    Err(_) => Capabilities::default(),
                }
            })
            .await
            .clone();
        Self { url, declared }
    }
}

#[async_trait]
impl Harness for MongoHarness {
    fn store(&self) -> &str {
        "mongo"
    }

    fn profile(&self) -> Profile {
        Profile::new(Duration::from_secs(1), self.declared.clone())
    }

    async fn connect(&self) -> Result<Arc<dyn Backend>, Error> {
        let backend = MongoBackend::connect(&self.url).await?;
        backend.ping().await?;
        // Every case checks that the backend promises what it is tested for.
        assert_eq!(backend.capabilities(), self.declared);
        Ok(Arc::new(backend))
    }

    fn endpoints(&self) -> Vec<String> {
        if self.url.starts_with("mongodb+srv://") {
            return Vec::new();
        }
        hosts_of(&self.url)
    }

    async fn connect_via(&self, via: &[SocketAddr]) -> Result<Arc<dyn Backend>, Error> {
        Ok(Arc::new(
            MongoBackend::connect(&direct_url(&self.url, via)?).await?,
        ))
    }

    fn servers(&self) -> Option<Arc<dyn Servers>> {
        // Only the server `scripts/services` runs: never kill someone's own.
        (self.endpoints() == [services_endpoint()])
            .then(|| Arc::new(ServicesCommand::new(SERVICES, ["mongo"])) as Arc<dyn Servers>)
    }

    async fn connect_url(&self, url: &str) -> Option<Result<Arc<dyn Backend>, Error>> {
        Some(
            MongoBackend::connect(url)
                .await
                .map(|b| Arc::new(b) as Arc<dyn Backend>),
        )
    }

    fn bad_urls(&self) -> Vec<String> {
        [
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
        ]
        .map(String::from)
        .to_vec()
    }

    async fn leftover_objects(&self, prefix: &str) -> Option<Result<usize, Error>> {
        Some(match MongoBackend::connect(&self.url).await {
            Ok(b) => b.held_docs(prefix).await,
            Err(e) => Err(e),
        })
    }
}

mod mongo {
    use super::*;
    conformance_tests!(MongoHarness::from_env().await);
}

#[test]
fn test_urls_get_options_set() {
    assert_eq!(
        with_option("mongodb://h:1/?replicaSet=rs0", "a", "1"),
        "mongodb://h:1/?replicaSet=rs0&a=1"
    );
    assert_eq!(with_option("mongodb://h:1", "a", "1"), "mongodb://h:1/?a=1");
    assert_eq!(
        with_option("mongodb://h:1/", "a", "1"),
        "mongodb://h:1/?a=1"
    );
    assert_eq!(
        with_option("mongodb://h:1/?", "a", "1"),
        "mongodb://h:1/?a=1"
    );
    assert_eq!(
        with_option("mongodb://h:1/admin", "a", "1"),
        "mongodb://h:1/admin?a=1"
    );
    assert_eq!(
        with_option("mongodb://h:1/?a=2&b=3", "a", "1"),
        "mongodb://h:1/?b=3&a=1"
    );
    let via = ["127.0.0.1:9".parse().unwrap()];
    assert_eq!(
        direct_url(
            "mongodb://u:p@h:1/?replicaSet=rs0&directConnection=false",
            &via
        )
        .unwrap(),
        "mongodb://u:p@127.0.0.1:9/?replicaSet=rs0&directConnection=true"
    );
    assert!(direct_url("mongodb+srv://u:p@c.example.net/", &via).is_err());
}

/// A backend declares change-stream wake-ups exactly when its waiters use
/// them, and the rest of what the harness used to declare by hand.
#[tokio::test]
async fn capabilities_follow_the_deployment() {
    if dlock_conformance::skip_requested("mongo", "capabilities_follow_the_deployment") {
        return;
    }
    let h = MongoHarness::from_env().await;
    let backend = MongoBackend::connect(&h.url)
        .await
        .expect("start the server with `scripts/services up mongo`");
    let caps = backend.capabilities();
    let streams = backend.change_streams();
    assert_eq!(caps.notify_wakeup, streams);
    let bound = if streams { 150 } else { 300 };
    assert_eq!(caps.wakeup_bound, Duration::from_millis(bound));
    assert!(caps.durable_tokens && caps.survives_reconnect, "{caps:?}");
    assert!(
        !caps.fair && !caps.no_herd && !caps.restart_loses_locks,
        "{caps:?}"
    );
    assert_eq!(caps.recovery_bound, Duration::from_secs(1));
    assert_eq!(caps, h.declared);
}
