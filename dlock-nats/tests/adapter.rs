//! Adapter-specific cases on a real `nats-server` (`scripts/services up
//! nats`; `DLOCK_TEST_NATS_URL`): what the conformance suite cannot set up.

use std::time::Duration;

use dlock_core::{Backend, Error, SessionOptions};
use dlock_nats::NatsBackend;

/// The server of `DLOCK_TEST_NATS_URL` (its host and port), with `bucket`.
fn url(bucket: &str) -> String {
    let base = std::env::var("DLOCK_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:14222".to_owned());
    let authority = base
        .trim_start_matches("nats://")
        .split(['/', '?'])
        .next()
        .unwrap_or_default()
        .to_owned();
    format!("nats://{authority}/{bucket}?max_age=5s")
}

async fn raw_client(bucket_url: &str) -> async_nats::Client {
    let authority = bucket_url
        .trim_start_matches("nats://")
        .split('/')
        .next()
        .unwrap();
    async_nats::connect(format!("nats://{authority}"))
        .await
        .expect("nats-server is up (scripts/services up nats)")
}

/// Deletes the bucket's stream, if there is one.
async fn delete_bucket(client: &async_nats::Client, bucket: &str) {
    client
        .request(format!("$JS.API.STREAM.DELETE.KV_{bucket}"), "".into())
        .await
        .expect("stream delete answered");
}

/// S2: a server that lost its stream's sequence (here: the bucket's
/// stream deleted and made again, as a kill that loses the last writes, or
/// a restart that forgets an emptied stream's last sequence, would leave
/// it) hands out sequences again; a client that saw higher ones takes
/// again until the sequence passes them, so its next token is still
/// larger. Red before: the take was granted with token 1, below the
/// earlier grants' tokens.
#[tokio::test]
async fn tokens_never_go_back_when_the_stream_sequence_does() {
    let bucket = "dlock_seq_back";
    let url = url(bucket);
    let raw = raw_client(&url).await;
    delete_bucket(&raw, bucket).await;
    let backend = NatsBackend::connect(url.as_str()).await.unwrap();
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    let mut last = 0;
    for _ in 0..5 {
        let guard = session.lock("x").unwrap().acquire().await.unwrap();
        last = guard.token().get();
        guard.release().await.unwrap();
    }
    assert!(last >= 5, "tokens so far end at {last}");
    delete_bucket(&raw, bucket).await;
    // Another client makes the bucket again: its sequences start at 1.
    let other = NatsBackend::connect(url.as_str()).await.unwrap();
    let guard = session
        .lock("x")
        .unwrap()
        .acquire_timeout(Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        guard.token().get() > last,
        "a token went back: {} after {last}",
        guard.token()
    );
    guard.release().await.unwrap();
    // The refused takes left nothing behind.
    assert_eq!(other.keys_under("x").await.unwrap(), 0);
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// A bucket that keeps several values per key (or memory storage, or
/// replicas) breaks what releases and tokens rest on: it is refused with
/// a configuration error naming why, not used.
#[tokio::test]
async fn a_bucket_with_history_is_refused() {
    let bucket = "dlock_history";
    let url = url(bucket);
    let raw = raw_client(&url).await;
    delete_bucket(&raw, bucket).await;
    let config = format!(
        r#"{{"name":"KV_{bucket}","subjects":["$KV.{bucket}.>"],"max_msgs_per_subject":5,
"max_age":5000000000,"storage":"file","num_replicas":1,"discard":"new",
"allow_rollup_hdrs":true,"allow_direct":true}}"#
    );
    let reply = raw
        .request(format!("$JS.API.STREAM.CREATE.KV_{bucket}"), config.into())
        .await
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&reply.payload).contains("\"error\""),
        "{:?}",
        reply.payload
    );
    let e = NatsBackend::connect(url.as_str()).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(_)) && e.to_string().contains("one value per key"),
        "{e:?}"
    );
    delete_bucket(&raw, bucket).await;
}

/// NatsFence refuses what it cannot keep its promise on: a bucket that
/// drops values on its own (the lock bucket's `max_age`), a key KV would
/// refuse, and a key that was deleted (its token went with it: an older
/// holder would otherwise write as if first).
#[tokio::test]
async fn the_fence_refuses_what_would_forget_tokens() {
    use dlock_core::{FenceError, FencingToken};
    use dlock_nats::NatsFence;

    let url = url("dlock_fence_refusals");
    let raw = raw_client(&url).await;
    let js = async_nats::jetstream::new(raw.clone());
    // A bucket with max_age (made by the lock backend).
    let _backend = NatsBackend::connect(url.as_str()).await.unwrap();
    let aging = js.get_key_value("dlock_fence_refusals").await.unwrap();
    let e = NatsFence::new("acct")
        .put(&js, &aging, FencingToken::new(5), "1".into())
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::InvalidResource { .. }), "{e:?}");
    delete_bucket(&raw, "dlock_fence_refusals").await;

    // A bucket without max_age.
    let bucket = "dlock_fence_keep";
    delete_bucket(&raw, bucket).await;
    let config = format!(
        r#"{{"name":"KV_{bucket}","subjects":["$KV.{bucket}.>"],"max_msgs_per_subject":1,
"storage":"file","num_replicas":1,"discard":"new","allow_rollup_hdrs":true,"allow_direct":true}}"#
    );
    raw.request(format!("$JS.API.STREAM.CREATE.KV_{bucket}"), config.into())
        .await
        .unwrap();
    let kv = js.get_key_value(bucket).await.unwrap();
    let e = NatsFence::new("a..b")
        .put(&js, &kv, FencingToken::new(5), "1".into())
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::InvalidResource { .. }), "{e:?}");
    let fence = NatsFence::new("acct");
    fence
        .put(&js, &kv, FencingToken::new(7), "1".into())
        .await
        .unwrap();
    let e = fence
        .put(&js, &kv, FencingToken::new(5), "2".into())
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::Stale { .. }), "{e:?}");
    kv.delete("acct").await.unwrap();
    let e = fence
        .put(&js, &kv, FencingToken::new(5), "2".into())
        .await
        .unwrap_err();
    assert!(
        matches!(e, FenceError::Store { .. }) && e.to_string().contains("deleted"),
        "{e:?}"
    );
    delete_bucket(&raw, bucket).await;
}
