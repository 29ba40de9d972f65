//! Faults on the wire between one client and the store (S8): lost and late
//! replies, dead connections, partitions, resets, and clients that see
//! different parts of a cluster. Each case puts its faulty client behind a
//! [`Link`](crate::wire::Link) of its own; the other clients are healthy.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::ExpiryModel;
use dlock_core::raw;
use dlock_core::{LockGuard, LockName, LostReason, Session};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};

use super::{
    NO_LINK, busy, ensure, joined, new_link, or_skip, passed, prompt, recovered, skipped,
    still_held, takes_over, watch_lost, within,
};
use crate::checker::FencedRegister;
use crate::wire::{Fault, Flow, Link};
use crate::{Ctx, Failure, Harness, Outcome};

/// A client behind a link of its own, or the verdict that the case does not
/// apply: the harness has no links, or (with `per_hold_skip`, the reason)
/// the case is about holds that live with the session and the store gives
/// each hold its own expiry.
async fn linked(
    ctx: &Ctx<'_>,
    per_hold_skip: Option<&str>,
) -> Result<Result<(Session, Arc<dyn Link>), Outcome>, Failure> {
    let Some((a, link)) = ctx.linked_client().await? else {
        return Ok(Err(skipped(NO_LINK)));
    };
    if let Some(why) = per_hold_skip
        && raw::session(&a).expiry() == ExpiryModel::PerHold
    {
        return Ok(Err(skipped(why)));
    }
    Ok(Ok((a, link)))
}

/// Where most wire cases start: the case's context, A's session behind a
/// link of its own (and that link), B's healthy session, and A's guard on
/// the lock `x`.
type Held<'h> = (Ctx<'h>, Session, Arc<dyn Link>, Session, LockGuard);

/// The [`Held`] start of `case`, or the verdict that it does not apply (see
/// [`linked`]).
async fn held<'h>(
    h: &'h dyn Harness,
    case: &str,
    per_hold_skip: Option<&str>,
) -> Result<Result<Held<'h>, Outcome>, Failure> {
    let ctx = Ctx::new(h, case);
    let (a, link) = match linked(&ctx, per_hold_skip).await? {
        Ok(pair) => pair,
        Err(verdict) => return Ok(Err(verdict)),
    };
    let b = ctx.client().await?;
    let name = ctx.name("x");
    let ga = a.lock(&name)?.acquire().await?;
    Ok(Ok((ctx, a, link, b, ga)))
}

/// A (holding `ga`, writing first to a fenced register) is blackholed: B
/// takes over within the TTL plus the recovery bound, after A's local
/// deadline (S4), and the register then refuses A's write. B's guard and
/// when it was granted.
async fn partitioned(
    ctx: &Ctx<'_>,
    link: &dyn Link,
    b: &Session,
    ga: &LockGuard,
    what: &str,
) -> Result<(LockGuard, Instant), Failure> {
    let (t, recovery) = (ctx.caps.ttl, ctx.caps.recovery_bound);
    let register = FencedRegister::new();
    ensure!(register.write(0, ga.token()), "A's first write refused");
    let cut_at = Instant::now();
    link.set_all(Fault::BLACKHOLE);
    let (gb, b_got) = takes_over(b, ga, t * 4 + recovery, what).await?;
    let took = b_got - cut_at;
    ensure!(
        took <= t + recovery,
        "B got the lock {took:?} after A's partition (bound {:?})",
        t + recovery
    );
    ensure!(register.write(1, gb.token()), "B's write refused");
    ensure!(
        !register.write(0, ga.token()),
        "the register accepted the partitioned holder's write"
    );
    Ok((gb, b_got))
}

/// Once `what` (A's faulty link) heals: A's lost hold stays lost and B keeps
/// the lock.
async fn healed(link: &dyn Link, ga: LockGuard, gb: LockGuard, t: Duration, what: &str) -> Outcome {
    link.heal();
    sleep(t / 2).await;
    ensure!(!ga.is_held(), "A holds again after {what} healed");
    ensure!(gb.is_held(), "B lost the lock when {what} healed");
    drop(ga);
    gb.release().await?;
    passed()
}

/// B gets the lock within 2 TTL plus the bound once A's link is back: the
/// clean-up of `what` that failed under the cut was retried, not left in
/// the store for as long as A's session lives.
async fn clean_up_retried(
    ctx: &Ctx<'_>,
    a: &Session,
    b: &Session,
    name: &LockName,
    what: &str,
) -> Result<LockGuard, Failure> {
    b.lock(name)?
        .acquire_timeout(a.ttl() * 2 + ctx.caps.recovery_bound)
        .await
        .map_err(|e| {
            Failure(format!(
                "{what} was not retried: B still waits ({e}); A's session alive: {}, holds: {}",
                a.is_alive(),
                raw::held_count(a)
            ))
        })
}

/// `fault` on every path of `link` for `span`, then everything passes again.
async fn for_a_while(link: &dyn Link, fault: Fault, span: Duration) {
    link.set_all(fault);
    sleep(span).await;
    link.heal();
}

/// Asserts for `span` that `a` keeps its hold and that `b` cannot take it.
async fn keeps_hold(a: &LockGuard, b: &Session, span: Duration, what: &str) -> Result<(), Failure> {
    let until = Instant::now() + span;
    while Instant::now() < until {
        ensure!(
            a.is_held(),
            "{what}: the holder lost a lock its store still had time on ({:?})",
            a.lost_reason()
        );
        ensure!(
            busy(b, a.name()).await?,
            "{what}: another client took a held lock"
        );
        sleep(span / 8).await;
    }
    Ok(())
}

/// S4, L3: A's renewals take effect but their replies are lost. Lost for
/// less than the validity left, the hold survives (the client times the
/// request out, retries on a fresh connection and is confirmed in time);
/// lost for longer, `lost()` fires by the local deadline, before anyone else
/// gets the lock, and the hold never comes back.
pub async fn renewal_replies_lost(h: &dyn Harness) -> Outcome {
    let (ctx, _, link, b, ga) = or_skip!(held(h, "renewal_replies_lost", None).await?);
    let t = ctx.caps.ttl;
    // Short: the store still has time on the lock, so must the holder.
    for_a_while(&*link, Fault::LOSE_REPLIES, t / 4).await;
    keeps_hold(&ga, &b, t * 2, "after replies were lost for TTL/4").await?;

    // Long: the holder must give up in time.
    let watcher = watch_lost(&ga);
    link.set_all(Fault::LOSE_REPLIES);
    let bound = t * 4 + ctx.caps.recovery_bound;
    let (gb, _) = takes_over(&b, &ga, bound, "replies lost").await?;
    let (reason, _) = joined(t, "A's lost()", watcher).await?;
    ensure!(reason != LostReason::Released, "lost() resolved Released");
    healed(&*link, ga, gb, t, "A's link").await
}

/// S4: A's replies arrive late, longer than its request timeout, so its
/// renewals time out while taking effect; then its requests stop reaching
/// the store while late replies still arrive. A reply must be matched to
/// its own request: a late answer to an old renewal taken as the answer to
/// a new one moves the deadline past the store's expiry.
pub async fn renewal_replies_late(h: &dyn Harness) -> Outcome {
    let (ctx, a, link, b, ga) = or_skip!(held(h, "renewal_replies_late", None).await?);
    let t = ctx.caps.ttl;
    let late = raw::renew_every(&a) * 3 / 2;
    link.set_all(Fault::Flows {
        to_server: Flow::Pass,
        to_client: Flow::Delay(late),
    });
    sleep(raw::renew_every(&a) * 2).await;
    link.set_all(Fault::Flows {
        to_server: Flow::Hold,
        to_client: Flow::Pass,
    });
    let held_at = Instant::now();
    let watcher = watch_lost(&ga);
    let bound = t * 4 + ctx.caps.recovery_bound;
    let (gb, _) = takes_over(&b, &ga, bound, "late replies, then requests held").await?;
    ensure!(
        ga.deadline() <= held_at + t,
        "A's deadline moved to {:?} after its requests stopped reaching the store",
        ga.deadline() - held_at
    );
    joined(t, "A's lost()", watcher).await?;
    link.heal();
    sleep(late).await;
    ensure!(!ga.is_held(), "a late reply revived a lost hold");
    drop(ga);
    gb.release().await?;
    passed()
}

/// L3, S4: A's connections go silently dead (requests hang, nothing is
/// reset) while new connections would work. Requests must time out well
/// inside the renewal period and be retried on a new connection, so the hold
/// survives and the client keeps working.
pub async fn renewal_on_dead_connection(h: &dyn Harness) -> Outcome {
    let (ctx, a, link, b, ga) = or_skip!(held(h, "renewal_on_dead_connection", None).await?);
    let t = ctx.caps.ttl;
    link.set_all(Fault::StallExisting);
    keeps_hold(&ga, &b, t * 3, "with the connection silently dead").await?;
    // The client still works: a new lock, and the held one released.
    let other = a
        .lock(ctx.name("y"))?
        .acquire_timeout(t)
        .await
        .map_err(|e| Failure(format!("acquire after the connection died: {e}")))?;
    other.release().await?;
    ga.release().await?;
    link.heal();
    passed()
}

/// Brings `a`'s acquire of `name` to the state "granted in the store, the
/// reply not delivered": another client holds the lock, `a` queues, `fault`
/// goes on `a`'s link, the holder releases, and the store records `a` as
/// holder (by its queue, or by its next take). Returns the acquire.
///
/// Where the store cannot count waiters, the setup waits a fixed settle,
/// and `a` may have had a request on the wire when the fault began: a
/// client that replaces a connection whose request went unanswered (Redis)
/// then sends nothing more, since the new connection's handshake gets no
/// reply either. Only then (the store cannot count waiters, the lock is
/// free and `a`'s acquire still waits) is the state set up again, after `a`
/// reaches the store again, at most [`SETUP_TRIES`] times, each said in a
/// `NOTE`. That is the setup's race, not the invariant's: a client that
/// never takes after the release stays red in every try.
pub(super) async fn granted_reply_undelivered(
    ctx: &Ctx<'_>,
    a: &Session,
    link: &dyn Link,
    name: &dlock_core::LockName,
    fault: Fault,
) -> Result<JoinHandle<Result<LockGuard, dlock_core::Error>>, Failure> {
    let t = ctx.caps.ttl;
    let (holder, admin) = (ctx.client().await?, ctx.admin().await?);
    let id = a.id().to_string();
    let mut tries = 0;
    loop {
        tries += 1;
        let g0 = holder
            .lock(name)?
            .acquire_timeout(t * 4 + ctx.caps.recovery_bound)
            .await?;
        let counts = admin.inspect(name).await?.and_then(|i| i.waiters).is_some();
        let lock = a.lock(name)?;
        let acquiring =
            tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(60)).await });
        super::queued(&*admin, name, 1, t / 3).await?;
        link.set_all(fault);
        g0.release().await?;
        let recorded = super::eventually(t * 4, "the store records A's grant", || async {
            Ok(admin.inspect(name).await?.is_some_and(|i| i.holder == id))
        })
        .await;
        let Err(e) = recorded else {
            return Ok(acquiring);
        };
        let raced = tries < SETUP_TRIES
            && !counts
            && !acquiring.is_finished()
            && admin.inspect(name).await?.is_none();
        if !raced {
            return Err(e);
        }
        println!(
            "NOTE {}: {name}: {e}; setting up again",
            ctx.harness.store()
        );
        acquiring.abort();
        let _ = acquiring.await;
        link.heal();
        // `a`'s connection may have been replaced under the fault (and the
        // replacement reset when the fault ended): the next try starts
        // once `a` answers again.
        let probe = ctx.name(&format!("probe-{tries}"));
        super::eventually(
            Duration::from_secs(20),
            "A reaches the store again",
            || async {
                Ok(match a.lock(&probe)?.try_acquire().await {
                    Ok(Some(g)) => g.release().await.is_ok(),
                    _ => false,
                })
            },
        )
        .await?;
    }
}

/// How many times [`granted_reply_undelivered`] sets up its state.
const SETUP_TRIES: u32 = 3;

/// S1, S5: A's take reaches the store but the reply is lost. Retried after
/// the link heals, the acquire gets the same grant (one holder, no orphan);
/// given up while the link is dark, the lock is free again within one TTL
/// plus the backend's bound.
pub async fn acquire_reply_lost(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "acquire_reply_lost");
    let (a, link) = or_skip!(linked(&ctx, None).await?);
    let (b, admin) = (ctx.client().await?, ctx.admin().await?);
    let t = ctx.caps.ttl;

    let name = ctx.name("retried");
    let acquiring = granted_reply_undelivered(&ctx, &a, &*link, &name, Fault::LOSE_REPLIES).await?;
    ensure!(
        busy(&b, &name).await?,
        "the lock was free while A's take (reply lost) was granted"
    );
    link.heal();
    let ga = joined(t * 4, "A's retried acquire", acquiring).await??;
    ensure!(
        admin.validate(&name, ga.token()).await?,
        "the store does not validate the retried grant"
    );
    let info = admin.inspect(&name).await?;
    ensure!(
        info.as_ref()
            .is_some_and(|i| i.holder == a.id().as_str() && i.token == ga.token()),
        "inspect shows {info:?}, expected A with token {}",
        ga.token()
    );
    ensure!(busy(&b, &name).await?, "lock free while held");
    let released = Instant::now();
    ga.release().await?;
    let gb = b.lock(&name)?.acquire_timeout(t).await?;
    let what = "after A's release (an orphan of the lost take?), B waited";
    prompt(&ctx, released.elapsed(), what)?;
    gb.release().await?;

    // Given up while the link is dark: no clean-up reaches the store.
    let name = ctx.name("abandoned");
    let acquiring = granted_reply_undelivered(&ctx, &a, &*link, &name, Fault::LOSE_REPLIES).await?;
    link.set_all(Fault::BLACKHOLE);
    acquiring.abort();
    let _ = acquiring.await;
    let limit = t * 3 + ctx.caps.recovery_bound;
    let what = "the orphan of an abandoned take kept the lock";
    let gb = recovered(&ctx, &b, &name, Instant::now(), limit, what).await?;
    link.heal();
    sleep(t / 2).await;
    still_held(&*admin, &gb, "after A's held requests arrived").await?;
    gb.release().await?;
    passed()
}

/// S5, L1: a take cut off in flight and delivered late grants nothing. A's
/// connections stall with their bytes kept ([`Fault::HoldExisting`]): A's
/// take waits on the wire, the core cuts it off at the request timeout and
/// retries it on a new connection, which is granted. A releases; B (another
/// attempt) takes the lock and releases it; only then does the held take
/// reach the store. It must be refused (the attempt it belongs to has ended),
/// or it grants a hold no one tracks: the lock looks free to everyone's
/// API and stays taken for a TTL (per-hold stores) or as long as A's session
/// lives (session leases). A store's memory of the *last* attempt to hold a
/// lock is not enough: B's cycle overwrote it.
pub async fn cut_take_delivered_late(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "cut_take_delivered_late");
    let (a, link) = or_skip!(linked(&ctx, None).await?);
    let (b, admin) = (ctx.client().await?, ctx.admin().await?);
    let t = ctx.caps.ttl;
    let name = ctx.name("x");
    // A's connections are open (and warm) before they stall.
    a.lock(&name)?.acquire().await?.release().await?;
    link.set_all(Fault::HoldExisting);
    let started = Instant::now();
    let ga = a
        .lock(&name)?
        .acquire_timeout(t * 4)
        .await
        .map_err(|e| Failure(format!("A's acquire with its connections stalled: {e}")))?;
    // Otherwise no take of A's was held, and the case would show nothing.
    // (Half: a store of several nodes cuts each node's request sooner.)
    ensure!(
        started.elapsed() >= raw::request_timeout(&a) / 2,
        "setup: A's acquire took {:?}, under half the request timeout: no take of it was held",
        started.elapsed()
    );
    ga.release().await?;
    b.lock(&name)?.acquire_timeout(t).await?.release().await?;
    link.heal();
    let healed = Instant::now();
    // The held bytes are delivered at once; the store answers them within
    // a few round trips. Watched for half a TTL, then taken.
    let mut info = None;
    while info.is_none() && healed.elapsed() < t / 2 {
        sleep(t / 20).await;
        info = admin.inspect(&name).await?;
    }
    if info.is_none() {
        match b.lock(&name)?.try_acquire().await? {
            Some(g) => {
                g.release().await?;
                // What refused the late take ended one attempt of A's, not
                // A's session: A's next attempt is granted.
                let again = a.lock(&name)?.try_acquire().await?;
                ensure!(
                    again.is_some(),
                    "A's next attempt found the free lock busy after A's late take was refused: \
                     the refusal must end one attempt, not A's session"
                );
                if let Some(g) = again {
                    g.release().await?;
                }
                return passed();
            }
            None => info = admin.inspect(&name).await?,
        }
    }
    let what = format!(
        "after A's release and B's cycle, A's take held on the wire and delivered late \
         granted a hold no one tracks: {info:?} (A's session {})",
        a.id()
    );
    ensure!(!ctx.caps.refuses_late_takes, "{what}");
    // Undeclared: such a hold must at least expire on its own (per-hold
    // expiry), not live with A's session.
    let limit = t * 3 + ctx.caps.recovery_bound;
    let gb = recovered(&ctx, &b, &name, healed, limit, &what)
        .await
        .map_err(|Failure(e)| Failure(format!("{what}; and then: {e}")))?;
    println!(
        "NOTE {}: {what}; it expired {:?} after the heal (refuses_late_takes not declared)",
        ctx.harness.store(),
        healed.elapsed()
    );
    gb.release().await?;
    passed()
}

/// S3: A's release takes effect but its reply is lost; B gets the lock; A's
/// retry must not free B's hold, and A's `release()` reports success.
pub async fn release_reply_lost(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "release_reply_lost");
    let (a, link) = or_skip!(linked(&ctx, None).await?);
    let (b, c, admin) = (ctx.client().await?, ctx.client().await?, ctx.admin().await?);
    let t = ctx.caps.ttl;
    let name = ctx.name("x");
    let ga = a.lock(&name)?.acquire().await?;
    let lock = b.lock(&name)?;
    let waiter = tokio::spawn(async move { lock.acquire_timeout(Duration::from_secs(60)).await });
    sleep(t / 10).await;
    link.set_all(Fault::LOSE_REPLIES);
    let releasing = tokio::spawn(ga.release());
    let gb = joined(t * 2, "B's acquire after A's release took effect", waiter).await??;
    link.heal();
    let released = joined(t * 3, "A's release", releasing).await?;
    ensure!(
        released.is_ok(),
        "A's release, which took effect, reported {released:?}"
    );
    still_held(&*admin, &gb, "after A's retried release").await?;
    ensure!(busy(&c, &name).await?, "the lock was free while B held it");
    gb.release().await?;
    passed()
}

/// S4, L1, fencing: A's link goes dark (a partition) past the TTL. A's
/// local deadline passes before B is granted (one monotonic clock), B gets
/// the lock within TTL plus the backend's bound, A's fenced write is
/// refused, and A does not believe it holds the lock when the link heals.
pub async fn holder_partitioned_past_ttl(h: &dyn Harness) -> Outcome {
    let (ctx, _, link, b, ga) = or_skip!(held(h, "holder_partitioned_past_ttl", None).await?);
    let t = ctx.caps.ttl;
    let watcher = watch_lost(&ga);
    let (gb, b_got) = partitioned(&ctx, &*link, &b, &ga, "partitioned holder").await?;
    let (_, lost_at) = joined(t, "A's lost()", watcher).await?;
    ensure!(
        lost_at <= b_got + t / 4,
        "A's lost() fired {:?} after B's grant",
        lost_at - b_got
    );
    healed(&*link, ga, gb, t, "A's partition").await
}

/// S4, L1, L4: like [`holder_partitioned_past_ttl`], but A was granted the
/// lock as a waiter, through the store's queue (on SQL, its lane keeps the
/// database's queue lock while it holds), and B queues behind it: a
/// blackholed holder's place in a queue (whose connection the server still
/// thinks alive) keeps B waiting no longer than the TTL plus the recovery
/// bound, and B's grant comes after A's local deadline.
pub async fn queued_holder_partitioned_past_ttl(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "queued_holder_partitioned_past_ttl");
    let (a, link) = match linked(&ctx, None).await? {
        Ok(pair) => pair,
        Err(verdict) => return verdict,
    };
    let t = ctx.caps.ttl;
    let (b, c) = (ctx.client().await?, ctx.client().await?);
    let admin = ctx.admin().await?;
    let name = ctx.name("x");
    let gc = c.lock(&name)?.acquire().await?;
    let lock = a.lock(&name)?;
    let waiting = tokio::spawn(async move { lock.acquire_timeout(t * 20).await });
    super::queued(&*admin, &name, 1, t / 3).await?;
    gc.release().await?;
    let ga = joined(t * 20, "A's queued acquire", waiting).await??;
    let (gb, _) = partitioned(&ctx, &*link, &b, &ga, "partitioned queued holder").await?;
    healed(&*link, ga, gb, t, "A's partition").await
}

/// L1, L2: waiters whose connections are reset while they wait (shorter
/// than the TTL) still get the lock, one after another, with no error.
pub async fn waiters_cut_while_waiting(h: &dyn Harness) -> Outcome {
    const WAITERS: usize = 3;
    let ctx = Ctx::new(h, "waiters_cut_while_waiting");
    let t = ctx.caps.ttl;
    let name = ctx.name("x");
    let a = ctx.client().await?;
    let ga = a.lock(&name)?.acquire().await?;
    let mut links = Vec::new();
    let mut waiters = Vec::new();
    for _ in 0..WAITERS {
        let (w, link) = or_skip!(linked(&ctx, None).await?);
        let lock = w.lock(&name)?;
        waiters.push(tokio::spawn(async move {
            let g = lock.acquire_timeout(Duration::from_secs(60)).await?;
            let token = g.token();
            g.release().await?;
            drop(w);
            Ok::<_, dlock_core::Error>(token)
        }));
        links.push(link);
    }
    sleep(t / 4).await;
    for link in &links {
        link.set_all(Fault::Cut);
    }
    sleep(t / 3).await;
    for link in &links {
        link.heal();
    }
    let first = ga.token();
    ga.release().await?;
    let bound = (t + raw::poll_fallback(&a) + ctx.caps.wakeup_bound) * WAITERS as u32;
    for (i, waiter) in waiters.into_iter().enumerate() {
        let token = joined(
            bound,
            &format!("waiter {i} after its connection was cut"),
            waiter,
        )
        .await?
        .map_err(|e| Failure(format!("waiter {i} failed after a cut: {e}")))?;
        ensure!(token > first, "waiter {i} got token {token} after {first}");
    }
    passed()
}

/// L3 as declared by `survives_reconnect`: a holder whose connections are
/// reset for a moment (well inside the TTL) keeps its lock; on backends that
/// do not declare it, it either keeps it or learns it lost it, and nobody
/// else holds it meanwhile.
pub async fn connection_blip(h: &dyn Harness) -> Outcome {
    let (ctx, _, link, b, ga) = or_skip!(held(h, "connection_blip", None).await?);
    let t = ctx.caps.ttl;
    for_a_while(&*link, Fault::Cut, t / 5).await;
    if ctx.caps.survives_reconnect {
        keeps_hold(&ga, &b, t * 2, "after a short reset").await?;
    } else {
        let until = Instant::now() + t * 2;
        while Instant::now() < until {
            let held = ga.is_held();
            let taken = b.lock(ga.name())?.try_acquire().await?;
            ensure!(
                !(held && taken.is_some() && ga.is_held()),
                "B took the lock while A still held it after a reset"
            );
            if let Some(g) = taken {
                g.release().await?;
            }
            sleep(t / 8).await;
        }
    }
    drop(ga);
    passed()
}

/// S1 on clusters: two clients that each cannot reach a different minority
/// of the nodes when they connect (and afterwards) never both hold a lock,
/// and each can take it when the other lets go: a majority is counted over
/// every configured node, never over the reachable ones.
pub async fn split_views_at_connect(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "split_views_at_connect");
    let link_a = or_skip!(new_link(&ctx).await?);
    let n = link_a.nodes();
    if n < 3 {
        return skipped(format!("{n} node(s): no minority to hide"));
    }
    if ctx.caps.sharded {
        return skipped("names are sharded over the hosts: no quorum of them decides");
    }
    let minority = (n - 1) / 2;
    let link_b = ctx.link().await?.ok_or_else(|| Failure(NO_LINK.into()))?;
    for i in 0..minority {
        link_a.set(i, Fault::Cut);
        link_b.set(n - 1 - i, Fault::Cut);
    }
    let a = ctx.client_over(&*link_a).await?;
    let b = ctx.client_over(&*link_b).await?;
    let t = ctx.caps.ttl;
    let name = ctx.name("x");
    for round in 0..3 {
        let ga = a.lock(&name)?.acquire_timeout(t * 4).await?;
        let taken = b.lock(&name)?.try_acquire().await?;
        ensure!(
            taken.is_none(),
            "round {round}: B took the lock A holds (A cannot see nodes 0..{minority}, B the last {minority} of {n})"
        );
        ga.release().await?;
        let gb = b.lock(&name)?.acquire_timeout(t * 4).await?;
        ensure!(
            busy(&a, &name).await?,
            "round {round}: A took the lock B holds"
        );
        gb.release().await?;
    }
    passed()
}

/// S5, L4: an acquire given up while its client's connections are refused
/// cannot clean up at once; once the link is back (well inside the TTL, so
/// the session lives on), the clean-up must be retried until it succeeds,
/// not dropped: otherwise the orphan blocks the lock for as long as the
/// session lives (stores whose queue entries live with the session).
pub async fn abandon_retried_after_cut(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "abandon_retried_after_cut");
    let per_hold = "what an attempt leaves expires on its own (per-hold expiry)";
    let (a, link) = or_skip!(linked(&ctx, Some(per_hold)).await?);
    let (holder, b, admin) = (ctx.client().await?, ctx.client().await?, ctx.admin().await?);
    let t = ctx.caps.ttl;
    let name = ctx.name("x");
    let g0 = holder.lock(&name)?.acquire().await?;
    let lock = a.lock(&name)?;
    let waiting = tokio::spawn(async move { lock.acquire().await });
    super::queued(&*admin, &name, 1, t / 3).await?;
    // B queues behind A's entry.
    let lock = b.lock(&name)?;
    let b_waiting = tokio::spawn(async move {
        let g = lock.acquire_timeout(Duration::from_secs(60)).await;
        (g, Instant::now())
    });
    super::queued(&*admin, &name, 2, t / 3).await?;
    link.set_all(Fault::Cut);
    waiting.abort();
    let _ = waiting.await;
    sleep(t / 5).await;
    link.heal();
    sleep(t / 5).await;
    let released = Instant::now();
    g0.release().await?;
    let (gb, b_got) = joined(
        t * 4 + ctx.caps.recovery_bound,
        "B behind the abandoned entry",
        b_waiting,
    )
    .await?;
    let gb = gb?;
    let what = "the abandoned entry's clean-up was not retried: after the release, B waited";
    prompt(&ctx, b_got - released, what)?;
    ensure!(
        a.is_alive(),
        "A's session died although its link was cut for TTL/5 only"
    );
    gb.release().await?;
    passed()
}

/// L5: `acquire_timeout(d)` returns `Timeout` within `d` plus a round trip
/// even when its requests hang (a partition): the deadline cuts requests in
/// flight; it does not wait out the request timeout.
pub async fn acquire_timeout_under_partition(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "acquire_timeout_under_partition");
    let (a, link) = or_skip!(linked(&ctx, None).await?);
    let t = ctx.caps.ttl;
    link.set_all(Fault::BLACKHOLE);
    for wait in [t / 10, t / 3] {
        let start = Instant::now();
        let r = a.lock(ctx.name("x"))?.acquire_timeout(wait).await;
        let took = start.elapsed();
        ensure!(
            matches!(r, Err(dlock_core::Error::Timeout { cause: Some(_), .. })),
            "acquire_timeout({wait:?}) through a partition gave {r:?}, expected Timeout naming the silent store"
        );
        ensure!(
            took <= wait + ctx.caps.wakeup_bound,
            "acquire_timeout({wait:?}) through a partition returned after {took:?}"
        );
    }
    link.heal();
    passed()
}

/// L5, S5: a waiting acquire whose session is lost (its renewals could not
/// reach the store for longer than the TTL) ends with `SessionLost` as soon
/// as the session is known lost, not at its next fallback poll. Where the
/// store keeps no session of its own (Redis: a session is its held keys), the
/// session survives the partition, and the waiter must then get the lock
/// once it is free.
pub async fn waiter_learns_session_lost(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "waiter_learns_session_lost");
    let link = or_skip!(new_link(&ctx).await?);
    let t = ctx.caps.ttl;
    let backend = h.connect_over(&*link).await?;
    // A fallback poll far longer than the test: only the session's end (or a
    // release) can end the wait.
    let a = backend
        .session(ctx.options().poll_fallback(Duration::from_secs(120)))
        .await?;
    // A holder with a long TTL: the store's expiry hint cannot wake the
    // waiter either.
    let holder = h.connect().await?;
    let long = Duration::from_secs(30).min(holder.max_ttl()).max(t);
    let holder = holder.session(ctx.options().ttl(long)).await?;
    let name = ctx.name("x");
    let g0 = holder.lock(&name)?.acquire().await?;
    let lock = a.lock(&name)?;
    let waiting = tokio::spawn(async move {
        let r = lock.acquire_timeout(Duration::from_secs(100)).await;
        (r, Instant::now())
    });
    sleep(t / 4).await;
    link.set_all(Fault::BLACKHOLE);
    sleep(t * 2 + ctx.caps.recovery_bound).await;
    link.heal();
    // One renewal round (and its retries) tells the session its fate.
    let settled = raw::renew_every(&a) * 2 + raw::renew_every(&a) / 2;
    let ended = within(settled, "", async {
        loop {
            if !a.is_alive() || waiting.is_finished() {
                return;
            }
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    if ended.is_ok() && !a.is_alive() {
        // The store dropped the session: the waiter ends at once.
        let lost_at = Instant::now();
        let (r, at) = joined(
            ctx.caps.wakeup_bound + t / 4,
            "the waiter of a lost session",
            waiting,
        )
        .await?;
        ensure!(
            matches!(r, Err(dlock_core::Error::SessionLost { .. })),
            "the waiter of a lost session gave {r:?}"
        );
        ensure!(
            at.saturating_duration_since(lost_at) <= ctx.caps.wakeup_bound + t / 4,
            "the waiter ended {:?} after its session was lost",
            at.saturating_duration_since(lost_at)
        );
        g0.release().await?;
    } else {
        // The session lived through the partition: the waiter still waits,
        // and gets the lock once it is free.
        ensure!(
            !waiting.is_finished(),
            "the waiter of a live session gave up"
        );
        g0.release().await?;
        let (r, _) = joined(
            t * 2 + ctx.caps.wakeup_bound,
            "the waiter after the release",
            waiting,
        )
        .await?;
        let g = r.map_err(|e| Failure(format!("the waiter of a live session failed: {e}")))?;
        g.release().await?;
    }
    passed()
}

/// S4, "counted from when it was *sent*": A's replies arrive late, though
/// within its request timeout, so they are accepted; then A is cut off. A
/// client that counted a grant's or a renewal's validity from the reply
/// would keep believing in the lock after the store freed it.
///
/// A's request timeout is the longest the core allows (just under the
/// renewal period) and each reply is late by the drift margin plus a
/// quarter of the rest: late enough that counting from the reply would
/// overshoot by tens of milliseconds, early enough that an operation of up
/// to three round trips (a Redlock take with its token write-back, an etcd
/// keep-alive and its read, a reconnect's handshake) still fits.
pub async fn replies_late_but_in_time(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "replies_late_but_in_time");
    let b = ctx.client().await?;
    // The renewal period in effect: a backend may run a session with less
    // than the TTL asked for (ZooKeeper subtracts the leader's report lag).
    let renew = raw::renew_every(&b);
    let options = ctx.options().request_timeout(renew * 9 / 10);
    let drift = options.drift_or_default();
    let request_timeout = options.request_timeout_or_default();
    let late = Fault::Flows {
        to_server: Flow::Pass,
        to_client: Flow::Delay(drift + (request_timeout - drift) / 4),
    };
    for renewals in [false, true] {
        let link = or_skip!(new_link(&ctx).await?);
        let a = h
            .connect_over(&*link)
            .await?
            .session(options.clone())
            .await?;
        let t = a.ttl();
        let name = ctx.name(if renewals { "renewed" } else { "granted" });
        if !renewals {
            link.set_all(late);
        }
        let ga = a.lock(&name)?.acquire().await?;
        if renewals {
            link.set_all(late);
            sleep(raw::renew_every(&a) * 3).await;
            ensure!(ga.is_held(), "late but accepted renewals lost the lock");
        }
        link.set_all(Fault::BLACKHOLE);
        let what = if renewals {
            "renewals confirmed late"
        } else {
            "a grant confirmed late"
        };
        let (gb, _) = takes_over(&b, &ga, t * 4 + ctx.caps.recovery_bound, what).await?;
        drop(ga);
        gb.release().await?;
        link.heal();
    }
    passed()
}

/// S5, L1 on stores whose holds live with the session (item 13, found by the
/// adversarial review): a `release()` that fails because A's connections are
/// refused until it gives up (at the hold's local deadline) must go on in
/// the background once they are back. Otherwise the hold, no longer renewed
/// by name but kept by A's live session lease, blocks the lock for as long
/// as A's session lives.
pub async fn release_retried_after_cut(h: &dyn Harness) -> Outcome {
    let per_hold = "an unreleased hold expires on its own (per-hold expiry)";
    let (ctx, a, link, b, ga) =
        or_skip!(held(h, "release_retried_after_cut", Some(per_hold)).await?);
    let (t, name) = (a.ttl(), ga.name().clone());
    link.set_all(Fault::Cut);
    let released = within(t * 2, "A's release under a cut", ga.release()).await?;
    link.heal();
    if released.is_ok() {
        return skipped("the release got through the cut (nothing to retry)");
    }
    let gb = clean_up_retried(&ctx, &a, &b, &name, "the failed release").await?;
    gb.release().await?;
    passed()
}

/// S5, L1 on stores whose holds live with the session (item 13): a hold lost
/// locally while the store still has it (A's renewals took effect, their
/// replies were lost) is released in the background; when that release
/// fails (A's connections are refused for a moment), it is retried, so the
/// lock does not stay taken for as long as A's session lives.
pub async fn lost_hold_release_retried(h: &dyn Harness) -> Outcome {
    let per_hold = "a lost hold expires on its own (per-hold expiry)";
    let (ctx, a, link, b, ga) =
        or_skip!(held(h, "lost_hold_release_retried", Some(per_hold)).await?);
    let t = a.ttl();
    link.set_all(Fault::LOSE_REPLIES);
    // Just before A's local deadline, its connections are refused: the
    // release of the lost hold fails.
    let cut_at = ga.deadline() - t / 10;
    tokio::time::sleep_until(cut_at).await;
    link.set_all(Fault::Cut);
    within(t, "A's lost()", ga.lost()).await?;
    sleep(t / 6).await;
    link.heal();
    let gb = clean_up_retried(&ctx, &a, &b, ga.name(), "the lost hold's release").await?;
    drop(ga);
    gb.release().await?;
    passed()
}
