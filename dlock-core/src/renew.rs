//! The renewal task: one per session, one round trip per period for all holds.
//!
//! Invariants: L3 (a healthy session keeps its locks for many TTLs) and S4 (a
//! hold's local deadline only moves forward on a renewal confirmed by the
//! store, counted from when the renewal was *sent*; when it passes, `lost()`
//! fires even if the store cannot be reached).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;

use crate::clock::{self, sleep_until};

use crate::session::{Shared, Stats};
use crate::{Error, LostReason};

pub(crate) async fn run(shared: Arc<Shared>) {
    let timing = shared.timing;
    let retry_every = (timing.renew_every / 4).max(Duration::from_millis(5));
    let mut next = clock::now() + timing.renew_every;
    loop {
        let wake = shared
            .earliest_deadline()
            .map_or(next, |deadline| deadline.min(next));
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = sleep_until(wake) => {}
        }
        shared.expire_overdue();
        if clock::now() < next {
            continue;
        }
        let holds = shared.holds();
        let request: Vec<_> = holds.iter().map(|h| h.hold.clone()).collect();
        let sent = clock::now();
        let result = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = timeout(timing.request_timeout, shared.raw.renew(&request)) => r,
        };
        match result {
            Ok(Ok(still_held)) if still_held.len() == holds.len() => {
                Stats::bump(&shared.stats.renewals);
                let until = timing.valid_until(sent);
                shared.extend_session(until);
                for (held, ok) in holds.iter().zip(still_held) {
                    if held.reason().is_some() {
                        continue; // released or lost meanwhile
                    }
                    if !ok {
                        shared.lose(held, LostReason::Revoked);
                    } else if !held.extend(until) {
                        shared.lose(held, LostReason::Expired);
                    }
                }
                tracing::trace!(session = %shared.id(), holds = holds.len(), "renewed");
                next = sent + timing.renew_every;
            }
            Ok(Ok(still_held)) => {
                Stats::bump(&shared.stats.renewal_failures);
                tracing::error!(
                    session = %shared.id(),
                    sent = holds.len(),
                    got = still_held.len(),
                    "adapter bug: renew answered for a different number of holds"
                );
                next = clock::now() + retry_every;
            }
            Ok(Err(Error::SessionLost { .. })) => {
                Stats::bump(&shared.stats.renewal_failures);
                shared.mark_lost();
                return;
            }
            Ok(Err(e)) => {
                Stats::bump(&shared.stats.renewal_failures);
                tracing::warn!(session = %shared.id(), error = %e, "renewal failed; retrying");
                next = clock::now() + retry_every;
            }
            Err(_) => {
                Stats::bump(&shared.stats.renewal_failures);
                tracing::warn!(session = %shared.id(), timeout = ?timing.request_timeout, "renewal timed out; retrying");
                next = clock::now() + retry_every;
            }
        }
    }
}
