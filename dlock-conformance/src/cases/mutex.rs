//! Mutual exclusion under contention, try/timeout semantics, reentrancy.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::Error;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{busy, declares, ensure, increased, or_skip, passed, round_trip};
use crate::checker::{FencedRegister, History, Op, Phase};
use crate::{Ctx, Failure, Harness, Outcome};

/// S1, S2: 16 clients on one name; every fenced write is accepted, no two
/// holds overlap, tokens follow grant order.
pub async fn contention(h: &dyn Harness) -> Outcome {
    const CLIENTS: usize = 16;
    const ROUNDS: usize = 6;
    let ctx = Ctx::new(h, "contention");
    let name = ctx.name("hot");
    let register = Arc::new(FencedRegister::new());
    let history = Arc::new(History::new());
    let mut tasks = JoinSet::new();
    for client in 0..CLIENTS {
        let session = ctx.client().await?;
        let (name, register, history) = (name.clone(), register.clone(), history.clone());
        tasks.spawn(async move {
            let lock = session.lock(&name)?;
            for _ in 0..ROUNDS {
                history.record(client, Op::Acquire, Phase::Invoke, None);
                let guard = lock.acquire_timeout(Duration::from_secs(90)).await?;
                history.record(client, Op::Acquire, Phase::Ok, Some(guard.token()));
                register.write(client, guard.token());
                // Hold for a while (a few round trips on loopback), so that
                // broken exclusion shows as overlapping holds.
                tokio::time::sleep(Duration::from_millis(2)).await;
                register.write(client, guard.token());
                history.record(client, Op::Release, Phase::Invoke, None);
                guard.release().await?;
                history.record(client, Op::Release, Phase::Ok, None);
            }
            session.close().await?;
            Ok::<_, Failure>(())
        });
    }
    super::join_all(tasks, "client task").await?;
    register.check()?;
    let summary = history.check()?;
    ensure!(
        summary.holds == CLIENTS * ROUNDS,
        "expected {} holds, history has {}",
        CLIENTS * ROUNDS,
        summary.holds
    );
    ensure!(
        register.accepted() == 2 * CLIENTS * ROUNDS,
        "register accepted {}",
        register.accepted()
    );
    passed()
}

/// S1, S2 on a lock's first use: clients race for names nobody has used,
/// all released by one barrier, so that a store creating a lock's record on
/// its first take must settle racing creations (the Mongo-wire server
/// answered two racing upserts both "granted, token 1"; `contention` could
/// not see it, its clients connect one after another). Each round: at most
/// one try wins while the winner holds, and the tokens of all rounds'
/// grants are distinct.
pub async fn first_take_race(h: &dyn Harness) -> Outcome {
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 5;
    let ctx = Ctx::new(h, "first_take_race");
    let mut sessions = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        sessions.push(Arc::new(ctx.client().await?));
    }
    let mut granted = 0;
    for round in 0..ROUNDS {
        let name = ctx.name(&format!("fresh{round}"));
        // Two barriers: all try at once; nobody releases before all tried.
        let start = Arc::new(tokio::sync::Barrier::new(CLIENTS));
        let tried = Arc::new(tokio::sync::Barrier::new(CLIENTS));
        let mut tasks = JoinSet::new();
        for session in &sessions {
            let (session, name) = (session.clone(), name.clone());
            let (start, tried) = (start.clone(), tried.clone());
            tasks.spawn(async move {
                let lock = session.lock(&name)?;
                start.wait().await;
                let guard = lock.try_acquire().await;
                tried.wait().await;
                // A try the store did not answer in time (the core's cut,
                // no other error) wins nothing (the core abandons what it
                // may have taken): an answer, not a failure of the case (eight tries at once on a loaded
                // Redlock, each node allowed 125 ms, in CI).
                let guard = match guard {
                    Err(e @ Error::Unavailable { .. })
                        if e.to_string().ends_with("request timed out") =>
                    {
                        None
                    }
                    other => other?,
                };
                let token = guard.as_ref().map(|g| g.token());
                if let Some(guard) = guard {
                    guard.release().await?;
                }
                Ok::<_, Failure>(token)
            });
        }
        let mut tokens = Vec::new();
        while let Some(done) = tasks.join_next().await {
            if let Some(token) = done.map_err(|e| Failure(format!("client task failed: {e}")))?? {
                tokens.push(token);
            }
        }
        ensure!(
            tokens.len() <= 1,
            "round {round}: {} clients won the first take of a fresh name at once (tokens {tokens:?})",
            tokens.len()
        );
        granted += tokens.len();
    }
    ensure!(
        granted > 0,
        "no try won a free, fresh name in {ROUNDS} rounds"
    );
    passed()
}

/// S1: `try_acquire` takes a free lock, reports a held one as busy without
/// waiting, and takes it once released (with a larger token).
pub async fn try_acquire(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "try_acquire");
    let name = ctx.name("x");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let ga = a.lock(&name)?.try_acquire().await?;
    let ga = ga.ok_or_else(|| Failure("try_acquire of a free lock said busy".into()))?;
    let start = Instant::now();
    let busy = b.lock(&name)?.try_acquire().await?;
    let took = start.elapsed();
    ensure!(busy.is_none(), "a second client took a held lock");
    ensure!(
        took < ctx.caps.ttl,
        "try_acquire of a held lock took {took:?}: it must not wait"
    );
    ensure!(ga.is_held(), "holder lost the lock after a failed try");
    let first = ga.token();
    ga.release().await?;
    let gb = b.lock(&name)?.try_acquire().await?;
    let gb = gb.ok_or_else(|| Failure("try_acquire after release said busy".into()))?;
    increased(gb.token(), first, "")?;
    gb.release().await?;
    passed()
}

/// L5: `acquire_timeout(d)` on a held lock returns `Timeout` no earlier than
/// `d` and within `d` plus a round trip; timed-out waiters block no one.
pub async fn timeouts(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "timeouts");
    let name = ctx.name("x");
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let rtt = round_trip(&a, &ctx.name("rtt")).await?;
    let slack = ctx.caps.wakeup_bound + rtt * 4;
    let ga = a.lock(&name)?.acquire().await?;
    let t = ctx.caps.ttl;
    for wait in [Duration::ZERO, t / 4, t] {
        let mut start = Instant::now();
        let mut result = b.lock(&name)?.acquire_timeout(wait).await;
        // A lock that stayed busy is no store failure (a zero wait may end
        // before any answer, which says nothing about the lock). A store
        // that really was slow once (a request timed out: SQLite's single
        // writer under the suite's parallel cases) is asked once more; a
        // wait that blames the store for a busy lock does so every time.
        if !wait.is_zero() && matches!(result, Err(Error::Timeout { cause: Some(_), .. })) {
            crate::loud(&format!(
                "NOTE timeouts: acquire_timeout({wait:?}) saw a store failure ({result:?}); once more"
            ));
            start = Instant::now();
            result = b.lock(&name)?.acquire_timeout(wait).await;
        }
        let took = start.elapsed();
        ensure!(
            matches!(result, Err(Error::Timeout { .. })),
            "acquire_timeout({wait:?}) on a held lock gave {result:?}"
        );
        if !wait.is_zero() {
            ensure!(
                matches!(result, Err(Error::Timeout { cause: None, .. })),
                "acquire_timeout({wait:?}) on a held lock blamed the store: {result:?}"
            );
        }
        ensure!(
            took >= wait,
            "acquire_timeout({wait:?}) gave up early, after {took:?}"
        );
        ensure!(
            took <= wait + slack,
            "acquire_timeout({wait:?}) took {took:?} (bound {:?})",
            wait + slack
        );
    }
    ensure!(ga.is_held(), "holder lost the lock while others timed out");
    let start = Instant::now();
    ga.release().await?;
    let gc = c.lock(&name)?.acquire_timeout(t * 4).await?;
    let took = start.elapsed();
    ensure!(
        took <= t / 2 + slack,
        "after release, a new client waited {took:?}: timed-out waiters are blocking it"
    );
    gc.release().await?;
    passed()
}

/// Reentrancy as declared: the same handle re-acquires at once with the same
/// token and frees the lock on the last release; another handle, even of the
/// same session and even a clone of the holding handle, is excluded
/// (ownership is per handle).
pub async fn reentrancy(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "reentrancy");
    or_skip!(declares(ctx.caps.reentrant, "reentrancy"));
    let name = ctx.name("x");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let lock = a.lock(&name)?;
    let g1 = lock.acquire().await?;
    let g2 = lock.acquire_timeout(Duration::ZERO).await?;
    let g3 = lock.try_acquire().await?;
    let g3 = g3.ok_or_else(|| Failure("the holding handle was refused".into()))?;
    ensure!(
        g2.token() == g1.token() && g3.token() == g1.token(),
        "reentrant guards carry different tokens"
    );
    ensure!(
        lock.clone().try_acquire().await?.is_none(),
        "a clone of the holding handle shared its hold (ownership is per handle)"
    );
    ensure!(
        busy(&a, &name).await?,
        "another handle of the same session took a held lock"
    );
    g2.release().await?;
    drop(g3);
    ensure!(g1.is_held(), "inner releases freed the outer hold");
    ensure!(
        busy(&b, &name).await?,
        "lock was free while the outer guard was live"
    );
    let t1 = g1.token();
    g1.release().await?;
    let gb = b.lock(&name)?.acquire_timeout(ctx.caps.ttl).await?;
    increased(gb.token(), t1, "")?;
    gb.release().await?;
    passed()
}
