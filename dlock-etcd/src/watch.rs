//! One watch per lock queue per backend, shared by the backend's waiters on
//! that queue.
//!
//! A waiter must hear of every deletion ahead of its key. etcd (3.4) makes a
//! watch "from now" start at the revision it read *before* registering it;
//! a write landing in between leaves the watch in the group a 100 ms loop
//! catches up (`watchableStore.watch`: a start revision at or below the
//! current one is "unsynced"). Under a hot lock that is exactly when waiters
//! make their watches: about one handoff in fifty then took ~90 ms
//! (`dlock bench`, release→grant p99 65–80 ms against a p50 of 1.2 ms; etcd's
//! own lock service, which watches per wait, shows the same tail). A watch
//! made once per queue and kept while it is used meets that at most once;
//! a wait then only subscribes, in the process.
//!
//! A subscription taken before a read hears of every deletion the read does
//! not show: the watch exists (its creation was answered) before anyone
//! subscribes, it delivers every event after its start in revision order,
//! and an event broadcast before the subscription is of a revision the later
//! read already reflects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Client, EventType, WatchFilterType, WatchOptions, WatchStream};
use tokio::sync::{Mutex, broadcast};
use tokio::task::JoinHandle;

/// The keys one watch response says were deleted.
pub(crate) type Deleted = Arc<[Vec<u8>]>;

/// How often a queue's watch checks for subscribers: it ends at the third
/// check in a row that finds none (10–15 s after the last one left).
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// How many responses a subscriber may fall behind before it must read the
/// queue again (it is told: `RecvError::Lagged`).
const BACKLOG: usize = 256;

/// The watches of one backend, by queue (`prefix/<flat name>/`). The map
/// is locked only to find a queue's slot; a slow creation holds up the
/// waiters of its own queue only.
#[derive(Default)]
pub(crate) struct QueueWatches {
    queues: std::sync::Mutex<HashMap<String, Arc<Slot>>>,
    ids: AtomicU64,
}

/// One queue's watch, if it has one.
type Slot = Mutex<Option<Entry>>;

struct Entry {
    id: u64,
    /// The client generation the watch runs on (see `Inner::generation`).
    generation: u64,
    events: broadcast::Sender<Deleted>,
    task: JoinHandle<()>,
}

impl Drop for Entry {
    /// Ends the watch: its subscribers see the channel closed once they
    /// have read what it sent, and read the queue again. (A dropped
    /// `JoinHandle` alone would leave the task running.)
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl QueueWatches {
    /// A receiver of every deletion in `queue` from now on, on the watch of
    /// the queue (made first if there is none on this client generation);
    /// `None` if etcd made none (the waiter then looks again on the core's
    /// fallback timer, and its next take tries again). The caller bounds
    /// the time; cut off, it leaves no watch half made.
    pub(crate) async fn subscribe(
        self: &Arc<Self>,
        client: Client,
        generation: u64,
        queue: &str,
    ) -> Option<broadcast::Receiver<Deleted>> {
        let (slot, mut entry) = loop {
            let slot = self.slot_or_new(queue);
            let entry = slot.clone().lock_owned().await;
            // Still the queue's slot (not emptied and dropped from the map
            // meanwhile): a watch made in a dropped slot would end with it.
            if self.holds(queue, &slot) {
                break (slot, entry);
            }
        };
        if let Some(e) = entry.as_ref() {
            if e.generation == generation && !e.task.is_finished() {
                return Some(e.events.subscribe());
            }
            // Made on a client since replaced (whose connection hung), or
            // ended: make another (dropping the old one ends it).
            *entry = None;
        }
        let stream = match create(client, queue).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "no watch of the lock queue; waiting on the fallback timer");
                self.drop_slot(queue, &slot);
                return None;
            }
        };
        let (events, subscriber) = broadcast::channel(BACKLOG);
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(forward(
            stream,
            events.clone(),
            Arc::downgrade(self),
            queue.to_owned(),
            id,
        ));
        *entry = Some(Entry {
            id,
            generation,
            events,
            task,
        });
        Some(subscriber)
    }

    /// The queue's slot, made if it has none.
    fn slot_or_new(&self, queue: &str) -> Arc<Slot> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = queues.get(queue) {
            return slot.clone();
        }
        queues.entry(queue.to_owned()).or_default().clone()
    }

    /// Whether `slot` is the queue's.
    fn holds(&self, queue: &str, slot: &Arc<Slot>) -> bool {
        let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.get(queue).is_some_and(|s| Arc::ptr_eq(s, slot))
    }

    /// Drops `slot` from the map if it is still the queue's (called with its
    /// entry locked and empty).
    fn drop_slot(&self, queue: &str, slot: &Arc<Slot>) {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if queues.get(queue).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            queues.remove(queue);
        }
    }

    /// Ends every watch (the client they run on was replaced): their
    /// waiters read again and subscribe to new ones. A watch being made
    /// just now is left; it is made again at its next use.
    pub(crate) fn end_all(&self) {
        let slots: Vec<Arc<Slot>> = self
            .queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, slot)| slot)
            .collect();
        for slot in slots {
            // A slot locked now (a subscriber in it) ends its watch when
            // that subscriber lets go of it: out of the map, its last
            // reference is the subscriber's.
            if let Ok(mut entry) = slot.try_lock() {
                *entry = None;
            }
        }
    }
}

impl Drop for QueueWatches {
    fn drop(&mut self) {
        self.end_all();
    }
}

/// Makes a watch of deletions under `queue`, from now, and waits until etcd
/// says it exists.
async fn create(client: Client, queue: &str) -> Result<WatchStream, dlock_core::Error> {
    let options = WatchOptions::new()
        .with_prefix()
        .with_filters([WatchFilterType::NoPut]);
    let mut stream = client
        .watch_client()
        .watch(queue, Some(options))
        .await
        .map_err(crate::map_err)?;
    match stream.message().await {
        Ok(Some(created)) if created.created() && !created.canceled() => Ok(stream),
        Ok(Some(other)) => Err(dlock_core::Error::unavailable(
            "etcd",
            format!("watch not created: {}", other.cancel_reason()),
        )),
        Ok(None) => Err(dlock_core::Error::unavailable(
            "etcd",
            "watch stream closed",
        )),
        Err(e) => Err(crate::map_err(e)),
    }
}

/// Passes the watch's deletions to the subscribers until the watch ends
/// (subscribers then see the channel closed and read again) or has had no
/// subscriber for three checks; then removes its entry.
async fn forward(
    mut stream: WatchStream,
    events: broadcast::Sender<Deleted>,
    owner: Weak<QueueWatches>,
    queue: String,
    id: u64,
) {
    let mut idle = tokio::time::interval(IDLE_CHECK);
    let mut unused = 0;
    loop {
        tokio::select! {
            message = stream.message() => match message {
                Ok(Some(resp)) if !resp.canceled() => {
                    let deleted: Vec<Vec<u8>> = resp
                        .events()
                        .iter()
                        .filter(|e| e.event_type() == EventType::Delete)
                        .filter_map(|e| e.kv().map(|kv| kv.key().to_vec()))
                        .collect();
                    if !deleted.is_empty() {
                        // No subscriber now is no error: the next one reads first.
                        let _ = events.send(deleted.into());
                    }
                }
                Ok(Some(resp)) => {
                    tracing::debug!(reason = resp.cancel_reason(), "lock queue watch cancelled");
                    break;
                }
                Ok(None) => {
                    tracing::debug!("lock queue watch closed");
                    break;
                }
                Err(e) => {
                    tracing::debug!(error = %crate::map_err(e), "lock queue watch failed");
                    break;
                }
            },
            _ = idle.tick() => {
                if events.receiver_count() > 0 {
                    unused = 0;
                } else {
                    unused += 1;
                    // The first check is at once.
                    if unused > 2 {
                        break;
                    }
                }
            }
        }
    }
    // Out of its slot (which leaves the map if nothing else took its
    // place): the subscribers see the channel closed.
    let Some(owner) = owner.upgrade() else { return };
    let slot = owner
        .queues
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&queue)
        .cloned();
    let Some(slot) = slot else { return };
    let mut entry = slot.lock().await;
    if entry.as_ref().is_some_and(|e| e.id == id) {
        // Dropping the entry aborts this task: leave the map first.
        owner.drop_slot(&queue, &slot);
        let _ending = entry.take();
    }
}
