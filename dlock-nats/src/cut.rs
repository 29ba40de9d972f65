//! Late takes (DESIGN.md S5): a take's write that the client cut off in
//! flight (its request timeout, a dropped acquire) may still reach the
//! server after its attempt ended and after other clients took and released
//! the lock, when the key is empty again, and would hold the lock on no
//! one's behalf. KV has no conditional write across keys, so no tombstone
//! key can refuse it; JetStream's de-duplication can. Every take write
//! carries a message id of its own (`Nats-Msg-Id`), and the end of an
//! attempt with writes left unanswered first publishes, for each of them, a
//! message with the same id (on a key of its own, `_dlock.e.<id>`): the
//! stream then drops the late write as a duplicate, whatever the lock's key
//! holds by then. The server checks ids before any other condition and
//! keeps them for the bucket's duplicate window (`min(max_age, 2 min)` on
//! a bucket dlock creates), by its own clock. A write that landed before
//! its id was taken is the attempt's hold, which the end then removes as
//! any other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The take writes of a session's attempts that were sent and not answered,
/// by attempt (its owner value): their message ids.
#[derive(Clone, Default)]
pub(crate) struct CutTakes(Arc<Mutex<HashMap<String, Vec<String>>>>);

impl CutTakes {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<String>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A take write of attempt `owner` is about to be sent, with a new
    /// message id: unanswered until [`Sending::answered`].
    pub(crate) fn sending(&self, owner: &str) -> Sending {
        let id = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        self.lock()
            .entry(owner.to_owned())
            .or_default()
            .push(id.clone());
        Sending {
            ids: self.clone(),
            owner: owner.to_owned(),
            id,
        }
    }

    /// The ids of attempt `owner`'s unanswered writes, to be made
    /// duplicates (see [`Inner::refuse_late`](crate::Inner::refuse_late)).
    pub(crate) fn pending(&self, owner: &str) -> Vec<String> {
        self.lock().get(owner).cloned().unwrap_or_default()
    }

    /// The write `id` of attempt `owner` cannot land any more (answered,
    /// or a duplicate now). Forgotten only then, so that an end cut off
    /// before making it a duplicate is tried again with it.
    pub(crate) fn settled(&self, owner: &str, id: &str) {
        let mut map = self.lock();
        if let Some(ids) = map.get_mut(owner) {
            ids.retain(|i| i != id);
            if ids.is_empty() {
                map.remove(owner);
            }
        }
    }

    /// How many attempts have unanswered writes (for tests).
    #[cfg(test)]
    fn attempts(&self) -> usize {
        self.lock().len()
    }
}

/// One take write in flight (see [`CutTakes::sending`]). Dropped without
/// [`answered`](Self::answered), its id stays with its attempt.
#[must_use = "a write is answered or left unanswered"]
pub(crate) struct Sending {
    ids: CutTakes,
    owner: String,
    id: String,
}

impl Sending {
    /// The write's message id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// The server answered the write (accepted or refused it): nothing of
    /// it is left to land.
    pub(crate) fn answered(self) {
        self.ids.settled(&self.owner, &self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unanswered_writes_are_kept_until_made_duplicates() {
        let cut = CutTakes::default();
        cut.sending("a#1").answered();
        assert_eq!(cut.attempts(), 0);
        let (first, second) = (cut.sending("a#2"), cut.sending("a#2"));
        let kept = first.id().to_owned();
        assert_ne!(kept, second.id());
        drop(first);
        second.answered();
        assert_eq!(cut.pending("a#1"), Vec::<String>::new());
        assert_eq!(cut.pending("a#2"), vec![kept.clone()]);
        // (an end cut off before it made the write a duplicate finds it again)
        assert_eq!(cut.pending("a#2"), vec![kept.clone()]);
        cut.settled("a#2", &kept);
        assert_eq!(cut.pending("a#2"), Vec::<String>::new());
        assert_eq!(cut.attempts(), 0);
    }
}
