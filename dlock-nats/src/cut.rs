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
//! a bucket dlock creates), by its own clock, from the message that took
//! the id. A write that landed before its id was taken answers the end's
//! message as a duplicate, with its own sequence: the end removes that
//! message (exactly, on the lock's key), whatever became of the attempt's
//! hold. The ids of a server that restarts are rebuilt from its stored
//! messages on a best-effort basis, and a killed server may lose the last
//! ones it acknowledged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The take writes of a session's attempts that were sent and not answered,
/// by attempt (its owner value): their lock's key and message ids.
#[derive(Clone, Default)]
pub(crate) struct CutTakes(Arc<Mutex<HashMap<String, Pending>>>);

/// An attempt's unanswered take writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pending {
    /// The lock's key.
    pub(crate) key: String,
    /// The writes' message ids.
    pub(crate) ids: Vec<String>,
}

impl CutTakes {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Pending>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A take write of attempt `owner` on `key` is about to be sent, with a
    /// new message id: unanswered until [`Sending::answered`].
    pub(crate) fn sending(&self, owner: &str, key: &str) -> Sending {
        let id = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let mut map = self.lock();
        let pending = map.entry(owner.to_owned()).or_default();
        pending.key = key.to_owned();
        pending.ids.push(id.clone());
        drop(map);
        Sending {
            ids: self.clone(),
            owner: owner.to_owned(),
            id,
        }
    }

    /// Attempt `owner`'s unanswered writes, to be made duplicates (see
    /// [`Inner::refuse_late`](crate::Inner::refuse_late)).
    pub(crate) fn pending(&self, owner: &str) -> Option<Pending> {
        self.lock().get(owner).cloned()
    }

    /// The attempts with unanswered writes (a closing session ends them
    /// all).
    pub(crate) fn owners(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// The write `id` of attempt `owner` cannot land any more (answered,
    /// or a duplicate now). Forgotten only then, so that an end cut off
    /// before making it a duplicate is tried again with it.
    pub(crate) fn settled(&self, owner: &str, id: &str) {
        let mut map = self.lock();
        if let Some(pending) = map.get_mut(owner) {
            pending.ids.retain(|i| i != id);
            if pending.ids.is_empty() {
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
        cut.sending("a#1", "l.78").answered();
        assert_eq!(cut.attempts(), 0);
        let (first, second) = (cut.sending("a#2", "l.78"), cut.sending("a#2", "l.78"));
        let kept = first.id().to_owned();
        assert_ne!(kept, second.id());
        drop(first);
        second.answered();
        assert_eq!(cut.pending("a#1"), None);
        let pending = Pending {
            key: "l.78".into(),
            ids: vec![kept.clone()],
        };
        assert_eq!(cut.pending("a#2").as_ref(), Some(&pending));
        assert_eq!(cut.owners(), vec!["a#2".to_owned()]);
        // (an end cut off before it made the write a duplicate finds it again)
        assert_eq!(cut.pending("a#2"), Some(pending));
        cut.settled("a#2", &kept);
        assert_eq!(cut.pending("a#2"), None);
        assert_eq!(cut.attempts(), 0);
    }
}
