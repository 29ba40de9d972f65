//! Phase 6: many locks held by one session. The renewal task extends every
//! hold of a session once per period, so what matters is what one renewal
//! round of all of them costs next to a round of one hold (O(1) round trips
//! keep it close to 1×), and how much client memory each held lock takes.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::raw;
use dlocks::{LockGuard, SessionOptions};
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};

use super::phases::Target;
use super::stats::{self, Latency};
use crate::exit::Failure;

/// Acquisitions (and releases) in flight at once.
const IN_FLIGHT: usize = 64;

/// Renewal rounds timed, of all the holds and of one.
const ROUNDS: usize = 7;

/// How long acquiring or releasing all the holds may take.
const PHASE_LIMIT: Duration = Duration::from_secs(300);

/// Phase 6's figures for one backend.
#[derive(Debug, Default, Serialize)]
pub(crate) struct ManyHolds {
    /// Locks the session held.
    pub(crate) holds: usize,
    /// How long acquiring them took ([`IN_FLIGHT`] at a time).
    pub(crate) acquire_s: f64,
    /// One renewal round (`RawSession::renew`, as the renewal task sends it)
    /// of one hold.
    pub(crate) renew_one: Option<Latency>,
    /// One renewal round of all of them.
    pub(crate) renew_all: Option<Latency>,
    /// `renew_all` ÷ `renew_one` at p50.
    pub(crate) renew_all_x_one: Option<f64>,
    /// The process's live heap growth while the locks were held, per lock
    /// (the client side: guards, the session's tenure, the adapter's).
    pub(crate) heap_bytes_per_hold: Option<f64>,
    /// What went wrong, if the phase could not finish.
    pub(crate) error: Option<String>,
}

/// Holds `n` locks on one new session of `t`'s first client's backend (TTL
/// `ttl`), times renewal rounds, then releases them and closes the session.
pub(crate) async fn many_holds(
    t: &Target,
    n: usize,
    ttl: Duration,
    bar: &ProgressBar,
) -> Result<ManyHolds, Failure> {
    let options = SessionOptions::new().ttl(ttl).label("dlock-bench-holds");
    let session = t.backend().session(options).await?;
    let mut out = ManyHolds::default();
    let before = crate::heap_bytes();
    let start = Instant::now();
    let (guards, error) = acquire_all(t, &session, n, bar).await?;
    out.acquire_s = start.elapsed().as_secs_f64();
    out.holds = guards.len();
    if !guards.is_empty() {
        let grown = (crate::heap_bytes() - before).max(0);
        out.heap_bytes_per_hold = Some(grown as f64 / guards.len() as f64);
    }
    out.error = error;
    if out.error.is_none() && !guards.is_empty() {
        let holds: Vec<_> = guards.iter().map(|g| raw::hold(g).clone()).collect();
        let store = raw::session(&session);
        let (mut one, mut all) = (stats::histogram(), stats::histogram());
        for _ in 0..ROUNDS {
            for (h, listed) in [(&mut one, &holds[..1]), (&mut all, &holds[..])] {
                let sent = Instant::now();
                match timeout(PHASE_LIMIT, store.renew(listed)).await {
                    Ok(Ok(_)) => stats::record(h, sent.elapsed()),
                    Ok(Err(e)) => out.error = Some(format!("renewal: {e}")),
                    Err(_) => out.error = Some("renewal: timed out".to_owned()),
                }
            }
        }
        out.renew_one = Latency::of(&one);
        out.renew_all = Latency::of(&all);
        out.renew_all_x_one = match (out.renew_all, out.renew_one) {
            (Some(a), Some(o)) if o.p50_us > 0.0 => Some(a.p50_us / o.p50_us),
            _ => None,
        };
    }
    release_all(guards).await;
    let _ = timeout(PHASE_LIMIT, session.close()).await;
    Ok(out)
}

/// Acquires `<prefix>/holds/<i>` for `i < n`, [`IN_FLIGHT`] at a time; the
/// guards got, and the first error if one stopped it.
async fn acquire_all(
    t: &Target,
    session: &dlocks::Session,
    n: usize,
    bar: &ProgressBar,
) -> Result<(Vec<LockGuard>, Option<String>), Failure> {
    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = JoinSet::new();
    for i in 0..n {
        let lock = session.lock(t.lock_name(&format!("holds/{i}"))?)?;
        let permit = gate.clone().acquire_owned().await.expect("never closed");
        tasks.spawn(async move {
            let _permit = permit;
            timeout(PHASE_LIMIT, lock.acquire_timeout(PHASE_LIMIT)).await
        });
        bar.set_position(i as u64);
    }
    let mut guards = Vec::with_capacity(n);
    let mut error = None;
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(Ok(guard))) => guards.push(guard),
            Ok(Ok(Err(e))) => {
                error.get_or_insert_with(|| e.to_string());
            }
            Ok(Err(_)) => {
                error.get_or_insert_with(|| "an acquire timed out".to_owned());
            }
            Err(e) => {
                error.get_or_insert_with(|| format!("an acquire task failed: {e}"));
            }
        }
    }
    Ok((guards, error))
}

/// Releases `guards`, [`IN_FLIGHT`] at a time (errors ignored: the session
/// is closed next).
async fn release_all(guards: Vec<LockGuard>) {
    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut tasks = JoinSet::new();
    for guard in guards {
        let permit = gate.clone().acquire_owned().await.expect("never closed");
        tasks.spawn(async move {
            let _permit = permit;
            let _ = timeout(PHASE_LIMIT, guard.release()).await;
        });
    }
    while tasks.join_next().await.is_some() {}
}
