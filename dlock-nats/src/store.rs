//! The store mapping shared by backend, sessions and claims: reads,
//! conditional writes and deletes on one key, each request bounded.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::context::PublishError;
use async_nats::jetstream::kv::{self, Operation};
use async_nats::jetstream::publish::PublishAck;
use bytes::Bytes;
use dlock_core::{Error, FencingToken, LockInfo, LockName};
use futures::StreamExt;
use tokio::time::Instant;

use crate::conn::{Conn, InFlight, open_bucket};
use crate::cut::CutTakes;
use crate::value::{Value, key_prefix};
use crate::{Inner, MAX_SEQUENCE_GAP, RACES, RECHECK_FLOOR, REQUEST_TIMEOUT, SCHEME, unavailable};

/// What [`Inner::write_if_free`] did.
pub(crate) enum Free {
    /// Wrote at this revision.
    Written(u64),
    /// The key holds a value (someone's hold, perhaps this client's own).
    Held,
    /// The key was free, but another write came first.
    Raced,
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

    /// Publishes `payload` on `subject` with `headers` and waits for the
    /// stream's acknowledgement, bounded as one request (see
    /// [`call`](Self::call)): the server's answer, accepted or refused.
    pub(crate) async fn publish(
        self: &Arc<Self>,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: Bytes,
    ) -> Result<Result<PublishAck, PublishError>, Error> {
        let js = self.conn().js.clone();
        self.call(async move {
            js.publish_with_headers(subject, headers, payload)
                .await?
                .await
        })
        .await
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

    /// The key's live entry, if held.
    pub(crate) async fn held(self: &Arc<Self>, key: &str) -> Result<Option<Held>, Error> {
        let Some(entry) = self.bounded(self.conn().kv.entry(key)).await? else {
            return Ok(None);
        };
        if entry.operation != Operation::Put {
            return Ok(None);
        }
        // A value this adapter did not write (another tool's) holds the
        // lock for no session: renewals and releases report it not theirs,
        // `force_release` removes it.
        let value = Value::decode(&entry.value).unwrap_or_else(|_| Value {
            owner: String::new(),
            token: None,
            session: "(not a dlock value)".to_owned(),
            why: String::new(),
        });
        let token = value.token.unwrap_or(FencingToken::new(entry.revision));
        Ok(Some(Held {
            value,
            revision: self.saw(entry.revision),
            token,
            created: entry.created.into(),
        }))
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
    /// listened). A take and the bench floor both take this way. A take
    /// gives `cut` (its session's unanswered writes, by attempt) and its
    /// owner: each write carries a message id of its own, kept there until
    /// answered (see the `cut` module).
    pub(crate) async fn write_if_free(
        self: &Arc<Self>,
        key: &str,
        value: Bytes,
        cut: Option<(&CutTakes, &str)>,
    ) -> Result<Free, Error> {
        if let Some(revision) = self.take_on(key, value.clone(), 0, cut).await? {
            return Ok(Free::Written(revision));
        }
        let on = match self.bounded(self.conn().kv.entry(key)).await? {
            None => 0,
            Some(entry) if entry.operation != Operation::Put => entry.revision,
            Some(_) => return Ok(Free::Held),
        };
        Ok(match self.take_on(key, value.clone(), on, cut).await? {
            Some(revision) => Free::Written(revision),
            // The marker was purged between the read and this write (the
            // releaser clears it in the background right after its
            // release): the key may have no message again.
            None if on != 0 => match self.take_on(key, value, 0, cut).await? {
                Some(revision) => Free::Written(revision),
                None => Free::Raced,
            },
            None => Free::Raced,
        })
    }

    /// One write of a take (see [`update_at`](Self::update_at)), with a
    /// message id of its own when `cut` is given (see the `cut` module).
    async fn take_on(
        self: &Arc<Self>,
        key: &str,
        value: Bytes,
        revision: u64,
        cut: Option<(&CutTakes, &str)>,
    ) -> Result<Option<u64>, Error> {
        use async_nats::header::{NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_ID};
        use async_nats::jetstream::context::PublishErrorKind;
        let Some((cut, owner)) = cut else {
            return self.update_at(key, value, revision).await;
        };
        let sending = cut.sending(owner, key);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            async_nats::HeaderValue::from(revision),
        );
        headers.insert(NATS_MESSAGE_ID, sending.id());
        let answer = self.publish(self.subject(key), headers, value).await?;
        // (answered, also when refused: a write the server refused cannot
        // land later)
        let written = match answer {
            Ok(ack) if ack.duplicate => {
                return Err(Error::protocol(
                    SCHEME,
                    "a take's message id was taken already (its attempt ended)",
                ));
            }
            Ok(ack) => Some(self.saw(ack.sequence)),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => None,
            Err(e) => return Err(unavailable(e)),
        };
        sending.answered();
        Ok(written)
    }

    /// Makes the unanswered take writes of an ending attempt `owner`
    /// duplicates before its end frees anything (see the `cut` module): one
    /// message per write's id, all sent at once, each on a key of its own
    /// (`_dlock.e.<id>`, so that a restarted server, which rebuilds its
    /// duplicate ids from the messages of the window, can find them all). A
    /// message answered as a duplicate names a write of the attempt that
    /// landed first (or an earlier end's message): that write is removed
    /// from the lock's key if it is still the key's last message. An id is
    /// forgotten only once done, so an end cut off or failed is tried again
    /// with the rest.
    pub(crate) async fn refuse_late(
        self: &Arc<Self>,
        cut: &CutTakes,
        owner: &str,
    ) -> Result<(), Error> {
        use async_nats::header::NATS_MESSAGE_ID;
        let Some(pending) = cut.pending(owner) else {
            return Ok(());
        };
        let sent = pending.ids.iter().map(|id| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(NATS_MESSAGE_ID, id.as_str());
            let subject = self.subject(&format!("_dlock.e.{id}"));
            async move {
                (self.publish(subject, headers, Bytes::new()).await?).map_err(unavailable)
            }
        });
        let answers = futures::future::join_all(sent).await;
        let mut first_error = None;
        for (id, answer) in pending.ids.iter().zip(answers) {
            let done = match answer {
                // (a write of this attempt's on the lock's key, or a message
                // on another key: the removal is exact and scoped to the key)
                Ok(ack) if ack.duplicate => self
                    .remove_exact(&pending.key, ack.sequence, true)
                    .await
                    .map(drop),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            match done {
                Ok(()) => cut.settled(owner, id),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
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
    /// its revision (read again if it moved meanwhile, as in `extend`).
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
            if self.remove_exact(key, held.revision, true).await? {
                return Ok(true);
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
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("KV-Operation", "PURGE");
        headers.insert("Nats-Rollup", "sub");
        headers.insert(
            async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            async_nats::HeaderValue::from(revision),
        );
        match self
            .publish(self.subject(key), headers, Bytes::new())
            .await?
        {
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
