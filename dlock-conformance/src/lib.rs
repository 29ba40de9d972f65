//! The dlock conformance suite: every adapter proves itself against a real
//! server with the same cases.
//!
//! An adapter's `tests/conformance.rs` is one macro call over a [`Harness`],
//! most simply an [`AdapterHarness`] built from the adapter and a URL:
//!
//! ```ignore
//! use std::time::Duration;
//! use dlock_conformance::{AdapterHarness, conformance_tests};
//!
//! conformance_tests!(
//!     AdapterHarness::new("my-store", my_adapter::MyAdapter)
//!         .default_url("mystore://127.0.0.1:7000") // or $DLOCK_TEST_MY_STORE_URL
//!         .ttl(Duration::from_secs(1))
//!         .services(["my-store"]) // server faults through $DLOCK_SERVICES
//!         .bad_urls(["mystore://", "mystore://h:1?no_such_option=1"])
//! );
//! ```
//!
//! It expands to one `#[tokio::test]` per case (the calling crate needs
//! `tokio` with the `macros` and `rt-multi-thread` features as a
//! dev-dependency). Each case uses a fresh random name prefix, so cases run in
//! parallel against one server. A case that does not apply to the harness's
//! [`Profile`] (the case TTL and the store's declared
//! [`Capabilities`](dlock_core::Capabilities)) passes with a loud `SKIPPED`
//! line on stderr saying why. If the server is down, every case fails saying
//! how to start it, unless `DLOCK_TEST_SKIP` names the store
//! (comma-separated), in which case each case says it was skipped. With
//! `DLOCK_TEST_TIMES` set, every case prints `TIME <store>::<case> <seconds>`
//! (CI's time budget).
//!
//! The cases that kill, pause or restart servers need process control: a
//! supervisor command named by the environment variable `DLOCK_SERVICES`
//! (see [`servers::ServicesCommand`]; the dlock repository's
//! `scripts/services env` exports it). Without it they say `SKIPPED`.
//!
//! # Cases and the invariants they guard
//!
//! Each case is a `pub async fn` in [`cases`]; its doc comment says what it
//! checks. [`CASES`] lists them all, with the invariants each guards and the
//! faults it injects. Cases that need what a harness cannot give (links,
//! process control, a leader, a stepped clock, a capability) say `SKIPPED`
//! and why.
//!
//! The wire faults come from [`wire`] (a TCP proxy per store node, or the
//! memory backend's in-process link), the server faults from the harness's
//! [`servers::Servers`], the in-process ones from [`faults`].

mod adapter_harness;
pub mod cases;
pub mod checker;
pub mod faults;
mod harness;
pub mod process;
pub mod servers;
pub mod unit;
pub mod wire;

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::time::Duration;

pub use adapter_harness::AdapterHarness;
pub use harness::{Ctx, Failure, Harness, Outcome, Profile, Verdict};

#[doc(hidden)]
pub use tokio as __tokio;

/// The longest a single case may run before it is failed as hung.
pub const CASE_TIME_LIMIT: Duration = Duration::from_secs(180);

/// Whether a case may run beside others, or needs the deployment to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Touches only its own names and clients (its own links included).
    Shared,
    /// Kills, pauses or restarts servers, or loads the store as no other
    /// case may beside it (200 waiters, 10,000 holds): runs while no other
    /// case of the test binary runs.
    Exclusive,
}

/// Shared cases hold it for reading, exclusive ones for writing.
static DEPLOYMENT: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Runs one case: checks the server is up (or skipped by `DLOCK_TEST_SKIP`),
/// runs the case with a time limit, prints skips loudly and panics on failure.
pub async fn run<H, F>(case: &str, kind: Kind, harness: &H, body: F)
where
    H: Harness,
    F: for<'a> FnOnce(&'a dyn Harness) -> Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>,
{
    init_tracing();
    let store = harness.store().to_owned();
    let skipped_by_env = std::env::var("DLOCK_TEST_SKIP")
        .map(|v| v.split(',').any(|s| s.trim() == store))
        .unwrap_or(false);
    if skipped_by_env {
        loud(&format!(
            "SKIPPED {store}::{case}: DLOCK_TEST_SKIP names {store}"
        ));
        return;
    }
    let _shared;
    let _exclusive;
    match kind {
        Kind::Shared => _shared = DEPLOYMENT.read().await,
        Kind::Exclusive => _exclusive = DEPLOYMENT.write().await,
    }
    if let Err(e) = harness.connect().await {
        // What the supervisor says of the servers, so that a CI log shows
        // why a server is down (who stopped it, how it died).
        let described = match harness.servers() {
            Some(servers) => servers.describe().await,
            None => None,
        };
        let described = described
            .map(|d| format!("\nthe supervisor says:\n{d}"))
            .unwrap_or_default();
        panic!(
            "{store}::{case}: cannot reach the {store} server ({e}); to start it: {}; \
             or set DLOCK_TEST_SKIP={store}{described}",
            harness.start_hint()
        );
    }
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(CASE_TIME_LIMIT, body(harness)).await;
    if std::env::var_os("DLOCK_TEST_TIMES").is_some() {
        loud(&format!(
            "TIME {store}::{case} {:.1}s",
            started.elapsed().as_secs_f64()
        ));
    }
    match outcome {
        Ok(Ok(Verdict::Passed)) => {}
        Ok(Ok(Verdict::Skipped(why))) => loud(&format!("SKIPPED {store}::{case}: {why}")),
        Ok(Err(failure)) => panic!("{store}::{case} FAILED: {failure}"),
        Err(_) => panic!("{store}::{case} FAILED: still running after {CASE_TIME_LIMIT:?} (hung?)"),
    }
}

/// Whether `DLOCK_TEST_SKIP` (a comma-separated list of store names) names
/// `store`; if so, says loudly that `what` was skipped, so that a run
/// without a server is never silently green.
///
/// ```
/// if dlock_conformance::skip_requested("redis", "my adapter test") {
///     return;
/// }
/// ```
pub fn skip_requested(store: &str, what: &str) -> bool {
    let skipped =
        std::env::var("DLOCK_TEST_SKIP").is_ok_and(|v| v.split(',').any(|s| s.trim() == store));
    if skipped {
        loud(&format!(
            "SKIPPED {store}::{what}: DLOCK_TEST_SKIP names {store}"
        ));
    }
    skipped
}

/// Writes past the test harness's output capture, so a skip is always seen.
pub(crate) fn loud(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn init_tracing() {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("RUST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_test_writer()
                .try_init();
        }
    });
}

/// Expands to one `#[tokio::test]` per conformance case (one per entry of
/// [`CASES`], named like it) for `$harness` (an expression evaluated afresh
/// in each test).
///
/// `conformance_tests!(mod NAME, $harness)` puts them in a module `NAME`
/// (which sees the items of the calling module), so that one test file can
/// test several deployments.
///
/// Cases that kill, pause or restart servers, and the two load cases, run
/// alone: while one runs, no other case of the same test binary does (cargo
/// runs test binaries one after another, so nothing else touches the
/// servers either).
#[macro_export]
macro_rules! conformance_tests {
    (mod $module:ident, $harness:expr $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_tests!($harness);
        }
    };
    ($harness:expr) => {
        $crate::__with_cases!(__conformance_cases!($harness));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    (($harness:expr) $($case:ident : $kind:ident, $invariants:literal, $faults:literal;)*) => {
        $( $crate::__conformance_case!($harness, $case, $kind); )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_case {
    ($harness:expr, $case:ident, $kind:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            let harness = $harness;
            $crate::run(stringify!($case), $crate::__kind!($kind), &harness, |h| {
                ::std::boxed::Box::pin($crate::cases::$case(h))
            })
            .await;
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __kind {
    (shared) => {
        $crate::Kind::Shared
    };
    (exclusive) => {
        $crate::Kind::Exclusive
    };
}

/// A case body: runs the case on a harness.
pub type CaseFn = for<'a> fn(&'a dyn Harness) -> Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>;

/// One conformance case, as [`CASES`] lists it.
#[derive(Clone, Copy, Debug)]
pub struct CaseInfo {
    /// The case's name: its function in [`cases`] and its test's name.
    pub name: &'static str,
    /// Whether it may run beside other cases.
    pub kind: Kind,
    /// The invariants it guards (S1–S9, L1–L6 of the design contract).
    pub invariants: &'static str,
    /// The faults it injects (`–` for none).
    pub faults: &'static str,
    /// The case itself, for running it with [`run`].
    pub body: CaseFn,
}

#[doc(hidden)]
#[macro_export]
macro_rules! __case_table {
    (() $($case:ident : $kind:ident, $invariants:literal, $faults:literal;)*) => {
        /// Every conformance case, in the order of this table: the cases that
        /// kill, pause or restart servers (kind `exclusive`) run alone.
        ///
        /// | case | kind | invariants | faults |
        /// |---|---|---|---|
        $(
            #[doc = concat!(
                "| [`", stringify!($case), "`](cases::", stringify!($case), ") | ",
                stringify!($kind), " | ", $invariants, " | ", $faults, " |"
            )]
        )*
        ///
        /// The wire faults come from [`wire`] (a TCP proxy per store node, or
        /// the memory backend's in-process link), the server faults from the
        /// harness's [`servers::Servers`], the in-process ones from [`faults`].
        pub const CASES: &[CaseInfo] = &[
            $(
                CaseInfo {
                    name: stringify!($case),
                    kind: $crate::__kind!($kind),
                    invariants: $invariants,
                    faults: $faults,
                    body: |h| Box::pin(cases::$case(h)),
                },
            )*
        ];
    };
}

__with_cases!(__case_table!());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_are_unique() {
        let mut names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "a case is listed twice");
    }

    #[test]
    fn exclusive_cases_come_last() {
        let first = CASES
            .iter()
            .position(|c| c.kind == Kind::Exclusive)
            .unwrap_or(CASES.len());
        assert!(CASES[first..].iter().all(|c| c.kind == Kind::Exclusive));
    }
}
