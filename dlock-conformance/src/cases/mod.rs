//! The conformance cases, one `pub async fn` each, grouped by theme.
//!
//! Every case takes a `&dyn Harness` and returns an [`Outcome`]. Bounds are
//! generous: they catch a wrong mechanism (a fixed poll, a lock that never
//! expires), not a slow machine; exact figures belong to `dlock bench`.
//!
//! # Cancel safety
//! Cases are test drivers: dropping one mid-way leaves only locks that expire
//! within the case TTL, under the case's own random prefix.

mod cancel;
mod expiry;
mod hygiene;
mod mutex;
mod ownership;
mod server;
mod wakeup;
mod wire;

pub use cancel::{
    acquire_retried_after_lost_reply, cancellation_sweep, idempotent_take_extends_expiry,
    session_close,
};
pub use expiry::{
    force_release, holder_crash_recovery, lost_signal_by_local_deadline,
    no_early_grant_while_renewing, pause_scenario, renewal_keeps_only_known_holds,
    renewal_task_panics, tokens_after_expiry,
};
pub use hygiene::{bad_input, inspect_and_validate, ten_thousand_names};
pub use mutex::{contention, first_take_race, reentrancy, timeouts, try_acquire};
pub use ownership::{
    release_by_non_owner, stale_release_after_expiry, stale_release_retried_after_lost_reply,
};
pub use server::{
    leader_killed_while_held, node_isolated_from_peers, node_restarted_from_old_snapshot,
    server_clock_jumps, server_paused_past_ttl, server_restart_while_held, tokens_after_restart,
};
pub use wakeup::{
    fifo_with_cancelled_waiter, many_waiters_one_handoff_each, wakeup_dead_notification_channel,
    wakeup_latency, wakeup_release_before_subscribe,
};
pub use wire::{
    abandon_retried_after_cut, acquire_reply_lost, acquire_timeout_under_partition,
    connection_blip, holder_partitioned_past_ttl, lost_hold_release_retried, release_reply_lost,
    release_retried_after_cut, renewal_on_dead_connection, renewal_replies_late,
    renewal_replies_lost, replies_late_but_in_time, split_views_at_connect,
    waiter_learns_session_lost, waiters_cut_while_waiting,
};

use std::future::Future;
use std::time::Duration;

use dlock_core::{Backend, LockName, Session};
use tokio::time::{Instant, sleep, timeout};

use crate::{Failure, Outcome, Verdict};

/// Fails the case with a formatted message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::Failure(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure;

pub(crate) fn passed() -> Outcome {
    Ok(Verdict::Passed)
}

pub(crate) fn skipped(why: impl Into<String>) -> Outcome {
    Ok(Verdict::Skipped(why.into()))
}

/// Awaits `fut` for at most `limit`, failing with `what` otherwise.
pub(crate) async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = T>,
) -> Result<T, Failure> {
    timeout(limit, fut)
        .await
        .map_err(|_| Failure(format!("{what}: not done within {limit:?}")))
}

/// Polls `check` until it returns true, for at most `limit`.
pub(crate) async fn eventually<F, Fut>(
    limit: Duration,
    what: &str,
    mut check: F,
) -> Result<(), Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, Failure>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Failure(format!("{what}: not true within {limit:?}")));
        }
        sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the store reports `n` waiters on `name`, or, where the store
/// cannot count waiters, for a fixed settling time.
pub(crate) async fn queued(
    admin: &dyn Backend,
    name: &LockName,
    n: usize,
    settle: Duration,
) -> Result<(), Failure> {
    let counts = admin.inspect(name).await?.and_then(|i| i.waiters).is_some();
    if !counts {
        sleep(settle).await;
        return Ok(());
    }
    eventually(
        Duration::from_secs(10),
        &format!("{n} waiters queued on {name}"),
        || async {
            Ok(admin
                .inspect(name)
                .await?
                .and_then(|i| i.waiters)
                .unwrap_or(0)
                >= n)
        },
    )
    .await
}

/// Median time of an uncontended acquire + release: the backend's round
/// trip as the core sees it.
pub(crate) async fn round_trip(session: &Session, name: &LockName) -> Result<Duration, Failure> {
    let lock = session.lock(name)?;
    let mut samples = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        lock.acquire().await?.release().await?;
        samples.push(start.elapsed());
    }
    samples.sort();
    Ok(samples[samples.len() / 2])
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Whether `reason` is one of the ways a holder can lose a lock to expiry.
pub(crate) fn is_loss(reason: dlock_core::LostReason) -> bool {
    !matches!(reason, dlock_core::LostReason::Released)
}
