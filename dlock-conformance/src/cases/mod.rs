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
mod election;
mod expiry;
mod hygiene;
mod multi;
mod mutex;
mod ownership;
mod rwlock;
mod semaphore;
mod server;
mod wakeup;
mod wire;

pub use cancel::*;
pub use election::*;
pub use expiry::*;
pub use hygiene::*;
pub use multi::*;
pub use mutex::*;
pub use ownership::*;
pub use rwlock::*;
pub use semaphore::*;
pub use server::*;
pub use wakeup::*;
pub use wire::*;

/// The case list, written once: calls `$crate::$callback!` with `($args)`
/// followed by one `name: kind, "invariants", "faults";` entry per case (kind
/// `shared` or `exclusive`), in the order of [`CASES`](crate::CASES).
/// [`conformance_tests!`](crate::conformance_tests) makes the test functions
/// from it, and `CASES` its table.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_cases {
    ($callback:ident ! ( $($args:tt)* )) => {
        $crate::$callback! {
            ( $($args)* )
            contention: shared, "S1, S2 (16 clients, fenced register, history check)", "–";
            try_acquire: shared, "S1, L5", "–";
            timeouts: shared, "L5, L4", "–";
            reentrancy: shared, "S1 (handles exclude each other)", "–";
            multi_lock_all_or_nothing: shared, "S1, L5 (lock_all takes none or all)", "–";
            multi_lock_no_deadlock: shared, "S1, S2, L1 (overlapping lock_all in any order)", "–";
            hold_at_most_ends_the_hold: shared, "S4, L1 (hold_at_most)", "–";
            hold_at_least_keeps_the_hold: shared, "S1, L1 (hold_at_least: renewed past a TTL after an early release)", "–";
            election_one_leader_per_term: shared, "S7, S2 (4 candidates, fenced register, history check, observers)", "–";
            semaphore_bounds_holders: shared, "S7, S2 (exactly N permits; 6 clients, per-permit fenced register and history check)", "–";
            semaphore_head_of_line_partitioned: shared, "L1, S7 (a blackholed head of the semaphore's line holds nobody up past the store's expiry)", "wire: head of line blackholed";
            semaphore_fifo: shared, "L4 (permits in arrival order where declared fair)", "–";
            primitives_cancellation_sweep: shared, "S5, L1 (dropped semaphore and read-write lock waits leave nothing)", "dropped futures";
            semaphore_permit_expiry: shared, "L1, S7 (a crashed holder's permit comes back, the others stay)", "in-process crash";
            rwlock_excludes_writers: shared, "S7, S2 (4 readers, 2 writers, fenced register and history of the writes)", "–";
            rwlock_writer_preference: shared, "S7, L1 (a waiting writer goes before later readers)", "–";
            election_failover: shared, "S7, L1, fencing (standby leads after a crash, observers follow)", "in-process crash";
            first_take_race: shared, "S1, S2 (racing creation of a lock's record)", "–";
            release_by_non_owner: shared, "S3", "–";
            stale_release_after_expiry: shared, "S3, S4", "in-process stall";
            stale_release_retried_after_lost_reply: shared, "S3", "in-process lost reply";
            holder_crash_recovery: shared, "L1, S2", "in-process crash";
            no_early_grant_while_renewing: shared, "S1, L3", "–";
            lost_signal_by_local_deadline: shared, "S4", "in-process stall";
            pause_scenario: shared, "S4, fencing", "client process paused";
            tokens_after_expiry: shared, "S2, S6", "in-process crash";
            force_release: shared, "S2, S3, S4", "–";
            renewal_task_panics: shared, "S4 (no zombie session)", "panicking renewal";
            renewal_keeps_only_known_holds: shared, "S5, L1 (untracked grants expire)", "–";
            inspect_and_validate: shared, "S2, S3", "–";
            wakeup_latency: shared, "L2", "–";
            wakeup_release_before_subscribe: shared, "L2", "–";
            wakeup_dead_notification_channel: shared, "L2, L1", "deaf notifications";
            fifo_with_cancelled_waiter: shared, "L4, S5", "–";
            cancellation_sweep: shared, "S5", "dropped futures";
            timed_out_waiter_leaves_no_trace: shared, "L4, L5 (a timed-out waiter has left the line when it answers)", "wire: waiter's requests slowed";
            acquire_retried_after_lost_reply: shared, "S5, idempotent take", "in-process lost reply";
            idempotent_take_extends_expiry: shared, "S4", "in-process slow lost reply";
            bad_input: shared, "typed errors", "–";
            session_close: shared, "S5, L3", "–";
            close_retried_after_lost_reply: shared, "S5 (a close cut off is retried: every adapter's close is safe to repeat)", "in-process lost reply";
            renewal_replies_lost: shared, "S4, L3", "wire: replies lost";
            renewal_replies_late: shared, "S4", "wire: replies later than the request timeout";
            replies_late_but_in_time: shared, "S4 (validity from the send)", "wire: replies late, in time";
            renewal_on_dead_connection: shared, "L3, S4", "wire: connections silently dead";
            acquire_reply_lost: shared, "S1, S5", "wire: take's reply lost, then dark";
            cut_take_delivered_late: shared, "S5, L1 (a take cut off in flight and delivered after its attempt ended grants nothing)", "wire: connections stalled, bytes delivered late";
            release_reply_lost: shared, "S3", "wire: release's reply lost";
            holder_partitioned_past_ttl: shared, "S4, L1, fencing", "wire: holder blackholed";
            queued_holder_partitioned_past_ttl: shared, "S4, L1, L4", "wire: holder granted through the queue blackholed";
            waiters_cut_while_waiting: shared, "L1, L2", "wire: waiters reset";
            connection_blip: shared, "L3 (`survives_reconnect`)", "wire: holder reset";
            split_views_at_connect: shared, "S1 (quorum of configured nodes)", "wire: different minorities cut";
            abandon_retried_after_cut: shared, "S5, L4", "wire: connections refused";
            acquire_timeout_under_partition: shared, "L5", "wire: blackhole";
            waiter_learns_session_lost: shared, "L5, S5", "wire: waiter blackholed past TTL";
            lost_hold_release_retried: shared, "S5, L1", "wire: replies lost, then refused";
            release_retried_after_cut: shared, "S5, L1", "wire: connections refused while releasing";
            one_poller_per_process: shared, "L6 (a process's waiters poll a busy lock as often as one would)", "–";
            many_waiters_one_handoff_each: exclusive, "L6, S1 (200 waiters)", "–";
            ten_thousand_names: exclusive, "S5 (no leaked state, before and after close), L3 (10,000 holds renewed)", "–";
            tokens_after_restart: exclusive, "S2 (durable tokens)", "servers killed, restarted";
            server_paused_past_ttl: exclusive, "S4, S2, fencing, L5", "servers SIGSTOPped";
            server_restart_while_held: exclusive, "S1, S2, S4", "servers killed, restarted";
            node_restarted_from_old_snapshot: exclusive, "S1, S4, S2", "majority restored from old snapshots";
            leader_killed_while_held: exclusive, "S1, S2, L4", "leader killed";
            node_isolated_from_peers: exclusive, "S4", "follower cut off from its peers";
            session_outlives_isolated_member: exclusive, "L3", "the member a client reached cut off from its peers";
            server_clock_jumps: exclusive, "fencing under clock faults", "store clock stepped";
        }
    };
}

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Backend, FencingToken, LockGuard, LockName, LostReason, Session, raw};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};

use crate::faults::Faults;
use crate::wire::Link;
use crate::{Ctx, Failure, Harness, Outcome, Verdict};

/// What most cases start with: their context, their lock `x` and the case
/// TTL.
pub(crate) fn start<'h>(h: &'h dyn Harness, case: &str) -> (Ctx<'h>, LockName, Duration) {
    let ctx = Ctx::new(h, case);
    let (name, t) = (ctx.name("x"), ctx.caps.ttl);
    (ctx, name, t)
}

/// Fails the case with a formatted message unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::Failure(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure;

/// Unwraps what a case needs (`Ok`), or returns the verdict that the case
/// does not apply (`Err`).
macro_rules! or_skip {
    ($needed:expr) => {
        match $needed {
            Ok(needed) => needed,
            Err(verdict) => return verdict,
        }
    };
}
pub(crate) use or_skip;

/// Why a case that needs a link says `SKIPPED`.
pub(crate) const NO_LINK: &str = "the harness cannot put a link between a client and the store";

/// A new link, or the verdict that the case does not apply.
pub(crate) async fn new_link(ctx: &Ctx<'_>) -> Result<Result<Arc<dyn Link>, Outcome>, Failure> {
    Ok(ctx.link().await?.ok_or_else(|| skipped(NO_LINK)))
}

/// `Ok` where the backend declares `declared`, else the verdict that the
/// case does not apply: "backend does not declare `what`".
pub(crate) fn declares(declared: bool, what: &str) -> Result<(), Outcome> {
    match declared {
        true => Ok(()),
        false => Err(skipped(format!("backend does not declare {what}"))),
    }
}

pub(crate) fn passed() -> Outcome {
    Ok(Verdict::Passed)
}

pub(crate) fn skipped(why: impl Into<String>) -> Outcome {
    Ok(Verdict::Skipped(why.into()))
}

/// Awaits every task of `tasks` (clients of a contended case): the first
/// failure, naming `what` if a task panicked.
pub(crate) async fn join_all(
    mut tasks: tokio::task::JoinSet<Result<(), Failure>>,
    what: &str,
) -> Result<(), Failure> {
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| Failure(format!("{what} failed: {e}")))??;
    }
    Ok(())
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

/// Awaits a spawned task for at most `limit`: its output, or a failure
/// naming `what` if it did not end in time or panicked.
pub(crate) async fn joined<T>(
    limit: Duration,
    what: &str,
    task: JoinHandle<T>,
) -> Result<T, Failure> {
    within(limit, what, task)
        .await?
        .map_err(|e| Failure(format!("{what}: {e}")))
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

/// After an attempt by `session` that gives back what it took when it
/// fails (a multi-lock's, a read-write lock's): `free` (whether what it took
/// is free again) must hold when the attempt returns, unless the attempt ran
/// `took` past its own `wait` plus the session's request timeout (the TTL
/// the store granted sets it, not the case's). Only then may its releases
/// go on in the background (a slow store must not stretch the caller's
/// deadline), and `free` must hold within half a TTL (something kept for
/// good is renewed: still held then).
pub(crate) async fn given_back<F, Fut>(
    ctx: &Ctx<'_>,
    session: &Session,
    what: &str,
    took: Duration,
    wait: Duration,
    mut free: F,
) -> Result<(), Failure>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, Failure>>,
{
    if free().await? {
        return Ok(());
    }
    let budget = wait + raw::request_timeout(session);
    if took < budget {
        return Err(Failure(format!(
            "{what} (it returned after {took:?}, within the {budget:?} it may wait for its \
             releases)"
        )));
    }
    eprintln!("{what} at once; it ran {took:?}: its releases may end in the background");
    eventually(ctx.caps.ttl / 2, what, free).await
}

/// Waits until the store reports `n` waiters on `name`, or, where the store
/// cannot count waiters, for a fixed settling time.
pub(crate) async fn queued(
    admin: &dyn Backend,
    name: &LockName,
    n: usize,
    settle: Duration,
) -> Result<(), Failure> {
    let what = format!("{n} waiters queued on {name}");
    waiters_until(admin, name, &what, settle, |waiting| waiting >= n).await
}

/// Waits until the number of waiters the store reports on `name` passes
/// `enough`, or, where the store cannot count waiters, for `settle`.
pub(crate) async fn waiters_until(
    admin: &dyn Backend,
    name: &LockName,
    what: &str,
    settle: Duration,
    enough: impl Fn(usize) -> bool + Send + Sync,
) -> Result<(), Failure> {
    let counts = admin.inspect(name).await?.and_then(|i| i.waiters).is_some();
    if !counts {
        sleep(settle).await;
        return Ok(());
    }
    eventually(Duration::from_secs(10), what, || async {
        let waiting = admin.inspect(name).await?.and_then(|i| i.waiters);
        Ok(enough(waiting.unwrap_or(0)))
    })
    .await
}

/// Whether `session` finds `name` taken: its `try_acquire` gets nothing.
pub(crate) async fn busy(session: &Session, name: &LockName) -> Result<bool, Failure> {
    Ok(session.lock(name)?.try_acquire().await?.is_none())
}

/// S2: `after` (a later grant's token) is larger than `before`; `context`
/// follows the numbers in the failure (`" across a restart"`).
pub(crate) fn increased(
    after: FencingToken,
    before: FencingToken,
    context: &str,
) -> Result<(), Failure> {
    ensure!(after > before, "token {after} after {before}{context}");
    Ok(())
}

/// Watches a guard's `lost()`: when it fired and why.
pub(crate) fn watch_lost(guard: &LockGuard) -> JoinHandle<(LostReason, Instant)> {
    let lost = guard.lost();
    tokio::spawn(async move { (lost.await, Instant::now()) })
}

/// B takes A's lock, waiting at most `limit`; S4 as one client sees
/// another: B's acquire returns no earlier than A's local validity
/// deadline, on this process's monotonic clock. B's guard and when it got it.
pub(crate) async fn takes_over(
    b: &Session,
    a: &LockGuard,
    limit: Duration,
    what: &str,
) -> Result<(LockGuard, Instant), Failure> {
    let gb = b.lock(a.name())?.acquire_timeout(limit).await?;
    let b_got = Instant::now();
    let deadline = a.deadline();
    ensure!(
        deadline <= b_got,
        "{what}: B got the lock {:?} before A's local deadline (S4)",
        deadline - b_got
    );
    Ok((gb, b_got))
}

/// Fails unless `g` still holds its lock, by its own account and by the
/// store's (`admin.validate`).
pub(crate) async fn still_held(
    admin: &dyn Backend,
    g: &LockGuard,
    what: &str,
) -> Result<(), Failure> {
    ensure!(
        g.is_held(),
        "{what}: the holder's guard says it lost the lock"
    );
    ensure!(
        admin.validate(g.name(), g.token()).await?,
        "{what}: the store does not validate the holder's token"
    );
    Ok(())
}

/// L1: `b` gets `name` (waiting at most `limit`), and it was free within a
/// TTL plus the recovery bound of `since` (when its holder crashed, or its
/// grant was orphaned).
pub(crate) async fn recovered(
    ctx: &Ctx<'_>,
    b: &Session,
    name: &LockName,
    since: Instant,
    limit: Duration,
    what: &str,
) -> Result<LockGuard, Failure> {
    let g = b.lock(name)?.acquire_timeout(limit).await?;
    let took = since.elapsed();
    let bound = ctx.caps.ttl + ctx.caps.recovery_bound;
    ensure!(
        took <= bound,
        "{what}: free only after {took:?} (bound {bound:?})"
    );
    Ok(g)
}

/// The next holder got the lock `took` after a release: within half a TTL
/// plus the wake-up bound (what a cancelled or orphaned waiter left would
/// hold it up for a TTL).
pub(crate) fn prompt(ctx: &Ctx<'_>, took: Duration, what: &str) -> Result<(), Failure> {
    ensure!(
        took <= ctx.caps.ttl / 2 + ctx.caps.wakeup_bound,
        "{what} {took:?}"
    );
    Ok(())
}

/// Where the in-process fault cases start: A, behind fault switches, and B,
/// healthy; A holds `x`.
pub(crate) async fn faulty_holder(
    ctx: &Ctx<'_>,
) -> Result<(Session, Arc<Faults>, Session, LockGuard), Failure> {
    let (a, faults) = ctx.faulty_client().await?;
    let b = ctx.client().await?;
    let ga = a.lock(ctx.name("x"))?.acquire().await?;
    Ok((a, faults, b, ga))
}

/// Where the two-client cases start: clients A and B and the admin; A holds
/// `name`.
pub(crate) async fn held_by_a(
    ctx: &Ctx<'_>,
    name: &LockName,
) -> Result<(Session, Session, Arc<dyn Backend>, LockGuard), Failure> {
    let (a, b, admin) = (ctx.client().await?, ctx.client().await?, ctx.admin().await?);
    let ga = a.lock(name)?.acquire().await?;
    Ok((a, b, admin, ga))
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
