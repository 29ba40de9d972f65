//! Checks the adapters' own unit and integration tests share: what every
//! adapter must do the same way outside the conformance cases.

use std::future::Future;
use std::time::{Duration, Instant};

use dlock_core::{Error, LockGuard, Session};

/// The password the URL checks put into refused URLs: it must not show in
/// what the refusal says (S9).
pub const SECRET: &str = "hunter2";

/// Asserts that `parsed`, the result of parsing `url`, is
/// [`Error::InvalidUrl`] whose text says `says`, and whose Display and
/// Debug leave out [`SECRET`].
#[track_caller]
pub fn assert_refused<T>(url: &str, parsed: Result<T, Error>, says: &str) {
    let e = parsed.err().unwrap_or_else(|| panic!("{url} accepted"));
    assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
    let shown = format!("{e} {e:?}");
    assert!(shown.contains(says), "{url}: {shown}");
    assert!(!shown.contains(SECRET), "{url}: {shown}");
}

/// Awaits `connect`, which uses credentials the server refuses, and
/// asserts the refusal is [`Error::Auth`], not retryable, arrives within
/// `within` (it was not retried), and that neither its Display nor its
/// Debug contains any of `hidden` (the password, encoded and not).
/// `what` names the attempt in the failure message.
pub async fn assert_auth_refused<T>(
    what: &str,
    connect: impl Future<Output = Result<T, Error>>,
    within: Duration,
    hidden: &[&str],
) {
    let start = Instant::now();
    let e = connect
        .await
        .err()
        .unwrap_or_else(|| panic!("{what}: connected"));
    let took = start.elapsed();
    assert!(took < within, "{what}: took {took:?} (retried?)");
    assert!(matches!(e, Error::Auth { .. }), "{what}: {e:?}");
    assert!(!e.is_retryable(), "{what}: {e}");
    let shown = format!("{e} {e:?}");
    for secret in hidden {
        assert!(
            !shown.contains(secret),
            "{what}: the password leaks: {shown}"
        );
    }
}

/// Takes `name` through a new lock handle of `session`, waiting as long as
/// it takes; panics where the handle or the take fails.
pub async fn acquired(session: &Session, name: &str) -> LockGuard {
    let lock = session
        .lock(name)
        .unwrap_or_else(|e| panic!("lock {name}: {e}"));
    lock.acquire()
        .await
        .unwrap_or_else(|e| panic!("acquire {name}: {e}"))
}
