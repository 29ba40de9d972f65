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

/// The URL of a `bucket` that does not exist yet, and a raw client.
async fn fresh(bucket: &str) -> (String, async_nats::Client) {
    let url = url(bucket);
    let raw = raw_client(&url).await;
    delete_bucket(&raw, bucket).await;
    (url, raw)
}

/// A fresh `bucket` reached directly and through a fault proxy: the
/// direct URL, the proxied one, a raw client and the proxy.
async fn behind_a_proxy(
    bucket: &str,
) -> (
    String,
    String,
    async_nats::Client,
    dlock_conformance::wire::Proxy,
) {
    let (direct, raw) = fresh(bucket).await;
    let authority = direct
        .trim_start_matches("nats://")
        .split('/')
        .next()
        .unwrap();
    let proxy = dlock_conformance::wire::Proxy::start(authority)
        .await
        .unwrap();
    let proxied = direct.replace(authority, &proxy.addr().to_string());
    (direct, proxied, raw, proxy)
}

/// Starts `session`'s acquire of lock "x" (its proxy losing replies) and
/// waits until its take reached the server: the acquire and the take's
/// revision.
async fn take_losing_its_reply(
    session: &dlock_core::Session,
    kv: &async_nats::jetstream::kv::Store,
) -> (
    tokio::task::JoinHandle<Result<dlock_core::LockGuard, Error>>,
    u64,
) {
    let lock = session.lock("x").unwrap();
    let acquiring =
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(20)).await });
    (acquiring, landed(kv).await)
}

/// The revision of the first value of lock "x" the server has, within 10 s.
async fn landed(kv: &async_nats::jetstream::kv::Store) -> u64 {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(entry) = kv.entry("l.78").await.unwrap()
                && entry.operation == async_nats::jetstream::kv::Operation::Put
            {
                return entry.revision;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the take reached the server")
}

/// Lets replies through again and awaits the acquire: its lock, whose
/// token must be above `floor`.
async fn granted_above(
    proxy: &dlock_conformance::wire::Proxy,
    acquiring: tokio::task::JoinHandle<Result<dlock_core::LockGuard, Error>>,
    floor: u64,
) -> dlock_core::LockGuard {
    proxy.set(dlock_conformance::wire::Fault::Pass);
    let guard = acquiring.await.unwrap().unwrap();
    assert!(
        guard.token().get() > floor,
        "a token went back: {} after {floor}",
        guard.token()
    );
    guard
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
    let (url, raw) = fresh(bucket).await;
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
    // The refused takes left nothing behind (the release's marker is
    // purged in the background).
    let mut left = other.keys_under("x").await.unwrap();
    for _ in 0..100 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        left = other.keys_under("x").await.unwrap();
    }
    assert_eq!(left, 0);
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// S2, the take whose reply was lost: the server gives sequences again
/// (the bucket made again), a take lands but its answer does not reach
/// the client, and the client's next try finds its own message on the key.
/// Its token is not above what the client saw before, so it is removed and
/// taken again, not extended and granted. Red before: granted with token 1
/// after tokens of 5 and more.
#[tokio::test]
async fn a_retried_take_never_returns_a_token_that_went_back() {
    use dlock_conformance::wire::Fault;

    let bucket = "dlock_seq_back_retried";
    let (direct, proxied, raw, proxy) = behind_a_proxy(bucket).await;
    let backend = NatsBackend::connect(proxied.as_str()).await.unwrap();
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    let mut last = 0;
    for _ in 0..5 {
        let guard = session.lock("x").unwrap().acquire().await.unwrap();
        last = guard.token().get();
        guard.release().await.unwrap();
    }
    delete_bucket(&raw, bucket).await;
    let _again = NatsBackend::connect(direct.as_str()).await.unwrap();
    let kv = async_nats::jetstream::new(raw.clone())
        .get_key_value(bucket)
        .await
        .unwrap();
    proxy.set(Fault::LOSE_REPLIES);
    let (acquiring, landed) = take_losing_its_reply(&session, &kv).await;
    assert!(landed <= last, "the take landed at {landed}, after {last}");
    let guard = granted_above(&proxy, acquiring, last).await;
    guard.release().await.unwrap();
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// S2, a waiter's lost reply after the sequence went back: a claim that
/// saw another client's hold of its lock at some sequence, and whose later
/// take lands below it (the server gave sequences again) with its reply
/// lost, is not granted that lower token when its next try finds it.
/// Red before (a check against the process's mark at the claim's first
/// try only, which was 0 here): granted a token below the hold it saw.
///
/// The take must land below the hold for the case to say anything, but the
/// backend's catch-up of the sequence (a thousand writes at a time, in the
/// background) can land first on a loaded machine (CI: "the take landed at
/// 1004"); then the setup is tried again, up to three times.
#[tokio::test]
async fn a_waiters_retried_take_never_goes_below_the_hold_it_waited_for() {
    for attempt in 1..=3 {
        if waiter_take_below_the_hold(attempt).await {
            return;
        }
        println!("NOTE attempt {attempt}: the take landed above the hold; setting up again");
    }
    panic!("in three attempts the take never landed below the hold: the case tested nothing");
}

/// One attempt of the case above: `false` if the take did not land below
/// the hold (nothing tested).
async fn waiter_take_below_the_hold(attempt: u32) -> bool {
    use dlock_conformance::wire::Fault;

    let bucket = format!("dlock_seq_back_waiter_{attempt}");
    let bucket = bucket.as_str();
    let (direct, proxied, raw, proxy) = behind_a_proxy(bucket).await;
    let backend = NatsBackend::connect(proxied.as_str()).await.unwrap();
    let js = async_nats::jetstream::new(raw.clone());
    let kv = js.get_key_value(bucket).await.unwrap();
    fill(&js, bucket, 99).await;
    // (another client's hold of lock "x", not a dlock value: nobody's)
    let held_at = kv.put("l.78", "another holder".into()).await.unwrap();
    assert_eq!(held_at, 100);
    // (a waiter that tries again every 100 ms: a reply-losing link makes
    // the client drop its connection after about a second)
    let session = backend
        .session(
            SessionOptions::new()
                .ttl(Duration::from_secs(5))
                .poll_fallback(Duration::from_millis(100)),
        )
        .await
        .unwrap();
    let lock = session.lock("x").unwrap();
    let acquiring =
        tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(30)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    delete_bucket(&raw, bucket).await;
    let _again = NatsBackend::connect(direct.as_str()).await.unwrap();
    let kv = js.get_key_value(bucket).await.unwrap();
    kv.put("l.78", "another holder".into()).await.unwrap();
    proxy.set(Fault::LOSE_REPLIES);
    // (the key emptied, not covered by a marker: the waiter's next take is
    // one write, which lands although its answer is lost)
    js.get_stream(format!("KV_{bucket}"))
        .await
        .unwrap()
        .purge()
        .filter(format!("$KV.{bucket}.l.78"))
        .await
        .unwrap();
    let landed = landed(&kv).await;
    if landed >= held_at {
        proxy.set(Fault::Pass);
        acquiring.abort();
        session.close().await.unwrap();
        delete_bucket(&raw, bucket).await;
        return false;
    }
    let guard = granted_above(&proxy, acquiring, held_at).await;
    guard.release().await.unwrap();
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
    true
}

/// Rule 4 beside other traffic: a take whose reply was lost is found again
/// by the claim's next try and granted with its own token, although the
/// process saw higher sequences meanwhile (another lock taken). Red before
/// (the check against the process's mark at each try): the found take was
/// removed as if the server had lost writes, and taken again with another
/// token.
#[tokio::test]
async fn a_take_whose_reply_was_lost_is_granted_beside_other_traffic() {
    use dlock_conformance::wire::Fault;

    let bucket = "dlock_lost_reply_traffic";
    let (_, proxied, raw, proxy) = behind_a_proxy(bucket).await;
    let backend = NatsBackend::connect(proxied.as_str()).await.unwrap();
    let options = SessionOptions::new().ttl(Duration::from_secs(5));
    let a = backend.session(options.clone()).await.unwrap();
    let kv = async_nats::jetstream::new(raw.clone())
        .get_key_value(bucket)
        .await
        .unwrap();
    proxy.set(Fault::LOSE_REPLIES);
    let (acquiring, landed) = take_losing_its_reply(&a, &kv).await;
    proxy.set(Fault::Pass);
    // (a backend of its own, on a new connection, but of the same servers
    // and bucket: it shares the process's mark)
    let b = NatsBackend::connect(proxied.as_str())
        .await
        .unwrap()
        .session(options)
        .await
        .unwrap();
    let other = b.lock("y").unwrap().acquire().await.unwrap();
    assert!(other.token().get() > landed);
    let guard = acquiring.await.unwrap().unwrap();
    assert_eq!(
        guard.token().get(),
        landed,
        "the take that landed was not the one granted"
    );
    guard.release().await.unwrap();
    other.release().await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// Publishes `count` messages on one key no lock uses (in batches: the
/// client holds back publishes while too many acks are awaited).
async fn fill(js: &async_nats::jetstream::Context, bucket: &str, count: usize) {
    let mut left = count;
    while left > 0 {
        let batch = left.min(1_000);
        let mut acks = Vec::new();
        for _ in 0..batch {
            let subject = format!("$KV.{bucket}.l.fill");
            acks.push(js.publish(subject, "x".into()).await.unwrap());
        }
        for ack in acks {
            ack.await.unwrap();
        }
        left -= batch;
    }
}

/// A sequence that went back thousands (a server that lost many writes)
/// is caught up at once, not one take per missing sequence; 100,000 or
/// more behind (a bucket made again, or restored from a backup) is an
/// error naming that, not a wait. Red before: the first acquire was still
/// taking again when its 5 s ran out (Timeout; at sequence 11 of 10,011),
/// and the second waited the same way.
#[tokio::test]
async fn a_sequence_far_behind_is_caught_up_or_an_error_not_a_wait() {
    let bucket = "dlock_seq_far_back";
    let (url, raw) = fresh(bucket).await;
    let backend = NatsBackend::connect(url.as_str()).await.unwrap();
    let js = async_nats::jetstream::new(raw.clone());
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    let take = || async {
        let guard = session.lock("x").unwrap().acquire().await.unwrap();
        let token = guard.token().get();
        guard.release().await.unwrap();
        token
    };
    fill(&js, bucket, 5_000).await;
    let last = take().await;
    assert!(last > 5_000, "{last}");
    delete_bucket(&raw, bucket).await;
    let _again = NatsBackend::connect(url.as_str()).await.unwrap();
    let started = std::time::Instant::now();
    let guard = session
        .lock("x")
        .unwrap()
        .acquire_timeout(Duration::from_secs(5))
        .await
        .unwrap();
    assert!(guard.token().get() > last, "{} after {last}", guard.token());
    guard.release().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    fill(&js, bucket, 100_010).await;
    take().await;
    delete_bucket(&raw, bucket).await;
    let _again = NatsBackend::connect(url.as_str()).await.unwrap();
    let started = std::time::Instant::now();
    let e = session
        .lock("x")
        .unwrap()
        .acquire_timeout(Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::Protocol { .. }) && e.to_string().contains("made again"),
        "{e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// S1 after a server lost writes: A's release, on the sequence it last
/// wrote, leaves alone what now carries sequences the server gave again
/// (here: the bucket made again, its sequences from 1): a newer hold of
/// A's own lock below A's sequence, and another lock's hold at exactly
/// A's sequence. Those holders would have lost their locks without
/// knowing until their next renewal. Red before: with a delete by
/// sequence, the other lock's hold was gone; with a purge of A's key up
/// to A's sequence (c38a2e9), the newer hold of A's lock was gone.
#[tokio::test]
async fn a_release_never_removes_holds_given_a_sequence_again() {
    let bucket = "dlock_seq_reuse";
    let (url, raw) = fresh(bucket).await;
    let backend = NatsBackend::connect(url.as_str()).await.unwrap();
    let js = async_nats::jetstream::new(raw.clone());
    fill(&js, bucket, 3).await;
    // (renewals every 1.7 s: the release below comes first, on the
    // revision of the take)
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    let guard = session.lock("a").unwrap().acquire().await.unwrap();
    let taken_at = guard.token().get();
    assert!(taken_at > 3);
    delete_bucket(&raw, bucket).await;
    let _again = NatsBackend::connect(url.as_str()).await.unwrap();
    let kv = js.get_key_value(bucket).await.unwrap();
    // (the key of lock "a": another client's hold, at sequence 1)
    let newer = kv.put("l.61", "another holder".into()).await.unwrap();
    let mut at = newer;
    while at < taken_at {
        at = kv.put("l.other", "another holder".into()).await.unwrap();
    }
    assert_eq!(at, taken_at, "the other key's message has A's sequence");
    let _ = guard.release().await;
    let put = |e: &async_nats::jetstream::kv::Entry, at| {
        e.revision == at && e.operation == async_nats::jetstream::kv::Operation::Put
    };
    let own = kv.entry("l.61").await.unwrap();
    assert!(
        own.is_some_and(|e| put(&e, newer)),
        "A's release removed a newer hold of its lock"
    );
    let other = kv.entry("l.other").await.unwrap();
    assert!(
        other.is_some_and(|e| put(&e, at)),
        "A's release removed another lock's hold"
    );
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// A bucket that keeps several values per key (or memory storage, or
/// replicas) breaks what releases and tokens rest on: it is refused with
/// a configuration error naming why, not used.
#[tokio::test]
async fn a_bucket_with_history_is_refused() {
    let bucket = "dlock_history";
    let (url, raw) = fresh(bucket).await;
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

/// L1, a try right after a release: the releaser purges its marker in the
/// background, and a take that read the marker and then wrote on it found
/// the key emptied in between and answered "busy" for a free lock (red in
/// CI once, conformance `multi_lock_all_or_nothing`: "x still held after
/// release"). It now writes on nothing again. The race needs the purge to
/// land between the take's read and its write, so this loop meets it only
/// now and then (it did not fail here in 3 runs without the fix, with the
/// CPUs loaded): a regression guard, not a reproduction.
#[tokio::test]
async fn a_try_right_after_a_release_finds_the_lock_free() {
    let bucket = "dlock_try_after_release";
    let (url, raw) = fresh(bucket).await;
    let backend = NatsBackend::connect(url.as_str()).await.unwrap();
    let options = || SessionOptions::new().ttl(Duration::from_secs(5));
    let (a, b) = (
        backend.session(options()).await.unwrap(),
        backend.session(options()).await.unwrap(),
    );
    for round in 0..1000 {
        let name = format!("x{}", round % 4);
        let held = a.lock(name.as_str()).unwrap().acquire().await.unwrap();
        held.release().await.unwrap();
        let got = b.lock(name.as_str()).unwrap().try_acquire().await.unwrap();
        let got = got.unwrap_or_else(|| panic!("round {round}: {name} busy after its release"));
        got.release().await.unwrap();
    }
    a.close().await.unwrap();
    b.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// S5: a take cut off on the wire while another client holds the lock,
/// delivered after that client's release, when the key is empty again,
/// grants nothing: the abandoned attempt's end made its write a duplicate
/// (its message id taken), which the server drops whatever the key holds.
/// The conformance case `cut_take_delivered_late` covers an attempt ended
/// by its own release. Red before (with `refuses_late_takes` not
/// declared): the late take held the lock for `max_age` on no one's
/// behalf.
#[tokio::test]
async fn a_take_cut_off_behind_another_hold_is_dropped_when_delivered() {
    use dlock_conformance::wire::Fault;

    let bucket = "dlock_late_behind_hold";
    let (direct, proxied, raw, proxy) = behind_a_proxy(bucket).await;
    let options = || SessionOptions::new().ttl(Duration::from_secs(1));
    let backend = NatsBackend::connect(direct.as_str()).await.unwrap();
    let b = backend.session(options()).await.unwrap();
    let a = NatsBackend::connect(proxied.as_str())
        .await
        .unwrap()
        .session(options())
        .await
        .unwrap();
    let kv = async_nats::jetstream::new(raw.clone())
        .get_key_value(bucket)
        .await
        .unwrap();
    let held = b.lock("x").unwrap().acquire().await.unwrap();
    // A's connection is open before its bytes are held.
    assert!(a.lock("y").unwrap().try_acquire().await.unwrap().is_some());
    proxy.set(Fault::HoldExisting);
    let cut = a.lock("x").unwrap().try_acquire().await;
    assert!(cut.is_err(), "A's take with its bytes held: {cut:?}");
    // A's attempt ends in its clean-up, on a new connection.
    let cleaned = tokio::time::timeout(Duration::from_secs(10), async {
        while dlock_core::raw::background_tasks(&a) > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(cleaned.is_ok(), "A's clean-up did not finish");
    // A plain subscriber sees the late write arrive, stored or not. The
    // server registers it only when it parses the SUB (a `flush` just
    // writes it out): the reads below, on the same connection, are
    // answered after that, so it is in place before the bytes are let go.
    // (Subscribed after them, with a flush only, it missed the write in a
    // CI run and 3 of 8 local ones, beside the other tests.)
    let mut arrivals = raw.subscribe(format!("$KV.{bucket}.l.78")).await.unwrap();
    held.release().await.unwrap();
    // The key is empty again (the release's marker purged), so the late
    // take's write (on no message) would be accepted but for its id.
    let emptied = tokio::time::timeout(Duration::from_secs(10), async {
        while kv.entry("l.78").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(emptied.is_ok(), "B's release left the key with a message");
    proxy.set(Fault::Pass);
    let delivered = tokio::time::timeout(Duration::from_secs(5), async {
        use futures::StreamExt;
        while let Some(message) = arrivals.next().await {
            if message.payload.starts_with(a.id().as_str().as_bytes()) {
                return;
            }
        }
    })
    .await;
    assert!(delivered.is_ok(), "A's held take was never delivered");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        backend
            .inspect(&dlock_core::LockName::new("x").unwrap())
            .await
            .unwrap(),
        None,
        "A's late take granted a hold no one tracks"
    );
    let again = b.lock("x").unwrap().try_acquire().await.unwrap();
    assert!(again.is_some(), "the lock is free after the late take");
    again.unwrap().release().await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}

/// L3, S4: a session whose holds take longer to renew than its request
/// timeout keeps them all. NATS renews with a write per hold; each write
/// the server confirmed before the round was cut off moves its hold's
/// deadline, and the period's retries renew the rest first. Here 2,000
/// holds behind a link that delays each way by 15 ms: a round (2,000
/// writes, 256 in flight, 8 round trips of ~35 ms) needs ~300 ms against
/// a 200 ms request timeout. Red before: every round was cut off and
/// counted as nothing, and all holds were lost one TTL later (as in a
/// loaded CI run of `ten_thousand_names`, 2026-11-28). With 3,000 holds
/// and 10 ms each way the case measured the machine's load instead (671
/// of 3,000 lost in a CI run beside the other backends' tests), and still
/// 1,036 of 2,000 there: it runs with the load cases (`under_load_`,
/// `scripts/test`).
#[tokio::test]
async fn under_load_holds_slower_to_renew_than_the_request_timeout_are_all_kept() {
    use dlock_conformance::wire::Fault;
    use futures::StreamExt;

    const HOLDS: usize = 2_000;
    let bucket = "dlock_slow_rounds";
    let (_direct, proxied, raw, proxy) = behind_a_proxy(bucket).await;
    let backend = NatsBackend::connect(proxied.as_str()).await.unwrap();
    let ttl = Duration::from_millis(4_500);
    let options = SessionOptions::new()
        .ttl(ttl)
        .request_timeout(Duration::from_millis(200));
    let session = backend.session(options).await.unwrap();
    let guards: Vec<_> = futures::stream::iter(0..HOLDS)
        .map(|i| {
            let lock = session.lock(format!("n{i}")).unwrap();
            async move { lock.acquire_timeout(Duration::from_secs(30)).await.unwrap() }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let before = session.stats();
    proxy.set(Fault::delay(
        Duration::from_millis(15),
        Duration::from_millis(15),
    ));
    tokio::time::sleep(ttl * 3).await;
    let after = session.stats();
    let lost = guards.iter().filter(|g| !g.is_held()).count();
    proxy.set(Fault::Pass);
    assert_eq!(lost, 0, "{lost} of {HOLDS} holds lost: {after:?}");
    // (the rounds were cut off, or this shows nothing; and the periods'
    // retries still renewed every hold)
    assert!(
        after.renewal_failures > before.renewal_failures,
        "no round was cut off: {after:?}"
    );
    assert!(
        after.renewals >= before.renewals + 2,
        "fewer than two periods renewed every hold: {before:?} then {after:?}"
    );
    futures::stream::iter(guards)
        .map(|g| async move { g.release().await.unwrap() })
        .buffer_unordered(64)
        .collect::<()>()
        .await;
    session.close().await.unwrap();
    delete_bucket(&raw, bucket).await;
}
