//! TLS and authentication against a real etcd that requires both: the
//! `etcd-tls` server of `scripts/services` (`DLOCK_TEST_ETCD_TLS_URL`, e.g.
//! `etcds://dlock:s3cr%2Fet%40x@127.0.0.1:12479?ca=.../ca.pem`: a user
//! whose role grants readwrite on the prefix `dlock`, and the CA of the
//! server's certificate).

use std::time::{Duration, Instant};

use dlock_core::{Backend, Error, SessionOptions};
use dlock_etcd::{EtcdAdapter, EtcdBackend};

fn url() -> Option<String> {
    if dlock_conformance::skip_requested("etcd-tls", "TLS/auth tests") {
        return None;
    }
    Some(
        std::env::var("DLOCK_TEST_ETCD_TLS_URL").unwrap_or_else(|_| {
            concat!(
                "etcds://dlock:s3cr%2Fet%40x@127.0.0.1:12479?ca=",
                env!("CARGO_MANIFEST_DIR"),
                "/../target/services/etcd-tls/ca.pem"
            )
            .into()
        }),
    )
}

/// The URL with other credentials (`None`: without any).
fn with_user(url: &str, user: Option<&str>) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (_, hosts) = rest.rsplit_once('@').expect("the test URL has credentials");
    match user {
        Some(user) => format!("{scheme}://{user}@{hosts}"),
        None => format!("{scheme}://{hosts}"),
    }
}

fn password_of(url: &str) -> String {
    let userinfo = url.split_once("://").unwrap().1.rsplit_once('@').unwrap().0;
    userinfo.split_once(':').unwrap().1.to_owned()
}

async fn connect(url: &str) -> Result<EtcdBackend, Error> {
    EtcdBackend::connect(url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_password_over_tls_works() {
    let Some(url) = url() else { return };
    let backend = connect(&url).await.unwrap_or_else(|e| {
        panic!("cannot reach etcd with TLS and auth ({e}); start it with `scripts/services up etcd-tls` or set DLOCK_TEST_SKIP=etcd-tls")
    });
    assert_eq!(backend.capabilities(), EtcdAdapter.capabilities());
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    let name = format!("auth/{:08x}", rand::random::<u32>());
    let guard = dlock_conformance::unit::acquired(&session, &name).await;
    // Renewals (keep-alives and reads) go through with the token too.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(guard.is_held(), "lost: {:?}", guard.lost_reason());
    let info = backend.inspect(guard.name()).await.unwrap().expect("held");
    assert_eq!(info.token, guard.token());
    guard.release().await.unwrap();
    session.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_an_auth_error_at_once() {
    let Some(url) = url() else { return };
    let secret = password_of(&url);
    for (what, bad) in [
        (
            "a wrong password",
            with_user(&url, Some("dlock:wrong%2Fpass")),
        ),
        ("an unknown user", with_user(&url, Some("nobody:wrong"))),
        ("no credentials", with_user(&url, None)),
    ] {
        let hidden = ["wrong%2Fpass", "wrong/pass", &secret];
        let within = Duration::from_secs(3);
        dlock_conformance::unit::assert_auth_refused(what, connect(&bad), within, &hidden).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_server_certificate_is_a_config_error() {
    let Some(url) = url() else { return };
    // Without ?ca=, the system's roots do not know the test CA.
    let no_ca = url
        .split_once('?')
        .map_or(url.as_str(), |(u, _)| u)
        .to_owned();
    let start = Instant::now();
    let e = connect(&no_ca).await.expect_err("an untrusted certificate");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("not trusted"), "{e}");
    assert!(!e.to_string().contains(&password_of(&url)), "{e}");
    // Plain text to a TLS port: an error, not a hang.
    let plain = no_ca.replacen("etcds://", "etcd://", 1);
    let e = tokio::time::timeout(Duration::from_secs(15), connect(&plain))
        .await
        .expect("plain text to a TLS port hangs")
        .expect_err("plain text to a TLS port");
    assert!(!e.to_string().contains(&password_of(&url)), "{e}");
    // A CA file that does not exist.
    let e = connect(&format!("{no_ca}?ca=/nonexistent/ca.pem"))
        .await
        .expect_err("no CA file");
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}
