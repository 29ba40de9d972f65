//! S3: only the holder (same session, same token) can release or renew.

use std::time::Duration;

use dlock_core::backend::Hold;
use dlock_core::{Error, FencingToken};
use tokio::time::sleep;

use super::{
    busy, ensure, faulty_holder, held_by_a, increased, joined, passed, start, still_held, within,
};
use crate::{Ctx, Harness, Outcome};

fn not_held(r: &Result<(), Error>) -> bool {
    matches!(r, Err(Error::NotHeld { .. }))
}

/// S3: a release or renewal by another session, or with a stale token,
/// changes nothing and returns `NotHeld`; the holder keeps the lock; after the
/// release, a late release of the old hold is refused too.
pub async fn release_by_non_owner(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "release_by_non_owner");
    let name = ctx.name("x");
    let (a, b, admin, ga) = held_by_a(&ctx, &name).await?;
    let other = b.lock(ctx.name("other"))?.acquire().await?;
    // B presents A's token with B's own identity.
    let forged = Hold {
        name: name.clone(),
        token: ga.token(),
        key: dlock_core::raw::hold(&other).key.clone(),
    };
    let r = dlock_core::raw::session(&b).release(&forged).await;
    ensure!(not_held(&r), "release by another session gave {r:?}");
    let renewed = dlock_core::raw::session(&b)
        .renew(std::slice::from_ref(&forged))
        .await?;
    ensure!(
        renewed == [false],
        "renewal by another session gave {renewed:?}"
    );
    // B presents A's exact hold (A's key and token): only the session differs.
    let stolen = dlock_core::raw::hold(&ga).clone();
    let r = dlock_core::raw::session(&b).release(&stolen).await;
    ensure!(
        not_held(&r),
        "release of another session's exact hold gave {r:?}"
    );
    let renewed = dlock_core::raw::session(&b)
        .renew(std::slice::from_ref(&stolen))
        .await?;
    ensure!(
        renewed == [false],
        "renewal of another session's exact hold gave {renewed:?}"
    );
    // A's own session with a stale token.
    let stale = Hold {
        token: FencingToken::new(ga.token().get().saturating_sub(1)),
        ..dlock_core::raw::hold(&ga).clone()
    };
    let r = dlock_core::raw::session(&a).release(&stale).await;
    ensure!(not_held(&r), "release with a stale token gave {r:?}");
    ensure!(
        ga.is_held(),
        "holder lost the lock to a non-owner's release"
    );
    ensure!(
        admin.validate(&name, ga.token()).await?,
        "store no longer validates the holder's token"
    );
    ensure!(
        busy(&b, &name).await?,
        "lock became free after a non-owner's release"
    );
    let old = dlock_core::raw::hold(&ga).clone();
    ga.release().await?;
    let r = dlock_core::raw::session(&a).release(&old).await;
    ensure!(not_held(&r), "a second release of the same hold gave {r:?}");
    other.release().await?;
    passed()
}

/// S3, S4 (seed 001, problem 3): A's lock expires while A is stalled; B takes
/// it; A's late release fails and does not free B's lock.
pub async fn stale_release_after_expiry(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "stale_release_after_expiry");
    let (a, faults, b, ga) = faulty_holder(&ctx).await?;
    let admin = ctx.admin().await?;
    let old = dlock_core::raw::hold(&ga).clone();
    faults.stall_renewals();
    let reason = within(t * 2, "lost() after renewals stopped", ga.lost()).await?;
    ensure!(super::is_loss(reason), "lost() resolved with {reason:?}");
    let gb = b
        .lock(&name)?
        .acquire_timeout(t + ctx.caps.recovery_bound)
        .await?;
    increased(gb.token(), old.token, "")?;
    let late = ga.release().await;
    ensure!(
        late.is_err(),
        "a late release of an expired hold reported success"
    );
    let raw = dlock_core::raw::session(&a).release(&old).await;
    ensure!(
        matches!(raw, Err(Error::NotHeld { .. } | Error::SessionLost { .. })),
        "a late raw release gave {raw:?}"
    );
    still_held(&*admin, &gb, "after a stale release").await?;
    gb.release().await?;
    passed()
}

/// S3: A's release commits but its reply is lost; the core retries; the retry
/// must neither fail the release nor free B, who got the lock in between.
pub async fn stale_release_retried_after_lost_reply(h: &dyn Harness) -> Outcome {
    let (ctx, name, t) = start(h, "stale_release_retried_after_lost_reply");
    let (_a, faults, b, ga) = faulty_holder(&ctx).await?;
    let admin = ctx.admin().await?;
    let b_lock = b.lock(&name)?;
    let waiter = tokio::spawn(async move { b_lock.acquire_timeout(t * 10).await });
    super::queued(&*admin, &name, 1, t / 3).await?;
    faults.lose_release_replies(1);
    let released = ga.release().await;
    ensure!(
        released.is_ok(),
        "release whose first reply was lost gave {released:?}"
    );
    let gb = joined(t * 10, "waiter after release", waiter).await??;
    sleep(Duration::from_millis(50)).await; // let any straggling retry land
    still_held(&*admin, &gb, "after a retried release").await?;
    gb.release().await?;
    passed()
}
