//! `ServicesCommand` against a fake supervisor: its `status` tells the
//! suite which servers it controls, and the server-fault cases touch them
//! only when they are the ones under test.
#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use dlock_conformance::servers::{Servers, ServicesCommand};
use dlock_conformance::{AdapterHarness, Harness, Verdict, cases};
use dlock_core::memory::{MemoryAdapter, MemoryBackend};

/// A supervisor that logs its arguments, serves `memory://NAME` for each
/// NAME, and does nothing else: its script and log, in a directory removed
/// when the returned guard drops.
fn fake_supervisor() -> (PathBuf, PathBuf, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("dlock-services-")
        .tempdir()
        .unwrap();
    let (script, log) = (dir.path().join("services"), dir.path().join("log"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\n\
             if [ \"$1\" = status ]; then shift; for n in \"$@\"; do echo \"$n up memory://$n\"; done; fi\n",
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, log, dir)
}

fn harness(url: &str, servers: ServicesCommand) -> AdapterHarness {
    let server = MemoryBackend::new();
    AdapterHarness::new("fake", MemoryAdapter)
        .url(url)
        .connect_with(move |_| std::future::ready(Ok(server.linked().0)))
        .servers(Some(servers))
}

#[tokio::test]
async fn status_lists_the_endpoints_in_node_order() {
    let (script, _, _dir) = fake_supervisor();
    let servers = ServicesCommand::new(&script, ["b", "a"]);
    let endpoints = servers.endpoints().await.expect("status is supported");
    assert_eq!(endpoints.unwrap(), ["b", "a"]);
    assert_eq!(
        servers.start_command(),
        format!("{} up b a", script.display())
    );
}

/// `tokens_after_restart` on a store at `url` whose supervisor serves
/// `memory://node`: its verdict, and what the supervisor was asked.
async fn restart_case(url: &str) -> (Verdict, String) {
    let (script, log, _dir) = fake_supervisor();
    let h = harness(url, ServicesCommand::new(&script, ["node"]));
    h.connect().await.unwrap();
    let verdict = cases::tokens_after_restart(&h).await.unwrap();
    (verdict, std::fs::read_to_string(&log).unwrap())
}

#[tokio::test]
async fn servers_not_under_test_are_left_alone() {
    let (verdict, log) = restart_case("memory://other").await;
    let Verdict::Skipped(why) = verdict else {
        panic!("ran on servers that are not under test");
    };
    assert!(why.contains("not the ones under test"), "{why}");
    assert_eq!(log, "status node\n");
}

#[tokio::test]
async fn servers_under_test_are_used() {
    let (verdict, log) = restart_case("memory://node").await;
    assert_eq!(verdict, Verdict::Passed);
    // Then the case puts every node back as it found it.
    assert!(
        log.starts_with("status node\nkill node\nup node\n"),
        "{log}"
    );
}
