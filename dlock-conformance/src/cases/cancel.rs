//! S5: cancellation at any point leaves nothing behind; sessions clean up.

use std::time::Duration;

use dlock_core::raw;
use dlock_core::{Error, LostReason};
use tokio::time::{Instant, timeout};

use super::{
    busy, ensure, eventually, joined, passed, prompt, recovered, round_trip, start, within,
};
use crate::wire::{Fault, Flow};
use crate::{Ctx, Failure, Harness, Outcome};

/// S5: acquires dropped at 0 .. 3×RTT, on free and on held locks, leave
/// neither a hold beyond one TTL nor a queue entry that blocks others, and no
/// background task outlives the session.
pub async fn cancellation_sweep(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "cancellation_sweep");
    let t = ctx.caps.ttl;
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let rtt = round_trip(&c, &ctx.name("rtt")).await?;
    let delays = [
        Duration::ZERO,
        rtt / 4,
        rtt / 2,
        rtt * 3 / 4,
        rtt,
        rtt * 3 / 2,
        rtt * 2,
        rtt * 3,
    ];
    for (i, delay) in delays.into_iter().enumerate() {
        // A free lock: the dropped acquire may or may not have been granted.
        let free = ctx.name(&format!("free-{i}"));
        if let Ok(done) = timeout(delay, c.lock(&free)?.acquire()).await {
            done?.release().await?;
        }
        let g = b
            .lock(&free)?
            .acquire_timeout(t + ctx.caps.recovery_bound)
            .await?;
        g.release().await?;

        // A held lock: the dropped acquire was queued or waiting.
        let busy = ctx.name(&format!("busy-{i}"));
        let ga = a.lock(&busy)?.acquire().await?;
        let dropped = timeout(delay, c.lock(&busy)?.acquire()).await;
        ensure!(dropped.is_err(), "acquire of a held lock succeeded");
        let released = Instant::now();
        ga.release().await?;
        let g = b.lock(&busy)?.acquire_timeout(t * 2).await?;
        let what =
            format!("a cancelled waiter (dropped after {delay:?}) delayed the next holder by");
        prompt(&ctx, released.elapsed(), &what)?;
        g.release().await?;
    }
    // Cancelled at observed states rather than at times: granted in the
    // store with the reply still on its way, and queued behind a holder.
    let admin = ctx.admin().await?;
    if let Some((d, link)) = ctx.linked_client().await? {
        let granted = ctx.name("granted-reply-in-flight");
        let hold_replies = Fault::Flows {
            to_server: Flow::Pass,
            to_client: Flow::Hold,
        };
        let acquiring =
            super::wire::granted_reply_undelivered(&ctx, &d, &*link, &granted, hold_replies)
                .await?;
        acquiring.abort();
        let _ = acquiring.await;
        link.heal();
        let start = Instant::now();
        b.lock(&granted)?
            .acquire_timeout(t * 2 + ctx.caps.recovery_bound)
            .await?
            .release()
            .await?;
        let what = "an acquire cancelled with its grant's reply in flight kept the lock";
        prompt(&ctx, start.elapsed(), what)?;
        ensure!(
            raw::held_count(&d) == 0,
            "the cancelled grant is held by its session"
        );
    }
    let queued_name = ctx.name("queued");
    let ga = a.lock(&queued_name)?.acquire().await?;
    let lock = c.lock(&queued_name)?;
    let waiting = tokio::spawn(async move { lock.acquire().await });
    super::queued(&*admin, &queued_name, 1, t / 3).await?;
    waiting.abort();
    let _ = waiting.await;
    let released = Instant::now();
    ga.release().await?;
    b.lock(&queued_name)?
        .acquire_timeout(t * 2)
        .await?
        .release()
        .await?;
    let what = "a waiter cancelled in the queue delayed the next holder by";
    prompt(&ctx, released.elapsed(), what)?;
    ensure!(
        raw::held_count(&c) == 0,
        "cancelled acquires left {} holds",
        raw::held_count(&c)
    );
    eventually(
        t * 2,
        "clean-up tasks of cancelled acquires finish",
        || async { Ok(raw::background_tasks(&c) <= 1) },
    )
    .await?;
    c.close().await?;
    ensure!(
        raw::background_tasks(&c) == 0,
        "{} tasks outlived the session",
        raw::background_tasks(&c)
    );
    if let Some(count) = h.leftover_objects(&ctx.prefix).await {
        count?;
        eventually(
            t + ctx.caps.recovery_bound,
            "no store objects left",
            || async {
                Ok(h.leftover_objects(&ctx.prefix)
                    .await
                    .transpose()?
                    .unwrap_or(0)
                    == 0)
            },
        )
        .await?;
    }
    passed()
}

/// S5 + idempotent take: a take whose reply was lost is retried and returns
/// the same grant at once, instead of waiting for its own orphan to expire.
pub async fn acquire_retried_after_lost_reply(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "acquire_retried_after_lost_reply");
    let (a, faults) = ctx.faulty_client().await?;
    let (b, admin) = (ctx.client().await?, ctx.admin().await?);
    faults.lose_take_replies(1);
    let start = Instant::now();
    let ga = a.lock(&name)?.acquire_timeout(t * 4).await?;
    let took = start.elapsed();
    ensure!(
        took < t / 2,
        "retry after a lost reply took {took:?}: the take is not idempotent"
    );
    ensure!(
        admin.validate(&name, ga.token()).await?,
        "store does not validate the retried grant"
    );
    ensure!(busy(&b, &name).await?, "lock free while held");
    let info = admin.inspect(&name).await?;
    ensure!(
        info.as_ref().is_some_and(|i| i.holder == a.id().as_str()),
        "inspect shows {info:?}, expected holder {}",
        a.id()
    );
    ga.release().await?;
    ensure!(
        b.lock(&name)?.try_acquire().await?.is_some(),
        "lock still busy after release"
    );

    // A take granted in the store whose reply is lost, by an acquire that then
    // gives up: its abandon must free the grant at once, not leave an orphan.
    let orphan = ctx.name("orphan");
    faults.lose_take_replies(1);
    let r = a.lock(&orphan)?.try_acquire().await;
    ensure!(r.is_err(), "try_acquire whose reply was lost gave {r:?}");
    let start = Instant::now();
    let g = b.lock(&orphan)?.acquire_timeout(t * 2).await?;
    let took = start.elapsed();
    ensure!(
        took <= t / 2 + ctx.caps.wakeup_bound,
        "an abandoned, granted take kept the lock for {took:?}"
    );
    g.release().await?;

    // Per-hold expiry: the same orphan whose abandon never arrives expires
    // within a TTL, although its session stays alive and renewing.
    if raw::session(&a).expiry() == dlock_core::backend::ExpiryModel::PerHold {
        let orphan = ctx.name("orphan-unabandoned");
        faults.lose_take_replies(1);
        faults.drop_abandons();
        let r = a.lock(&orphan)?.try_acquire().await;
        ensure!(r.is_err(), "try_acquire whose reply was lost gave {r:?}");
        let limit = t * 2 + ctx.caps.recovery_bound;
        let what = "an orphaned grant outlived its TTL";
        let g = recovered(&ctx, &b, &orphan, Instant::now(), limit, what).await?;
        ensure!(a.is_alive(), "the orphan's session died meanwhile");
        g.release().await?;
    }
    passed()
}

/// S4 + idempotent take: a take whose reply is lost *slowly* is retried; the
/// retry must extend the store's expiry, because the client counts the
/// grant's validity from the retry. With renewals then stalled, the holder's
/// `lost()` must still fire before anyone else gets the lock.
pub async fn idempotent_take_extends_expiry(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "idempotent_take_extends_expiry");
    let (a, faults) = ctx.faulty_client().await?;
    let b = ctx.client().await?;
    faults.lose_take_replies_after(1, t / 2);
    let ga = a.lock(&name)?.acquire_timeout(t * 4).await?;
    faults.stall_renewals();
    let lost = ga.lost();
    let watcher = tokio::spawn(async move { (lost.await, Instant::now()) });
    let gb = b
        .lock(&name)?
        .acquire_timeout(t * 4 + ctx.caps.recovery_bound)
        .await?;
    let b_got = Instant::now();
    let (_, lost_at) = joined(t * 2, "holder's lost()", watcher).await?;
    // S4 is about A's local deadline (is_held() turns false exactly then);
    // when the lost() future completes is timer and scheduler latency.
    let deadline = ga.deadline();
    ensure!(
        deadline <= b_got,
        "B got the lock {:?} before A's local deadline: the retried take did not extend the store's expiry",
        deadline - b_got
    );
    let late = lost_at.saturating_duration_since(deadline);
    ensure!(
        late <= Duration::from_millis(100).max(t / 4),
        "lost() fired {late:?} after the deadline"
    );
    drop(ga);
    gb.release().await?;
    passed()
}

/// L4, L5: a waiter whose `acquire_timeout` answered `Timeout` has left the
/// line by then: the holder's release goes to the next `try_acquire`, at
/// once. Three rounds on a plain client, then one whose waiter's requests
/// are slowed on the wire after it queued: its clean-up must be done before
/// the timeout answers, not go on in the background, where a fair store's
/// queue would keep its place (or a lock manager would keep its queue lock
/// until the server noticed a closed connection). Red before: the core
/// abandoned a timed-out claim in the background, and the SQL queue closed
/// the lane instead of unlocking it (`dlocks` blocking test: "mysql: not
/// free right after the drop").
pub async fn timed_out_waiter_leaves_no_trace(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "timed_out_waiter_leaves_no_trace");
    let t = ctx.caps.ttl;
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let wait = t / 4;
    let free_after = |round: &str, result: Result<dlock_core::LockGuard, Error>| {
        ensure!(
            matches!(result, Err(Error::Timeout { cause: None, .. })),
            "{round}: acquire_timeout on a held lock gave {result:?}"
        );
        Ok(())
    };
    for round in 0..3 {
        let name = ctx.name(&format!("plain-{round}"));
        let ga = a.lock(&name)?.acquire().await?;
        free_after("plain", b.lock(&name)?.acquire_timeout(wait).await)?;
        ga.release().await?;
        let gc = c.lock(&name)?.try_acquire().await?;
        ensure!(
            gc.is_some(),
            "round {round}: after the holder's release a try found the lock busy: \
             the waiter that had timed out still held a place"
        );
        gc.into_iter().next().expect("some").release().await?;
    }
    if let Some((d, link)) = ctx.linked_client().await? {
        // Slower than the release and the try below, well within the
        // request timeout (a sixth of the TTL) for a clean-up of a few
        // requests (SQL's queue: up to four).
        let slow = t / 80;
        let name = ctx.name("slow");
        let ga = a.lock(&name)?.acquire().await?;
        let lock = d.lock(&name)?;
        let waiting = tokio::spawn(async move { lock.acquire_timeout(t).await });
        let admin = ctx.admin().await?;
        super::queued(&*admin, &name, 1, t / 4).await?;
        link.set_all(Fault::Flows {
            to_server: Flow::Delay(slow),
            to_client: Flow::Pass,
        });
        ensure!(
            !waiting.is_finished(),
            "the waiter ended before its link was slowed: {:?}",
            waiting.await
        );
        let result = waiting.await.map_err(|e| Failure(format!("waiter: {e}")))?;
        link.heal();
        free_after("slow", result)?;
        ga.release().await?;
        let gc = c.lock(&name)?.try_acquire().await?;
        ensure!(
            gc.is_some(),
            "after the holder's release a try found the lock busy: the waiter that had \
             timed out (its requests {slow:?} slower) still held a place"
        );
        gc.into_iter().next().expect("some").release().await?;
        d.close().await?;
    }
    passed()
}

/// S5, L3: closing a session fires `lost()` (Closed) for its holds, frees
/// them in the store at once, stops its tasks and refuses new acquires;
/// dropping a session without closing frees its locks promptly too.
pub async fn session_close(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "session_close");
    let t = ctx.caps.ttl;
    let (x, y) = (ctx.name("x"), ctx.name("y"));
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let gx = a.lock(&x)?.acquire().await?;
    let gy = a.lock(&y)?.acquire().await?;
    a.close().await?;
    let reason = within(t, "lost() after close", gx.lost()).await?;
    ensure!(
        reason == LostReason::Closed,
        "lost() gave {reason:?}, expected Closed"
    );
    ensure!(!gy.is_held(), "a hold survived its session's close");
    ensure!(
        raw::background_tasks(&a) == 0,
        "{} tasks outlived the closed session",
        raw::background_tasks(&a)
    );
    let r = a.lock(&x)?.try_acquire().await;
    ensure!(
        matches!(r, Err(Error::SessionLost { .. })),
        "acquire on a closed session gave {r:?}"
    );
    let start = Instant::now();
    b.lock(&x)?.acquire_timeout(t * 2).await?.release().await?;
    b.lock(&y)?.acquire_timeout(t * 2).await?.release().await?;
    let took = start.elapsed();
    ensure!(
        took <= t / 2 + ctx.caps.wakeup_bound,
        "locks of a closed session were free only after {took:?}"
    );
    drop((gx, gy));

    // Dropped without close: guard and session go away together.
    let c = ctx.client().await?;
    let gc = c.lock(&x)?.acquire().await?;
    drop(gc);
    drop(c);
    let start = Instant::now();
    b.lock(&x)?.acquire_timeout(t * 2).await?.release().await?;
    let took = start.elapsed();
    ensure!(
        took <= t / 2 + ctx.caps.wakeup_bound,
        "a dropped session's lock was free only after {took:?}"
    );
    passed()
}

/// S5: a close that reached the store but whose reply never came (the
/// request timeout cut it off) is retried by the core, so `close()` reports
/// success and the session's locks are free at once, not one TTL later.
/// The retry repeats a close that has already happened: every adapter's
/// close must be safe to repeat. Red before the core retried a close: "a
/// close whose first reply never came gave Err(Unavailable .. close timed
/// out)", as a loaded SQLite's close did in CI (`contention`, whose
/// clients close after their last release: the second part).
pub async fn close_retried_after_lost_reply(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "close_retried_after_lost_reply");
    let t = ctx.caps.ttl;
    let (x, y) = (ctx.name("x"), ctx.name("y"));
    let (a, faults) = ctx.faulty_client().await?;
    let b = ctx.client().await?;
    let gx = a.lock(&x)?.acquire().await?;
    let gy = a.lock(&y)?.acquire().await?;
    faults.hang_close_replies(1);
    let closed = a.close().await;
    ensure!(
        closed.is_ok(),
        "a close whose first reply never came gave {closed:?}"
    );
    for guard in [&gx, &gy] {
        let reason = within(t, "lost() after close", guard.lost()).await?;
        ensure!(
            reason == LostReason::Closed,
            "lost() gave {reason:?}, expected Closed"
        );
    }
    ensure!(
        raw::background_tasks(&a) == 0,
        "{} tasks outlived the closed session",
        raw::background_tasks(&a)
    );
    for name in [&x, &y] {
        let got = b.lock(name)?.try_acquire().await?;
        ensure!(
            got.is_some(),
            "{name} was still held after its session's close was retried"
        );
        got.into_iter().next().expect("some").release().await?;
    }
    // A session that holds nothing any more: its close is retried too (red
    // before: a close with no holds had one try, as `contention`'s clients'
    // do after their last release).
    let (c, faults) = ctx.faulty_client().await?;
    c.lock(&x)?.acquire().await?.release().await?;
    faults.hang_close_replies(1);
    let closed = c.close().await;
    ensure!(
        closed.is_ok(),
        "a close without holds whose first reply never came gave {closed:?}"
    );
    b.close().await?;
    passed()
}
