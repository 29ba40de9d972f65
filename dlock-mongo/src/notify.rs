//! Wake-ups (invariant L2): waiters of this process register per lock name in
//! a [`Hub`]; a release by this process wakes them directly, and where the
//! deployment has change streams, one stream per backend on the lock
//! collection turns other processes' releases into the same wake-ups.
//!
//! One shared stream rather than one per waiter: each open change stream keeps
//! a pooled connection busy in an awaiting `getMore`, so 200 waiters with a
//! stream each would starve the connection pool that takes and renewals need.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::StreamExt;
use mongodb::Collection;
use mongodb::bson::{Bson, Document};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::{ChangeStreamEvent, OperationType, ResumeToken};
use tokio::sync::Notify;

use crate::query;

/// Per-name registrations of waiting attempts.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    waiters: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
}

/// One attempt's registration; unregisters when dropped.
#[derive(Debug)]
pub(crate) struct Subscription {
    hub: Arc<Hub>,
    name: String,
    notify: Arc<Notify>,
}

impl Subscription {
    /// Resolves at the next wake-up of this name (or at once if one came
    /// since the last call: [`Notify`] keeps a permit).
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let weak = Arc::downgrade(&self.notify);
        let mut map = self.hub.waiters.lock().unwrap();
        if let Some(list) = map.get_mut(&self.name) {
            list.retain(|w| !w.ptr_eq(&weak) && w.strong_count() > 0);
            if list.is_empty() {
                map.remove(&self.name);
            }
        }
    }
}

impl Hub {
    /// Registers interest in `name` *before* the attempt's first take, so a
    /// release between that take and the wait leaves a permit.
    pub(crate) fn subscribe(self: &Arc<Self>, name: &str) -> Subscription {
        let notify = Arc::new(Notify::new());
        let mut map = self.waiters.lock().unwrap();
        let list = map.entry(name.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&notify));
        drop(map);
        Subscription {
            hub: self.clone(),
            name: name.to_owned(),
            notify,
        }
    }

    /// Wakes every waiter of `name` in this process (no queue: they race).
    pub(crate) fn wake(&self, name: &str) {
        let map = self.waiters.lock().unwrap();
        if let Some(list) = map.get(name) {
            for n in list.iter().filter_map(Weak::upgrade) {
                n.notify_one();
            }
        }
    }

    /// Wakes every waiter (the stream lost track: resume history gone,
    /// collection dropped).
    pub(crate) fn wake_all(&self) {
        let map = self.waiters.lock().unwrap();
        for n in map.values().flatten().filter_map(Weak::upgrade) {
            n.notify_one();
        }
    }

    #[cfg(test)]
    fn names(&self) -> usize {
        self.waiters.lock().unwrap().len()
    }
}

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
    hub: Weak<Hub>,
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
                        ) => hub.wake(name),
                        _ => hub.wake_all(),
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
            hub.wake_all();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wake_before_wait_leaves_a_permit() {
        let hub = Arc::new(Hub::default());
        let s = hub.subscribe("a");
        hub.wake("a");
        tokio::time::timeout(Duration::from_secs(1), s.notified())
            .await
            .expect("permit kept");
    }

    #[tokio::test]
    async fn wake_all_reaches_every_name() {
        let hub = Arc::new(Hub::default());
        let (a, b) = (hub.subscribe("a"), hub.subscribe("b"));
        hub.wake_all();
        for s in [&a, &b] {
            tokio::time::timeout(Duration::from_secs(1), s.notified())
                .await
                .expect("woken");
        }
    }

    #[test]
    fn dropped_subscriptions_are_forgotten() {
        let hub = Arc::new(Hub::default());
        let a = hub.subscribe("a");
        let a2 = hub.subscribe("a");
        let b = hub.subscribe("b");
        assert_eq!(hub.names(), 2);
        drop(a);
        assert_eq!(hub.names(), 2);
        drop(a2);
        drop(b);
        assert_eq!(hub.names(), 0);
    }

    #[test]
    fn other_names_are_not_woken() {
        let hub = Arc::new(Hub::default());
        let a = hub.subscribe("a");
        hub.wake("b");
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let mut fut = std::pin::pin!(a.notified());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
    }
}
