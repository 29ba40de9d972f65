//! The seeds' semantics (MongoDB 2.4's `distlock.cpp`: `config.locks`,
//! `config.lockpings`, takeover of a holder that stopped pinging) checked on
//! the real wire, by reading the stored documents back with the raw driver.
//!
//! Against `DLOCK_TEST_MONGO_URL` (default: the mongo-wire server of
//! `scripts/services`), in the database `dlock_test`, each test on lock
//! names of its own. Times are compared on the **server's** clock where the
//! claim is about it: the tests read `$$NOW` from the server rather than use
//! the test process's clock.

use std::time::Duration;

use dlock_core::backend::Take;
use dlock_core::{Backend, Error, LockName, SessionId, SessionOptions};
use dlock_mongo::MongoBackend;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::{Client, Collection};

const DEFAULT_URL: &str =
    "mongodb://dlock:dlock@127.0.0.1:17017/?directConnection=true&authMechanism=SCRAM-SHA-256";

const DATABASE: &str = "dlock_test";

/// The test server's URL (`DLOCK_TEST_MONGO_URL`) as dlock takes it: the
/// test database, and `dlock_mongos=allow` (the mongo-wire server presents
/// as a `mongos` but is one process with one clock).
fn dlock_url() -> String {
    let url = std::env::var("DLOCK_TEST_MONGO_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let (head, query) = url.split_once('?').unwrap_or((&url, ""));
    let head = if head.split_once("://").is_some_and(|(_, r)| r.contains('/')) {
        head.to_owned()
    } else {
        format!("{head}/")
    };
    let mut pairs: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && !p.starts_with("dlock_db=") && !p.starts_with("dlock_mongos="))
        .collect();
    pairs.push("dlock_mongos=allow");
    let db = format!("dlock_db={DATABASE}");
    pairs.push(&db);
    format!("{head}?{}", pairs.join("&"))
}

/// The same server for the raw driver (dlock's own options taken out).
fn driver_url() -> String {
    let url = dlock_url();
    let (head, query) = url.split_once('?').unwrap_or((&url, ""));
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| !p.starts_with("dlock_"))
        .collect();
    format!("{head}?{}", kept.join("&"))
}

struct Raw {
    locks: Collection<Document>,
    sessions: Collection<Document>,
}

async fn raw() -> Raw {
    let client = Client::with_uri_str(driver_url())
        .await
        .expect("driver URL");
    let db = client.database(DATABASE);
    Raw {
        locks: db.collection(dlock_mongo::DEFAULT_LOCKS),
        sessions: db.collection(dlock_mongo::DEFAULT_SESSIONS),
    }
}

impl Raw {
    async fn lock(&self, name: &str) -> Document {
        self.locks
            .find_one(doc! { "_id": name })
            .await
            .expect("read the lock document")
            .unwrap_or_else(|| panic!("no lock document {name}"))
    }

    async fn session(&self, id: &SessionId) -> Option<Document> {
        self.sessions
            .find_one(doc! { "_id": id.as_str() })
            .await
            .expect("read the session document")
    }

    /// The server's clock before and after `wait`, and between them the
    /// ping of session `id` read at the end.
    async fn ping_across(&self, id: &SessionId, wait: Duration) -> (DateTime, DateTime, DateTime) {
        let start = self.server_now().await;
        tokio::time::sleep(wait).await;
        let ping = *self
            .session(id)
            .await
            .unwrap()
            .get_datetime("ping")
            .unwrap();
        // (read after the ping: a ping that lands between two reads is
        // still before `end`)
        let end = self.server_now().await;
        (start, ping, end)
    }

    /// The server's clock now: `$$NOW` projected from any session document
    /// (every caller has a session open).
    async fn server_now(&self) -> DateTime {
        let d = self
            .sessions
            .find_one(doc! {})
            .projection(doc! { "_id": 0, "now": "$$NOW" })
            .await
            .expect("read $$NOW")
            .expect("a session document");
        *d.get_datetime("now").expect("$$NOW is a date")
    }
}

async fn backend() -> MongoBackend {
    MongoBackend::connect(&dlock_url())
        .await
        .unwrap_or_else(|e| panic!("{e} (start the server: scripts/services up mongo)"))
}

/// A lock name no other test (or run) uses.
fn fresh_name(test: &str) -> String {
    format!("seeds/{test}/{:016x}", rand::random::<u64>())
}

fn ms(a: DateTime, b: DateTime) -> i64 {
    a.timestamp_millis() - b.timestamp_millis()
}

fn token(doc: &Document) -> u64 {
    match doc.get("token") {
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap(),
        other => panic!("token is not a 64-bit integer: {other:?}"),
    }
}

/// The `locks` document of a held lock has the seeds' fields, with the
/// seeds' meanings, written by the server's clock; a release frees it in
/// place and keeps its token.
#[tokio::test]
async fn lock_document_has_the_seeds_shape() {
    let (backend, raw) = (backend().await, raw().await);
    let name = fresh_name("shape");
    let ttl = Duration::from_secs(2);
    let session = backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let before = raw.server_now().await;
    let guard = session
        .lock(name.as_str())
        .unwrap()
        .why("nightly import")
        .acquire()
        .await
        .unwrap();
    let after = raw.server_now().await;
    let doc = raw.lock(&name).await;

    assert_eq!(doc.get_str("_id").unwrap(), name);
    assert_eq!(doc.get("state"), Some(&Bson::Int32(2)), "{doc}");
    let sid = session.id().as_str();
    assert_eq!(doc.get_str("session").unwrap(), sid, "{doc}");
    let who = doc.get_str("who").unwrap();
    assert!(
        who.starts_with(&format!("{sid}#")) && who.len() > sid.len() + 1,
        "who names the attempt within the session: {doc}"
    );
    assert_eq!(doc.get_str("why").unwrap(), "nightly import");
    assert!(
        matches!(doc.get("ts"), Some(Bson::ObjectId(_))),
        "ts is an ObjectId: {doc}"
    );
    assert_eq!(token(&doc), guard.token().get());
    assert_eq!(token(&doc), 1, "a new name starts at token 1");
    // `when` is the server's clock at the grant.
    let when = *doc.get_datetime("when").unwrap();
    assert!(
        ms(when, before) >= 0 && ms(after, when) >= 0,
        "when {when} not within the server's clock [{before}, {after}]"
    );
    // Held for the TTL from `when` (renewals only push it further).
    let expires = *doc.get_datetime("expiresAt").unwrap();
    assert!(
        ms(expires, when) >= ttl.as_millis() as i64,
        "expiresAt {expires} is less than the TTL after {when}"
    );
    // The first grant replaced nothing.
    let prev = doc.get_document("prev").unwrap();
    assert!(prev.get("who").is_none(), "{doc}");

    // `inspect` reports what is stored.
    let info = backend
        .inspect(&LockName::new(&name).unwrap())
        .await
        .unwrap()
        .expect("held");
    assert_eq!(info.holder, sid);
    assert_eq!(info.token, guard.token());
    assert_eq!(info.why.as_deref(), Some("nightly import"));
    assert_eq!(info.acquired_at, Some(when.to_system_time()));

    guard.release().await.unwrap();
    let freed = raw.lock(&name).await;
    assert_eq!(freed.get("state"), Some(&Bson::Int32(0)), "{freed}");
    for gone in ["session", "who", "why"] {
        assert!(
            freed.get(gone).is_none(),
            "{gone} left after release: {freed}"
        );
    }
    assert_eq!(
        freed.get_datetime("expiresAt").unwrap().timestamp_millis(),
        0
    );
    assert_eq!(token(&freed), 1, "the document and its token stay");
    assert_eq!(freed.get_datetime("when").unwrap(), &when);
    session.close().await.unwrap();
}

/// The session's document is the seeds' `lockpings` entry: `{_id: session,
/// ping}`, `ping` set by the server's clock, advancing every renewal period
/// whether the session holds locks or not; removed when the session closes.
#[tokio::test]
async fn session_document_is_pinged_with_the_server_clock() {
    let (backend, raw) = (backend().await, raw().await);
    let ttl = Duration::from_millis(900);
    let session = backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let period = dlock_core::raw::renew_every(&session);
    let doc = raw.session(session.id()).await.expect("session document");
    let keys: Vec<&str> = doc.keys().map(String::as_str).collect();
    assert_eq!(keys, ["_id", "ping"], "{doc}");
    let first = *doc.get_datetime("ping").unwrap();

    // Without holds: the ping is the heartbeat.
    let (start, ping, end) = raw.ping_across(session.id(), period * 3).await;
    assert!(
        ping > first,
        "ping did not advance without holds: {first} → {ping}"
    );
    assert!(
        ms(end, ping) >= 0 && ms(ping, start) >= 0,
        "ping {ping} not on the server's clock within [{start}, {end}]"
    );

    // With a hold: the renewal extends the hold and pings after it.
    let name = fresh_name("ping");
    let guard = dlock_conformance::unit::acquired(&session, &name).await;
    let expires_first = *raw.lock(&name).await.get_datetime("expiresAt").unwrap();
    let (start, held_ping, end) = raw.ping_across(session.id(), period * 4).await;
    assert!(
        ms(end, held_ping) >= 0 && ms(held_ping, start) >= 0,
        "ping {held_ping} did not advance while holding: [{start}, {end}]"
    );
    let lock = raw.lock(&name).await;
    // (the server's now after the read: a renewal may land after `end`,
    // which CI saw once, 901 ms past it with a TTL of 900 ms)
    let now = raw.server_now().await;
    let expires = *lock.get_datetime("expiresAt").unwrap();
    assert!(expires > expires_first, "the renewal did not extend {lock}");
    assert!(
        ms(expires, now) <= ttl.as_millis() as i64,
        "expiresAt {expires} is more than the TTL past the server's now {now}"
    );
    assert!(guard.is_held());

    // Close: the hold is freed in place and the ping entry removed.
    session.close().await.unwrap();
    assert!(raw.session(session.id()).await.is_none());
    assert_eq!(raw.lock(&name).await.get("state"), Some(&Bson::Int32(0)));
}

/// A holder whose process stopped (no renewal, no ping: the store side of a
/// session whose client is frozen) and so the seeds' takeover: another
/// client gets the lock once its `expiresAt` passes **by the server's
/// clock**, with the next token, and the grant records whom it replaced.
/// The stale holder, when it wakes, can neither renew nor release.
#[tokio::test]
async fn takeover_of_a_holder_that_stopped_renewing() {
    let (backend, raw) = (backend().await, raw().await);
    let name = fresh_name("takeover");
    let lock_name = LockName::new(&name).unwrap();
    let ttl = Duration::from_millis(800);

    // The stale holder: the store side only, so nothing renews or pings.
    let stale_id = SessionId::generate(Some("stale"));
    let stale = backend
        .open(stale_id.clone(), &SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    let mut attempt = stale
        .claim(&lock_name, Some("frozen holder"))
        .await
        .unwrap();
    let Take::Granted(stale_hold) = attempt.try_take().await.unwrap() else {
        panic!("a fresh name was busy")
    };
    let stale_doc = raw.lock(&name).await;
    let stale_expires = *stale_doc.get_datetime("expiresAt").unwrap();
    let stale_ping = *raw
        .session(&stale_id)
        .await
        .expect("stale session document")
        .get_datetime("ping")
        .unwrap();

    // While its TTL runs, the lock is busy for everyone else.
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    assert!(
        session
            .lock(name.as_str())
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "granted while the stale holder's TTL ran"
    );
    let guard = session
        .lock(name.as_str())
        .unwrap()
        .why("takeover")
        .acquire_timeout(ttl * 5)
        .await
        .unwrap();

    let doc = raw.lock(&name).await;
    let when = *doc.get_datetime("when").unwrap();
    assert!(
        when >= stale_expires,
        "taken over at {when}, before the stale hold expired at {stale_expires} (server clock)"
    );
    assert_eq!(token(&doc), stale_hold.token.get() + 1);
    assert_eq!(guard.token().get(), stale_hold.token.get() + 1);
    assert_eq!(doc.get_str("session").unwrap(), session.id().as_str());
    // The replaced holder, as the seeds logged "forcefully taking over".
    let prev = doc.get_document("prev").unwrap();
    assert_eq!(prev.get("state"), Some(&Bson::Int32(2)), "{doc}");
    assert_eq!(prev.get_str("session").unwrap(), stale_id.as_str());
    assert_eq!(prev.get_str("who").unwrap(), stale_hold.key);
    assert_eq!(prev.get_str("why").unwrap(), "frozen holder");
    assert_eq!(token(prev), stale_hold.token.get());
    // The stale session's ping stayed where it stopped.
    let ping = *raw
        .session(&stale_id)
        .await
        .unwrap()
        .get_datetime("ping")
        .unwrap();
    assert_eq!(ping, stale_ping, "nothing pinged for the stale session");

    // The stale holder wakes up: its renewal and release are refused
    // (owner-checked by session, attempt and token), the new holder keeps it.
    let renewed = stale
        .renew(std::slice::from_ref(&stale_hold))
        .await
        .unwrap();
    assert_eq!(renewed, [false]);
    assert!(matches!(
        stale.release(&stale_hold).await,
        Err(Error::NotHeld { .. })
    ));
    assert!(
        !backend
            .validate(&lock_name, stale_hold.token)
            .await
            .unwrap()
    );
    assert!(backend.validate(&lock_name, guard.token()).await.unwrap());
    let after = raw.lock(&name).await;
    assert_eq!(after.get_str("who").unwrap(), doc.get_str("who").unwrap());
    assert_eq!(token(&after), token(&doc));
    assert!(guard.is_held());

    guard.release().await.unwrap();
    stale.close(&[]).await.unwrap();
    session.close().await.unwrap();
}

/// Tokens only grow on one name: through normal releases, a takeover of a
/// stale holder, and `force_release` (the path of `dlock release --force`),
/// which frees the document in place (it is never deleted) and makes the
/// broken holder learn it lost the lock.
#[tokio::test]
async fn tokens_increase_across_takeover_and_force_release() {
    let (backend, raw) = (backend().await, raw().await);
    let name = fresh_name("tokens");
    let lock_name = LockName::new(&name).unwrap();
    let ttl = Duration::from_millis(800);
    let session = backend
        .session(SessionOptions::new().ttl(ttl))
        .await
        .unwrap();
    // A new handle for each grant: one handle is reentrant.
    let lock = || session.lock(name.as_str()).unwrap();
    let mut tokens = Vec::new();

    // 1: a grant broken by force-release.
    let broken = lock().acquire().await.unwrap();
    tokens.push(broken.token().get());
    assert!(backend.force_release(&lock_name).await.unwrap());
    let freed = raw.lock(&name).await;
    assert_eq!(freed.get("state"), Some(&Bson::Int32(0)), "{freed}");
    assert_eq!(token(&freed), tokens[0], "force release keeps the token");
    assert!(freed.get("who").is_none(), "{freed}");
    assert!(
        !backend.force_release(&lock_name).await.unwrap(),
        "already free"
    );
    assert_eq!(token(&raw.lock(&name).await), tokens[0]);
    // The broken holder learns it at its next renewal.
    tokio::time::timeout(ttl * 2, broken.lost())
        .await
        .expect("the force-released holder was never told");
    assert!(!broken.is_held());

    // 2: a normal grant and release.
    let guard = lock().acquire().await.unwrap();
    tokens.push(guard.token().get());
    assert!(broken.release().await.is_err());
    guard.release().await.unwrap();

    // 3: a holder that stops renewing, 4: taken over from it.
    let stale = backend
        .open(
            SessionId::generate(Some("stale")),
            &SessionOptions::new().ttl(ttl),
        )
        .await
        .unwrap();
    let mut attempt = stale.claim(&lock_name, None).await.unwrap();
    let Take::Granted(stale_hold) = attempt.try_take().await.unwrap() else {
        panic!("the released lock was busy")
    };
    tokens.push(stale_hold.token.get());
    let taker = lock().acquire_timeout(ttl * 5).await.unwrap();
    tokens.push(taker.token().get());
    assert_eq!(
        raw.lock(&name)
            .await
            .get_document("prev")
            .unwrap()
            .get_str("who")
            .unwrap(),
        stale_hold.key,
        "a takeover"
    );

    // 5: force-released while held, then granted again.
    assert!(backend.force_release(&lock_name).await.unwrap());
    let last = lock().acquire_timeout(ttl * 5).await.unwrap();
    tokens.push(last.token().get());

    // Every grant is the previous token + 1 (the stored counter never goes
    // back), and only the last one validates.
    let first = tokens[0];
    let expected: Vec<u64> = (first..first + tokens.len() as u64).collect();
    assert_eq!(tokens, expected);
    for old in &tokens[..tokens.len() - 1] {
        let t = dlock_core::FencingToken::new(*old);
        assert!(!backend.validate(&lock_name, t).await.unwrap(), "{old}");
    }
    assert!(backend.validate(&lock_name, last.token()).await.unwrap());
    assert_eq!(token(&raw.lock(&name).await), *tokens.last().unwrap());

    last.release().await.unwrap();
    assert_eq!(token(&raw.lock(&name).await), *tokens.last().unwrap());
    stale.close(&[]).await.unwrap();
    session.close().await.unwrap();
}
