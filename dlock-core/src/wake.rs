//! Wake-up plumbing for adapters: waiters of this process register per key
//! (a lock name, a channel) *before* their first take; a release seen by
//! this process — its own, or a store notification — wakes them.
//!
//! Each waiter has its own [`Notify`], which keeps a permit: a wake-up that
//! arrives between a waiter's take and its wait is not lost (the "released
//! just before I subscribed" race, invariant L2). A [`Waiter`] unregisters
//! when dropped.
//!
//! ```
//! # async fn demo() {
//! use std::sync::Arc;
//! use dlock_core::wake::WakeHub;
//! let hub = Arc::new(WakeHub::default());
//! let waiter = hub.subscribe("jobs/report");
//! hub.wake_all("jobs/report"); // e.g. a release by this process
//! waiter.notified().await;     // returns at once: the permit was kept
//! # }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// Bounded polling for waiters that have no store notification: 5 ms,
/// doubling to 100 ms. Each wait ends at the next poll or at the core's
/// deadline (`until`, which already includes the holder-expiry hint and the
/// fallback timer), whichever is first.
///
/// ```
/// use std::time::Duration;
/// use dlock_core::wake::PollBackoff;
/// use tokio::time::Instant;
/// let mut backoff = PollBackoff::default();
/// let far = Instant::now() + Duration::from_secs(60);
/// assert!(backoff.next_wake(far) <= Instant::now() + Duration::from_millis(5));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct PollBackoff {
    next: Duration,
}

impl PollBackoff {
    /// The first poll interval.
    pub const MIN: Duration = Duration::from_millis(5);
    /// The longest poll interval.
    pub const MAX: Duration = Duration::from_millis(100);

    /// When the next poll is due (at most `until`); doubles the interval.
    pub fn next_wake(&mut self, until: Instant) -> Instant {
        let polled = Instant::now() + self.next;
        self.next = (self.next * 2).min(Self::MAX);
        until.min(polled)
    }
}

impl PollBackoff {
    /// When `waiter` should look again: as [`next_wake`](Self::next_wake)
    /// if it is the longest-waiting waiter of its key in this process,
    /// otherwise `until` (the holder's expiry, the core's fallback timer) or
    /// a wake-up. One waiter per key and process polls the store: the others
    /// learn of a release from this process's own release, or when the
    /// poller is granted the lock or goes away (its [`Waiter`] passes the
    /// wake-up on, and the next one polls from then on, starting at
    /// [`MIN`](Self::MIN)). 200 waiters of one lock in one process polling
    /// each on its own kept a MongoDB server so busy that releases timed
    /// out (`many_waiters_one_handoff_each`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use dlock_core::wake::{PollBackoff, WakeHub};
    /// use tokio::time::Instant;
    /// let hub = Arc::new(WakeHub::default());
    /// let (first, second) = (hub.subscribe("jobs/report"), hub.subscribe("jobs/report"));
    /// let far = Instant::now() + Duration::from_secs(60);
    /// let mut backoff = PollBackoff::default();
    /// assert!(backoff.next_wake_for(&first, far) < far);
    /// assert_eq!(backoff.next_wake_for(&second, far), far);
    /// ```
    pub fn next_wake_for(&mut self, waiter: &Waiter, until: Instant) -> Instant {
        if waiter.is_first() {
            self.next_wake(until)
        } else {
            *self = Self::default();
            until
        }
    }
}

impl Default for PollBackoff {
    fn default() -> Self {
        Self { next: Self::MIN }
    }
}

/// Per-key registrations of waiting claims.
#[derive(Debug, Default)]
pub struct WakeHub {
    waiters: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
}

/// One waiter's registration; unregisters when dropped.
#[derive(Debug)]
pub struct Waiter {
    hub: Arc<WakeHub>,
    key: String,
    notify: Arc<Notify>,
}

impl Waiter {
    /// Resolves at the next wake-up of this key, or at once if one came since
    /// the last call.
    ///
    /// # Cancel safety
    /// Cancel safe: a wake-up that arrives while no one awaits is kept.
    pub async fn notified(&self) {
        self.notify.notified().await;
    }

    /// The key this waiter waits on.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether this is the longest-waiting live waiter of its key in its
    /// hub (the one [`WakeHub::wake_first`] wakes).
    pub fn is_first(&self) -> bool {
        let map = self.hub.waiters.lock().unwrap();
        map.get(&self.key)
            .and_then(|list| list.iter().find(|w| w.strong_count() > 0))
            .is_some_and(|first| std::ptr::eq(first.as_ptr(), Arc::as_ptr(&self.notify)))
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let weak = Arc::downgrade(&self.notify);
        let mut map = self.hub.waiters.lock().unwrap();
        if let Some(list) = map.get_mut(&self.key) {
            list.retain(|w| !w.ptr_eq(&weak) && w.strong_count() > 0);
            // This waiter may have been the one woken for a release it will
            // now never act on: pass the wake-up on (a spurious one is cheap).
            if let Some(next) = list.iter().find_map(Weak::upgrade) {
                next.notify_one();
            }
            if list.is_empty() {
                map.remove(&self.key);
            }
        }
    }
}

impl WakeHub {
    /// Registers a waiter on `key`.
    pub fn subscribe(self: &Arc<Self>, key: &str) -> Waiter {
        let notify = Arc::new(Notify::new());
        let mut map = self.waiters.lock().unwrap();
        let list = map.entry(key.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&notify));
        drop(map);
        Waiter {
            hub: self.clone(),
            key: key.to_owned(),
            notify,
        }
    }

    /// Wakes every waiter of `key` (stores without a queue: they race).
    pub fn wake_all(&self, key: &str) {
        let map = self.waiters.lock().unwrap();
        if let Some(list) = map.get(key) {
            for n in list.iter().filter_map(Weak::upgrade) {
                n.notify_one();
            }
        }
    }

    /// Wakes the longest-waiting waiter of `key` only (one per release: no
    /// herd within the process; if it loses the race, the winner's release
    /// wakes the next).
    pub fn wake_first(&self, key: &str) {
        let map = self.waiters.lock().unwrap();
        if let Some(first) = map.get(key).and_then(|l| l.iter().find_map(Weak::upgrade)) {
            first.notify_one();
        }
    }

    /// Wakes every waiter of every key (a notification source lost track).
    pub fn wake_everyone(&self) {
        let map = self.waiters.lock().unwrap();
        for n in map.values().flatten().filter_map(Weak::upgrade) {
            n.notify_one();
        }
    }

    /// Whether `key` has waiters.
    pub fn has_waiters(&self, key: &str) -> bool {
        self.waiters.lock().unwrap().contains_key(key)
    }

    /// The keys that have waiters.
    pub fn keys(&self) -> Vec<String> {
        self.waiters.lock().unwrap().keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn wake_before_wait_leaves_a_permit() {
        let hub = Arc::new(WakeHub::default());
        let w = hub.subscribe("a");
        hub.wake_all("a");
        tokio::time::timeout(Duration::from_secs(1), w.notified())
            .await
            .expect("permit kept");
    }

    #[tokio::test]
    async fn wake_first_wakes_one_and_a_dropped_waiter_passes_it_on() {
        let hub = Arc::new(WakeHub::default());
        let first = hub.subscribe("a");
        let second = hub.subscribe("a");
        hub.wake_first("a");
        let quick = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(quick, second.notified())
                .await
                .is_err(),
            "herd"
        );
        drop(first); // woken, but gone: the wake-up moves on
        tokio::time::timeout(quick, second.notified())
            .await
            .expect("passed on");
    }

    #[tokio::test]
    async fn only_the_first_waiter_polls_and_the_next_takes_over() {
        let hub = Arc::new(WakeHub::default());
        let (first, second) = (hub.subscribe("a"), hub.subscribe("a"));
        let other = hub.subscribe("b");
        let far = Instant::now() + Duration::from_secs(60);
        let (mut b1, mut b2) = (PollBackoff::default(), PollBackoff::default());
        assert!(b1.next_wake_for(&first, far) < far);
        assert_eq!(b2.next_wake_for(&second, far), far, "two pollers");
        assert!(other.is_first(), "first is per key");
        drop(first);
        tokio::time::timeout(Duration::from_millis(50), second.notified())
            .await
            .expect("the next waiter is woken to take over");
        let next = b2.next_wake_for(&second, far);
        assert!(next <= Instant::now() + PollBackoff::MIN, "{next:?}");
    }

    #[test]
    fn dropped_waiters_unregister() {
        let hub = Arc::new(WakeHub::default());
        drop(hub.subscribe("a"));
        assert!(!hub.has_waiters("a"));
        assert!(hub.keys().is_empty());
    }
}
