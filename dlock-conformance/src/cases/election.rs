//! Leader election (`Session::election`, issue 17 item 1): written once in
//! the core on each store's locks, proved here on every store. S7 for
//! elections: never two leaders at once, and a later term is larger.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::FenceGate;
use dlock_core::election::{self, LeaderWatch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{ensure, eventually, increased, joined, passed, within};
use crate::checker::{FencedRegister, History, Op, Phase};
use crate::{Ctx, Failure, Harness, Outcome};

/// S7, S2: candidates campaign for one election, lead a moment and resign,
/// round after round. Leaderships never overlap and terms follow the order
/// of the terms' starts (fenced register and history check), and while a
/// candidate leads, an observer that does not campaign (`election::leader`)
/// sees its term and what it proclaimed.
pub async fn election_one_leader_per_term(h: &dyn Harness) -> Outcome {
    const CANDIDATES: usize = 4;
    const ROUNDS: usize = 6;
    let ctx = Ctx::new(h, "election_one_leader_per_term");
    let name = ctx.name("leader");
    let (register, history) = (Arc::new(FencedRegister::new()), Arc::new(History::new()));
    let wait = (ctx.caps.ttl * 20).max(Duration::from_secs(60));
    let ttl = ctx.caps.ttl;
    let admin = ctx.admin().await?;
    let mut tasks = JoinSet::new();
    for client in 0..CANDIDATES {
        let session = ctx.client().await?;
        let (name, register, history, admin) = (
            name.clone(),
            register.clone(),
            history.clone(),
            admin.clone(),
        );
        tasks.spawn(async move {
            let me = format!("candidate-{client}");
            let candidate = session.election(&name)?.proclaim(me.clone());
            for _ in 0..ROUNDS {
                history.record(client, Op::Acquire, Phase::Invoke, None);
                let led = candidate
                    .campaign_timeout(wait)
                    .await
                    .map_err(|e| Failure(format!("{me} campaigned {wait:?} in vain: {e}")))?;
                let term = led.term();
                history.record(client, Op::Acquire, Phase::Ok, Some(term));
                register.write(client, term);
                // (a replica the observer reads may lag a moment behind)
                let mine = |seen: &Option<election::Leader>| {
                    seen.as_ref()
                        .is_some_and(|l| l.term == term && l.value.as_deref() == Some(&me))
                };
                let deadline = tokio::time::Instant::now() + ttl;
                let mut seen = election::leader(&*admin, &name).await?;
                while !mine(&seen) && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    seen = election::leader(&*admin, &name).await?;
                }
                ensure!(
                    mine(&seen),
                    "{me} leads term {term}; an observer sees {seen:?}"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
                ensure!(led.is_leader(), "{me} lost term {term} while leading");
                register.write(client, term);
                history.record(client, Op::Release, Phase::Invoke, None);
                led.resign().await?;
                history.record(client, Op::Release, Phase::Ok, None);
            }
            session.close().await?;
            Ok::<_, Failure>(())
        });
    }
    super::join_all(tasks, "candidate task").await?;
    register.check()?;
    let terms = history.check()?.holds;
    ensure!(
        terms == CANDIDATES * ROUNDS,
        "expected {} terms, the history has {terms}",
        CANDIDATES * ROUNDS
    );
    eventually(
        ctx.caps.ttl,
        "an observer to see no leader after every candidate resigned",
        || {
            let (admin, name) = (admin.clone(), name.clone());
            async move { Ok(election::leader(&*admin, &name).await?.is_none()) }
        },
    )
    .await?;
    passed()
}

/// S7, L1, fencing: the leader crashes while a second candidate campaigns.
/// The second candidate leads within a TTL plus the recovery bound, in a
/// larger term; an observer's `LeaderWatch` reports that term;
/// and the resource refuses the deposed leader's term after the new one
/// wrote.
pub async fn election_failover(h: &dyn Harness) -> Outcome {
    let ctx = Ctx::new(h, "election_failover");
    let (t, bound) = (ctx.caps.ttl, ctx.caps.recovery_bound);
    let name = ctx.name("leader");
    let (a, faults) = ctx.faulty_client().await?;
    let b = ctx.client().await?;
    let admin = ctx.admin().await?;
    let mut watch = LeaderWatch::new(admin.clone(), &name, Duration::from_millis(20))?;
    ensure!(
        watch.changed().await?.is_none(),
        "an observer sees a leader before anyone campaigned"
    );
    let first = a.election(&name)?.proclaim("a").campaign().await?;
    let old = first.term();
    let seen = within(t, "the watch to see the first leader", watch.changed()).await??;
    ensure!(
        seen.as_ref().map(|l| l.term) == Some(old),
        "the observer sees {seen:?} while term {old} leads"
    );
    let gate = FenceGate::new();
    gate.check(old)
        .map_err(|e| Failure(format!("the first leader's write: {e}")))?;
    // B stands by, campaigning, before A goes.
    let standby = tokio::spawn({
        let candidate = b.election(&name)?.proclaim("b");
        let limit = t * 2 + bound;
        async move {
            let led = candidate.campaign_timeout(limit).await;
            (led, Instant::now())
        }
    });
    faults.crash();
    let crashed = Instant::now();
    // Gone with its process: a crashed client's session object does not
    // keep talking to the store (ZooKeeper's driver would ping on). (S4, the
    // crashed leader deposed by its deadline before another leads, is the
    // lock's: `lost_signal_by_local_deadline`, `pause_scenario`.)
    drop(first);
    drop(a);
    let (led, b_got) = joined(t * 3 + bound, "the standby's campaign", standby).await?;
    let next = led.map_err(|e| Failure(format!("the standby never led: {e}")))?;
    let took = b_got.duration_since(crashed);
    ensure!(
        took <= t + bound,
        "the standby led only {took:?} after the leader crashed (bound {:?})",
        t + bound
    );
    increased(
        next.term(),
        old,
        " (the standby's term after the crashed leader's)",
    )?;
    // The observer follows: its next change is the new term.
    let seen = within(t * 2, "the watch to see the new leader", async {
        loop {
            match watch.changed().await {
                // (the old term may show until the store expires it)
                Ok(Some(l)) if l.term == old => continue,
                Ok(None) => continue,
                other => return other,
            }
        }
    })
    .await??;
    ensure!(
        seen.as_ref().map(|l| (l.term, l.value.as_deref())) == Some((next.term(), Some("b"))),
        "after the failover the observer sees {seen:?}, not term {} of b",
        next.term()
    );
    gate.check(next.term())
        .map_err(|e| Failure(format!("the new leader's write: {e}")))?;
    ensure!(
        gate.check(old).is_err(),
        "the resource took the deposed leader's term {old} after term {}",
        next.term()
    );
    next.resign().await?;
    eventually(
        t,
        "the election to have no leader after the resignation",
        || {
            let (admin, name) = (admin.clone(), name.clone());
            async move { Ok(election::leader(&*admin, &name).await?.is_none()) }
        },
    )
    .await?;
    passed()
}
