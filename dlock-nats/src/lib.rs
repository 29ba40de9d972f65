//! dlock on NATS JetStream KV: `nats://host:port[,host:port...][/bucket][?max_age=30s]`.
//!
//! Written from `docs/writing-an-adapter.md` as an outside adapter author
//! would (issue 18): the store mapping is this crate; the core does the rest.
//!
//! | primitive | NATS KV |
//! |---|---|
//! | take | one write of the lock's key that the server accepts only if the key has no message (`Nats-Expected-Last-Subject-Sequence: 0`): free, expired or released |
//! | token | the stream sequence of that write (the key's revision), increasing over every key of the bucket, kept across restarts with the stream's file storage |
//! | expiry | the bucket's `max_age`: the server drops a value `max_age` after its last write, by its own clock |
//! | renew | `update` on the key's last revision with the same owner and token (resets its age) |
//! | release | a purge marker written only if the key's last message is at the sequence this session last wrote it at (exact and scoped to the key: a sequence the server gave again after losing writes, to another key or to a newer hold of this one, is never removed), else after reading owner and token; the marker is then purged in the background (only while connected), so the next take is one write, and waiters are told |
//! | late takes (S5) | every take write carries a message id of its own; an attempt that ends with writes unanswered first publishes a message with each such id, so that the stream drops those writes as duplicates if they arrive later (`cut` module) |
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
//! replica, purges and roll-ups allowed). A bucket made otherwise (purges
//! denied or sealed, a mirror or sourced bucket; history above 1, memory
//! storage or replicas break what releases and tokens rest on) is refused
//! with [`Error::Config`].
//!
//! **Limits, found in review:**
//! - A take given up while its write was still on the way (a lost or slow
//!   reply, then `abandon`) is dropped as a duplicate if it lands within the
//!   bucket's duplicate window (`min(max_age, 2 min)` on a bucket dlock
//!   creates; a bucket without one declares no `refuses_late_takes`); one
//!   landing later keeps the lock for `max_age`, not the session's TTL,
//!   which the declared recovery bound covers. The server keeps the id of
//!   every take write it stored for that window (about 100-150 bytes each:
//!   tens of megabytes at thousands of takes a second for two minutes), and
//!   the messages that take ids (on `_dlock.e.<id>`, one per write cut off)
//!   for `max_age`.
//! - **A killed server loses its last acknowledged writes**: JetStream
//!   acknowledges a write before its file store has written it, and syncs
//!   every two minutes. A lost take or renewal frees a held lock before its
//!   holder's next renewal fails (declared: `restart_loses_locks`), and the
//!   sequences of lost writes (tokens) are given again (declared: no
//!   `durable_tokens`), so after a kill two grants can carry the same token
//!   and fencing cannot tell them apart. A take (also a retried take that
//!   finds its own earlier message) whose sequence is not above what this
//!   process saw of the bucket is removed and taken again, so one process's
//!   tokens never go back (a retried take that finds its own message also
//!   compares it with what its claim saw of the key); the stream's sequence
//!   is moved past the mark in the background, once per backend at a time
//!   (small messages on `_dlock.advance`, a key no lock uses), and 100,000
//!   or more below is an [`Error::Protocol`] naming a bucket made again,
//!   restored from a backup or a host crash, not a wait. Releases and removals are exact
//!   and scoped to the lock's key, so a sequence given again never removes
//!   another lock's hold or a newer hold of the same lock (the marker's own
//!   purge is sent only while connected; one held back across a reconnect
//!   could still meet a sequence given again). This narrows the kill's
//!   effect but does not close it: a process started after the kill cannot
//!   tell, and a renewal's conditional write on exactly the sequence given
//!   again to the same key by another client overwrites that client's hold
//!   (the lock whose writes the kill lost). The same if the server forgets an
//!   emptied stream's last sequence (nats-server#5497, #6789; Debian 12's
//!   2.9.10 predates both). Fence the data ([`NatsFence`] or the store's
//!   own).
//!
//! Value of a held key: `owner\ntoken\nsession\nwhy` (`token` empty until the
//! first renewal: the take's own sequence is the token, and the take cannot
//! know it before the server answers).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions,
};

mod conn;
mod cut;
mod fence;
mod floor;
mod session;
mod store;
mod value;

use conn::{Conn, Dialer, open_bucket};
pub use fence::{FENCE_HEADER, NatsFence};
pub use floor::NatsFloor;
use session::{NatsSession, Revisions};
use value::{key_of, name_of};

const SCHEME: &str = "nats";
const DEFAULT_BUCKET: &str = "dlock";
const DEFAULT_MAX_AGE: Duration = Duration::from_secs(30);
const MIN_TTL: Duration = Duration::from_millis(500);
/// How many times a conditional write is tried again when the key moved
/// between the read and the write.
const RACES: usize = 4;
/// The soonest a waiter checks a busy key again on its own (see `left`).
const RECHECK_FLOOR: Duration = Duration::from_millis(100);
/// How far below the highest sequence seen a take may land and still be
/// taken again until the sequence passes it (a killed server loses its
/// last few writes); farther is an error (a bucket made again, or restored
/// from a backup), not a wait of one take per missing sequence.
const MAX_SEQUENCE_GAP: u64 = 100_000;
/// How many renewals of one session are in flight at once.
const RENEWALS_IN_FLIGHT: usize = 256;
/// How long one request may take before it counts as unanswered.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The `nats://` adapter.
#[derive(Debug, Clone, Copy, Default)]
pub struct NatsAdapter;

dlock_core::impl_adapter!(NatsAdapter, name: SCHEME, schemes: &["nats"], connect: NatsBackend::connect, floor: NatsFloor::connect);

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
    /// Whether the stream's sequence is being moved on (one at a time, see
    /// `Inner::went_back`).
    advancing: std::sync::atomic::AtomicBool,
    /// The highest stream sequence this backend has seen: a new write must
    /// get a higher one (see `fresh`).
    highest: Arc<std::sync::atomic::AtomicU64>,
    bucket: String,
    max_age: Duration,
    /// The bucket's duplicate window: how long a late take is refused
    /// (see the `cut` module).
    window: Duration,
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

/// The highest sequence seen of one bucket on one set of servers as one
/// user, shared by every backend of this process that opens it: a sequence
/// one of them saw is then above what any of them may be granted. (Two
/// users may be two accounts, each with its own stream of that name; a
/// token is kept only as a hash.)
fn highest_of(dialer: &Dialer, bucket: &str) -> Arc<std::sync::atomic::AtomicU64> {
    use std::hash::{Hash, Hasher};
    type Marks = std::collections::HashMap<String, Arc<std::sync::atomic::AtomicU64>>;
    static MARKS: std::sync::Mutex<Option<Marks>> = std::sync::Mutex::new(None);
    let user = match &dialer.credentials {
        None => String::new(),
        Some((user, Some(_))) => user.clone(),
        Some((token, None)) => {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            token.hash(&mut hasher);
            format!("token-{:x}", hasher.finish())
        }
    };
    let mut marks = MARKS.lock().unwrap_or_else(|e| e.into_inner());
    let key = format!("{user}@{}/{bucket}", dialer.servers.join(","));
    marks
        .get_or_insert_with(Default::default)
        .entry(key)
        .or_default()
        .clone()
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
        let kv = open_bucket(&client, &bucket, Some(max_age)).await?;
        let status = kv.status().await.map_err(unavailable)?;
        let config = &status.info.config;
        if config.mirror.is_some() || config.sources.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} is a mirror or has sources: its writes go to another \
                 stream; give a bucket dlock creates"
            )));
        }
        if config.deny_purge || !config.allow_rollup || config.sealed {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} denies purges, roll-ups or any change (deny_purge \
                 {}, allow_rollup_hdrs {}, sealed {}): dlock releases a lock by purging its \
                 message; give a bucket dlock creates",
                config.deny_purge, config.allow_rollup, config.sealed
            )));
        }
        if config.max_messages_per_subject != 1
            || config.storage != async_nats::jetstream::stream::StorageType::File
            || config.num_replicas > 1
        {
            return Err(Error::Config(format!(
                "nats: bucket {bucket} keeps {} values per key on {:?} storage with {} \
                 replicas; dlock needs one value per key (a release removes the held \
                 message, which is then the key's only one), file storage (tokens must \
                 survive a restart) and one replica (reads are served by any replica); give a \
                 bucket dlock creates",
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
                conn: std::sync::RwLock::new(Arc::new(Conn::new(client, kv))),
                highest: highest_of(&dialer, &bucket),
                dialer,
                replacing: Default::default(),
                advancing: Default::default(),
                bucket,
                max_age,
                window: config.duplicate_window,
                shown,
            }),
        })
    }
}

fn unavailable(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::unavailable(SCHEME, e)
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
        // JetStream acknowledges a write before its file store has written
        // it (a flusher writes behind, and syncs every 2 minutes): a killed
        // server comes back without its last acknowledged writes. CI's soak
        // saw it (server-restarts: 11 overlapping holds in 329). A lost
        // take or renewal frees a held lock, and the sequences of lost
        // writes are given again (a process that saw them refuses such a
        // take: `Inner::fresh`).
        caps.durable_tokens = false;
        caps.restart_loses_locks = true;
        // A release is announced on a plain subject the waiters subscribe to.
        caps.notify_wakeup = true;
        // A late take's write is dropped as a duplicate (the `cut` module),
        // for the bucket's duplicate window: min(max_age, 2 min) on a bucket
        // dlock creates (a shorter one, made by another tool, covers less).
        caps.refuses_late_takes =
            self.inner.window >= self.inner.max_age.min(Duration::from_secs(120));
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
            request_timeout: options.request_timeout_or_default(),
            revisions: Revisions::default(),
            cut: Default::default(),
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
