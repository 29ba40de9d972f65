//! The renewal task: one per session, one round trip per period for all holds
//! (more where a round is cut off before it is answered).
//!
//! Invariants: L3 (a healthy session keeps its locks for many TTLs) and S4 (a
//! hold's local deadline only moves forward on a renewal confirmed by the
//! store, counted from when the renewal was *sent*; when it passes, `lost()`
//! fires even if the store cannot be reached).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, timeout};
use tracing::Instrument;

use crate::backend::{RenewalReport, Renewed};
use crate::clock::{self, sleep_until};
use crate::error::Error;
use crate::lost::LostReason;
use crate::state::{SessionState, Stats};
use crate::telemetry;

/// A renewal period whose rounds have not confirmed every hold yet.
struct Sweep {
    /// When the period's first round was sent.
    started: Instant,
    /// The tenures its rounds confirmed: a retry sends every other one,
    /// also those granted since the period began (on a session lease, a
    /// grant's deadline is the lease's when it was granted).
    confirmed: HashSet<u64>,
}

/// Renews `state` every period until it shuts down; expires overdue holds
/// locally in between.
///
/// A period renews every hold, the nearest deadline first. A round that
/// leaves some holds unanswered (cut off at the request timeout, a server
/// that did not answer) keeps what it confirmed ([`RenewalReport`]), and
/// the period's retries send every hold it has not confirmed (at once if
/// the round confirmed some, so the store is up), until the period ends and
/// the next one renews every hold again: on a store that renews in many
/// requests (NATS, Redis), a session whose holds take more than one request
/// timeout to renew still keeps them all (L3), and no hold waits behind the
/// others' retries for longer than a period.
pub(crate) async fn run(state: Arc<SessionState>) {
    let timing = state.timing;
    let retry_every = (timing.renew_every / 4).max(Duration::from_millis(5));
    let mut next = clock::now() + timing.renew_every;
    let mut sweep: Option<Sweep> = None;
    loop {
        let wake = state
            .earliest_deadline()
            .map_or(next, |deadline| deadline.min(next));
        tokio::select! {
            _ = state.shutdown.cancelled() => return,
            _ = sleep_until(wake) => {}
        }
        state.expire_overdue();
        if clock::now() < next {
            continue;
        }
        let (started, mut confirmed) = match sweep.take() {
            Some(s) if clock::now() < s.started + timing.renew_every => (s.started, s.confirmed),
            _ => (clock::now(), HashSet::new()),
        };
        let mut tenures = state.tenures();
        tenures.retain(|t| !confirmed.contains(&t.id));
        tenures.sort_by_key(|t| t.deadline());
        let request: Vec<_> = tenures.iter().map(|t| t.hold.clone()).collect();
        let report = RenewalReport::new(request.len());
        let sent = clock::now();
        let span = tracing::debug_span!("dlock.renew", backend = state.scheme, session = %state.id(), holds = request.len());
        let result = tokio::select! {
            _ = state.shutdown.cancelled() => return,
            r = timeout(timing.request_timeout, state.raw.renew_into(&request, &report)).instrument(span) => r,
        };
        if let Ok(Err(Error::SessionLost { .. })) = result {
            telemetry::renewal_failed(state.scheme);
            Stats::bump(&state.stats.renewal_failures);
            state.mark_lost();
            return;
        }
        // What the store confirmed stands, whatever became of the rest.
        let landed = clock::now();
        let until = timing.valid_until(sent);
        let answers = report.answers();
        let answered = answers.iter().filter(|r| **r != Renewed::Unknown).count();
        for (tenure, renewed) in tenures.into_iter().zip(answers) {
            if tenure.reason().is_some() {
                continue; // released or lost meanwhile
            }
            match renewed {
                Renewed::Lost => state.lose(&tenure, LostReason::Revoked),
                Renewed::Held => {
                    if tenure.extend(until) {
                        confirmed.insert(tenure.id);
                    } else {
                        state.lose(&tenure, LostReason::Expired);
                    }
                }
                // Its deadline stays; tried again first.
                _ => {}
            }
        }
        let unknown = request.len() - answered;
        match result {
            Ok(Ok(())) if answered == request.len() => {
                Stats::bump(&state.stats.renewals);
                let lag = state
                    .earliest_deadline()
                    .map(|deadline| deadline.saturating_duration_since(landed));
                telemetry::renewed(state.scheme, landed - sent, lag);
                state.extend_session(until);
                tracing::trace!(session = %state.id(), holds = request.len(), "renewed");
                next = started + timing.renew_every;
                continue;
            }
            Ok(Ok(())) => {
                tracing::warn!(session = %state.id(), unknown, holds = request.len(), "renewal not answered for some holds; retrying them");
            }
            Ok(Err(e)) => {
                tracing::warn!(session = %state.id(), error = %e, answered, unknown, "renewal failed; retrying the holds it did not renew");
            }
            Err(_) => {
                tracing::warn!(session = %state.id(), timeout = ?timing.request_timeout, answered, unknown, "renewal timed out; retrying the holds it did not renew");
            }
        }
        telemetry::renewal_failed(state.scheme);
        Stats::bump(&state.stats.renewal_failures);
        sweep = Some(Sweep { started, confirmed });
        // (a store that answered part of the round is up: the rest goes at
        // once; one that answered nothing is given time)
        next = if answered > 0 {
            clock::now()
        } else {
            clock::now() + retry_every
        };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;

    use crate::backend::{Claim, ExpiryModel, Hold, RawSession, Renewed};
    use crate::memory::MemoryBackend;
    use crate::{Error, LockName, SessionId, SessionOptions};

    /// A memory backend whose renewals answer for the first `answered`
    /// holds of a round only, the rest unknown: a store that renews in many
    /// requests and whose round ran out of time (a Redis Cluster's late
    /// slots, NATS's last writes).
    #[derive(Debug)]
    struct Partial {
        inner: MemoryBackend,
        answered: usize,
    }

    crate::forward_backend! {
        impl Backend for Partial => inner;
        forward: scheme, min_ttl, max_ttl, capabilities, wait_ready, inspect, list, validate,
            force_release;

        async fn open(
            &self,
            id: SessionId,
            options: &SessionOptions,
        ) -> Result<Arc<dyn RawSession>, Error> {
            let inner = self.inner.open(id, options).await?;
            Ok(Arc::new(PartialSession { inner, answered: self.answered }))
        }
    }

    #[derive(Debug)]
    struct PartialSession {
        inner: Arc<dyn RawSession>,
        answered: usize,
    }

    #[async_trait]
    impl RawSession for PartialSession {
        fn ttl(&self) -> Duration {
            self.inner.ttl()
        }

        fn expiry(&self) -> ExpiryModel {
            self.inner.expiry()
        }

        async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
            self.inner.claim(name, why).await
        }

        async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
            self.inner.renew(holds).await
        }

        async fn renew_each(&self, holds: &[Hold]) -> Result<Vec<Renewed>, Error> {
            let sent = &holds[..self.answered.min(holds.len())];
            let mut answers: Vec<Renewed> = self
                .inner
                .renew(sent)
                .await?
                .into_iter()
                .map(Renewed::from)
                .collect();
            answers.resize(holds.len(), Renewed::Unknown);
            Ok(answers)
        }

        async fn release(&self, hold: &Hold) -> Result<(), Error> {
            self.inner.release(hold).await
        }

        async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
            self.inner.close(holds).await
        }
    }

    /// L3: a round that answers for part of the holds keeps them, and the
    /// period's retries renew the rest, so no hold is lost while every
    /// round answers for some. Here each round answers for 10 of 40 holds,
    /// for three TTLs. Red before the retries sent only what the last round
    /// left unanswered: the same 30 holds went unanswered in every round
    /// and were lost one TTL in.
    #[tokio::test]
    async fn holds_a_round_leaves_unanswered_are_renewed_by_its_retries() {
        let backend = Partial {
            inner: MemoryBackend::new(),
            answered: 10,
        };
        let ttl = Duration::from_millis(600);
        // (the trait's path: `forward_backend!` imports it in each method)
        let session = crate::Backend::session(&backend, SessionOptions::new().ttl(ttl))
            .await
            .unwrap();
        let mut guards = Vec::new();
        for i in 0..40 {
            guards.push(
                session
                    .lock(format!("n{i}"))
                    .unwrap()
                    .acquire()
                    .await
                    .unwrap(),
            );
        }
        tokio::time::sleep(ttl * 3).await;
        let lost = guards.iter().filter(|g| !g.is_held()).count();
        let stats = session.stats();
        assert_eq!(lost, 0, "{lost} of 40 holds lost: {stats:?}");
        assert!(stats.renewals >= 3, "{stats:?}");
        assert!(stats.renewal_failures >= 9, "{stats:?}");
        for g in guards {
            g.release().await.unwrap();
        }
        session.close().await.unwrap();
    }
}
