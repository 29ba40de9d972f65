//! Counting semaphores (`Session::semaphore`, issue 17 item 2): written
//! once in the core on each store's locks, proved here on every store. S7
//! for semaphores: never more than N valid permits; each permit expires on
//! its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock_core::semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{ensure, increased, joined, passed};
use crate::checker::{FencedRegister, History, Op, Phase};
use crate::{Ctx, Failure, Harness, Outcome};

/// S7, S2: clients take permits of a 3-permit semaphore round after round.
/// One client gets exactly 3 permits and no fourth; under contention never
/// more than 3 permits are held at once (counted by the clients, from grant
/// to release, and as the store lists them), and per permit the holds
/// never overlap and tokens follow grant order (fenced register and
/// history check per permit).
pub async fn semaphore_bounds_holders(h: &dyn Harness) -> Outcome {
    const PERMITS: usize = 3;
    const CLIENTS: usize = 6;
    const ROUNDS: usize = 5;
    let ctx = Ctx::new(h, "semaphore_bounds_holders");
    let name = ctx.name("pool");
    let admin = ctx.admin().await?;
    // Exactly N for one client.
    let first = ctx.client().await?;
    let pool = first.semaphore(&name, PERMITS)?;
    let mut taken = Vec::new();
    for _ in 0..PERMITS {
        let got = pool.try_acquire().await?;
        taken.push(got.ok_or_else(|| Failure("a free permit was refused".into()))?);
    }
    ensure!(
        pool.try_acquire().await?.is_none(),
        "a permit beyond the {PERMITS} was granted"
    );
    let listed = semaphore::holders(&*admin, &name).await?.len();
    ensure!(
        listed == PERMITS,
        "the store lists {listed} held permits, not {PERMITS}"
    );
    for permit in taken {
        permit.release().await?;
    }
    first.close().await?;

    let per_slot: Arc<Vec<(FencedRegister, History)>> = Arc::new(
        (0..PERMITS)
            .map(|_| (FencedRegister::new(), History::new()))
            .collect(),
    );
    let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let wait = (ctx.caps.ttl * 20).max(Duration::from_secs(60));
    let mut tasks = JoinSet::new();
    for client in 0..CLIENTS {
        let session = ctx.client().await?;
        let (name, per_slot, inside, most, admin) = (
            name.clone(),
            per_slot.clone(),
            inside.clone(),
            most.clone(),
            admin.clone(),
        );
        tasks.spawn(async move {
            let pool = session.semaphore(&name, PERMITS)?;
            for _ in 0..ROUNDS {
                let permit = pool
                    .acquire_timeout(wait)
                    .await
                    .map_err(|e| Failure(format!("waited {wait:?} for a permit: {e}")))?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let (register, history) = &per_slot[permit.slot()];
                history.record(client, Op::Acquire, Phase::Invoke, None);
                history.record(client, Op::Acquire, Phase::Ok, Some(permit.token()));
                register.write(client, permit.token());
                let listed = semaphore::holders(&*admin, &name).await?.len();
                ensure!(
                    listed <= PERMITS,
                    "the store lists {listed} held permits of {PERMITS}"
                );
                tokio::time::sleep(Duration::from_millis(3)).await;
                register.write(client, permit.token());
                inside.fetch_sub(1, Ordering::SeqCst);
                history.record(client, Op::Release, Phase::Invoke, None);
                let slot = permit.slot();
                permit.release().await?;
                per_slot[slot]
                    .1
                    .record(client, Op::Release, Phase::Ok, None);
            }
            session.close().await?;
            Ok::<_, Failure>(())
        });
    }
    super::join_all(tasks, "client task").await?;
    let most = most.load(Ordering::SeqCst);
    ensure!(
        most <= PERMITS,
        "{most} permits were held at once, of {PERMITS}"
    );
    let mut holds = 0;
    for (register, history) in per_slot.iter() {
        register.check()?;
        holds += history.check()?.holds;
    }
    ensure!(
        holds == CLIENTS * ROUNDS,
        "expected {} holds, the histories have {holds}",
        CLIENTS * ROUNDS
    );
    passed()
}

/// L1, S7 (per-permit expiry): of a 2-permit semaphore, A holds one and B
/// the other; C waits. A crashes: C gets A's permit within a TTL plus the
/// recovery bound, with a larger token, while B's permit stays valid (the
/// store validates it): one holder's crash frees its permit, not the
/// semaphore.
pub async fn semaphore_permit_expiry(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "semaphore_permit_expiry");
    let (t, bound) = (ctx.caps.ttl, ctx.caps.recovery_bound);
    let name = ctx.name("pool");
    let (a, faults) = ctx.faulty_client().await?;
    let (b, c) = (ctx.client().await?, ctx.client().await?);
    let admin = ctx.admin().await?;
    let held_a = a.semaphore(&name, 2)?.acquire().await?;
    let held_b = b.semaphore(&name, 2)?.acquire().await?;
    ensure!(
        held_a.slot() != held_b.slot(),
        "two holders share permit {}",
        held_a.slot()
    );
    let pool_c = c.semaphore(&name, 2)?;
    ensure!(
        pool_c.try_acquire().await?.is_none(),
        "a third permit of two was granted"
    );
    let waiting = tokio::spawn({
        let pool_c = pool_c.clone();
        let limit = t * 3 + bound;
        async move { (pool_c.acquire_timeout(limit).await, Instant::now()) }
    });
    let (slot_a, token_a) = (held_a.slot(), held_a.token());
    faults.crash();
    let crashed = Instant::now();
    // Gone with its process (its session object no longer talks to the store).
    drop(held_a);
    drop(a);
    let (got, at) = joined(t * 4 + bound, "C's wait for a permit", waiting).await?;
    let got = got.map_err(|e| Failure(format!("C never got the crashed holder's permit: {e}")))?;
    let took = at.duration_since(crashed);
    ensure!(
        took <= t + bound,
        "the crashed holder's permit came back after {took:?} (bound {:?})",
        t + bound
    );
    ensure!(
        got.slot() == slot_a,
        "C got permit {}, not the crashed holder's {slot_a}",
        got.slot()
    );
    increased(got.token(), token_a, " (the permit's next grant)")?;
    ensure!(held_b.is_held(), "B's permit was lost with A's");
    ensure!(
        admin
            .validate(held_b.guard().name(), held_b.token())
            .await?,
        "the store no longer validates B's permit after A crashed"
    );
    got.release().await?;
    held_b.release().await?;
    passed()
}

/// L1, S7, S8 (wire): the semaphore's head of line is blackholed while it
/// keeps the line and claims the only permit. When the permit is given
/// back, the client behind it still gets it within the store's expiry of
/// what the partitioned one held (its place in line, and the permit if its
/// claim was granted unseen), and never while another holds it: after the
/// partition heals, the partitioned client is granted only once the permit
/// is free again, with a larger token.
pub async fn semaphore_head_of_line_partitioned(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "semaphore_head_of_line_partitioned");
    let Some((a, link)) = ctx.linked_client().await? else {
        return super::skipped(super::NO_LINK);
    };
    let t = ctx.caps.ttl;
    let name = ctx.name("pool");
    let (b, c) = (ctx.client().await?, ctx.client().await?);
    let admin = ctx.admin().await?;
    let held_c = c.semaphore(&name, 1)?.acquire().await?;
    let pool_a = a.semaphore(&name, 1)?;
    let waiting_a = tokio::spawn(async move { pool_a.acquire_timeout(t * 30).await });
    // A reaches the head of the line (it takes the queue lock) before B.
    let queue = dlock_core::LockName::new(format!("{name}/queue"))?;
    let a_id = a.id().as_str().to_owned();
    super::eventually(t * 2, "A to be at the head of the semaphore's line", || {
        let (admin, queue, a_id) = (admin.clone(), queue.clone(), a_id.clone());
        async move {
            Ok(admin
                .inspect(&queue)
                .await?
                .is_some_and(|i| i.holder.starts_with(&a_id)))
        }
    })
    .await?;
    let pool_b = b.semaphore(&name, 1)?;
    let waiting_b = tokio::spawn(async move { pool_b.acquire_timeout(t * 30).await });
    tokio::time::sleep(t / 10).await;
    link.set_all(crate::wire::Fault::BLACKHOLE);
    let released = Instant::now();
    let token_c = held_c.token();
    held_c.release().await?;
    let bound = (t + ctx.caps.recovery_bound) * 2 + ctx.caps.wakeup_bound + t;
    let got_b = joined(
        bound + t * 4,
        "B's wait behind a partitioned head of line",
        waiting_b,
    )
    .await?
    .map_err(|e| Failure(format!("B never got the permit: {e}")))?;
    let took = released.elapsed();
    ensure!(
        took <= bound,
        "B got the permit {took:?} after it was given back (bound {bound:?})"
    );
    increased(got_b.token(), token_c, " (B's permit after C's)")?;
    link.heal();
    // A is granted, if ever, only after B gives the permit back.
    tokio::time::sleep(t).await;
    ensure!(
        got_b.is_held(),
        "B lost its permit when A's partition healed"
    );
    let listed = semaphore::holders(&*admin, &name).await?.len();
    ensure!(listed <= 1, "{listed} holders of the only permit");
    let (early, waiting_a) = if waiting_a.is_finished() {
        (Some(joined(t, "A's finished wait", waiting_a).await?), None)
    } else {
        (None, Some(waiting_a))
    };
    if let Some(Ok(got_a)) = &early {
        ensure!(
            !got_a.is_held(),
            "A holds the only permit (token {}) while B does (token {})",
            got_a.token(),
            got_b.token()
        );
    }
    let token_b = got_b.token();
    got_b.release().await?;
    let a_result = match (early, waiting_a) {
        (Some(result), _) => result,
        (None, Some(waiting)) => {
            joined(t * 40, "A's wait after the partition healed", waiting).await?
        }
        (None, None) => unreachable!("A's wait is either finished or not"),
    };
    match a_result {
        Ok(got_a) => {
            increased(got_a.token(), token_b, " (A's permit after B's)")?;
            got_a.release().await?;
        }
        // Its session may have ended during the partition (session leases).
        Err(dlock_core::Error::SessionLost { .. } | dlock_core::Error::Timeout { .. }) => {}
        Err(e) => return Err(Failure(format!("A's wait failed: {e:?}"))),
    }
    passed()
}

/// L4 for semaphores (where the store declares `fair`): waiters for the
/// only permit get it in the order they came, one after another.
pub async fn semaphore_fifo(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "semaphore_fifo");
    super::or_skip!(super::declares(ctx.caps.fair, "fair (FIFO) ordering"));
    let t = ctx.caps.ttl;
    let name = ctx.name("pool");
    let queue = dlock_core::LockName::new(format!("{name}/queue"))?;
    let permit = dlock_core::LockName::new(format!("{name}/permits/0"))?;
    let admin = ctx.admin().await?;
    let a = ctx.client().await?;
    let held = a.semaphore(&name, 1)?.acquire().await?;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for w in 1..=3usize {
        let session = ctx.client().await?;
        let pool = session.semaphore(&name, 1)?;
        let order = order.clone();
        waiters.push(tokio::spawn(async move {
            let got = pool.acquire_timeout(t * 30).await?;
            order.lock().unwrap().push(w);
            got.release().await?;
            drop(session);
            Ok::<_, Failure>(())
        }));
        // The first is at the head of the line (waiting for the permit),
        // the others wait in line behind it.
        if w == 1 {
            super::queued(&*admin, &permit, 1, t / 3).await?;
        } else {
            super::queued(&*admin, &queue, w - 1, t / 3).await?;
        }
    }
    held.release().await?;
    for (i, waiter) in waiters.into_iter().enumerate() {
        joined(t * 30, &format!("waiter {}", i + 1), waiter).await??;
    }
    let order = order.lock().unwrap().clone();
    ensure!(
        order == [1, 2, 3],
        "permits granted in the order {order:?}, not [1, 2, 3]"
    );
    passed()
}

/// S5, L1 for semaphores and read-write locks: waits dropped at any point
/// (in line, at the head of the line claiming every permit, a writer that
/// took some permits and waits for the rest) leave nothing held beyond one
/// TTL: once the holders give back, the next acquire gets through within a
/// TTL plus the recovery bound (a take in flight when its wait was dropped
/// may still be granted, and then expires), and the store soon lists no
/// permit and no place in line.
pub async fn primitives_cancellation_sweep(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "primitives_cancellation_sweep");
    let t = ctx.caps.ttl;
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let admin = ctx.admin().await?;
    let rtt = super::round_trip(&c, &ctx.name("rtt")).await?;
    for (i, delay) in [Duration::ZERO, rtt / 2, rtt, rtt * 2, rtt * 4]
        .into_iter()
        .enumerate()
    {
        // A semaphore whose two permits A holds: C's wait is dropped.
        let name = ctx.name(&format!("sem-{i}"));
        let pool_a = a.semaphore(&name, 2)?;
        let held = [pool_a.acquire().await?, pool_a.acquire().await?];
        let dropped = tokio::time::timeout(delay, c.semaphore(&name, 2)?.acquire()).await;
        ensure!(dropped.is_err(), "a third permit of two was granted");
        let released = Instant::now();
        for p in held {
            p.release().await?;
        }
        let pool_b = b.semaphore(&name, 2)?;
        let next = [
            pool_b.acquire_timeout(t * 2).await?,
            pool_b.acquire_timeout(t * 2).await?,
        ];
        let what = format!("a dropped semaphore wait (after {delay:?}) delayed the next holder by");
        within_a_ttl(&ctx, released.elapsed(), &what)?;
        for p in next {
            p.release().await?;
        }
        nothing_left(&ctx, &*admin, &name).await?;

        // A read-write lock A reads: C's write is dropped (it may hold the
        // other permits by then).
        let name = ctx.name(&format!("rw-{i}"));
        let read = a.rwlock_with(&name, 3)?.read().await?;
        let dropped = tokio::time::timeout(delay, c.rwlock_with(&name, 3)?.write()).await;
        ensure!(dropped.is_err(), "a write was granted while A read");
        let released = Instant::now();
        read.release().await?;
        let write = b.rwlock_with(&name, 3)?.write_timeout(t * 2).await?;
        let what = format!("a dropped write (after {delay:?}) delayed the next writer by");
        within_a_ttl(&ctx, released.elapsed(), &what)?;
        write.release().await?;
        nothing_left(&ctx, &*admin, &name).await?;
    }
    passed()
}

/// A dropped wait held up the next holder by `took`: no more than a TTL
/// plus the recovery bound (S5's "nothing beyond one TTL").
fn within_a_ttl(ctx: &Ctx<'_>, took: Duration, what: &str) -> Result<(), Failure> {
    let bound = ctx.caps.ttl + ctx.caps.recovery_bound;
    ensure!(took <= bound, "{what} {took:?} (bound {bound:?})");
    Ok(())
}

/// The store soon lists neither a permit of `name` nor its line's lock.
async fn nothing_left(
    ctx: &Ctx<'_>,
    admin: &dyn dlock_core::Backend,
    name: &dlock_core::LockName,
) -> Result<(), Failure> {
    let queue = dlock_core::LockName::new(format!("{name}/queue"))?;
    let limit = ctx.caps.ttl + ctx.caps.recovery_bound;
    let deadline = Instant::now() + limit;
    loop {
        let permits = semaphore::holders(admin, name).await?;
        let line = admin.inspect(&queue).await?;
        if permits.is_empty() && line.is_none() {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{limit:?} after the last release, {name} still has {permits:?} and its line {line:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
