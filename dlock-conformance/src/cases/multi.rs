//! Several names taken all-or-nothing (`Session::lock_all`, issue 17 item
//! 4): written once in the core on top of each store's locks, proved here on
//! every store.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::Error;
use rand::seq::SliceRandom;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{ensure, eventually, given_back, passed};
use crate::checker::{FencedRegister, History, Op, Phase};
use crate::{Ctx, Failure, Harness, Outcome};

/// S1, L5: a multi-lock that finds one name busy takes none of them (what
/// it took first is free again when it returns, for a try and for a timed
/// wait; briefly later only if its release outlasted a request timeout),
/// then takes all of them once they are free, each with its own
/// token, and frees all of them on release.
pub async fn multi_lock_all_or_nothing(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "multi_lock_all_or_nothing");
    let (x, y) = (ctx.name("x"), ctx.name("y"));
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let held = a.lock(&y)?.acquire().await?;
    // (given in reverse: taken in name order, x first)
    let both = b.lock_all([&y, &x])?;
    let order: Vec<_> = both.names().cloned().collect();
    ensure!(
        order == [x.clone(), y.clone()],
        "lock_all takes {order:?}, not in name order"
    );
    let free_again = |what: &'static str, took: Duration, wait: Duration| {
        let (b, c, x, ctx) = (&b, &c, x.clone(), &ctx);
        let what = format!("{what} left {x} held");
        async move {
            given_back(ctx, b, &what, took, wait, || async {
                Ok(match c.lock(&x)?.try_acquire().await? {
                    Some(guard) => guard.release().await.map(|()| true)?,
                    None => false,
                })
            })
            .await
        }
    };
    let started = Instant::now();
    ensure!(
        both.try_acquire().await?.is_none(),
        "lock_all took both names while one was held"
    );
    free_again("a failed try", started.elapsed(), Duration::ZERO).await?;
    let wait = ctx.caps.ttl / 4;
    let started = Instant::now();
    match both.acquire_timeout(wait).await {
        Err(Error::Timeout { .. }) => {}
        Ok(_) => {
            return Err(Failure(
                "lock_all took both names while one was held".into(),
            ));
        }
        Err(e) => return Err(e.into()),
    }
    free_again("a timed-out wait", started.elapsed(), wait).await?;
    held.release().await?;
    let guard = both.acquire_timeout(ctx.caps.ttl * 4).await?;
    ensure!(guard.is_held(), "a fresh multi-guard is not held");
    let (tx, ty) = (guard.token(x.as_str()), guard.token(y.as_str()));
    ensure!(tx.is_some() && ty.is_some(), "tokens {tx:?} {ty:?}");
    for name in [&x, &y] {
        ensure!(
            c.lock(name)?.try_acquire().await?.is_none(),
            "{name} is free while the multi-guard holds it"
        );
    }
    guard.release().await?;
    for name in [&x, &y] {
        let got = c.lock(name)?.try_acquire().await?;
        let got = got.ok_or_else(|| Failure(format!("{name} still held after release")))?;
        got.release().await?;
    }
    passed()
}

/// S1, S2, L1: clients take random pairs of three names in random order
/// through `lock_all`, overlapping one another: every one finishes (no
/// deadlock), and per name no two holds overlap and tokens follow grant
/// order (fenced register and history check per name).
pub async fn multi_lock_no_deadlock(h: &dyn Harness) -> Outcome {
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 8;
    let ctx = Ctx::new(h, "multi_lock_no_deadlock");
    let names = [ctx.name("a"), ctx.name("b"), ctx.name("c")];
    let per_name: Arc<Vec<(FencedRegister, History)>> = Arc::new(
        names
            .iter()
            .map(|_| (FencedRegister::new(), History::new()))
            .collect(),
    );
    let wait = (ctx.caps.ttl * 20).max(Duration::from_secs(60));
    let mut tasks = JoinSet::new();
    for client in 0..CLIENTS {
        let session = ctx.client().await?;
        let (names, per_name) = (names.clone(), per_name.clone());
        tasks.spawn(async move {
            for _ in 0..ROUNDS {
                let mut pick: Vec<usize> = (0..names.len()).collect();
                pick.shuffle(&mut rand::rng());
                pick.truncate(2);
                let guard = session
                    .lock_all(pick.iter().map(|&i| names[i].clone()))?
                    .acquire_timeout(wait)
                    .await
                    .map_err(|e| Failure(format!("lock_all waited {wait:?} (deadlock?): {e}")))?;
                for &i in &pick {
                    let token = guard.token(names[i].as_str()).expect("a picked name");
                    let (register, history) = &per_name[i];
                    history.record(client, Op::Acquire, Phase::Invoke, None);
                    history.record(client, Op::Acquire, Phase::Ok, Some(token));
                    register.write(client, token);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                for &i in &pick {
                    let token = guard.token(names[i].as_str()).expect("a picked name");
                    per_name[i].0.write(client, token);
                    per_name[i]
                        .1
                        .record(client, Op::Release, Phase::Invoke, None);
                }
                guard.release().await?;
                for &i in &pick {
                    per_name[i].1.record(client, Op::Release, Phase::Ok, None);
                }
            }
            session.close().await?;
            Ok::<_, Failure>(())
        });
    }
    super::join_all(tasks, "client task").await?;
    let mut holds = 0;
    for (register, history) in per_name.iter() {
        register.check()?;
        holds += history.check()?.holds;
    }
    ensure!(
        holds == CLIENTS * ROUNDS * 2,
        "expected {} holds, the histories have {holds}",
        CLIENTS * ROUNDS * 2
    );
    passed()
}

/// S4, L1 for scheduled jobs (issue 17 item 5): a hold taken with
/// `hold_at_most(limit)` ends at its limit although the session renews it:
/// `lost()` fires with `HoldLimit` no earlier than the limit, the lock is
/// given back (the next client gets it, with a larger token), and the late
/// holder's release reports the loss.
pub async fn hold_at_most_ends_the_hold(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "hold_at_most_ends_the_hold");
    let name = ctx.name("job");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    // Longer than a renewal period, so that the renewals would keep it.
    let limit = ctx.caps.ttl;
    let start = tokio::time::Instant::now();
    let held = a.lock(&name)?.hold_at_most(limit).acquire().await?;
    let bound = limit + ctx.caps.ttl + ctx.caps.recovery_bound;
    let reason = tokio::time::timeout(bound, held.lost())
        .await
        .map_err(|_| {
            Failure(format!(
                "the hold outlived its limit of {limit:?} by {bound:?}"
            ))
        })?;
    let took = start.elapsed();
    ensure!(
        reason == dlock_core::LostReason::HoldLimit,
        "the hold ended with {reason:?}, not at its limit"
    );
    ensure!(
        took >= limit,
        "the hold ended after {took:?}, before its limit {limit:?}"
    );
    // Released, not left to expire: the store shows it free well within
    // the TTL (renewed up to the limit, it would expire 2/3 TTL later at
    // the earliest).
    let admin = ctx.admin().await?;
    eventually(
        ctx.caps.ttl / 2,
        "the store to free a hold ended by its limit",
        || {
            let (admin, name) = (admin.clone(), name.clone());
            async move { Ok(admin.inspect(&name).await?.is_none()) }
        },
    )
    .await?;
    let next = b.lock(&name)?.acquire_timeout(bound).await?;
    super::increased(next.token(), held.token(), "after a hold limit")?;
    match held.release().await {
        Err(Error::Lost { .. }) => {}
        other => {
            return Err(Failure(format!(
                "the release of a hold ended by its limit answered {other:?}"
            )));
        }
    }
    next.release().await?;
    passed()
}

/// S1, L1 for scheduled jobs (issue 17 item 5): a hold taken with
/// `hold_at_least(minimum)` and released at once stays taken until its
/// minimum (the release returns at once; the session renews the hold
/// meanwhile, past a TTL; the store validates it), and is given back then:
/// the next client gets it promptly after the minimum, with a larger
/// token.
pub async fn hold_at_least_keeps_the_hold(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "hold_at_least_keeps_the_hold");
    let name = ctx.name("job");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let admin = ctx.admin().await?;
    // Longer than a TTL, so that only renewals keep it.
    let minimum = ctx.caps.ttl * 2;
    let held = a.lock(&name)?.hold_at_least(minimum).acquire().await?;
    let granted = tokio::time::Instant::now();
    let token = held.token();
    held.release().await?;
    let returned = granted.elapsed();
    ensure!(
        returned < minimum / 2,
        "the release waited {returned:?} for the minimum of {minimum:?}"
    );
    let lock_b = b.lock(&name)?;
    ensure!(
        lock_b.try_acquire().await?.is_none(),
        "the lock was free right after a release before its minimum"
    );
    tokio::time::sleep(ctx.caps.ttl * 3 / 2).await;
    ensure!(
        admin.validate(&name, token).await?,
        "the store dropped the hold before its minimum (not renewed after the release?)"
    );
    let next = lock_b.acquire_timeout(minimum + ctx.caps.ttl * 4).await?;
    let took = granted.elapsed();
    ensure!(
        took >= minimum,
        "the lock was free {took:?} after its grant, before its minimum {minimum:?}"
    );
    let late = took - minimum;
    ensure!(
        late <= ctx.caps.ttl / 2 + ctx.caps.wakeup_bound,
        "the lock was given back {late:?} after its minimum"
    );
    super::increased(next.token(), token, " after a hold's minimum")?;
    next.release().await?;
    passed()
}
