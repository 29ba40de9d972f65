//! S9: a password in a URL never shows in an error (Display or Debug), a
//! backend's Debug, or the log, for any scheme, through `dlocks::connect` and
//! the `dlock` command. The password holds every character that trips naive
//! parsers (`/ @ : ? # %`), raw and percent-encoded, in the user info and in
//! password query parameters; the servers are closed ports (so the drivers'
//! own connection errors are checked too) or, where reachable, the real test
//! servers (wrong passwords).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

const NASTY: &str = "Sx/@:?#%q";

/// Fragments of the password that must not show.
fn fragments() -> Vec<String> {
    let encoded: String = url_encode(NASTY);
    vec![
        NASTY.to_owned(),
        encoded,
        "Sx/@".to_owned(),
        "?#%q".to_owned(),
        "Sx%2F".to_owned(),
    ]
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// URLs of every compiled scheme with the password in every place.
fn urls() -> Vec<String> {
    let enc = url_encode(NASTY);
    let mut hosts: Vec<(&str, &str)> = vec![("memory", "x")];
    if cfg!(feature = "postgres") {
        hosts.push(("postgres", "127.0.0.1:1/db"));
        hosts.push(("postgres", "127.0.0.1:15432/dlock"));
    }
    if cfg!(feature = "mysql") {
        hosts.push(("mysql", "127.0.0.1:1/db"));
        hosts.push(("mysql", "127.0.0.1:13306/dlock"));
    }
    if cfg!(feature = "sqlite") {
        hosts.push(("sqlite", "/nonexistent-dir/x.db"));
    }
    if cfg!(feature = "redis") {
        hosts.push(("redis", "127.0.0.1:1"));
        hosts.push(("redis", "127.0.0.1:16379"));
        hosts.push(("redlock", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"));
    }
    if cfg!(feature = "etcd") {
        hosts.push(("etcd", "127.0.0.1:1,127.0.0.1:2"));
    }
    if cfg!(feature = "zk") {
        hosts.push(("zk", "127.0.0.1:1/root"));
    }
    if cfg!(feature = "mongo") {
        hosts.push(("mongodb", "127.0.0.1:1/?serverSelectionTimeoutMS=300"));
    }
    if cfg!(feature = "nats") {
        hosts.push(("nats", "127.0.0.1:1"));
        hosts.push(("nats", "127.0.0.1:14222/dlock_test?max_age=5s"));
    }
    let mut urls = Vec::new();
    for (scheme, host) in hosts {
        let (authority, tail) = host.split_once('/').map_or((host, ""), |(a, t)| (a, t));
        let path = if tail.is_empty() {
            String::new()
        } else {
            format!("/{tail}")
        };
        let sep = if path.contains('?') { '&' } else { '?' };
        urls.push(format!("{scheme}://user:{NASTY}@{authority}{path}"));
        urls.push(format!("{scheme}://user:{enc}@{authority}{path}"));
        urls.push(format!("{scheme}://:{NASTY}@{authority}{path}"));
        urls.push(format!("{scheme}://{authority}{path}{sep}password={enc}"));
        urls.push(format!(
            "{scheme}://user@{authority}{path}{sep}password={NASTY}"
        ));
    }
    urls
}

/// A log sink shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

fn leaks(text: &str) -> Option<String> {
    fragments().into_iter().find(|f| text.contains(f.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_never_shows_a_password() {
    let log = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .finish();
    // Global: drivers log from their own tasks, on any worker thread.
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    let mut connects = tokio::task::JoinSet::new();
    for url in urls() {
        connects.spawn(async move {
            match tokio::time::timeout(Duration::from_secs(15), dlocks::connect(&url)).await {
                Err(_) => format!(
                    "(connect still running after 15 s for {})",
                    dlock_core::url::redact(&url)
                ),
                Ok(Ok(backend)) => format!("{backend:?}"),
                Ok(Err(e)) => format!("{e}\n{e:?}"),
            }
        });
    }
    let mut failures = Vec::new();
    while let Some(shown) = connects.join_next().await {
        let shown = shown.expect("connect task");
        if let Some(f) = leaks(&shown) {
            failures.push(format!("{shown}\n  (shows {f:?})"));
        }
    }
    let log = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    if let Some(f) = leaks(&log) {
        let line = log.lines().find(|l| l.contains(&f)).unwrap_or_default();
        failures.push(format!("log line: {line}\n  (shows {f:?})"));
    }
    assert!(
        failures.is_empty(),
        "secrets shown:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_cli_never_shows_a_password() {
    let bin = env!("CARGO_BIN_EXE_dlock");
    // One process per URL, all at once: unreachable servers take seconds.
    let runs: Vec<_> = urls()
        .into_iter()
        .map(|url| {
            let child = std::process::Command::new(bin)
                .args(["run", "x", "--no-wait", "--url", &url, "--", "true"])
                .env("RUST_LOG", "trace")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run dlock");
            (url, child)
        })
        .collect();
    let mut failures = Vec::new();
    for (url, child) in runs {
        let out = child.wait_with_output().expect("dlock output");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if let Some(f) = leaks(&text) {
            let shown = dlock_core::url::redact(&url);
            failures.push(format!("dlock run --url {shown}:\n{text}\n  (shows {f:?})"));
        }
    }
    assert!(
        failures.is_empty(),
        "secrets shown:\n{}",
        failures.join("\n")
    );
}
