//! `dlocks::blocking` on every backend this run can reach (memory://, an
//! SQLite file, and each `DLOCK_TEST_<STORE>_URL` that is set): the async
//! API's cases that apply to a thread without a runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dlocks::blocking::{self, Backend};
use dlocks::{Error, LostReason, SessionOptions};

const TTL: Duration = Duration::from_secs(2);

fn unique(tag: &str) -> String {
    format!("blocking/{tag}-{:08x}", rand::random::<u32>())
}

/// Every backend to run on: (label, URL).
fn backends(sqlite_dir: &std::path::Path) -> Vec<(String, String)> {
    let mut all = vec![
        ("memory".to_owned(), "memory://blocking-tests".to_owned()),
        (
            "sqlite".to_owned(),
            format!("sqlite://{}/blocking.db", sqlite_dir.display()),
        ),
    ];
    for (label, var, feature_on) in [
        (
            "postgres",
            "DLOCK_TEST_POSTGRES_URL",
            cfg!(feature = "postgres"),
        ),
        ("mysql", "DLOCK_TEST_MYSQL_URL", cfg!(feature = "mysql")),
        ("redis", "DLOCK_TEST_REDIS_URL", cfg!(feature = "redis")),
        ("etcd", "DLOCK_TEST_ETCD_URL", cfg!(feature = "etcd")),
        ("zk", "DLOCK_TEST_ZK_URL", cfg!(feature = "zk")),
        ("mongo", "DLOCK_TEST_MONGO_URL", cfg!(feature = "mongo")),
        ("nats", "DLOCK_TEST_NATS_URL", cfg!(feature = "nats")),
    ] {
        match std::env::var(var) {
            Ok(url) if feature_on => all.push((label.to_owned(), url)),
            Ok(_) => {}
            Err(_) => println!("SKIPPED blocking::{label}: {var} is not set"),
        }
    }
    all
}

fn options() -> SessionOptions {
    SessionOptions::new().ttl(TTL)
}

/// S1 and S2: threads never hold together, and each grant's token is above
/// every earlier one's.
fn threads_exclude_each_other(backend: &Backend, label: &str) {
    let name = unique("mutex");
    let busy = Arc::new(AtomicBool::new(false));
    let last = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (backend, name) = (backend.clone(), name.clone());
            let (busy, last) = (busy.clone(), last.clone());
            std::thread::spawn(move || {
                let session = backend.session(options()).unwrap();
                let lock = session.lock(name.as_str()).unwrap();
                for _ in 0..5 {
                    let guard = lock.acquire().unwrap();
                    assert!(!busy.swap(true, Ordering::SeqCst), "two holders at once");
                    let token = guard.token().get();
                    let before = last.swap(token, Ordering::SeqCst);
                    assert!(token > before, "token {token} after {before}");
                    std::thread::sleep(Duration::from_millis(2));
                    busy.store(false, Ordering::SeqCst);
                    guard.release().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join()
            .unwrap_or_else(|_| panic!("{label}: a thread failed"));
    }
}

/// A held lock: a try answers `None`, a timed wait times out; dropping the
/// guard releases before the drop returns.
fn busy_then_free_on_drop(backend: &Backend, label: &str) {
    let name = unique("busy");
    let a = backend.session(options()).unwrap();
    let b = backend.session(options()).unwrap();
    let guard = a.lock(name.as_str()).unwrap().acquire().unwrap();
    let lock_b = b.lock(name.as_str()).unwrap();
    assert!(lock_b.try_acquire().unwrap().is_none(), "{label}");
    let started = Instant::now();
    let r = lock_b.acquire_timeout(Duration::from_millis(200));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{label}: {r:?}");
    assert!(started.elapsed() >= Duration::from_millis(200), "{label}");
    drop(guard);
    let next = lock_b.try_acquire().unwrap();
    assert!(next.is_some(), "{label}: not free right after the drop");
    // Dropping the last handles closes the session in the foreground.
    drop(next);
    drop(lock_b);
    drop(b);
    let again = a.lock(name.as_str()).unwrap().try_acquire().unwrap();
    assert!(again.is_some(), "{label}");
}

/// A hold broken by an admin: the guard's channel says so within the
/// renewal bound, and the check agrees.
fn lost_is_a_channel(backend: &Backend, label: &str) {
    let name = unique("lost");
    let session = backend.session(options()).unwrap();
    let guard = session.lock(name.as_str()).unwrap().acquire().unwrap();
    let lost = guard.lost();
    assert!(lost.try_recv().is_err(), "{label}: lost while held");
    assert!(backend.force_release(name.as_str()).unwrap(), "{label}");
    let reason = lost
        .recv_timeout(TTL * 3)
        .unwrap_or_else(|e| panic!("{label}: no loss reported: {e}"));
    assert!(
        matches!(reason, LostReason::Revoked | LostReason::Expired),
        "{label}: {reason:?}"
    );
    assert!(!guard.is_held(), "{label}");
    assert_eq!(guard.lost_reason(), Some(reason), "{label}");
    assert!(
        matches!(guard.release(), Err(Error::Lost { .. })),
        "{label}"
    );
    session.close().unwrap();
}

#[test]
fn on_every_reachable_backend() {
    let dir = tempfile::tempdir().unwrap();
    for (label, url) in backends(dir.path()) {
        let backend = blocking::connect(&url)
            .unwrap_or_else(|e| panic!("{label}: {e} (scripts/services up starts the servers)"));
        threads_exclude_each_other(&backend, &label);
        busy_then_free_on_drop(&backend, &label);
        lost_is_a_channel(&backend, &label);
    }
}

/// From a thread inside a runtime (a `spawn_blocking` thread, and an
/// async task that calls it anyway) the API works, and dropping a guard
/// (and the last handles, which stops the API's runtime) still releases in
/// the foreground. Red before: `block_on` panicked ("Cannot start a runtime
/// from within a runtime"), and a drop there left the lock to its TTL.
#[test]
fn works_from_inside_a_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let name = unique("inside");
    let url = "memory://blocking-inside";
    let other = blocking::connect(url).unwrap();
    let long = SessionOptions::new().ttl(Duration::from_secs(30));
    let watcher = other.session(long.clone()).unwrap();
    for in_task in [false, true] {
        let (theirs, long) = (name.clone(), long.clone());
        let work = move || {
            let backend = blocking::connect(url).unwrap();
            let session = backend.session(long).unwrap();
            let guard = session.lock(theirs.as_str()).unwrap().acquire().unwrap();
            let token = guard.token();
            // Backend and session first: the guard's drop is the last.
            drop(backend);
            drop(session);
            drop(guard);
            token
        };
        let token = if in_task {
            rt.block_on(async move { work() })
        } else {
            rt.block_on(rt.spawn_blocking(work)).unwrap()
        };
        // Free at once (a TTL of 30 s would show a release left undone).
        let next = watcher.lock(name.as_str()).unwrap().try_acquire().unwrap();
        let next = next.expect("released by the drop");
        assert!(next.token() > token);
        next.release().unwrap();
    }
}
