//! A network blip while `dlock run --wait` waits must not end the run: the
//! wait rides out reset connections and a session that expired during a
//! partition (issue 12 item 16), through a fault proxy, against the real
//! servers. A store that stays unreachable past the budget ends the run with
//! the documented status, never 1.

#![cfg(any(feature = "postgres", feature = "etcd", feature = "redis"))]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dlock_conformance::wire::{Fault, Proxy};
use dlocks::SessionOptions;
use dlocks::url::StoreUrl;

const BIN: &str = env!("CARGO_BIN_EXE_dlock");

/// A fault proxy to the first host of `url`, and `url` through it.
async fn behind_proxy(url: &str) -> (Proxy, String) {
    let parsed = StoreUrl::parse(url).expect("the test URL");
    let upstream = parsed.hosts()[0].to_string();
    let proxy = Proxy::start(&upstream).await.expect("proxy");
    let proxied = parsed.with_hosts(&[proxy.addr()]).expect("proxied");
    let proxied = proxied.expose().to_owned();
    (proxy, proxied)
}

/// Starts the `dlock` binary with `args`, its output piped.
fn spawn_dlock(args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dlock")
}

/// Waits for `child` (off the runtime's threads) and returns its output.
async fn finished(child: Child) -> Output {
    tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap()
}

/// A holder keeps `name` while the CLI, behind `proxy`, waits for it; the
/// link is put under `fault` for `dark`, then healed, then the holder lets go.
async fn waiter_survives(url: &str, fault: Fault, dark: Duration) {
    let (proxy, proxied) = behind_proxy(url).await;
    let name = format!("dlock-test/cli-blip-{:08x}", rand::random::<u32>());
    let backend = dlocks::connect(url).await.expect("connect");
    let holder = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    let guard = holder.lock(name.as_str()).unwrap().acquire().await.unwrap();
    let started = Instant::now();
    let child = spawn_dlock(&[
        "run",
        &name,
        "--ttl",
        "2s",
        "--wait",
        "40s",
        "--url",
        &proxied,
        "--",
        "sh",
        "-c",
        "echo ran with $DLOCK_TOKEN",
    ]);
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.set(fault);
    tokio::time::sleep(dark).await;
    proxy.set(Fault::Pass);
    tokio::time::sleep(Duration::from_millis(500)).await;
    guard.release().await.unwrap();
    let out = finished(child).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "dlock run ended after a {fault:?} of {dark:?} while waiting ({:?}):\n{stdout}{stderr}",
        started.elapsed()
    );
    assert!(stdout.contains("ran with"), "{stdout}{stderr}");
}

/// The store stays dark past `--wait`: the documented status for an
/// unreachable store (69) or for a wait that ran out (75), never 1.
#[cfg(any(feature = "postgres", feature = "redis"))]
async fn dark_past_the_budget(url: &str) {
    let (proxy, proxied) = behind_proxy(url).await;
    let name = format!("dlock-test/cli-dark-{:08x}", rand::random::<u32>());
    let backend = dlocks::connect(url).await.expect("connect");
    let holder = backend.session(SessionOptions::new()).await.unwrap();
    let guard = holder.lock(name.as_str()).unwrap().acquire().await.unwrap();
    let child = spawn_dlock(&[
        "run", &name, "--ttl", "2s", "--wait", "4s", "--url", &proxied, "--", "true",
    ]);
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.set(Fault::Cut);
    let out = finished(child).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        matches!(out.status.code(), Some(69 | 75)),
        "dlock run exited {:?} after its store stayed unreachable past --wait:\n{stderr}",
        out.status.code()
    );
    guard.release().await.unwrap();
}

#[cfg(feature = "postgres")]
fn postgres() -> String {
    std::env::var("DLOCK_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://dlock:dlock@127.0.0.1:15432/dlock".into())
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiter_survives_resets() {
    waiter_survives(&postgres(), Fault::Cut, Duration::from_millis(1500)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_waiter_survives_a_partition_past_its_ttl() {
    waiter_survives(&postgres(), Fault::BLACKHOLE, Duration::from_secs(3)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_dark_past_the_budget() {
    dark_past_the_budget(&postgres()).await;
}

#[cfg(feature = "etcd")]
fn etcd() -> String {
    std::env::var("DLOCK_TEST_ETCD_URL").unwrap_or_else(|_| "etcd://127.0.0.1:12379".into())
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiter_survives_resets() {
    waiter_survives(&etcd(), Fault::Cut, Duration::from_millis(1500)).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiter_survives_its_session_expiring() {
    waiter_survives(&etcd(), Fault::BLACKHOLE, Duration::from_secs(4)).await;
}

#[cfg(feature = "redis")]
fn redis() -> String {
    std::env::var("DLOCK_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:16379".into())
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_waiter_survives_resets() {
    waiter_survives(&redis(), Fault::Cut, Duration::from_millis(1500)).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dark_past_the_budget() {
    dark_past_the_budget(&redis()).await;
}
