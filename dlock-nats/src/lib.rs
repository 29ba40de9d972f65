//! dlock on NATS JetStream KV: `nats://host:port[,host:port...][/bucket][?max_age=30s]`.
//!
//! Written from `docs/writing-an-adapter.md` as an outside adapter author
//! would (issue 18): the store mapping is this file; the core does the rest.
//!
//! | primitive | NATS KV |
//! |---|---|
//! | take | one write of the lock's key that the server accepts only if the key has no message (`Nats-Expected-Last-Subject-Sequence: 0`): free, expired or released |
//! | token | the stream sequence of that write (the key's revision), increasing over every key of the bucket, kept across restarts with the stream's file storage |
//! | expiry | the bucket's `max_age`: the server drops a value `max_age` after its last write, by its own clock |
//! | renew | `update` on the key's last revision with the same owner and token (resets its age) |
//! | release | delete of the held message by its sequence (one message is kept per key, so that message exists only while it is the key's value), after checking owner and token; no delete marker is left, so the next take is one write |
//! | wake-up | a release is announced on a plain NATS subject that waiters subscribe to; an expiry sends nothing, so waiters also re-check at the holder's expiry |
//!
//! **`max_age` is the bucket's, not the session's.** NATS 2.9 has no TTL per
//! message, and a lock name must mean one key, so all clients of a bucket
//! share one `max_age` (the URL's `max_age`, default 30 s; a bucket that
//! exists with another one is refused, not changed). A session's TTL may be
//! at most `max_age`: its holds are renewed every TTL/3, but a crashed
//! holder's lock is free only `max_age` after its last renewal. Give
//! sessions `max_age` as their TTL.
//!
//! | URL part | meaning | default |
//! |---|---|---|
//! | `user:password@` | NATS user and password | none |
//! | `token@` (no password) | NATS token authentication | none |
//! | `/bucket` | the KV bucket (1-64 of `[A-Za-z0-9-_]`), created if missing | `dlock` |
//! | `?max_age=30s` | how long the bucket keeps a value after its last write; a session's TTL may be at most this | `30s` |
//!
//! **The bucket.** dlock creates it (file storage, one value per key, one
//! replica, message deletes allowed). A bucket made otherwise (`nats kv add`
//! denies deletes; history above 1, memory storage or replicas break what
//! releases and tokens rest on) is refused with [`Error::Config`].
//!
//! **Limits, found in review:**
//! - A take given up while its write was still on the way (a lost or slow
//!   reply, then `abandon`) can land afterwards and keep the lock for
//!   `max_age`, not the session's TTL; the declared recovery bound covers it.
//! - Tokens are stream sequences. A server that forgets an emptied stream's
//!   last sequence across a hard kill (nats-server#5497, #6789; Debian 12's
//!   2.9.10 predates both fixes) would hand them out again: a client that saw
//!   higher sequences refuses such a take with [`Error::Protocol`], but a
//!   process started after the reset cannot tell. JetStream also syncs its
//!   files to disk only every two minutes by default: a host crash (not a
//!   server kill) can lose acknowledged writes. Use a current server.
//!
//! Value of a held key: `owner\ntoken\nsession\nwhy` (`token` empty until the
//! first renewal: the take's own sequence is the token, and the take cannot
//! know it before the server answers).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv::{self, Operation, Store};
use async_trait::async_trait;
use bytes::Bytes;
use dlock_core::backend::{Busy, Claim, ExpiryModel, Hold, RawSession, Take};
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions,
};
use futures::StreamExt;
use tokio::time::Instant;

const SCHEME: &str = "nats";
const DEFAULT_BUCKET: &str = "dlock";
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(30);
const MIN_TTL: Duration = Duration::from_millis(500);
/// How many times a conditional write is tried again when the key moved
/// between the read and the write.
const RACES: usize = 4;
/// The soonest a waiter checks a busy key again on its own (see `left`).
const RECHECK_FLOOR: Duration = Duration::from_millis(100);
/// How many renewals of one session are in flight at once.
const RENEWALS_IN_FLIGHT: usize = 256;
/// How long one request may take before it counts as unanswered.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The `nats://` adapter.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsAdapter;

dlock_core::impl_adapter!(NatsAdapter, name: SCHEME, schemes: &["nats"], connect: NatsBackend::connect);

/// A lock service on one NATS JetStream KV bucket.
#[derive(Clone)]
pub struct NatsBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// The connection requests go to: replaced by a new one when a request
    /// goes unanswered (see `Dialer`).
    conn: std::sync::RwLock<Arc<Conn>>,
    dialer: Dialer,
    /// Whether a replacement is being made (one at a time).
    replacing: std::sync::atomic::AtomicBool,
    /// The highest stream sequence this backend has seen: a new write must
    /// get a higher one (see `fresh`).
    highest: std::sync::atomic::AtomicU64,
    bucket: String,
    max_age: Duration,
    shown: String,
}

impl fmt::Debug for NatsBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsBackend")
            .field("url", &self.inner.shown)
            .field("bucket", &self.inner.bucket)
            .finish()
    }
}

impl NatsBackend {
    /// How many keys of lock names under `prefix` hold a message: live
    /// holds, and messages past `max_age` the server has not removed yet.
    /// For leak checks (the conformance suite's `leftovers`).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the server does not answer.
    pub async fn keys_under(&self, prefix: &str) -> Result<usize, Error> {
        Ok(self.inner.keys(prefix).await?.len())
    }

    /// Connects and opens (or creates) the URL's bucket.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a URL this adapter cannot use,
    /// [`Error::Config`] for a bucket that exists with another `max_age`,
    /// [`Error::Unavailable`] when no server answers, [`Error::Auth`] for
    /// refused credentials.
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url: StoreUrl = url.try_into()?;
        if url.scheme() != SCHEME || url.hosts().is_empty() {
            return Err(url.invalid("expected nats://host:port[,host:port...][/bucket]"));
        }
        let mut options = url.options();
        let max_age = options.duration("max_age")?.unwrap_or(DEFAULT_MAX_AGE);
        options.finish()?;
        if max_age < MIN_TTL {
            return Err(url.invalid(format!("max_age must be at least {MIN_TTL:?}")));
        }
        let bucket = match url.path_decoded()?.trim_matches('/') {
            "" => DEFAULT_BUCKET.to_owned(),
            b if b.len() <= 64
                && b.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') =>
            {
                b.to_owned()
            }
            _ => return Err(url.invalid("the bucket must be 1-64 of [A-Za-z0-9-_]")),
        };
        let dialer = Dialer {
            servers: url
                .hosts()
                .iter()
                .map(|h| format!("nats://{}", h.with_default_port(4222)))
                .collect(),
            credentials: match (url.username(), url.password()) {
                ("", None) => None,
                (user, password) => Some((user.to_owned(), password.map(str::to_owned))),
            },
        };
        let shown = url.redacted();
        let client = dialer.dial(&shown).await?;
        let js = async_nats::jetstream::new(client.clone());
        let kv = match tokio::time::timeout(REQUEST_TIMEOUT, js.get_key_value(&bucket)).await {
            Err(_) => return Err(Error::unavailable(SCHEME, "no answer opening the bucket")),
            Ok(Ok(kv)) => kv,
            Ok(Err(_)) => {
                create_bucket(&client, &bucket, max_age).await?;
                tokio::time::timeout(REQUEST_TIMEOUT, js.get_key_value(&bucket))
                    .await
                    .map_err(|_| Error::unavailable(SCHEME, "no answer opening the bucket"))?
                    .map_err(|e| {
                        Error::unavailable(SCHEME, format!("cannot open bucket {bucket}: {e}"))
                    })?
            }
        };
        let status = kv.status().await.map_err(unavailable)?;
        if status.info.config.deny_delete {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} denies message deletes (a bucket made by `nats kv add`): \
                 dlock releases a lock by deleting its message; give a bucket dlock creates"
            )));
        }
        let config = &status.info.config;
        if config.max_messages_per_subject != 1
            || config.storage != async_nats::jetstream::stream::StorageType::File
            || config.num_replicas > 1
        {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} keeps {} values per key on {:?} storage with {} \
                 replicas; dlock needs one value per key (a release deletes the held message \
                 by its sequence), file storage (tokens must survive a restart) and one replica \
                 (reads are served by any replica); give a bucket dlock creates",
                config.max_messages_per_subject, config.storage, config.num_replicas
            )));
        }
        let have = status.max_age();
        if have != max_age {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} has max_age {have:?}, the URL says {max_age:?} \
                 (every client of a bucket must give the same; a bucket is never changed here)"
            )));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                conn: std::sync::RwLock::new(Arc::new(Conn { client, kv })),
                dialer,
                replacing: Default::default(),
                highest: Default::default(),
                bucket,
                max_age,
                shown,
            }),
        })
    }
}

/// A connection and the bucket opened on it.
struct Conn {
    client: async_nats::Client,
    kv: Store,
}

/// Makes connections to the URL's servers.
struct Dialer {
    servers: Vec<String>,
    /// User and password, or a token (the URL's user without a password).
    credentials: Option<(String, Option<String>)>,
}

impl Dialer {
    /// A new connection, its whole handshake bounded.
    async fn dial(&self, shown: &str) -> Result<async_nats::Client, Error> {
        let mut connect = async_nats::ConnectOptions::new()
            .connection_timeout(REQUEST_TIMEOUT)
            .request_timeout(Some(REQUEST_TIMEOUT))
            // A silently dead connection is noticed within about a second
            // (two unanswered pings), not the client's default two minutes.
            .ping_interval(Duration::from_millis(500))
            // Reconnect attempts 100 ms apart, growing to 1 s (the client's
            // default grows to 4 s, which a lock with a short TTL outlives).
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(100 * attempts.min(10) as u64)
            })
            .max_reconnects(None);
        connect = match &self.credentials {
            Some((user, Some(password))) => {
                connect.user_and_password(user.clone(), password.clone())
            }
            // `nats://TOKEN@host`: NATS's token authentication.
            Some((token, None)) => connect.token(token.clone()),
            None => connect,
        };
        let connected =
            tokio::time::timeout(REQUEST_TIMEOUT, connect.connect(self.servers.clone()))
                .await
                .map_err(|_| Error::unavailable(SCHEME, format!("no answer from {shown}")))?;
        connected.map_err(|e| match e.kind() {
            async_nats::ConnectErrorKind::AuthorizationViolation
            | async_nats::ConnectErrorKind::Authentication => Error::Auth {
                backend: SCHEME,
                reason: format!("{shown}: {e}"),
            },
            _ => Error::unavailable(SCHEME, format!("cannot connect to {shown}: {e}")),
        })
    }
}

/// Creates `bucket`'s stream as KV would, but with message deletes allowed
/// (KV denies them; a release deletes the held message, see `delete_if`).
///
/// A raw JetStream request: the client's own stream and bucket creation
/// cannot read nats-server 2.9's answer.
async fn create_bucket(
    client: &async_nats::Client,
    bucket: &str,
    max_age: Duration,
) -> Result<(), Error> {
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    // (a duplicate window longer than max_age is refused)
    let window = max_age.min(Duration::from_secs(120));
    let config = format!(
        r#"{{"name":"KV_{bucket}","subjects":["$KV.{bucket}.>"],"retention":"limits",
"max_consumers":-1,"max_msgs_per_subject":1,"max_msgs":-1,"max_bytes":-1,
"max_age":{},"max_msg_size":-1,"storage":"file","discard":"new","num_replicas":1,
"duplicate_window":{},"allow_rollup_hdrs":true,"deny_delete":false,"deny_purge":false,
"allow_direct":true}}"#,
        nanos(max_age),
        nanos(window)
    );
    let reply = tokio::time::timeout(
        REQUEST_TIMEOUT,
        client.request(format!("$JS.API.STREAM.CREATE.KV_{bucket}"), config.into()),
    )
    .await
    .map_err(|_| Error::unavailable(SCHEME, "no answer creating the bucket"))?
    .map_err(|e| Error::unavailable(SCHEME, format!("cannot create bucket {bucket}: {e}")))?;
    // `{"error":{"code":..,"err_code":..,"description":".."}}` on failure.
    let text = String::from_utf8_lossy(&reply.payload);
    match text.split_once(r#""description":""#) {
        // (a bucket another client created meanwhile is fine: it is read next)
        Some(_) if text.contains("10058") => Ok(()),
        Some((_, why)) => Err(Error::unavailable(
            SCHEME,
            format!(
                "cannot create bucket {bucket}: {}",
                why.split('"').next().unwrap_or_default()
            ),
        )),
        None => Ok(()),
    }
}

/// Whether a message delete failed because the message is gone (replaced
/// by a newer write, expired, or deleted already).
fn no_message(e: &async_nats::jetstream::stream::DeleteMessageError) -> bool {
    use async_nats::jetstream::ErrorCode;
    match e.kind() {
        async_nats::jetstream::stream::DeleteMessageErrorKind::JetStream(js) => {
            js.error_code() == ErrorCode::NO_MESSAGE_FOUND
                // (nats-server 2.9 answers a delete of a missing message with
                // the generic "delete failed" code and this text)
                || (js.error_code() == ErrorCode::STREAM_MESSAGE_DELETE_FAILED
                    && js.to_string().contains("no message found"))
        }
        _ => false,
    }
}

fn unavailable(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::unavailable(SCHEME, e)
}

/// A lock name as a KV key: its bytes in hex (keys allow only `[-/_=.a-zA-Z0-9]`).
fn key_of(name: &LockName) -> String {
    key_prefix(name.as_str())
}

/// The start of the keys of every name that starts with `prefix`.
fn key_prefix(prefix: &str) -> String {
    let mut key = String::from("l.");
    for b in prefix.bytes() {
        key.push_str(&format!("{b:02x}"));
    }
    key
}

fn name_of(key: &str) -> Option<LockName> {
    let hex = key.strip_prefix("l.")?;
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    LockName::new(String::from_utf8(bytes?).ok()?).ok()
}

/// A request in flight: if it is dropped unanswered after `STALLED`, the
/// connection is replaced.
struct InFlight<'a> {
    inner: Option<&'a Arc<Inner>>,
    since: Instant,
}

/// How long a request may go unanswered before its connection counts as
/// dead (loopback round trips take well under a millisecond; a request
/// cancelled sooner, e.g. by a caller's `select!`, says nothing).
const STALLED: Duration = Duration::from_millis(50);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.filter(|_| self.since.elapsed() >= STALLED) {
            inner.replace_connection();
        }
    }
}

/// A held key's value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Value {
    owner: String,
    token: Option<FencingToken>,
    session: String,
    why: String,
}

impl Value {
    fn encode(&self) -> Bytes {
        let token = self.token.map(|t| t.get().to_string()).unwrap_or_default();
        Bytes::from(format!(
            "{}\n{token}\n{}\n{}",
            self.owner, self.session, self.why
        ))
    }

    fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| Error::protocol(SCHEME, "a lock value is not UTF-8"))?;
        let mut parts = text.splitn(4, '\n');
        let (Some(owner), Some(token), Some(session), why) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Error::protocol(SCHEME, "a lock value has too few fields"));
        };
        let token = match token {
            "" => None,
            t => Some(FencingToken::new(t.parse().map_err(|_| {
                Error::protocol(SCHEME, format!("lock value token {t:?} is no number"))
            })?)),
        };
        Ok(Self {
            owner: owner.to_owned(),
            token,
            session: session.to_owned(),
            why: why.unwrap_or_default().to_owned(),
        })
    }
}

/// A live lock entry: its value, revision, token and server timestamp.
struct Held {
    value: Value,
    revision: u64,
    token: FencingToken,
    created: SystemTime,
}

impl Inner {
    /// Bounds one request (NATS requests wait for a reconnect).
    async fn bounded<T, E>(
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
    async fn call<T>(self: &Arc<Self>, fut: impl Future<Output = T>) -> Result<T, Error> {
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
    fn conn(&self) -> Arc<Conn> {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes a new connection in the background and sends later requests
    /// to it (one replacement at a time).
    fn replace_connection(self: &Arc<Self>) {
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
            if let Ok(client) = inner.dialer.dial(&inner.shown).await {
                let js = async_nats::jetstream::new(client.clone());
                if let Ok(Ok(kv)) =
                    tokio::time::timeout(REQUEST_TIMEOUT, js.get_key_value(&inner.bucket)).await
                {
                    *inner.conn.write().unwrap_or_else(|e| e.into_inner()) =
                        Arc::new(Conn { client, kv });
                }
            }
            inner.replacing.store(false, Ordering::Release);
        });
    }

    /// The highest stream sequence seen so far.
    fn highest(&self) -> u64 {
        self.highest.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records a stream sequence the server reported.
    fn saw(&self, revision: u64) -> u64 {
        self.highest
            .fetch_max(revision, std::sync::atomic::Ordering::AcqRel);
        revision
    }

    /// Checks the sequence of a new take against `before`, the highest
    /// sequence seen before it was sent (`highest()`; one seen meanwhile
    /// may be larger): a server that forgot its stream's last sequence
    /// (a hard kill while the bucket was empty, on servers without
    /// nats-server#5497 and #6789, 2.9 among them) would hand out tokens
    /// again (S2). The take is then refused here (the core abandons it,
    /// which deletes it), and every later one too, until the sequences
    /// pass what this process saw.
    fn fresh(&self, revision: u64, before: u64) -> Result<u64, Error> {
        self.saw(revision);
        if revision <= before {
            return Err(Error::protocol(
                SCHEME,
                format!(
                    "bucket {}: the stream's sequence went back (a take got {revision} after \
                     {before} was seen): the server lost its stream state, and fencing tokens \
                     would repeat",
                    self.bucket
                ),
            ));
        }
        Ok(revision)
    }

    /// The keys of the lock names under `prefix` that have a message (a
    /// hold, or a delete marker another tool left), from the stream's own
    /// list of subjects (one request per page), not KV's `keys`: that is a
    /// consumer, which goes on delivering while holders renew, so under load
    /// it never ends.
    async fn keys(self: &Arc<Self>, prefix: &str) -> Result<Vec<String>, Error> {
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
    async fn held(self: &Arc<Self>, key: &str) -> Result<Option<Held>, Error> {
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
    fn left(&self, created: SystemTime) -> Duration {
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
    async fn extend(
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
            match self
                .call(self.conn().kv.update(key, value.clone(), held.revision))
                .await
            {
                Err(e) => return Err(e),
                Ok(Ok(revision)) => return Ok(Some((held.token, self.saw(revision), value))),
                Ok(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Ok(Err(e)) => return Err(unavailable(e)),
            }
        }
        Err(Error::unavailable(SCHEME, "the lock's key kept changing"))
    }

    /// Deletes a held key if `owner` (and `token`, if given) hold it, by
    /// its revision (read again if it moved meanwhile, as in `extend`).
    async fn delete_if(
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
            // The message itself is removed, not covered by a delete marker:
            // the subject is then empty, and the next take is one write
            // (see `try_take`).
            if self.delete_message(held.revision).await? {
                self.released(key).await;
                return Ok(true);
            }
        }
        Err(Error::unavailable(SCHEME, "the lock's key kept changing"))
    }

    /// Deletes the message at `revision`: `false` if it is gone (replaced
    /// by a newer write, expired, or deleted already). With one message
    /// kept per key, that message exists only while it is its key's value,
    /// so the delete is conditional by itself.
    async fn delete_message(self: &Arc<Self>, revision: u64) -> Result<bool, Error> {
        match self
            .call(self.conn().kv.stream.delete_message(revision))
            .await?
        {
            Ok(_) => Ok(true),
            Err(e) if no_message(&e) => Ok(false),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// The subject a release of `key` is announced on (plain NATS, not
    /// JetStream: a waiter that misses it re-checks at the holder's expiry
    /// or the core's fallback poll).
    fn release_subject(&self, key: &str) -> String {
        format!("_dlock.{}.{key}", self.bucket)
    }

    /// Wakes the waiters of `key` (best effort).
    async fn released(self: &Arc<Self>, key: &str) {
        // (in the background: a publish waits while the client reconnects)
        let client = self.conn().client.clone();
        let subject = self.release_subject(key);
        tokio::spawn(async move {
            let _ = client.publish(subject, Bytes::new()).await;
        });
    }

    fn info(&self, name: LockName, held: Held) -> LockInfo {
        let mut info = LockInfo::new(name, held.value.session.clone(), held.token);
        info.why = (!held.value.why.is_empty()).then(|| held.value.why.clone());
        info.expires_at = Some(held.created + self.max_age);
        info
    }
}

#[async_trait]
impl Backend for NatsBackend {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    /// The bucket's `max_age`: the store keeps a hold that long after its
    /// last write, so no session may ask for more.
    fn max_ttl(&self) -> Duration {
        self.inner.max_age
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::default();
        // Stream sequences on file storage: they survive a restart, and so
        // do held keys (acknowledged writes are on disk).
        caps.durable_tokens = true;
        caps.restart_loses_locks = false;
        // A release is announced on a plain subject the waiters subscribe to.
        caps.notify_wakeup = true;
        caps.wakeup_bound = Duration::from_millis(250);
        // A crashed holder's key lives max_age from its last write, which
        // is at most one renewal period before the crash; a session's TTL
        // is at least MIN_TTL, and the server removes an expired message
        // within about a second (its age check).
        caps.recovery_bound =
            self.inner.max_age.saturating_sub(MIN_TTL) + Duration::from_millis(1500);
        caps
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(NatsSession {
            inner: self.inner.clone(),
            id,
            ttl: options.ttl_value(),
            revisions: Revisions::default(),
        }))
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        Ok(self
            .inner
            .held(&key_of(name))
            .await?
            .map(|held| self.inner.info(name.clone(), held)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        dlock_core::name::check_prefix(prefix)?;
        let mut names = std::collections::BTreeMap::new();
        for key in self.inner.keys(prefix).await? {
            if let Some(name) = name_of(&key) {
                names.insert(key, name);
            }
        }
        let mut out = Vec::new();
        for (key, name) in names {
            if let Some(held) = self.inner.held(&key).await? {
                out.push(self.inner.info(name, held));
            }
        }
        out.sort_by(|a, b| a.name.as_str().cmp(b.name.as_str()));
        Ok(out)
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        Ok(self
            .inner
            .held(&key_of(name))
            .await?
            .is_some_and(|held| held.token == token))
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        self.inner.delete_if(&key_of(name), None, None).await
    }

    async fn ping(&self) -> Result<(), Error> {
        // (a read of a key no lock uses: `status` answers from a cache)
        self.inner
            .bounded(self.inner.conn().kv.entry("ping"))
            .await
            .map(drop)
    }
}

/// A session: nothing in the store (each hold expires on its own).
struct NatsSession {
    inner: Arc<Inner>,
    id: SessionId,
    ttl: Duration,
    revisions: Revisions,
}

/// The revision each of a session's holds was last written at, by owner
/// value: a renewal is then one conditional write and a release one
/// delete, not a read first. Only a hint: a write on a stale revision is
/// refused by the server, a delete of a gone message too, and both fall
/// back to reading the key.
type Revisions = Arc<std::sync::Mutex<std::collections::HashMap<String, Written>>>;

/// What a session last wrote for one hold.
#[derive(Clone)]
struct Written {
    /// The store key (a hold's owner value names one lock, but a forged
    /// hold may pair it with another lock's name: a message delete is not
    /// scoped to a key, so the key is checked here).
    key: String,
    token: FencingToken,
    revision: u64,
    value: Bytes,
}

/// Records what a session wrote for the hold `owner`.
fn remember(revisions: &Revisions, owner: &str, key: &str, grant: (FencingToken, u64, Bytes)) {
    let (token, revision, value) = grant;
    let written = Written {
        key: key.to_owned(),
        token,
        revision,
        value,
    };
    revisions.lock().unwrap().insert(owner.to_owned(), written);
}

impl fmt::Debug for NatsSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSession").field("id", &self.id).finish()
    }
}

impl NatsSession {
    /// Deletes the hold's message by the revision this session last wrote
    /// it at, in one request, so that a release whose reply is lost still
    /// takes effect (a read first would need its answer); reads the key
    /// only when that revision is unknown or gone (a renewal in flight
    /// moved it, or an earlier try of this release deleted it).
    /// What this session last wrote for `hold` under `key`, if anything.
    fn known(&self, hold: &Hold, key: &str) -> Option<Written> {
        let revisions = self.revisions.lock().unwrap();
        let written = revisions.get(&hold.key)?;
        (written.key == key && written.token == hold.token).then(|| written.clone())
    }

    async fn release_once(&self, hold: &Hold) -> Result<(), Error> {
        if !self.id.issued(&hold.key) {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        let key = key_of(&hold.name);
        if let Some(written) = self.known(hold, &key)
            && self.inner.delete_message(written.revision).await?
        {
            self.inner.released(&key).await;
            return Ok(());
        }
        if self
            .inner
            .delete_if(&key, Some(&hold.key), Some(hold.token))
            .await?
        {
            Ok(())
        } else {
            Err(Error::NotHeld {
                name: hold.name.to_string(),
            })
        }
    }

    /// Rewrites one hold on its known revision; reads the key first only
    /// when that revision is unknown or stale.
    async fn renew_one(&self, hold: &Hold) -> Result<bool, Error> {
        if !self.id.issued(&hold.key) {
            return Ok(false);
        }
        let key = key_of(&hold.name);
        if let Some(written) = self.known(hold, &key) {
            // (a write on `revision` succeeds only if nothing else wrote the
            // key since this session did: it is still this hold)
            let conn = self.inner.conn();
            let update = conn
                .kv
                .update(&key, written.value.clone(), written.revision);
            match self.inner.call(update).await {
                Err(e) => return Err(e),
                Ok(Ok(next)) => {
                    self.inner.saw(next);
                    // (only if still there: a release may have begun meanwhile)
                    if let Some(entry) = self.revisions.lock().unwrap().get_mut(&hold.key) {
                        entry.revision = next;
                    }
                    return Ok(true);
                }
                Ok(Err(e)) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                Ok(Err(e)) => return Err(unavailable(e)),
            }
        }
        match self.inner.extend(&key, &hold.key, Some(hold.token)).await? {
            Some(grant) => {
                remember(&self.revisions, &hold.key, &key, grant);
                Ok(true)
            }
            None => {
                self.revisions.lock().unwrap().remove(&hold.key);
                Ok(false)
            }
        }
    }
}

#[async_trait]
impl RawSession for NatsSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::PerHold
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(NatsClaim {
            inner: self.inner.clone(),
            key: key_of(name),
            name: name.clone(),
            value: Value {
                owner: self.id.claim_owner(),
                token: None,
                session: self.id.to_string(),
                why: why.unwrap_or_default().replace('\n', " "),
            },
            sent: false,
            watch: None,
            revisions: self.revisions.clone(),
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        // (a write per hold: KV keys expire one by one. A bounded number
        // in flight: 10,000 at once took longer than 256 at a time)
        let renewals: Vec<_> = holds.iter().map(|h| self.renew_one(h)).collect();
        futures::stream::iter(renewals)
            .buffered(RENEWALS_IN_FLIGHT)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let result = self.release_once(hold).await;
        if !result.as_ref().is_err_and(Error::is_retryable) {
            // (kept for a retry: its first delete may have gone unanswered)
            self.revisions.lock().unwrap().remove(&hold.key);
        }
        result
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        for r in futures::future::join_all(holds.iter().map(|h| self.release(h))).await {
            match r {
                Ok(()) | Err(Error::NotHeld { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// One client's claim on one lock: its owner value and, once it waits, a
/// watch of the key.
struct NatsClaim {
    inner: Arc<Inner>,
    key: String,
    name: LockName,
    value: Value,
    /// Whether a create was sent (abandon must then delete what it made).
    sent: bool,
    /// The subscription to the key's release announcements.
    watch: Option<async_nats::Subscriber>,
    revisions: Revisions,
}

impl fmt::Debug for NatsClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsClaim")
            .field("name", &self.name)
            .field("owner", &self.value.owner)
            .finish()
    }
}

impl NatsClaim {
    /// The grant of this claim's write at `revision` (the take's token).
    fn granted(&self, revision: u64) -> (FencingToken, u64, Bytes) {
        let token = FencingToken::new(revision);
        let value = Value {
            token: Some(token),
            ..self.value.clone()
        };
        (token, revision, value.encode())
    }
}

#[async_trait]
impl Claim for NatsClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.sent = true;
        // One write, judged by the server: only if the key has no message
        // (free, expired or released; releases remove the message, see
        // `delete_if`). KV's `create` would be two requests after a delete
        // marker, so a take whose first reply is lost could not take effect.
        let before = self.inner.highest();
        let put = self
            .inner
            .call(
                self.inner
                    .conn()
                    .kv
                    .update(&self.key, self.value.encode(), 0),
            )
            .await?;
        let granted = match put {
            Ok(revision) => Some(self.granted(self.inner.fresh(revision, before)?)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                match self
                    .inner
                    .bounded(self.inner.conn().kv.entry(&self.key))
                    .await?
                {
                    // A delete marker (another tool's delete): take on it.
                    Some(entry) if entry.operation != Operation::Put => {
                        let value = self.value.encode();
                        match self
                            .inner
                            .call(
                                self.inner
                                    .conn()
                                    .kv
                                    .update(&self.key, value, entry.revision),
                            )
                            .await?
                        {
                            Ok(revision) => Some(self.granted(self.inner.fresh(revision, before)?)),
                            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => None,
                            Err(e) => return Err(unavailable(e)),
                        }
                    }
                    // Ours already (an earlier reply lost)? Then extend it,
                    // as a fresh take would (rule 4).
                    _ => {
                        self.inner
                            .extend(&self.key, &self.value.owner, None)
                            .await?
                    }
                }
            }
            Err(e) => return Err(unavailable(e)),
        };
        if let Some(grant) = granted {
            let token = grant.0;
            remember(&self.revisions, &self.value.owner, &self.key, grant);
            return Ok(Take::Granted(Hold {
                name: self.name.clone(),
                token,
                key: self.value.owner.clone(),
            }));
        }
        let retry_after = self
            .inner
            .held(&self.key)
            .await?
            .map(|held| self.inner.left(held.created));
        Ok(Take::Busy(Busy { retry_after }))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let Some(watch) = self.watch.as_mut() else {
            // Subscribe, then return at once: the core takes again, so a
            // release between the last take and the subscription is not
            // missed.
            let subject = self.inner.release_subject(&self.key);
            self.watch = Some(
                self.inner
                    .bounded(self.inner.conn().client.subscribe(subject))
                    .await?,
            );
            return Ok(());
        };
        tokio::select! {
            event = watch.next() => if event.is_none() {
                // The subscription ended: make a new one at the next wait.
                self.watch = None;
            },
            _ = tokio::time::sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        self.watch = None;
        self.revisions.lock().unwrap().remove(&self.value.owner);
        if self.sent {
            self.inner
                .delete_if(&self.key, Some(&self.value.owner), None)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for name in ["a", "reports/nightly", "x.y-z_1"] {
            let n = LockName::new(name).unwrap();
            assert_eq!(name_of(&key_of(&n)), Some(n));
        }
    }

    #[test]
    fn values_round_trip() {
        let v = Value {
            owner: "s#1".into(),
            token: Some(FencingToken::new(7)),
            session: "s".into(),
            why: "a\nb".into(),
        };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
        let v = Value { token: None, ..v };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
    }
}
