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
use tokio::time::{Instant, sleep_until};

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

impl Default for PollBackoff {
    fn default() -> Self {
        Self { next: Self::MIN }
    }
}

/// How late a key's poller may be before another waiter of the key polls
/// in its place (see [`Waiter::wait_polling`]).
const POLLER_LATE: Duration = Duration::from_millis(500);

/// Per-key registrations of waiting claims.
#[derive(Debug, Default)]
pub struct WakeHub {
    waiters: Mutex<HashMap<String, Vec<Weak<Notify>>>>,
    /// Per key with waiters: its poller (by address) and when it polls
    /// next.
    polls: Mutex<HashMap<String, (usize, Instant)>>,
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

    /// Waits, for a store that notifies, until a wake-up or `until` (the
    /// holder's expiry, the core's fallback timer); see
    /// [`wait_polling`](Self::wait_polling) for a store that does not.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait_until(&self, until: Instant) {
        tokio::select! {
            _ = self.notified() => {}
            _ = sleep_until(until) => {}
        }
    }

    /// Waits, for a store without notifications, until this waiter should
    /// take again: a wake-up, `until` (the holder's expiry, the core's
    /// fallback timer), or its next poll ([`PollBackoff`]). One waiter per
    /// key and process polls the store: the longest-waiting one. The others
    /// learn of a release from this process's own release, or when the
    /// poller is granted the lock or goes away (its [`Waiter`] passes the
    /// wake-up on, and the next one polls from then on, starting at
    /// [`PollBackoff::MIN`]); and if the poller has not polled for 500 ms
    /// past its time (its acquire future is not being polled, its runtime
    /// is blocked), the next waiter to notice polls in its place. 200
    /// waiters of one lock in one process polling each on its own kept a
    /// MongoDB server so busy that releases timed out
    /// (`many_waiters_one_handoff_each`; `one_poller_per_process`).
    ///
    /// ```
    /// # async fn demo() {
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use dlock_core::wake::{PollBackoff, WakeHub};
    /// use tokio::time::Instant;
    /// let hub = Arc::new(WakeHub::default());
    /// let waiter = hub.subscribe("jobs/report");
    /// let mut backoff = PollBackoff::default();
    /// let start = Instant::now();
    /// waiter.wait_polling(&mut backoff, start + Duration::from_secs(60)).await;
    /// assert!(start.elapsed() < Duration::from_secs(1)); // the first poll
    /// # }
    /// ```
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait_polling(&self, backoff: &mut PollBackoff, until: Instant) {
        loop {
            let (polls, at) = self.poll_turn(backoff, until);
            tokio::select! {
                _ = self.notified() => return,
                _ = sleep_until(at) => if polls || at >= until { return },
            }
        }
    }

    /// Whether this waiter polls now, and until when it waits: its next
    /// poll (recorded as the key's) if it is first, the key's poller, or
    /// the key's poller is late; else until the poller would be late.
    fn poll_turn(&self, backoff: &mut PollBackoff, until: Instant) -> (bool, Instant) {
        let me = Arc::as_ptr(&self.notify) as usize;
        let first = self.is_first();
        let now = Instant::now();
        let mut polls = self.hub.polls.lock().unwrap();
        match polls.get(&self.key) {
            Some(&(poller, due)) if !first && poller != me && now < due + POLLER_LATE => {
                *backoff = PollBackoff::default();
                (false, (due + POLLER_LATE).min(until))
            }
            _ => {
                let at = backoff.next_wake(until);
                polls.insert(self.key.clone(), (me, at));
                (true, at)
            }
        }
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
                self.hub.polls.lock().unwrap().remove(&self.key);
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

    /// Polls of `waiter` (returns from `wait_polling` not caused by a
    /// wake-up) within `window`.
    async fn polls_within(waiter: &Waiter, window: Duration) -> usize {
        let (mut backoff, end) = (PollBackoff::default(), Instant::now() + window);
        let mut polls = 0;
        while Instant::now() < end {
            waiter.wait_polling(&mut backoff, end).await;
            polls += usize::from(Instant::now() < end);
        }
        polls
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_first_waiter_polls_and_the_next_takes_over() {
        let hub = Arc::new(WakeHub::default());
        let (first, second) = (hub.subscribe("a"), hub.subscribe("a"));
        let other = hub.subscribe("b");
        let window = Duration::from_secs(2);
        let (a, b, c) = tokio::join!(
            polls_within(&first, window),
            polls_within(&second, window),
            polls_within(&other, window),
        );
        assert!(a >= 15, "the first polled {a} times");
        assert_eq!(b, 0, "two pollers of one key");
        assert!(c >= 15, "first is per key: {c}");
        drop(first);
        let mut backoff = PollBackoff::default();
        let far = Instant::now() + Duration::from_secs(60);
        // (the hand-off's wake-up, then polls from MIN on)
        second.wait_polling(&mut backoff, far).await;
        let start = Instant::now();
        second.wait_polling(&mut backoff, far).await;
        assert!(
            start.elapsed() <= 2 * PollBackoff::MIN,
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_poller_is_replaced() {
        let hub = Arc::new(WakeHub::default());
        let (first, second) = (hub.subscribe("a"), hub.subscribe("a"));
        let mut backoff = PollBackoff::default();
        let far = Instant::now() + Duration::from_secs(60);
        first.wait_polling(&mut backoff, far).await; // polls once, then stalls
        let stalled = Instant::now();
        let took_over = polls_within(&second, Duration::from_secs(2)).await;
        assert!(
            took_over >= 10,
            "{took_over} polls in place of a stalled poller"
        );
        assert!(stalled.elapsed() >= Duration::from_secs(2));
        // Back from its stall, the first polls again, and the other stops.
        let (a, b) = tokio::join!(polls_within(&first, Duration::from_secs(2)), async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            polls_within(&second, Duration::from_millis(1300)).await
        });
        assert!(a >= 10 && b == 0, "first {a}, second {b}");
    }

    #[test]
    fn dropped_waiters_unregister() {
        let hub = Arc::new(WakeHub::default());
        drop(hub.subscribe("a"));
        assert!(!hub.has_waiters("a"));
        assert!(hub.keys().is_empty());
    }
}
