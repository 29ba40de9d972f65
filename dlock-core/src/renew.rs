//! The renewal task: one per session, one round trip per period for all holds.
//!
//! Invariants: L3 (a healthy session keeps its locks for many TTLs) and S4 (a
//! hold's local deadline only moves forward on a renewal confirmed by the
//! store, counted from when the renewal was *sent*; when it passes, `lost()`
//! fires even if the store cannot be reached).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;
use tracing::Instrument;

use crate::backend::Renewed;
use crate::clock::{self, sleep_until};
use crate::error::Error;
use crate::lost::LostReason;
use crate::state::{SessionState, Stats};
use crate::telemetry;

/// Renews `state` every period until it shuts down; expires overdue holds
/// locally in between.
pub(crate) async fn run(state: Arc<SessionState>) {
    let timing = state.timing;
    let retry_every = (timing.renew_every / 4).max(Duration::from_millis(5));
    let mut next = clock::now() + timing.renew_every;
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
        let tenures = state.tenures();
        let request: Vec<_> = tenures.iter().map(|t| t.hold.clone()).collect();
        let sent = clock::now();
        let span = tracing::debug_span!("dlock.renew", backend = state.scheme, session = %state.id(), holds = request.len());
        let result = tokio::select! {
            _ = state.shutdown.cancelled() => return,
            r = timeout(timing.request_timeout, state.raw.renew_each(&request)).instrument(span) => r,
        };
        // (a round that left some holds unknown counts as a failed one)
        let complete = matches!(result, Ok(Ok(ref still_held))
            if still_held.len() == tenures.len() && !still_held.contains(&Renewed::Unknown));
        if !complete {
            telemetry::renewal_failed(state.scheme);
        }
        match result {
            Ok(Ok(still_held)) if still_held.len() == tenures.len() => {
                let landed = clock::now();
                let until = timing.valid_until(sent);
                let unknown = still_held
                    .iter()
                    .filter(|r| **r == Renewed::Unknown)
                    .count();
                if unknown == 0 {
                    Stats::bump(&state.stats.renewals);
                    let lag = state
                        .earliest_deadline()
                        .map(|deadline| deadline.saturating_duration_since(landed));
                    telemetry::renewed(state.scheme, landed - sent, lag);
                    state.extend_session(until);
                } else {
                    Stats::bump(&state.stats.renewal_failures);
                }
                for (tenure, renewed) in tenures.iter().zip(still_held) {
                    if tenure.reason().is_some() {
                        continue; // released or lost meanwhile
                    }
                    match renewed {
                        Renewed::Lost => state.lose(tenure, LostReason::Revoked),
                        Renewed::Held => {
                            if !tenure.extend(until) {
                                state.lose(tenure, LostReason::Expired);
                            }
                        }
                        // Its deadline stays; tried again below.
                        Renewed::Unknown => {}
                    }
                }
                if unknown == 0 {
                    tracing::trace!(session = %state.id(), holds = tenures.len(), "renewed");
                    next = sent + timing.renew_every;
                } else {
                    tracing::warn!(session = %state.id(), unknown, holds = tenures.len(), "renewal not answered for some holds; retrying");
                    next = clock::now() + retry_every;
                }
            }
            Ok(Ok(still_held)) => {
                Stats::bump(&state.stats.renewal_failures);
                tracing::error!(
                    session = %state.id(),
                    sent = tenures.len(),
                    got = still_held.len(),
                    "adapter bug: renew answered for a different number of holds"
                );
                next = clock::now() + retry_every;
            }
            Ok(Err(Error::SessionLost { .. })) => {
                Stats::bump(&state.stats.renewal_failures);
                state.mark_lost();
                return;
            }
            Ok(Err(e)) => {
                Stats::bump(&state.stats.renewal_failures);
                tracing::warn!(session = %state.id(), error = %e, "renewal failed; retrying");
                next = clock::now() + retry_every;
            }
            Err(_) => {
                Stats::bump(&state.stats.renewal_failures);
                tracing::warn!(session = %state.id(), timeout = ?timing.request_timeout, "renewal timed out; retrying");
                next = clock::now() + retry_every;
            }
        }
    }
}
