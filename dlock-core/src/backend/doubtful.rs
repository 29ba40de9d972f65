//! [`Doubtful`]: which of a session's attempts may still have a take on the
//! wire, so that ending them must also refuse that take in the store.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The attempts of one session (by their key: [`Hold::key`](super::Hold),
/// the claim's identity in the store) with a take that was sent and not
/// answered: cut off at the core's request timeout, dropped with its
/// acquire, or lost with its connection. Such a take may still reach the
/// store, after its attempt ended and after other attempts took and
/// released the lock, and grant a hold no one tracks (the conformance case
/// `cut_take_delivered_late`). The store's memory of the *last* attempt to
/// hold a lock does not refuse it; a tombstone of the attempt, written when
/// it ends, does ([`Capabilities::refuses_late_takes`](crate::Capabilities)).
/// Only doubtful attempts need one, which keeps tombstones rare: a fault
/// per tombstone.
///
/// A claim wraps each take in [`Doubtful::sending`] and calls
/// [`Sending::answered`] when the reply came; the session's release and
/// close and the claim's abandon end the attempt through
/// [`Doubtful::end_with`], which says whether to leave a tombstone.
///
/// ```
/// use dlock_core::backend::Doubtful;
/// let doubtful = Doubtful::default();
/// doubtful.sending("a#1").answered(); // answered: nothing can land late
/// let cut_off = doubtful.sending("a#2");
/// drop(cut_off); // the take's future was dropped before its reply
/// assert!(!doubtful.end("a#1"));
/// assert!(doubtful.end("a#2")); // its end must refuse the late take
/// assert!(!doubtful.end("a#2")); // asked once
/// ```
#[derive(Clone, Default)]
pub struct Doubtful(Arc<Mutex<HashMap<String, Attempt>>>);

#[derive(Default)]
struct Attempt {
    /// Takes in flight now.
    unanswered: u32,
    /// A take was given up before its reply: it may land at any time.
    doubtful: bool,
}

impl fmt::Debug for Doubtful {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let map = self.lock();
        f.debug_struct("Doubtful")
            .field("attempts", &map.len())
            .field("doubtful", &map.values().filter(|a| a.doubtful).count())
            .finish()
    }
}

impl Doubtful {
    /// How long a tombstone must refuse its attempt's late takes: two
    /// minutes, longer than Linux keeps retransmitting the unsent bytes of a
    /// connection its client closed (default settings), or the lock's TTL
    /// if longer. A take later still grants a hold that expires after one
    /// TTL.
    ///
    /// ```
    /// # use std::time::Duration;
    /// use dlock_core::backend::Doubtful;
    /// assert_eq!(Doubtful::tombstone_life(Duration::from_secs(10)), Duration::from_secs(120));
    /// assert_eq!(Doubtful::tombstone_life(Duration::from_secs(600)), Duration::from_secs(600));
    /// ```
    pub fn tombstone_life(ttl: Duration) -> Duration {
        ttl.max(Duration::from_secs(120))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Attempt>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A take of attempt `key` is about to be sent: doubtful until
    /// [`Sending::answered`].
    pub fn sending(&self, key: &str) -> Sending {
        self.lock().entry(key.to_owned()).or_default().unanswered += 1;
        Sending {
            doubtful: self.clone(),
            key: Some(key.to_owned()),
        }
    }

    /// Marks attempt `key` doubtful outright: a take of it that was
    /// answered by some of the store's nodes but not all (Redlock), whose
    /// request may still reach the rest.
    pub fn mark(&self, key: &str) {
        self.lock().entry(key.to_owned()).or_default().doubtful = true;
    }

    /// Every take of attempt `key` given up so far is known to have been
    /// answered since (an adapter that drains a connection whose request was
    /// cut off sees its answer): no longer doubtful, unless a take is in
    /// flight now.
    pub fn settled(&self, key: &str) {
        let mut map = self.lock();
        if let Some(a) = map.get_mut(key) {
            a.doubtful = false;
            if a.unanswered == 0 {
                map.remove(key);
            }
        }
    }

    /// Whether attempt `key` may have a take on the wire, without ending it.
    pub fn is_doubtful(&self, key: &str) -> bool {
        self.lock()
            .get(key)
            .is_some_and(|a| a.doubtful || a.unanswered > 0)
    }

    /// Ends attempt `key` with `end`, told whether the attempt is doubtful
    /// (so `end` must leave its tombstone before it frees anything); the
    /// attempt is forgotten once `end` succeeded, and stays doubtful if it
    /// failed, so that a retry leaves the tombstone again (its first try
    /// may not have reached the store).
    ///
    /// ```
    /// # async fn demo() -> Result<(), dlock_core::Error> {
    /// use dlock_core::backend::Doubtful;
    /// let doubtful = Doubtful::default();
    /// drop(doubtful.sending("a#1")); // cut off
    /// let left = doubtful
    ///     .end_with("a#1", |tombstone| async move {
    ///         // the store's release, leaving a tombstone first if asked
    ///         Ok::<_, dlock_core::Error>(tombstone)
    ///     })
    ///     .await?;
    /// assert!(left && !doubtful.is_doubtful("a#1"));
    /// # Ok(()) }
    /// ```
    pub async fn end_with<T, E, F>(&self, key: &str, end: impl FnOnce(bool) -> F) -> Result<T, E>
    where
        F: Future<Output = Result<T, E>>,
    {
        let ended = end(self.is_doubtful(key)).await;
        if ended.is_ok() {
            self.end(key);
        }
        ended
    }

    /// For a store whose tombstone is a write of its own, before the write
    /// that frees: ends attempt `key` with `leave` (its tombstone) if it is
    /// doubtful, through [`Doubtful::end_with`]; whether one was left.
    pub async fn tombstone_if_doubtful<E, F>(
        &self,
        key: &str,
        leave: impl FnOnce() -> F,
    ) -> Result<bool, E>
    where
        F: Future<Output = Result<(), E>>,
    {
        self.end_with(key, |doubtful| async move {
            if doubtful {
                leave().await?;
            }
            Ok(doubtful)
        })
        .await
    }

    /// Attempt `key` ends (its hold released, its claim abandoned): whether
    /// a take of it may still land, so the end must leave a tombstone.
    /// Forgets the attempt: a second end of it answers `false` unless a
    /// take was sent again in between.
    pub fn end(&self, key: &str) -> bool {
        self.lock()
            .remove(key)
            .is_some_and(|a| a.doubtful || a.unanswered > 0)
    }
}

/// One take in flight (see [`Doubtful::sending`]). Dropped without
/// [`Sending::answered`], it leaves its attempt doubtful.
#[must_use = "a take is answered or left doubtful"]
pub struct Sending {
    doubtful: Doubtful,
    key: Option<String>,
}

impl fmt::Debug for Sending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sending").field("key", &self.key).finish()
    }
}

impl Sending {
    /// The store answered this take (granted, busy or refused): nothing of
    /// it is left to land.
    pub fn answered(mut self) {
        if let Some(key) = self.key.take() {
            let mut map = self.doubtful.lock();
            if let Some(a) = map.get_mut(&key) {
                a.unanswered -= 1;
                if a.unanswered == 0 && !a.doubtful {
                    map.remove(&key);
                }
            }
        }
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut map = self.doubtful.lock();
            let a = map.entry(key).or_default();
            a.unanswered = a.unanswered.saturating_sub(1);
            a.doubtful = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answered_takes_leave_nothing() {
        let d = Doubtful::default();
        let first = d.sending("k");
        let second = d.sending("k");
        assert!(d.is_doubtful("k"));
        first.answered();
        assert!(d.is_doubtful("k"), "the second take is still unanswered");
        second.answered();
        assert!(!d.is_doubtful("k"));
        assert!(d.0.lock().unwrap().is_empty(), "no state per clean attempt");
    }

    #[test]
    fn a_cut_off_take_stays_doubtful_after_a_later_answer() {
        let d = Doubtful::default();
        drop(d.sending("k"));
        d.sending("k").answered();
        assert!(d.end("k"));
        assert!(!d.end("k"));
    }

    #[test]
    fn settled_attempts_are_not_doubtful_unless_a_take_is_in_flight() {
        let d = Doubtful::default();
        drop(d.sending("k"));
        let now = d.sending("k");
        d.settled("k");
        assert!(d.is_doubtful("k"), "a take is in flight");
        drop(now);
        d.settled("k");
        assert!(!d.is_doubtful("k"));
        assert!(d.0.lock().unwrap().is_empty());
    }

    #[test]
    fn marked_attempts_are_doubtful() {
        let d = Doubtful::default();
        d.mark("k");
        assert!(d.is_doubtful("k"));
        assert!(d.end("k"));
    }
}
