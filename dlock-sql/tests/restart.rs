//! S2 across a real server restart: tokens issued after PostgreSQL or MariaDB
//! restarts are larger than every token before it (the lock row is durable).
//!
//! Runs in its own test binary, so no other test is connected while the
//! server restarts (cargo runs test binaries one after another).

use std::time::Duration;

use dlock_conformance::services;
use dlock_core::{Backend, SessionOptions};
use dlock_sql::SqlBackend;

async fn tokens_survive_restart(store: &str, default: &str) {
    if services::skipped(store, "tokens_survive_restart") {
        return;
    }
    let url = std::env::var(format!("DLOCK_TEST_{}_URL", store.to_uppercase()))
        .unwrap_or_else(|_| default.to_owned());
    let name = format!("restart/{:08x}", rand::random::<u32>());
    let before = {
        let backend = SqlBackend::connect(&url)
            .await
            .expect("server up (scripts/services up)");
        let session = backend.session(SessionOptions::new()).await.unwrap();
        let mut last = 0;
        for _ in 0..3 {
            let g = session.lock(&name).unwrap().acquire().await.unwrap();
            last = g.token().get();
            g.release().await.unwrap();
        }
        session.close().await.unwrap();
        last
    };
    services::run(&["restart", store]);
    let backend = SqlBackend::connect(&url)
        .await
        .expect("server back after restart");
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    let g = session.lock(&name).unwrap().acquire().await.unwrap();
    assert!(
        g.token().get() > before,
        "{store}: token {} after restart, {before} before",
        g.token()
    );
    g.release().await.unwrap();
}

#[tokio::test]
async fn tokens_survive_server_restarts() {
    // One test, so the two restarts never overlap.
    tokens_survive_restart("postgres", "postgres://dlock:dlock@127.0.0.1:15432/dlock").await;
    tokens_survive_restart("mysql", "mysql://dlock:dlock@127.0.0.1:13306/dlock").await;
}
