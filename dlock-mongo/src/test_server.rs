//! The test server, for the crate's own tests of queries on the wire.

use std::time::Duration;

use crate::client::Clients;

/// A client of the test server (`DLOCK_TEST_MONGO_URL`, default
/// `scripts/services`' mongo), on the test database.
pub(crate) async fn clients() -> Clients {
    let url = std::env::var("DLOCK_TEST_MONGO_URL").unwrap_or_else(|_| {
        "mongodb://dlock:dlock@127.0.0.1:17017/?directConnection=true\
         &authMechanism=SCRAM-SHA-256"
            .to_owned()
    });
    let options = crate::MongoOptions::from_url(&url).unwrap();
    let mut client_options = mongodb::options::ClientOptions::parse(options.driver_url())
        .await
        .unwrap();
    client_options.server_selection_timeout = Some(Duration::from_secs(5));
    Clients::new(crate::client::Spec {
        options: client_options,
        database: "dlock_test".to_owned(),
        locks: crate::DEFAULT_LOCKS.to_owned(),
        sessions: crate::DEFAULT_SESSIONS.to_owned(),
        collection_options: crate::collection_options(),
    })
    .unwrap()
}
