//! The dlock conformance suite: every adapter proves itself against a real
//! server with the same cases.
//!
//! An adapter's `tests/conformance.rs` is one macro call over a [`Harness`]:
//!
//! ```ignore
//! use dlock_conformance::conformance_tests;
//! conformance_tests!(my_adapter::TestHarness::from_env());
//! ```
//!
//! It expands to one `#[tokio::test]` per case (the calling crate needs
//! `tokio` with the `macros` and `rt-multi-thread` features as a
//! dev-dependency). Each case uses a fresh random name prefix, so cases run in
//! parallel against one server. A case that does not apply to the backend's
//! declared [`Capabilities`] passes with a loud `SKIPPED` line on stderr
//! saying why. If the server is down, every case fails with the command that
//! starts it, unless `DLOCK_TEST_SKIP` names the store (comma-separated), in
//! which case each case says it was skipped. With `DLOCK_TEST_TIMES` set,
//! every case prints `TIME <store>::<case> <seconds>` (CI's time budget).
//!
//! # Cases and the invariants they guard
//!
//! Each case is a `pub async fn` in [`cases`]; its doc comment says what it
//! checks. Cases that need what a harness cannot give (links, process
//! control, a leader, a stepped clock, a capability) say `SKIPPED` and why.
//!
//! | case | invariants | faults |
//! |---|---|---|
//! | `contention` (16 clients, fenced register, history check) | S1, S2 | – |
//! | `try_acquire` | S1, L5 | – |
//! | `timeouts` | L5, L4 | – |
//! | `reentrancy` | S1 (handles exclude each other) | – |
//! | `first_take_race` | S1, S2 (racing creation of a lock's record) | – |
//! | `release_by_non_owner` | S3 | – |
//! | `stale_release_after_expiry` | S3, S4 | in-process stall |
//! | `stale_release_retried_after_lost_reply` | S3 | in-process lost reply |
//! | `holder_crash_recovery` | L1, S2 | in-process crash |
//! | `no_early_grant_while_renewing` | S1, L3 | – |
//! | `lost_signal_by_local_deadline` | S4 | in-process stall |
//! | `pause_scenario` | S4, fencing | client process paused |
//! | `tokens_after_expiry` | S2, S6 | in-process crash |
//! | `force_release` | S2, S3, S4 | – |
//! | `renewal_task_panics` | S4 (no zombie session) | panicking renewal |
//! | `renewal_keeps_only_known_holds` | S5, L1 (untracked grants expire) | – |
//! | `inspect_and_validate` | S2, S3 | – |
//! | `wakeup_latency` | L2 | – |
//! | `wakeup_release_before_subscribe` | L2 | – |
//! | `wakeup_dead_notification_channel` | L2, L1 | deaf notifications |
//! | `many_waiters_one_handoff_each` (200 waiters) | L6, S1 | – |
//! | `fifo_with_cancelled_waiter` | L4, S5 | – |
//! | `cancellation_sweep` | S5 | dropped futures |
//! | `acquire_retried_after_lost_reply` | S5, idempotent take | in-process lost reply |
//! | `idempotent_take_extends_expiry` | S4 | in-process slow lost reply |
//! | `ten_thousand_names` | S5 (no leaked state, before and after close) | – |
//! | `bad_input` | typed errors | – |
//! | `session_close` | S5, L3 | – |
//! | `renewal_replies_lost` | S4, L3 | wire: replies lost |
//! | `renewal_replies_late` | S4 | wire: replies later than the request timeout |
//! | `replies_late_but_in_time` | S4 (validity from the send) | wire: replies late, in time |
//! | `renewal_on_dead_connection` | L3, S4 | wire: connections silently dead |
//! | `acquire_reply_lost` | S1, S5 | wire: take's reply lost, then dark |
//! | `release_reply_lost` | S3 | wire: release's reply lost |
//! | `holder_partitioned_past_ttl` | S4, L1, fencing | wire: holder blackholed |
//! | `waiters_cut_while_waiting` | L1, L2 | wire: waiters reset |
//! | `connection_blip` | L3 (`survives_reconnect`) | wire: holder reset |
//! | `split_views_at_connect` | S1 (quorum of configured nodes) | wire: different minorities cut |
//! | `abandon_retried_after_cut` | S5, L4 | wire: connections refused |
//! | `acquire_timeout_under_partition` | L5 | wire: blackhole |
//! | `waiter_learns_session_lost` | L5, S5 | wire: waiter blackholed past TTL |
//! | `lost_hold_release_retried` | S5, L1 | wire: replies lost, then refused |
//! | `release_retried_after_cut` | S5, L1 | wire: connections refused while releasing |
//! | `tokens_after_restart` (exclusive) | S2 (durable tokens) | servers killed, restarted |
//! | `server_paused_past_ttl` (exclusive) | S4, S2, fencing, L5 | servers SIGSTOPped |
//! | `server_restart_while_held` (exclusive) | S1, S2, S4 | servers killed, restarted |
//! | `node_restarted_from_old_snapshot` (exclusive) | S1, S4, S2 | majority restored from old snapshots |
//! | `leader_killed_while_held` (exclusive) | S1, S2, L4 | leader killed |
//! | `node_isolated_from_peers` (exclusive) | S4 | follower cut off from its peers |
//! | `server_clock_jumps` (exclusive) | fencing under clock faults | store clock stepped |
//!
//! The wire faults come from [`wire`] (a TCP proxy per store node, or the
//! memory backend's in-process link), the server faults from the harness's
//! [`servers::Servers`], the in-process ones from [`faults`].

pub mod cases;
pub mod checker;
pub mod faults;
mod harness;
pub mod process;
pub mod servers;
pub mod wire;

use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::time::Duration;

pub use harness::{Capabilities, Ctx, Failure, Harness, Outcome, Verdict};

#[doc(hidden)]
pub use tokio as __tokio;

/// The longest a single case may run before it is failed as hung.
pub const CASE_TIME_LIMIT: Duration = Duration::from_secs(180);

/// Whether a case may run beside others, or needs the deployment to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Touches only its own names and clients (its own links included).
    Shared,
    /// Kills, pauses or restarts servers: runs while no other case of the
    /// test binary runs.
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
        panic!(
            "{store}::{case}: cannot reach the {store} server ({e}); start it with `{}` \
             or set DLOCK_TEST_SKIP={store}",
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

/// Expands to one `#[tokio::test]` per conformance case for `$harness` (an
/// expression evaluated afresh in each test).
///
/// Cases that kill, pause or restart servers run alone: while one runs, no
/// other case of the same test binary does (cargo runs test binaries one
/// after another, so nothing else touches the servers either).
#[macro_export]
macro_rules! conformance_tests {
    ($harness:expr) => {
        $crate::__conformance_cases!(
            $harness;
            shared:
            contention,
            try_acquire,
            timeouts,
            release_by_non_owner,
            stale_release_after_expiry,
            stale_release_retried_after_lost_reply,
            holder_crash_recovery,
            no_early_grant_while_renewing,
            lost_signal_by_local_deadline,
            pause_scenario,
            tokens_after_expiry,
            force_release,
            inspect_and_validate,
            wakeup_latency,
            wakeup_release_before_subscribe,
            wakeup_dead_notification_channel,
            many_waiters_one_handoff_each,
            fifo_with_cancelled_waiter,
            reentrancy,
            first_take_race,
            cancellation_sweep,
            acquire_retried_after_lost_reply,
            idempotent_take_extends_expiry,
            ten_thousand_names,
            bad_input,
            session_close,
            renewal_replies_lost,
            renewal_replies_late,
            renewal_on_dead_connection,
            acquire_reply_lost,
            release_reply_lost,
            holder_partitioned_past_ttl,
            waiters_cut_while_waiting,
            connection_blip,
            split_views_at_connect,
            abandon_retried_after_cut,
            acquire_timeout_under_partition,
            waiter_learns_session_lost,
            replies_late_but_in_time,
            lost_hold_release_retried,
            release_retried_after_cut,
            renewal_task_panics,
            renewal_keeps_only_known_holds;
            exclusive:
            tokens_after_restart,
            server_paused_past_ttl,
            server_restart_while_held,
            node_restarted_from_old_snapshot,
            leader_killed_while_held,
            node_isolated_from_peers,
            server_clock_jumps,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($harness:expr; shared: $($shared:ident),* ; exclusive: $($exclusive:ident),* $(,)?) => {
        $( $crate::__conformance_case!($harness, $shared, Shared); )*
        $( $crate::__conformance_case!($harness, $exclusive, Exclusive); )*
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_case {
    ($harness:expr, $case:ident, $kind:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            let harness = $harness;
            $crate::run(stringify!($case), $crate::Kind::$kind, &harness, |h| {
                ::std::boxed::Box::pin($crate::cases::$case(h))
            })
            .await;
        }
    };
}
