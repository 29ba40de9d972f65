//! Expiry and renewal: crash recovery, renewal keeps the lock, the lost signal
//! by local deadline, the pause scenario, tokens across expiry and restarts.

use std::time::Duration;

use dlock_core::LostReason;
use dlock_core::raw;
use tokio::time::{Instant, sleep};

use super::{
    busy, ensure, faulty_holder, held_by_a, increased, joined, passed, recovered, start,
    takes_over, watch_lost, within,
};
use crate::checker::FencedRegister;
use crate::process::Process;
use crate::{Ctx, Failure, Harness, Outcome};

/// L1, S2: a holder that dies without releasing frees the lock within TTL +
/// the backend's bound; the next token is larger.
pub async fn holder_crash_recovery(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "holder_crash_recovery");
    let (t, bound) = (ctx.caps.ttl, ctx.caps.recovery_bound);
    let (a, faults, b, ga) = faulty_holder(&ctx).await?;
    let name = ga.name().clone();
    let first = ga.token();
    faults.crash();
    let crashed = Instant::now();
    drop(ga);
    drop(a);
    let what = "the lock of a crashed holder";
    let gb = recovered(&ctx, &b, &name, crashed, t * 2 + bound, what).await?;
    increased(gb.token(), first, "")?;
    gb.release().await?;
    passed()
}

/// S1, L3: while the holder renews, nobody else gets the lock for several
/// TTLs, and the holder stays valid throughout.
pub async fn no_early_grant_while_renewing(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "no_early_grant_while_renewing");
    let (a, b, admin, ga) = held_by_a(&ctx, &name).await?;
    let until = Instant::now() + t * 3;
    while Instant::now() < until {
        ensure!(busy(&b, &name).await?, "lock granted to B while A renews");
        ensure!(ga.is_held(), "holder's lock expired although it renews");
        sleep(t / 5).await;
    }
    let r = b.lock(&name)?.acquire_timeout(t / 2).await;
    ensure!(
        r.is_err(),
        "a waiting acquire got a lock that is being renewed: {r:?}"
    );
    ensure!(
        admin.validate(&name, ga.token()).await?,
        "store does not validate the renewed holder"
    );
    let renewals = a.stats().renewals;
    ensure!(renewals >= 4, "only {renewals} renewals in 3.5 TTLs");
    let first = ga.token();
    ga.release().await?;
    let gb = b.lock(&name)?.acquire_timeout(t).await?;
    increased(gb.token(), first, "")?;
    gb.release().await?;
    passed()
}

/// S4: when renewals stop reaching the store, `lost()` fires by the local
/// deadline — before another client can get the lock — with no server contact.
pub async fn lost_signal_by_local_deadline(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "lost_signal_by_local_deadline");
    let t = ctx.caps.ttl;
    let (_a, faults, b, ga) = faulty_holder(&ctx).await?;
    faults.stall_renewals();
    let watcher = watch_lost(&ga);
    // S4 is about the local deadline (is_held() turns false exactly then);
    // when the lost() future completes is timer and scheduler latency,
    // bounded separately below.
    let (gb, _) = takes_over(&b, &ga, t * 3, "renewals stalled").await?;
    let (reason, lost_at) = joined(t, "lost() of the stalled holder", watcher).await?;
    ensure!(
        reason == LostReason::Expired,
        "lost() gave {reason:?}, expected Expired"
    );
    let late = lost_at.saturating_duration_since(ga.deadline());
    ensure!(
        late <= Duration::from_millis(100).max(t / 4),
        "lost() fired {late:?} after the deadline"
    );
    ensure!(!ga.is_held(), "is_held() is true after the deadline");
    drop(ga);
    gb.release().await?;
    passed()
}

/// S4 + fencing, with a real pause: the holder's whole process (renewal
/// task, timers, connections) stops after it decided to write, past its TTL;
/// another client acquires and writes; when the old holder resumes and
/// writes, the register refuses it, its `lost()` fires at once and its
/// late renewals do not revive the hold.
pub async fn pause_scenario(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "pause_scenario");
    let register = FencedRegister::new();
    let process = Process::start().map_err(|e| Failure(format!("process: {e}")))?;
    let a = ctx.client_in(&process, None)?;
    let b = ctx.client().await?;
    let lock = a.lock(&name)?;
    let ga = process.run(async move { lock.acquire().await }).await?;
    ensure!(register.write(0, ga.token()), "first write refused");
    // A checks that it holds the lock, decides to write... and stops.
    ensure!(ga.is_held(), "A does not hold the lock it just acquired");
    process.pause();
    let paused = Instant::now();
    let gb = b
        .lock(&name)?
        .acquire_timeout(t * 3 + ctx.caps.recovery_bound)
        .await;
    let b_got = Instant::now();
    process.resume();
    let gb = gb?;
    ensure!(
        ga.deadline() <= b_got,
        "B got the lock {:?} after A paused, {:?} before A's local deadline",
        b_got - paused,
        ga.deadline() - b_got
    );
    ensure!(
        register.write(1, gb.token()),
        "the new holder's write was refused"
    );
    // A resumes and acts on its stale decision.
    ensure!(
        !register.write(0, ga.token()),
        "the register accepted the paused holder's write"
    );
    ensure!(
        !ga.is_held(),
        "the resumed holder still believes it holds the lock"
    );
    within(
        Duration::from_millis(100).max(t / 4),
        "the resumed holder's lost()",
        ga.lost(),
    )
    .await?;
    sleep(raw::renew_every(&a) * 2).await;
    ensure!(
        !ga.is_held(),
        "a late renewal revived the paused holder's lock"
    );
    ensure!(gb.is_held(), "the new holder lost the lock when A resumed");
    drop(ga);
    gb.release().await?;
    drop(a);
    drop(process);
    passed()
}

/// S2, S6: tokens strictly increase across expiry of crashed holders and
/// across plain releases.
pub async fn tokens_after_expiry(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "tokens_after_expiry");
    let name = ctx.name("x");
    let wait = ctx.caps.ttl * 2 + ctx.caps.recovery_bound;
    let mut last = None;
    for _ in 0..3 {
        let (c, faults) = ctx.faulty_client().await?;
        let g = c.lock(&name)?.acquire_timeout(wait).await?;
        ensure!(last < Some(g.token()), "token {} after {last:?}", g.token());
        last = Some(g.token());
        faults.crash();
    }
    let c = ctx.client().await?;
    for _ in 0..3 {
        let g = c.lock(&name)?.acquire_timeout(wait).await?;
        ensure!(last < Some(g.token()), "token {} after {last:?}", g.token());
        last = Some(g.token());
        g.release().await?;
    }
    passed()
}

/// S2, S3, S4: an admin force-release frees the lock; the old holder's
/// `lost()` fires within a renewal period; the next token is larger; the old
/// holder's release fails.
pub async fn force_release(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "force_release");
    let (a, b, admin, ga) = held_by_a(&ctx, &name).await?;
    let first = ga.token();
    ensure!(
        admin.force_release(&name).await?,
        "force_release of a held lock said it was free"
    );
    let bound = raw::renew_every(&a) + ctx.caps.wakeup_bound + t / 4;
    let reason = within(bound, "old holder's lost() after force_release", ga.lost()).await?;
    ensure!(
        reason == LostReason::Revoked,
        "lost() gave {reason:?}, expected Revoked"
    );
    let gb = b.lock(&name)?.acquire_timeout(t).await?;
    increased(gb.token(), first, " (a forced release)")?;
    ensure!(
        ga.release().await.is_err(),
        "the old holder's release succeeded"
    );
    ensure!(gb.is_held(), "the new holder lost the lock");
    gb.release().await?;
    ensure!(
        !admin.force_release(&name).await?,
        "force_release of a free lock said it was held"
    );
    passed()
}

/// S4: the renewal task dies (a panic in the adapter's renewal): the
/// session must not live on as a zombie whose holds nobody renews. It is
/// marked lost: `lost()` fires promptly, new acquires are refused, and the
/// lock becomes free for others within one TTL plus the bound.
pub async fn renewal_task_panics(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "renewal_task_panics");
    let t = ctx.caps.ttl;
    let (a, faults, b, ga) = faulty_holder(&ctx).await?;
    faults.panic_renewals();
    let bound = raw::renew_every(&a) * 2 + ctx.caps.wakeup_bound;
    let reason = within(bound, "lost() after the renewal task panicked", ga.lost()).await?;
    ensure!(
        reason == LostReason::SessionLost,
        "lost() gave {reason:?}, expected SessionLost"
    );
    ensure!(!a.is_alive(), "the session is alive without a renewal task");
    let r = a.lock(ctx.name("y"))?.try_acquire().await;
    ensure!(
        r.is_err(),
        "an acquire on a session without a renewal task gave {r:?}"
    );
    let gb = b
        .lock(ga.name())?
        .acquire_timeout(t * 2 + ctx.caps.recovery_bound)
        .await?;
    increased(gb.token(), ga.token(), "")?;
    drop(ga);
    gb.release().await?;
    passed()
}

/// S5, L1 on stores where each hold has its own expiry: a grant the client
/// no longer tracks (a take that landed after its acquire gave up, a release
/// whose clean-up never got through) must not be kept alive by the
/// session's renewals of its *other* holds. It expires one TTL after the
/// take, and another client gets the lock; the renewed hold stays.
///
/// Stores whose holds live with the session (etcd leases, ZooKeeper
/// sessions) cannot expire one hold alone: there the core's retried
/// clean-ups free it (`abandon_retried_after_cut`,
/// `lost_hold_release_retried`).
pub async fn renewal_keeps_only_known_holds(h: &dyn Harness) -> Outcome {
    use dlock_core::backend::{ExpiryModel, Take};
    let ctx = Ctx::new(h, "renewal_keeps_only_known_holds");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    if raw::session(&a).expiry() != ExpiryModel::PerHold {
        return super::skipped(
            "holds live with the session: retried clean-ups free untracked ones",
        );
    }
    let (t, bound) = (ctx.caps.ttl, ctx.caps.recovery_bound);
    let (untracked, renewed) = (ctx.name("untracked"), ctx.name("renewed"));
    // The core keeps one hold of A's session alive...
    let kept = a.lock(&renewed)?.acquire().await?;
    // ...while another grant of the same session is one it never learns of.
    let mut attempt = raw::session(&a).claim(&untracked, None).await?;
    let taken = Instant::now();
    let hold = match attempt.try_take().await? {
        Take::Granted(hold) => hold,
        Take::Busy(_) => return Err(Failure("a free lock was busy".into())),
    };
    let gb = b
        .lock(&untracked)?
        .acquire_timeout(t * 4 + bound)
        .await
        .map_err(|e| {
            Failure(format!(
                "the untracked grant (token {}) outlived its TTL: the session's renewals kept it ({e})",
                hold.token
            ))
        })?;
    let took = taken.elapsed();
    ensure!(
        took <= t + bound,
        "the untracked grant kept the lock for {took:?} (TTL {t:?}, bound {bound:?})"
    );
    ensure!(
        kept.is_held(),
        "the renewed hold was lost ({:?})",
        kept.lost_reason()
    );
    increased(gb.token(), hold.token, "")?;
    gb.release().await?;
    kept.release().await?;
    let _ = attempt.abandon().await;
    passed()
}
