//! Connect-time refusals on the real server. Issue 12 item 20: a wrong
//! password is [`Error::Auth`] (never `Unavailable`, retried forever), a TLS
//! certificate the client does not trust is [`Error::Config`] at once (not
//! after the server-selection timeout), the right CA works, and no message
//! carries the password. Item 10: a `mongos` is refused unless the URL says
//! `dlock_mongos=allow`.
//!
//! The mongo-wire server of `scripts/services` serves plain TCP (its own
//! certificate is a CA certificate, which rustls rightly refuses as a
//! server's), so TLS is terminated by a small proxy here, with the
//! certificate `scripts/services` makes for its TLS servers
//! (`<services dir>/postgres/server.crt`: self-signed, not a CA, for
//! `127.0.0.1`). Only against that setup: with another
//! `DLOCK_TEST_MONGO_URL`, or without the certificate, the TLS test says it
//! is skipped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_core::{Backend, Error, SessionOptions};
use dlock_mongo::MongoBackend;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, pki_types::pem::PemObject};

const DEFAULT_URL: &str =
    "mongodb://dlock:dlock@127.0.0.1:17017/?directConnection=true&authMechanism=SCRAM-SHA-256";

/// A password with every character URL redaction tends to get wrong.
const SECRET: &str = "s3cr/et@:?#%";

/// The test server's URL without `dlock_mongos` (each test says whether it
/// opts in).
fn base_url() -> String {
    let url = std::env::var("DLOCK_TEST_MONGO_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    match url.split_once('?') {
        Some((head, query)) => {
            let kept: Vec<&str> = query
                .split('&')
                .filter(|p| !p.is_empty() && p.split('=').next() != Some("dlock_mongos"))
                .collect();
            format!("{head}?{}", kept.join("&"))
        }
        None => url,
    }
}

fn services_port() -> u16 {
    let offset: u16 = std::env::var("DLOCK_SERVICES_PORT_OFFSET")
        .ok()
        .and_then(|o| o.parse().ok())
        .unwrap_or(0);
    17017 + offset
}

/// `base_url()` with `user:password@` replaced and `extra` options added.
fn url_with(password: Option<&str>, host: &str, extra: &str) -> String {
    let url = base_url();
    let (_, rest) = url.split_once("://").expect("a mongodb:// URL");
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let (_, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let (_, query) = tail.split_once('?').unwrap_or(("", ""));
    let userinfo = match password {
        Some(p) => format!("dlock:{}@", encode(p)),
        None => String::new(),
    };
    let sep = if query.is_empty() { "" } else { "&" };
    format!("mongodb://{userinfo}{host}/?{query}{sep}dlock_mongos=allow{extra}")
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn assert_no_secret(what: &str, e: &Error) {
    for text in [e.to_string(), format!("{e:?}")] {
        for secret in [SECRET.to_owned(), encode(SECRET), "s3cr".to_owned()] {
            assert!(
                !text.contains(&secret),
                "{what}: the password leaks: {text}"
            );
        }
    }
}

fn services_dir() -> PathBuf {
    std::env::var_os("DLOCK_SERVICES_DIR").map_or_else(
        || PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/services")),
        PathBuf::from,
    )
}

#[tokio::test]
async fn wrong_password_is_auth() {
    let url = url_with(Some(SECRET), &format!("127.0.0.1:{}", services_port()), "");
    let hidden = [SECRET, &encode(SECRET), "s3cr"];
    let connect = MongoBackend::connect(&url);
    dlock_conformance::unit::assert_auth_refused(
        "wrong password",
        connect,
        Duration::from_secs(4),
        &hidden,
    )
    .await;
}

/// A TLS terminator on an ephemeral port in front of the plain server.
async fn tls_terminator(cert: &PathBuf, key: &PathBuf, upstream: u16) -> u16 {
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(cert)
        .expect("cert.pem")
        .collect::<Result<Vec<_>, _>>()
        .expect("cert.pem");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).expect("key.pem");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("TLS config");
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut plain) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    port
}

#[tokio::test]
async fn tls_untrusted_certificate_is_config_and_trusted_one_works() {
    let dir = services_dir().join("postgres");
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    let plain = format!("127.0.0.1:{}", services_port());
    if !base_url().contains(&plain) || !cert.exists() || !key.exists() {
        eprintln!(
            "SKIPPED tls_untrusted_certificate_is_config_and_trusted_one_works: needs the \
             mongo-wire server of scripts/services and its certificate ({})",
            cert.display()
        );
        return;
    }
    let port = tls_terminator(&cert, &key, services_port()).await;
    let host = format!("127.0.0.1:{port}");

    // The system's roots do not include the server's self-signed certificate.
    let started = Instant::now();
    let e = MongoBackend::connect(&url_with(Some("dlock"), &host, "&tls=true"))
        .await
        .expect_err("an untrusted certificate must not connect");
    assert!(
        matches!(e, Error::Config(_)),
        "untrusted certificate: {e:?} (want Error::Config)"
    );
    assert!(e.to_string().contains("certificate"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}: the certificate failure waited out server selection",
        started.elapsed()
    );
    // A wrong password behind an untrusted certificate: the certificate is
    // what fails, and the password still does not leak.
    let e = MongoBackend::connect(&url_with(Some(SECRET), &host, "&tls=true"))
        .await
        .expect_err("an untrusted certificate must not connect");
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert_no_secret("untrusted certificate", &e);

    // With the server's certificate as the CA: TLS works end to end.
    let ca = format!("&tls=true&tlsCAFile={}", cert.display());
    let backend = MongoBackend::connect(&url_with(Some("dlock"), &host, &ca))
        .await
        .expect("TLS with the right CA");
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .expect("session over TLS");
    let name = format!("auth-test/tls-{:016x}", rand::random::<u64>());
    let guard = session
        .lock(&name)
        .expect("name")
        .acquire()
        .await
        .expect("acquire over TLS");
    guard.release().await.expect("release over TLS");
    session.close().await.expect("close over TLS");

    // Over TLS too, a wrong password is Auth.
    let e = MongoBackend::connect(&url_with(Some(SECRET), &host, &ca))
        .await
        .expect_err("a wrong password must not connect");
    assert!(
        matches!(e, Error::Auth { .. }),
        "TLS, wrong password: {e:?}"
    );
    assert_no_secret("TLS, wrong password", &e);
}

/// Item 10: the mongo-wire server presents as `mongos`, whose `$$NOW` is the
/// router's clock; connect refuses it unless the URL opts in.
#[tokio::test]
async fn mongos_is_refused_without_opt_in() {
    let url = base_url();
    let backend = MongoBackend::connect(&url_with(Some("dlock"), host_of(&url), "")).await;
    let Ok(backend) = backend else {
        panic!("the test server: {:?}", backend.err());
    };
    if backend.deployment() != dlock_mongo::Deployment::Sharded {
        eprintln!("SKIPPED mongos_is_refused_without_opt_in: the server is not a mongos");
        return;
    }
    // The test server's URL without the opt-in.
    let e = MongoBackend::connect(&url)
        .await
        .expect_err("a mongos without dlock_mongos=allow must be refused");
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("dlock_mongos=allow"), "{e}");
}

fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest)
}
