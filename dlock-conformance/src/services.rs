//! Process control of the real servers, for adapter fault tests: restart,
//! kill, pause and find the leader through the repository's
//! `scripts/services` (DESIGN.md §6).
//!
//! Tests that use these run in their own test binary (cargo runs binaries one
//! after another), so no other test is connected while a server is down.
//!
//! ```no_run
//! use dlock_conformance::services;
//! if !services::skipped("redis", "restart test") {
//!     services::run(&["restart", "redis"]);
//! }
//! ```

use std::path::PathBuf;
use std::process::Command;

/// The `scripts/services` of this repository (or `DLOCK_SERVICES_SCRIPT`).
pub fn script() -> PathBuf {
    std::env::var_os("DLOCK_SERVICES_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services"))
        })
}

/// Runs `scripts/services ARGS...` and returns its standard output; panics
/// with its standard error if it fails.
pub fn run(args: &[&str]) -> String {
    let out = Command::new(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script().display()));
    assert!(
        out.status.success(),
        "scripts/services {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Whether `DLOCK_TEST_SKIP` names `store`; if so, says loudly that `what`
/// was skipped.
pub fn skipped(store: &str, what: &str) -> bool {
    let skipped =
        std::env::var("DLOCK_TEST_SKIP").is_ok_and(|v| v.split(',').any(|s| s.trim() == store));
    if skipped {
        crate::loud(&format!(
            "SKIPPED {store}::{what}: DLOCK_TEST_SKIP names {store}"
        ));
    }
    skipped
}

/// The pid of a running instance, from its folder under the services
/// directory (`DLOCK_SERVICES_DIR`, default `target/services`).
pub fn pid(instance: &str) -> String {
    let dir = std::env::var("DLOCK_SERVICES_DIR")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/services").into());
    std::fs::read_to_string(format!("{dir}/{instance}/pid"))
        .unwrap_or_else(|e| panic!("no pid file for {instance} ({e}); is it up?"))
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// Sends `signal` (e.g. `-STOP`, `-CONT`) to a process.
pub fn signal(pid: &str, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, pid])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {signal} {pid} failed");
}

/// Brings an instance back up when dropped, even if an assertion failed.
#[derive(Debug)]
pub struct Restore(pub String);

impl Drop for Restore {
    fn drop(&mut self) {
        run(&["up", &self.0]);
    }
}

/// Resumes a paused process when dropped, even if an assertion failed.
#[derive(Debug)]
pub struct Resume(pub String);

impl Drop for Resume {
    fn drop(&mut self) {
        signal(&self.0, "-CONT");
    }
}
