//! The store mapping shared by backend, sessions and claims: reads,
//! conditional writes and deletes on one key, each request bounded.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv::{self, Operation};
use bytes::Bytes;
use dlock_core::{Error, FencingToken, LockInfo, LockName};
use futures::StreamExt;
use tokio::time::Instant;

use crate::conn::{Conn, InFlight, open_bucket};
use crate::value::{Ended, Value, key_prefix, now_ms};
use crate::{Inner, MAX_SEQUENCE_GAP, RACES, RECHECK_FLOOR, REQUEST_TIMEOUT, SCHEME, unavailable};

/// What [`Inner::write_if_free`] did.
pub(crate) enum Free {
    /// Wrote at this revision, this value (the one asked for, with the
    /// key's tombstones).
    Written(u64, Value),
    /// The key holds a value (someone's hold, perhaps this client's own).
    Held,
    /// The key was free, but another write came first.
    Raced,
}

/// What a lock's key holds.
pub(crate) enum State {
    /// No message: a take writes on nothing.
    Empty,
    /// A purge marker at this revision: a release whose marker is not
    /// purged yet, or another tool's delete.
    Marker(u64),
    /// A free value at this revision, keeping tombstones.
    Free(u64, Value),
    /// A hold.
    Held(Held),
}

/// A live lock entry: its value, revision, token and server timestamp.
pub(crate) struct Held {
    pub(crate) value: Value,
    pub(crate) revision: u64,
    pub(crate) token: FencingToken,
    pub(crate) created: SystemTime,
}

/// Messages per batch of [`Inner::advance`].
const ADVANCE_BATCH: u64 = 1_000;

/// Publishes a batch of empty messages on `subject`: the sequence of the
/// last one.
async fn publish_batch(
    js: &async_nats::jetstream::Context,
    subject: &str,
) -> Result<u64, async_nats::jetstream::context::PublishError> {
    let mut acks = Vec::with_capacity(ADVANCE_BATCH as usize);
    for _ in 0..ADVANCE_BATCH {
        acks.push(js.publish(subject.to_owned(), Bytes::new()).await?);
    }
    let mut last = 0;
    for ack in acks {
        last = ack.await?.sequence;
    }
    Ok(last)
}

impl Inner {
    /// Bounds one request (NATS requests wait for a reconnect).
    pub(crate) async fn bounded<T, E>(
        self: &Arc<Self>,
        fut: impl Future<Output = Result<T, E>>,
    ) -> Result<T, Error>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        self.call(fut).await?.map_err(unavailable)
    }

    /// One request, bounded. One that goes unanswered (its time-out, or the
    /// core's, which drops it) may mean a silently dead connection: later
    /// requests go to a new one, at once rather than after the pings. The
    /// old connection is left to its requests in flight, not reset under
    /// them (a reset would fail every other request of this backend).
    pub(crate) async fn call<T>(
        self: &Arc<Self>,
        fut: impl Future<Output = T>,
    ) -> Result<T, Error> {
        let mut in_flight = InFlight {
            inner: Some(self),
            since: Instant::now(),
        };
        let result = tokio::time::timeout(REQUEST_TIMEOUT, fut).await;
        match result {
            Ok(r) => {
                in_flight.inner = None;
                Ok(r)
            }
            Err(_) => Err(Error::unavailable(SCHEME, "request timed out")),
        }
    }

    /// The connection for the next request.
    pub(crate) fn conn(&self) -> Arc<Conn> {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes a new connection in the background and sends later requests
    /// to it (one replacement at a time).
    pub(crate) fn replace_connection(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.replacing.store(false, Ordering::Release);
            return;
        };
        let inner = self.clone();
        runtime.spawn(async move {
            if let Ok(client) = inner.dialer.dial(&inner.shown).await
                && let Ok(kv) = open_bucket(&client, &inner.bucket, None).await
            {
                *inner.conn.write().unwrap_or_else(|e| e.into_inner()) =
                    Arc::new(Conn::new(client, kv));
            }
            inner.replacing.store(false, Ordering::Release);
        });
    }

    /// The highest stream sequence seen so far.
    pub(crate) fn highest(&self) -> u64 {
        self.highest.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records a stream sequence the server reported.
    pub(crate) fn saw(&self, revision: u64) -> u64 {
        self.highest
            .fetch_max(revision, std::sync::atomic::Ordering::AcqRel);
        revision
    }

    /// Checks the sequence of a new take against `before`, the highest
    /// sequence seen before it was sent (`highest()`; one seen meanwhile
    /// may be larger). A server that lost its last writes (a kill: JetStream
    /// writes behind) or forgot an emptied stream's last sequence
    /// (nats-server#5497, #6789) gives sequences again, and a token would
    /// repeat (S2). Such a take is removed here and refused (see
    /// [`went_back`](Self::went_back)).
    pub(crate) async fn fresh(
        self: &Arc<Self>,
        key: &str,
        revision: u64,
        before: u64,
    ) -> Result<u64, Error> {
        self.saw(revision);
        if revision > before {
            return Ok(revision);
        }
        Err(self.went_back(key, revision, revision, before).await)
    }

    /// Removes this client's message of `key` at `revision`, whose token
    /// would not be above `before` (the highest sequence this process saw
    /// before the take), and says why. Within [`MAX_SEQUENCE_GAP`] the
    /// error is `Unavailable`, and the stream's sequence is moved past
    /// `before` in the background (see [`advance`](Self::advance)): the
    /// core takes again, and the lock is granted with a larger token.
    /// Farther behind, a `Protocol` error names what happened.
    pub(crate) async fn went_back(
        self: &Arc<Self>,
        key: &str,
        revision: u64,
        token: u64,
        before: u64,
    ) -> Error {
        // (best effort: a message left behind expires after max_age)
        let _ = self.remove_exact(key, revision, false).await;
        let what = format!(
            "bucket {}: the stream's sequence went back (a take got {token} after {before} \
             was seen)",
            self.bucket
        );
        if before - token >= MAX_SEQUENCE_GAP {
            return Error::protocol(
                SCHEME,
                format!(
                    "{what}, {MAX_SEQUENCE_GAP} or more: the bucket was deleted and made \
                     again, restored from a backup, or its server lost that many writes (a \
                     host crash); its tokens would go back, so this client takes no lock from \
                     it (data fenced with the old tokens must be reset before new clients use \
                     the bucket)"
                ),
            );
        }
        self.advance(before);
        Error::unavailable(
            SCHEME,
            format!("{what}; the server lost writes: taking again"),
        )
    }

    /// Moves the stream's sequence past `target`, in the background and
    /// once per backend at a time (the waiters of every lock that met the
    /// gap would otherwise each write it): small messages on a key no lock
    /// uses (`_dlock.advance`, one kept), published a thousand at a time
    /// until one is acknowledged above `target`, each batch bounded.
    fn advance(self: &Arc<Self>, target: u64) {
        use std::sync::atomic::Ordering;
        if self.advancing.swap(true, Ordering::AcqRel) {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let conn = inner.conn();
            let subject = inner.subject("_dlock.advance");
            for _ in 0..=MAX_SEQUENCE_GAP / ADVANCE_BATCH {
                match inner.bounded(publish_batch(&conn.js, &subject)).await {
                    Ok(last) if inner.saw(last) > target => break,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "moving the stream's sequence on failed");
                        break;
                    }
                }
            }
            inner.advancing.store(false, Ordering::Release);
        });
    }

    /// The keys of the lock names under `prefix` that have a message (a
    /// hold, or a delete marker another tool left), from the stream's own
    /// list of subjects (one request per page), not KV's `keys`: that is a
    /// consumer, which goes on delivering while holders renew, so under load
    /// it never ends.
    pub(crate) async fn keys(self: &Arc<Self>, prefix: &str) -> Result<Vec<String>, Error> {
        let bucket_prefix = format!("$KV.{}.", self.bucket);
        let wanted = key_prefix(prefix);
        let conn = self.conn();
        let filter = format!("{bucket_prefix}l.>");
        let mut subjects = self
            .bounded(conn.kv.stream.info_with_subjects(filter))
            .await?;
        let mut keys = Vec::new();
        while let Some(subject) = tokio::time::timeout(REQUEST_TIMEOUT, subjects.next())
            .await
            .map_err(|_| Error::unavailable(SCHEME, "listing timed out"))?
        {
            let (subject, _) = subject.map_err(unavailable)?;
            if let Some(key) = subject.strip_prefix(&bucket_prefix)
                && key.starts_with(&wanted)
            {
                keys.push(key.to_owned());
            }
        }
        Ok(keys)
    }

    /// What the key holds now.
    pub(crate) async fn read(self: &Arc<Self>, key: &str) -> Result<State, Error> {
        let Some(entry) = self.bounded(self.conn().kv.entry(key)).await? else {
            return Ok(State::Empty);
        };
        if entry.operation != Operation::Put {
            return Ok(State::Marker(self.saw(entry.revision)));
        }
        // A value this adapter did not write (another tool's) holds the
        // lock for no session: renewals and releases report it not theirs,
        // `force_release` removes it.
        let value = Value::decode(&entry.value).unwrap_or_else(|_| Value {
            owner: String::new(),
            token: None,
            session: "(not a dlock value)".to_owned(),
            why: String::new(),
            ended: Vec::new(),
        });
        if value.is_free() {
            return Ok(State::Free(self.saw(entry.revision), value));
        }
        let token = value.token.unwrap_or(FencingToken::new(entry.revision));
        Ok(State::Held(Held {
            value,
            revision: self.saw(entry.revision),
            token,
            created: entry.created.into(),
        }))
    }

    /// The key's live entry, if held.
    pub(crate) async fn held(self: &Arc<Self>, key: &str) -> Result<Option<Held>, Error> {
        Ok(match self.read(key).await? {
            State::Held(held) => Some(held),
            _ => None,
        })
    }

    /// When to check again a key written at `created` (server time): at its
    /// expiry, but not sooner than `RECHECK_FLOOR` (the server removes an
    /// expired message lazily, and this client's clock may run ahead of
    /// the server's: either would make waiters re-read in a tight loop).
    pub(crate) fn left(&self, created: SystemTime) -> Duration {
        let age = SystemTime::now()
            .duration_since(created)
            .unwrap_or_default();
        self.max_age.saturating_sub(age).max(RECHECK_FLOOR)
    }

    /// Rewrites a held key on its revision with its token (renewal, the
    /// idempotent take): `Some(token)` if it was ours and is extended.
    ///
    /// Each write is conditional on the revision just read; a revision that
    /// moved meanwhile is read again (it may have been this session's own
    /// concurrent write: a renewal beside a take retry or a release).
    pub(crate) async fn extend(
        self: &Arc<Self>,
        key: &str,
        owner: &str,
        token: Option<FencingToken>,
    ) -> Result<Option<(FencingToken, u64, Bytes)>, Error> {
        for _ in 0..RACES {
            let Some(held) = self.held(key).await? else {
                return Ok(None);
            };
            if held.value.owner != owner || token.is_some_and(|t| t != held.token) {
                return Ok(None);
            }
            let value = Value {
                token: Some(held.token),
                ended: held.value.live_ended(now_ms()),
                ..held.value
            }
            .encode();
            if let Some(revision) = self.update_at(key, value.clone(), held.revision).await? {
                return Ok(Some((held.token, revision, value)));
            }
        }
        Err(Error::unavailable(SCHEME, "the lock's key kept changing"))
    }

    /// Writes `value` to `key` if the key is free: one write if it has no
    /// message, else a read and, on a purge marker (a release whose marker
    /// is not purged yet, or another tool's delete), a write on it, or on
    /// nothing again if the key was emptied between the two (a marker
    /// purged: the wake-up it sent may have come before this client
    /// listened); on a free value that keeps tombstones, a write on it that
    /// keeps them. A take and the bench floor both take this way.
    pub(crate) async fn write_if_free(
        self: &Arc<Self>,
        key: &str,
        value: &Value,
    ) -> Result<Free, Error> {
        let bytes = value.encode();
        if let Some(revision) = self.update_at(key, bytes.clone(), 0).await? {
            return Ok(Free::Written(revision, value.clone()));
        }
        let on = match self.read(key).await? {
            State::Empty => 0,
            State::Marker(revision) => revision,
            State::Free(revision, free) => {
                let kept = Value {
                    ended: free.live_ended(now_ms()),
                    ..value.clone()
                };
                return Ok(match self.update_at(key, kept.encode(), revision).await? {
                    Some(revision) => Free::Written(revision, kept),
                    None => Free::Raced,
                });
            }
            State::Held(_) => return Ok(Free::Held),
        };
        Ok(match self.update_at(key, bytes.clone(), on).await? {
            Some(revision) => Free::Written(revision, value.clone()),
            // The marker was purged between the read and this write (the
            // releaser clears it in the background right after its
            // release): the key may have no message again.
            None if on != 0 => match self.update_at(key, bytes, 0).await? {
                Some(revision) => Free::Written(revision, value.clone()),
                None => Free::Raced,
            },
            None => Free::Raced,
        })
    }

    /// Writes `value` to `key` only if the key's last message is at
    /// `revision` (0: the key has none): the new revision (recorded as
    /// seen), or `None` when the key moved.
    pub(crate) async fn update_at(
        self: &Arc<Self>,
        key: &str,
        value: Bytes,
        revision: u64,
    ) -> Result<Option<u64>, Error> {
        match self
            .call(self.conn().kv.update(key, value, revision))
            .await?
        {
            Ok(next) => Ok(Some(self.saw(next))),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Deletes a held key if `owner` (and `token`, if given) hold it, by
    /// its revision (read again if it moved meanwhile, as in `extend`). A
    /// hold that carries live tombstones is replaced by a free value that
    /// keeps them (see [`free_at`](Self::free_at)), not removed.
    pub(crate) async fn delete_if(
        self: &Arc<Self>,
        key: &str,
        owner: Option<&str>,
        token: Option<FencingToken>,
    ) -> Result<bool, Error> {
        for _ in 0..RACES {
            let Some(held) = self.held(key).await? else {
                return Ok(false);
            };
            if owner.is_some_and(|o| o != held.value.owner)
                || token.is_some_and(|t| t != held.token)
            {
                return Ok(false);
            }
            if self.free_or_remove(key, &held.value, held.revision).await? {
                return Ok(true);
            }
        }
        Err(Error::unavailable(SCHEME, "the lock's key kept changing"))
    }

    /// Frees `key`, whose hold `value` is at `revision`: removes it (see
    /// [`remove_exact`](Self::remove_exact)), or, while it carries live
    /// tombstones, writes a free value that keeps them on that revision
    /// (see [`free_at`](Self::free_at)). `false` if the key moved.
    pub(crate) async fn free_or_remove(
        self: &Arc<Self>,
        key: &str,
        value: &Value,
        revision: u64,
    ) -> Result<bool, Error> {
        let ended = value.live_ended(now_ms());
        if ended.is_empty() {
            self.remove_exact(key, revision, true).await
        } else {
            self.free_at(key, revision, ended).await
        }
    }

    /// Writes a free value keeping `ended` on `revision` (the hold's), then
    /// wakes the key's waiters: `false` if the key moved. Such a key is never emptied by a release while a
    /// tombstone lives, so a late take (written on no message, or on a
    /// revision since replaced) finds neither; it expires `max_age` after
    /// its last write, like a hold.
    pub(crate) async fn free_at(
        self: &Arc<Self>,
        key: &str,
        revision: u64,
        ended: Vec<Ended>,
    ) -> Result<bool, Error> {
        let freed = self
            .update_at(key, Value::free(ended).encode(), revision)
            .await?
            .is_some();
        if freed {
            self.released(key).await;
        }
        Ok(freed)
    }

    /// Ends attempt `owner` on `key` while a take of it may still be on the
    /// wire (DESIGN.md S5): adds its tombstone, until `until_ms`, to what
    /// the key holds, by a write on the revision read, so that the late take
    /// (written on no message, or on a revision this write replaces) is
    /// refused. The attempt's own hold is freed by the same write: `true`
    /// if it had `token` (if given). Another client's hold keeps its
    /// holder and token and carries the tombstone on (its renewals and
    /// release keep it, see [`free_or_remove`](Self::free_or_remove)).
    pub(crate) async fn leave_tombstone(
        self: &Arc<Self>,
        key: &str,
        owner: &str,
        token: Option<FencingToken>,
        until_ms: u64,
    ) -> Result<bool, Error> {
        let tombstone = Ended {
            owner: owner.to_owned(),
            until_ms,
        };
        let with = |value: &Value| {
            let mut ended = value.live_ended(now_ms());
            ended.retain(|e| e.owner != owner);
            ended.insert(0, tombstone.clone());
            ended.truncate(crate::value::MAX_ENDED);
            ended
        };
        for _ in 0..RACES {
            // (the revision to write on, whether a hold of this attempt is
            // freed and whether it had `token`, the value)
            let (revision, freed, ours, value) = match self.read(key).await? {
                State::Empty => (0, false, false, Value::free(with(&Value::free(Vec::new())))),
                State::Marker(revision) => {
                    let value = Value::free(with(&Value::free(Vec::new())));
                    (revision, false, false, value)
                }
                State::Free(revision, free) => (revision, false, false, Value::free(with(&free))),
                // (any hold of this attempt goes: one with another token is a
                // late take of it that landed after its hold was lost)
                State::Held(held) if held.value.owner == owner => {
                    let ours = token.is_none_or(|t| t == held.token);
                    (held.revision, true, ours, Value::free(with(&held.value)))
                }
                State::Held(held) => {
                    let ended = with(&held.value);
                    let value = Value {
                        token: Some(held.token),
                        ended,
                        ..held.value
                    };
                    (held.revision, false, false, value)
                }
            };
            if self
                .update_at(key, value.encode(), revision)
                .await?
                .is_some()
            {
                if freed {
                    self.released(key).await;
                }
                return Ok(ours);
            }
        }
        Err(Error::unavailable(SCHEME, "the lock's key kept changing"))
    }

    /// The stream subject of `key`.
    pub(crate) fn subject(&self, key: &str) -> String {
        format!("$KV.{}.{key}", self.bucket)
    }

    /// Removes `key`'s message only if it is at `revision`: `false` if the
    /// key moved (a newer write, expired, or removed already). One
    /// request, exact and scoped to the key: a purge marker written only if
    /// the key's last message is at `revision`, which replaces it
    /// (`Nats-Rollup: sub`), so a release whose reply is lost still takes
    /// effect, and a sequence that a server which lost writes gave again,
    /// to another key or to a newer hold of this one below `revision`, is
    /// never touched. Waiters are then told (see [`released`](Self::released)),
    /// and the marker is cleared (see [`remove`](Self::remove)), so the next
    /// take is one write; until it is, a take writes on the marker (see
    /// `try_take`).
    pub(crate) async fn remove_exact(
        self: &Arc<Self>,
        key: &str,
        revision: u64,
        announce: bool,
    ) -> Result<bool, Error> {
        use async_nats::jetstream::context::PublishErrorKind;
        let js = self.conn().js.clone();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("KV-Operation", "PURGE");
        headers.insert("Nats-Rollup", "sub");
        headers.insert(
            async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            async_nats::HeaderValue::from(revision),
        );
        let subject = self.subject(key);
        let sent = async move {
            js.publish_with_headers(subject, headers, Bytes::new())
                .await?
                .await
        };
        match self.call(sent).await? {
            Ok(ack) => {
                let marker = self.saw(ack.sequence);
                self.clear_marker(key, marker, announce);
                Ok(true)
            }
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Ok(false),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Purges the marker `remove_exact` left at `marker`, then (if
    /// `announce`) wakes the key's waiters, in the background: the removal
    /// took effect with the marker, so a release does not wait for this,
    /// and waiters woken after the purge take with one write. Best effort,
    /// and the purge only while connected: a request the client holds back
    /// while it reconnects could land after a server that lost writes gave
    /// the marker's sequence again, to a newer hold of the key. A marker
    /// left behind is free to take (see `try_take`) and expires after
    /// `max_age`.
    fn clear_marker(self: &Arc<Self>, key: &str, marker: u64, announce: bool) {
        let (inner, key) = (self.clone(), key.to_owned());
        tokio::spawn(async move {
            let conn = inner.conn();
            if conn.client.connection_state() == async_nats::connection::State::Connected {
                let _ = inner.remove(&key, marker).await;
            }
            if announce {
                inner.released(&key).await;
            }
        });
    }

    /// Removes `key`'s message if it is at `revision` or older: `false`
    /// if the key has none. A purge of the key's subject below
    /// `revision + 1`, never a delete by sequence alone (a sequence given
    /// again may be another key's): the subject is then empty, and the next
    /// take is one write. Only for a message this client just wrote (the
    /// marker of [`remove_exact`](Self::remove_exact)): below a sequence
    /// remembered longer, a server that lost writes may have given a newer
    /// hold of the key a sequence again.
    pub(crate) async fn remove(self: &Arc<Self>, key: &str, revision: u64) -> Result<bool, Error> {
        let conn = self.conn();
        let purge = conn
            .kv
            .stream
            .purge()
            .filter(self.subject(key))
            .sequence(revision + 1);
        let purged = self.bounded(purge.into_future()).await?;
        Ok(purged.purged > 0)
    }

    /// The subject a release of `key` is announced on (plain NATS, not
    /// JetStream: a waiter that misses it re-checks at the holder's expiry
    /// or the core's fallback poll).
    pub(crate) fn release_subject(&self, key: &str) -> String {
        format!("_dlock.{}.{key}", self.bucket)
    }

    /// Wakes the waiters of `key` (best effort).
    pub(crate) async fn released(self: &Arc<Self>, key: &str) {
        // (in the background: a publish waits while the client reconnects)
        let client = self.conn().client.clone();
        let subject = self.release_subject(key);
        tokio::spawn(async move {
            let _ = client.publish(subject, Bytes::new()).await;
        });
    }

    pub(crate) fn info(&self, name: LockName, held: Held) -> LockInfo {
        let mut info = LockInfo::new(name, held.value.session.clone(), held.token);
        info.why = (!held.value.why.is_empty()).then(|| held.value.why.clone());
        info.expires_at = Some(held.created + self.max_age);
        info
    }
}
