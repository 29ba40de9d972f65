//! Phase 8: the coordination primitives written on the locks. A counting
//! semaphore of half as many permits as clients, all clients taking and
//! giving back permits for the phase's duration (grants per second, and the
//! most permits held at once, which must never exceed the count); and
//! planned leader failovers: a leader resigns while another candidate
//! campaigns, timed from the resignation's call to the new leader's grant.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use indicatif::ProgressBar;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};

use super::phases::Target;
use super::stats::{self, Latency};
use crate::exit::{FAILURE, Failure};

/// The longest one acquire, campaign or release may take.
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Phase 8's figures for one backend.
#[derive(Debug, Serialize)]
pub(crate) struct Primitives {
    /// The semaphore's permits.
    pub(crate) permits: usize,
    /// Permits granted per second, over all clients.
    pub(crate) permit_grants_per_s: f64,
    /// The most permits held at once (clients' count, grant to release):
    /// never above `permits`.
    pub(crate) most_held: usize,
    /// Planned failovers: a leader's `resign()` call to the standby's
    /// grant (`None` with fewer than two clients, or none asked for).
    pub(crate) failover: Option<Latency>,
    /// The first failure, which ended the phase on this backend.
    pub(crate) error: Option<String>,
}

impl Primitives {
    /// Whether the semaphore held no more permits than it has.
    pub(crate) fn ok(&self) -> bool {
        self.most_held <= self.permits
    }
}

/// Phase 8 on `t`: the semaphore for `duration`, then `failovers` planned
/// failovers between the first two clients. The bar counts milliseconds of
/// the semaphore part.
pub(crate) async fn primitives(
    t: &Target,
    duration: Duration,
    failovers: u64,
    bar: &ProgressBar,
) -> Result<Primitives, Failure> {
    let permits = (t.clients() / 2).max(1);
    let mut out = Primitives {
        permits,
        permit_grants_per_s: 0.0,
        most_held: 0,
        failover: None,
        error: None,
    };
    if let Err(e) = semaphore(t, duration, bar, &mut out).await {
        out.error = Some(e);
        return Ok(out);
    }
    if t.clients() >= 2 && failovers > 0 {
        match failover(t, failovers).await {
            Ok(latency) => out.failover = latency,
            Err(e) => out.error = Some(e),
        }
    }
    Ok(out)
}

/// Every client takes a permit, holds it a moment and gives it back, until
/// `duration` is over.
async fn semaphore(
    t: &Target,
    duration: Duration,
    bar: &ProgressBar,
    out: &mut Primitives,
) -> Result<(), String> {
    let name = t.lock_name("semaphore").map_err(|e| e.to_string())?;
    let (held, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = JoinSet::new();
    for i in 0..t.clients() {
        let pool = t
            .session(i)
            .semaphore(&name, out.permits)
            .map_err(|e| e.to_string())?;
        let (held, most) = (held.clone(), most.clone());
        tasks.spawn(async move {
            let mut grants = 0u64;
            while Instant::now() < deadline {
                let permit = pool.acquire_timeout(OP_TIMEOUT).await?;
                let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                grants += 1;
                tokio::task::yield_now().await;
                held.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, dlocks::Error>(grants)
        });
    }
    let ticker = async {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            bar.set_position(super::phases::millis(start.elapsed()));
        }
    };
    let joined = async {
        let mut grants = 0;
        while let Some(done) = tasks.join_next().await {
            grants += done
                .map_err(|e| format!("a semaphore client failed: {e}"))?
                .map_err(|e| format!("a semaphore client: {e}"))?;
        }
        Ok::<_, String>(grants)
    };
    let grants = tokio::select! {
        grants = joined => grants?,
        () = ticker => unreachable!("the ticker never ends"),
    };
    out.permit_grants_per_s = grants as f64 / start.elapsed().as_secs_f64();
    out.most_held = most.load(Ordering::SeqCst);
    Ok(())
}

/// `rounds` planned failovers between the first two clients, alternating
/// who leads: the standby campaigns, the leader resigns, and the time from
/// the resignation's call to the standby's grant is recorded.
async fn failover(t: &Target, rounds: u64) -> Result<Option<Latency>, String> {
    let name = t.lock_name("election").map_err(|e| e.to_string())?;
    let candidates = [
        t.session(0).election(&name).map_err(|e| e.to_string())?,
        t.session(1).election(&name).map_err(|e| e.to_string())?,
    ];
    let mut samples = stats::histogram();
    let mut leading = bounded("campaigning", candidates[0].campaign()).await?;
    for round in 0..rounds {
        let standby = candidates[usize::from(round % 2 == 0)].clone();
        let campaign = tokio::spawn(async move {
            let led = timeout(OP_TIMEOUT, standby.campaign()).await;
            (led, Instant::now())
        });
        // Let the standby's campaign reach the store (it waits in line).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let resigned = Instant::now();
        bounded("resigning", leading.resign()).await?;
        let (led, at) = campaign
            .await
            .map_err(|e| format!("a campaign failed: {e}"))?;
        leading = led
            .map_err(|_| format!("no new leader within {OP_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        stats::record(&mut samples, at.duration_since(resigned));
    }
    bounded("resigning", leading.resign()).await?;
    Ok(Latency::of(&samples))
}

/// `fut` within [`OP_TIMEOUT`], its error as text.
async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, dlocks::Error>>,
) -> Result<T, String> {
    match timeout(OP_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {OP_TIMEOUT:?}")),
    }
}

/// Fails the run when a semaphore held more permits than it has.
pub(crate) fn check(label: &str, p: &Primitives) -> Result<(), Failure> {
    if p.ok() {
        return Ok(());
    }
    Err(Failure::new(
        FAILURE,
        format!(
            "{label}: the semaphore held {} of {} permits at once",
            p.most_held, p.permits
        ),
    ))
}
