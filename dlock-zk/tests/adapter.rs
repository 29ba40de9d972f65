//! ZooKeeper-specific behaviour the conformance suite does not cover,
//! against the real servers from `scripts/services`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_core::{Backend, LockName, SessionOptions};
use dlock_zk::ZkBackend;

const SERVICES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services");

fn skipped(store: &str, what: &str) -> bool {
    dlock_conformance::skip_requested(store, what)
}

fn standalone_url() -> String {
    std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:12181".into())
}

async fn connect(url: &str) -> ZkBackend {
    ZkBackend::connect(url).await.unwrap_or_else(|e| {
        panic!("cannot reach ZooKeeper at {url} ({e}); start it with `scripts/services up zk` or set DLOCK_TEST_SKIP=zk")
    })
}

/// A test that kills the server runs alone (`write`); the others (`read`)
/// hold sessions of a few seconds that must not meet its restart, which
/// can take longer than they last on a loaded machine (CI saw the digest
/// test's 2 s session expire beside it).
static SERVER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// `survives_reconnect`: the server is killed and started again (ZooKeeper
/// keeps sessions in its snapshot and log) while a lock is held; the client
/// reconnects within its session timeout, and the lock is still held and
/// valid, with renewals going on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_survives_a_server_restart_within_the_session() {
    let _alone = SERVER.write().await;
    if skipped("zk", "a_lock_survives_a_server_restart_within_the_session") {
        return;
    }
    let url = format!("{}/dlock-test", standalone_url());
    let servers: Arc<dyn Servers> = Arc::new(ServicesCommand::new(SERVICES, ["zk"]));
    let name = LockName::new(format!("adapter/restart-{:08x}", rand::random::<u32>())).unwrap();
    let a = connect(&url)
        .await
        .session(SessionOptions::new().ttl(Duration::from_secs(12)))
        .await
        .unwrap();
    let held = a.lock(&name).unwrap().acquire().await.unwrap();
    let renewals_before = a.stats().renewals;
    servers.kill(0).await.unwrap();
    let started = servers.start(0).await;
    if started.is_err() {
        // Put the server back whatever happened.
        let _ = servers.start(0).await;
    }
    started.unwrap();
    // A renewal after the restart proves the session reconnected.
    let deadline = Instant::now() + Duration::from_secs(15);
    while a.stats().renewals <= renewals_before + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        a.stats().renewals > renewals_before + 1,
        "no renewal succeeded after the restart"
    );
    assert!(
        held.is_held(),
        "lost after a restart: {:?}",
        held.lost_reason()
    );
    let admin = connect(&url).await;
    assert!(
        admin.validate(&name, held.token()).await.unwrap(),
        "the node did not survive the restart"
    );
    held.release().await.unwrap();
    a.close().await.unwrap();
}

/// Digest credentials: the right ones work, and nodes get `CREATOR_ALL`;
/// a wrong password (or none) on a root created with credentials is a
/// typed [`Error::Auth`] at connect, at once and without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_digest_password_is_an_auth_error_at_once() {
    let _beside = SERVER.read().await;
    if skipped("zk", "a_wrong_digest_password_is_an_auth_error_at_once") {
        return;
    }
    let (scheme, hosts) = standalone_url()
        .split_once("://")
        .map(|(s, h)| (s.to_owned(), h.to_owned()))
        .unwrap();
    let root = format!("/dlock-auth-{:08x}", rand::random::<u32>());
    let url = |userinfo: &str| format!("{scheme}://{userinfo}{hosts}{root}");
    // The password has characters a URL must encode.
    let right = url("app:s3cr%2Fet%40x@");
    let backend = connect(&right).await;
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    let guard = session.lock("auth/x").unwrap().acquire().await.unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(guard.is_held());
    guard.release().await.unwrap();
    session.close().await.unwrap();
    for (what, bad) in [
        ("a wrong password", url("app:wrong%2Fpass@")),
        ("another user", url("other:pw@")),
        ("no credentials", url("")),
    ] {
        let hidden = ["wrong/pass", "wrong%2Fpass", "s3cr"];
        let connect = ZkBackend::connect(&bad);
        dlock_conformance::unit::assert_auth_refused(
            what,
            connect,
            Duration::from_secs(3),
            &hidden,
        )
        .await;
    }
    // Remove the test's root (its lock parents are containers, gone once
    // empty, or removed on release).
    let zk = zookeeper_client::Client::connector()
        .with_auth("digest", b"app:s3cr/et@x".as_slice())
        .connect(&hosts)
        .await
        .unwrap();
    for child in zk.list_children(&root).await.unwrap() {
        let _ = zk.delete(&format!("{root}/{child}"), None).await;
    }
    zk.delete(&root, None).await.unwrap();
}

/// A lock whose parent node does not exist is taken through the multi that
/// creates parent and node together; the emptied parent is removed a moment
/// after the release (or by `close`, which removes what is still pending).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parents_come_and_go_with_their_queues() {
    let _beside = SERVER.read().await;
    if skipped("zk", "parents_come_and_go_with_their_queues") {
        return;
    }
    let url = format!("{}/dlock-test", standalone_url());
    let backend = connect(&url).await;
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    let prefix = format!("adapter/parents-{:08x}", rand::random::<u32>());
    for round in 0..20 {
        let name = format!("{prefix}/{}", round % 3);
        let guard = dlock_conformance::unit::acquired(&session, &name).await;
        let info = backend.inspect(guard.name()).await.unwrap().expect("held");
        assert_eq!(info.token, guard.token());
        guard.release().await.unwrap();
    }
    session.close().await.unwrap();
    assert_eq!(
        backend.nodes_under(&prefix).await.unwrap(),
        0,
        "nodes left behind"
    );
}

/// A take finds itself alone from its create's own answer (the parent's
/// stat, from the `setData` in the same multi) and lists nothing: that must
/// grant only where the new node is the parent's one child, with the node's
/// czxid as the token (the parent's mzxid where the server answers a multi's
/// create without a stat, as 3.8.0 does). Alone on a new name, on a kept
/// parent, behind a holder (busy: two children), and the waiter's grant
/// after the holder's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_alone_is_granted_from_its_create_with_the_nodes_czxid() {
    let _beside = SERVER.read().await;
    if skipped(
        "zk",
        "a_take_alone_is_granted_from_its_create_with_the_nodes_czxid",
    ) {
        return;
    }
    let url = format!("{}/dlock-test", standalone_url());
    let backend = connect(&url).await;
    let open = || backend.session(SessionOptions::new().ttl(Duration::from_secs(5)));
    let (first, second) = (open().await.unwrap(), open().await.unwrap());
    let name = format!("adapter/alone-{:08x}", rand::random::<u32>());
    let token_of = |guard: &dlock_core::LockGuard| {
        let (backend, name) = (&backend, guard.name().clone());
        async move { backend.inspect(&name).await.unwrap().expect("held").token }
    };
    // The parent's data version: each take's multi writes it once.
    let host = standalone_url().trim_start_matches("zk://").to_owned();
    let zk = zookeeper_client::Client::connect(&host).await.unwrap();
    let parent = format!("/dlock-test/{}", LockName::new(&name).unwrap().flat());
    let version = || async { zk.check_stat(&parent).await.unwrap().map(|s| s.version) };
    let mut last = None;
    for _ in 0..3 {
        // (a new parent first, then the kept one)
        let before = version().await;
        let guard = dlock_conformance::unit::acquired(&first, &name).await;
        let after = version().await.expect("the parent is there");
        if let Some(before) = before {
            // (0: the parent went meanwhile, after 2 s idle, and came back)
            assert!(
                after == before + 1 || after == 0,
                "no multi: {before} → {after}"
            );
        }
        assert_eq!(token_of(&guard).await, guard.token(), "alone");
        assert!(last < Some(guard.token()), "tokens go up");
        last = Some(guard.token());
        let busy = second
            .lock(name.as_str())
            .unwrap()
            .try_acquire()
            .await
            .unwrap();
        assert!(busy.is_none(), "granted beside a holder");
        guard.release().await.unwrap();
    }
    let holder = dlock_conformance::unit::acquired(&first, &name).await;
    let waiter = tokio::spawn({
        let lock = second.lock(name.as_str()).unwrap();
        async move { lock.acquire_timeout(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "granted behind a holder");
    holder.release().await.unwrap();
    let granted = waiter.await.unwrap().unwrap();
    assert_eq!(token_of(&granted).await, granted.token(), "after a wait");
    assert!(last < Some(granted.token()), "tokens go up");
    granted.release().await.unwrap();
    first.close().await.unwrap();
    second.close().await.unwrap();
}

/// An emptied parent stays for a moment after the release, so that the
/// name's next acquire is one multi (no failed create, no create of the
/// parent), and goes once the name has been left alone for that moment, while
/// the session lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emptied_parents_stay_a_moment_then_go() {
    let _beside = SERVER.read().await;
    if skipped("zk", "emptied_parents_stay_a_moment_then_go") {
        return;
    }
    let url = format!("{}/dlock-test", standalone_url());
    let backend = connect(&url).await;
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    let prefix = format!("adapter/tidy-{:08x}", rand::random::<u32>());
    let name = format!("{prefix}/x");
    for _ in 0..3 {
        dlock_conformance::unit::acquired(&session, &name)
            .await
            .release()
            .await
            .unwrap();
        assert_eq!(
            backend.nodes_under(&prefix).await.unwrap(),
            1,
            "the emptied parent right after a release"
        );
    }
    let released = Instant::now();
    loop {
        let left = backend.nodes_under(&prefix).await.unwrap();
        if left == 0 {
            break;
        }
        assert!(
            released.elapsed() < Duration::from_secs(10),
            "{left} nodes still there {:?} after the last release",
            released.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        released.elapsed() >= Duration::from_secs(1),
        "removed after {:?}: too soon for the next acquire to reuse it",
        released.elapsed()
    );
    session.close().await.unwrap();
}

/// `close` removes the parents still waiting for their delay, also those of
/// 500 names released just before, and that of a guard dropped without a
/// release (whose release the core finishes in the background, possibly
/// after the adapter's own clean-up ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_removes_the_parents_waiting_for_their_delay() {
    let _beside = SERVER.read().await;
    if skipped("zk", "close_removes_the_parents_waiting_for_their_delay") {
        return;
    }
    let url = format!("{}/dlock-test", standalone_url());
    let backend = connect(&url).await;
    let prefix = format!("adapter/close-tidy-{:08x}", rand::random::<u32>());
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    release_many(&session, &prefix, 500).await;
    let dropped = dlock_conformance::unit::acquired(&session, &format!("{prefix}/dropped")).await;
    drop(dropped);
    session.close().await.unwrap();
    assert_eq!(
        backend.nodes_under(&prefix).await.unwrap(),
        0,
        "nodes left behind right after close"
    );
}

/// Acquires and releases `<prefix>/<i>` for `i < n`, 50 at a time.
async fn release_many(session: &dlock_core::Session, prefix: &str, n: usize) {
    let mut tasks = tokio::task::JoinSet::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        for &i in chunk {
            let lock = session.lock(format!("{prefix}/{i}")).unwrap();
            tasks.spawn(async move { lock.acquire().await.unwrap().release().await.unwrap() });
        }
        while tasks.join_next().await.is_some() {}
    }
}
