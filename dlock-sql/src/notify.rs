//! Wake-ups: waiters of this process register per lock name; a release by
//! this process wakes them directly, and on PostgreSQL a `LISTEN` connection
//! turns other processes' `pg_notify` into the same wake-ups (invariant L2).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

/// Per-name registrations of waiting attempts.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    waiters: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
}

impl Hub {
    /// Registers interest in `name` *before* the first take, so a release
    /// between that take and the wait leaves a permit instead of being missed.
    pub(crate) fn subscribe(&self, name: &str) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        let mut map = self.waiters.lock().unwrap();
        let list = map.entry(name.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&notify));
        notify
    }

    /// Wakes every waiter of `name` in this process (SQL has no queue, so
    /// all of them race for the lock); forgets those that are gone.
    pub(crate) fn wake(&self, name: &str) {
        let mut map = self.waiters.lock().unwrap();
        if let Some(list) = map.get_mut(name) {
            list.retain(|w| match w.upgrade() {
                Some(n) => {
                    n.notify_one();
                    true
                }
                None => false,
            });
            if list.is_empty() {
                map.remove(name);
            }
        }
    }

    /// Forgets registrations whose attempts are gone.
    pub(crate) fn prune(&self, name: &str) {
        let mut map = self.waiters.lock().unwrap();
        if let Some(list) = map.get_mut(name) {
            list.retain(|w| w.strong_count() > 0);
            if list.is_empty() {
                map.remove(name);
            }
        }
    }

    #[cfg(test)]
    fn names(&self) -> usize {
        self.waiters.lock().unwrap().len()
    }
}

/// Listens on the table's channel and wakes local waiters; ends when the
/// backend is dropped.
#[cfg(feature = "postgres")]
pub(crate) async fn listen(url: String, channel: String, hub: Weak<Hub>) {
    use sqlx::postgres::PgListener;
    use std::time::Duration;
    loop {
        let mut listener = match PgListener::connect(&url).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN connection failed; retrying (waiters fall back to polling)");
                tokio::time::sleep(Duration::from_secs(1)).await;
                if hub.strong_count() == 0 {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => match hub.upgrade() {
                    Some(hub) => hub.wake(n.payload()),
                    None => return,
                },
                // Connection lost: notifications in the gap are covered by
                // the waiters' fallback timers.
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection broke; reconnecting");
                    break;
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
        let hub = Hub::default();
        let n = hub.subscribe("a");
        hub.wake("a");
        tokio::time::timeout(std::time::Duration::from_secs(1), n.notified())
            .await
            .expect("permit kept");
    }

    #[tokio::test]
    async fn dropped_waiters_are_forgotten() {
        let hub = Hub::default();
        drop(hub.subscribe("a"));
        hub.prune("a");
        assert_eq!(hub.names(), 0);
    }
}
