//! Wake-ups (invariant L2): waiters of this process register per lock name in
//! dlock-core's [`WakeHub`]; a release by this process wakes them directly, and where the
//! deployment has change streams, one stream per backend on the lock
//! collection turns other processes' releases into the same wake-ups.
//!
//! One shared stream rather than one per waiter: each open change stream keeps
//! a pooled connection busy in an awaiting `getMore`, so 200 waiters with a
//! stream each would starve the connection pool that takes and renewals need.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dlock_core::wake::WakeHub;
use futures::StreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, OperationType, ResumeToken};

use crate::query;

/// The lock name an event is about, if it names one.
fn event_name(event: &ChangeStreamEvent<Document>) -> Option<&str> {
    match event.document_key.as_ref()?.get("_id")? {
        Bson::String(s) => Some(s),
        _ => None,
    }
}

/// Opens the wake-up stream on the lock collection, resuming after `token`.
pub(crate) async fn open(
    locks: &Collection<Document>,
    token: Option<ResumeToken>,
) -> mongodb::error::Result<ChangeStream<ChangeStreamEvent<Document>>> {
    locks
        .watch()
        .pipeline(query::wake_pipeline())
        .resume_after(token)
        .max_await_time(Duration::from_secs(1))
        .await
}

/// Server codes after which a resume token is useless: ChangeStreamHistoryLost,
/// ChangeStreamFatalError, InvalidResumeToken.
fn history_lost(e: &mongodb::error::Error) -> bool {
    matches!(crate::store::error_code(e), Some(286 | 280 | 260))
}

/// Feeds change events to the hub until the backend is gone (the task is
/// aborted then). While the stream is down, `live` is false and waiters poll
/// with a bounded backoff; a reopened stream resumes after the last event
/// seen, so releases in the gap still wake.
pub(crate) async fn pump(
    locks: Collection<Document>,
    mut stream: ChangeStream<ChangeStreamEvent<Document>>,
    hub: Weak<WakeHub>,
    live: Arc<AtomicBool>,
) {
    let mut retry = Duration::from_millis(100);
    loop {
        while let Some(next) = stream.next().await {
            let Some(hub) = hub.upgrade() else { return };
            match next {
                Ok(event) => {
                    retry = Duration::from_millis(100);
                    match (&event.operation_type, event_name(&event)) {
                        (
                            OperationType::Update | OperationType::Replace | OperationType::Delete,
                            Some(name),
                        ) => hub.wake_all(name),
                        _ => hub.wake_everyone(),
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "change stream failed; reopening (waiters poll meanwhile)");
                    break;
                }
            }
        }
        live.store(false, Ordering::Release);
        let mut token = stream.resume_token();
        loop {
            let Some(hub) = hub.upgrade() else { return };
            // Whatever happened while the stream was down is covered by a
            // re-check of every waiter.
            hub.wake_everyone();
            drop(hub);
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(Duration::from_secs(2));
            match open(&locks, token.clone()).await {
                Ok(s) => {
                    stream = s;
                    live.store(true, Ordering::Release);
                    tracing::debug!("change stream reopened");
                    break;
                }
                Err(e) if history_lost(&e) => {
                    tracing::warn!(error = %e, "change stream history lost; starting afresh");
                    token = None;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "reopening the change stream failed; retrying");
                }
            }
        }
    }
}
