//! dlock on MongoDB: the seeds' `config.locks` / `config.lockpings` design
//! (MongoDB 2.4's `distlock.cpp`), made atomic, fenced and judged by the
//! server's clock. Official `mongodb` driver; replica sets, sharded clusters
//! (through `mongos`, opt-in: see "Deployments") and standalone servers,
//! MongoDB 4.4 or newer; Mongo-compatible servers where they run the take
//! (checked at connect: see "Compatibility").
//!
//! # How it works
//!
//! Two collections in one database (names configurable, see [`MongoOptions`]):
//!
//! * `locks`, one document per lock name, **kept after release** so its token
//!   only grows:
//!
//!   | field | meaning |
//!   |---|---|
//!   | `_id` | the lock name |
//!   | `state` | `2` held, `0` free (the seeds' states; their `1`, "being taken", is not needed) |
//!   | `session` | the holding session's id, `host:pid:start:random` (the seeds' `process`) |
//!   | `who` | the holding attempt, `session#random`: the owner that release checks |
//!   | `why` | the reason given at acquisition |
//!   | `when` | when it was taken, by the server's clock |
//!   | `ts` | an `ObjectId` naming the request that took it (as in the seeds) |
//!   | `token` | the fencing token, a 64-bit integer: `token + 1` on every grant |
//!   | `expiresAt` | when the hold ends unless renewed, by the server's clock |
//!   | `prev` | `state`, `session`, `who`, `why`, `token`, `expiresAt` of the hold the latest grant replaced |
//!
//! * `sessions`, one document per live session, `{_id: session id, ping}`,
//!   pinged with the server's clock every renewal period (the seeds'
//!   `config.lockpings`); a TTL index removes the documents of dead sessions
//!   four days after their last ping (the seeds' clean-up). Lock documents are
//!   never removed: deleting one would restart its token at 1.
//!
//! **Expiry is judged by the server's clock only** (invariant S6): every
//! comparison is with `$$NOW` inside the server, never with the client's clock
//! (the seeds compared their own clock with the config server's ping times and
//! had to refuse takeovers on skew; dlock avoids the question).
//!
//! * **Take** is one `findOneAndUpdate` (no upsert) on `{_id: name}` and a
//!   one-stage update pipeline: `$replaceWith` the document plus the new
//!   holder (`token + 1`, `expiresAt = $$NOW + ttl`, `when = $$NOW`, ...) **if**
//!   its `expiresAt` (missing = epoch) is `<= $$NOW`; if this attempt already
//!   holds it (a retry after a lost reply) only `expiresAt` is extended to
//!   `$$NOW + ttl`, since the core counts the grant's validity from the retry;
//!   otherwise the document is left unchanged (a no-op that writes nothing).
//!   The reply is the document after the update with `remaining = expiresAt −
//!   $$NOW` projected in, so one round trip tells granted (our `who`), already
//!   ours (same `who`, same token: the take is idempotent) or busy for
//!   `remaining`.
//!   A lock's first take finds no document: it inserts `{_id: name}` (a
//!   duplicate key means another client did) and takes again. An upsert would
//!   save that round trip, but two upserts racing to create the document were
//!   both answered "granted, token 1" by the Mongo-wire server (S2, found by
//!   `dlock bench`'s hot lock), and mongod retries that race only under
//!   conditions. The free-or-expired test lives in the pipeline rather than
//!   the filter so that one request decides and answers.
//! * **Takeover**: the seeds' "forcefully taking over" is now plain expiry. The
//!   take copies the old holder into `prev`, and when a grant replaced a hold
//!   that had expired without release it is logged at `info` with the old
//!   holder's session, owner, reason and token.
//! * **Release** (and renewal) are owner-checked: `_id` + `session` + `who` +
//!   `token` and still live by `$$NOW` (S3). Release sets `state: 0`,
//!   `expiresAt` to the epoch and removes `session`, `who` and `why`.
//! * **Renewal**: every period, one `updateMany` extends all the session's live
//!   holds the core names (`expiresAt = max(expiresAt, $$NOW + ttl)`); a
//!   second request (a `find`) only follows when some hold was not extended,
//!   to tell which. The session's ping goes out after it in the background
//!   (at most one at a time): it keeps the session's document fresh for
//!   operators, but no hold depends on it, so a ping stuck on a dead
//!   connection cannot make a renewal late. A session without holds pings
//!   instead (that is its heartbeat).
//! * **Wedged driver clients** are replaced: a request that fails with a
//!   network error, or hangs until dlock-core gives up on it, marks the
//!   driver client it used, and the next request gets a new one (at most
//!   two a second). The driver's own recovery takes 0.5–1 s after a reset
//!   and can hang for good on connections opened during a partition; see
//!   the `client` module.
//! * **Wake-up**: where the deployment supports change streams (a replica set
//!   or a sharded cluster, detected at connect with `hello`), each backend
//!   keeps one change stream on the lock collection, filtered to events that
//!   free a lock, and wakes this process's waiters of that name; a stream that
//!   breaks is reopened after its last resume token, and waiters poll
//!   meanwhile. Otherwise (a standalone server) waiters poll with a bounded
//!   backoff (5 ms doubling to 100 ms), one per lock and process: the
//!   longest-waiting waiter of a name polls, the others wait until it is
//!   granted the lock or goes away, and the next polls from then on (200
//!   waiters polling each on their own kept the server too busy to answer
//!   releases in time). Either way a waiter also wakes when the
//!   holder's `expiresAt` passes (the take reports the server-measured time
//!   left), on the core's fallback timer, and at once when a lock is released
//!   by this process (the longest-waiting waiter of that name only). Not
//!   fair: whoever asks first after a release wins.
//! * **Consistency**: every write uses write concern `majority`, every read read
//!   concern `majority`, all on the primary, whatever the URL says — a grant
//!   acknowledged by a primary that then loses an election must not be rolled
//!   back, nor a read see a write that will be.
//! * **Indexes** are created at connect if missing (by key): `locks.session`
//!   (renewal, close) and the TTL index on `sessions.ping`.
//!
//! # URLs
//!
//! `mongodb://[user:pass@]host1[:port1][,host2...]/[authdb][?options]` and
//! `mongodb+srv://user:pass@cluster.example.net/` — credentials, `authSource`,
//! `tls`, `replicaSet`, timeouts and the rest as the driver parses them. dlock's
//! own options (`dlock_db`, `dlock_locks`, `dlock_sessions`, `dlock_mongos`)
//! are taken out first, and any other `dlock_…` option is refused; see
//! [`MongoOptions`]. Unless the URL sets `serverSelectionTimeoutMS`,
//! dlock uses 5 s (the driver's default is 30 s). Passwords never appear in
//! `Debug`, errors or logs. [`MongoAdapter`] registers both schemes in a
//! [`Registry`](dlock_core::Registry); [`Backend::capabilities`] says
//! whether a backend's waiters wake by change stream or poll.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//! let backend = dlock_mongo::MongoBackend::connect("mongodb://127.0.0.1:27017/?replicaSet=rs0").await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("jobs/import")?.why("nightly import").acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Deployments
//!
//! | deployment | wake-ups | clock that judges expiry | connect |
//! |---|---|---|---|
//! | replica set | change streams | the primary's | yes |
//! | standalone `mongod` | polling (5→100 ms) | the server's | yes |
//! | sharded cluster, through `mongos` | change streams (polling if the router refuses them) | **the router's that handled each request** | refused unless `dlock_mongos=allow` ([`MongosPolicy`]) |
//! | Mongo-compatible services that present as `mongos` (DocumentDB's gateway, FerretDB 2, ...) | polling (they refuse change streams: code 115) | the gateway's | refused unless `dlock_mongos=allow` |
//!
//! Every deployment must also pass the connect probe ("Compatibility").
//! Polling is bounded: the polling waiter retries the take after 5 ms,
//! doubling to at most 100 ms between tries, and every waiter at the busy
//! lock's server-reported expiry at the latest; a release by this process
//! wakes its longest-waiting waiter of that name at once.
//! Where change streams are up, waiters sleep until a free event (or the
//! expiry, or the core's fallback timer); while a broken stream is being
//! reopened they poll as above. Which of the two a backend uses is
//! [`MongoBackend::change_streams`].
//!
//! `$$NOW` through `mongos`: the router computes it and sends it to the shard
//! with the request, so `expiresAt` is written by one router's clock and
//! compared, at the next take, with whatever router that client used. A
//! router whose clock is **ahead** of the writer's by more than the drift
//! margin frees a hold before its holder's local deadline: two holders
//! (S1). Through one router (or one gateway process, as with DocumentDB) there
//! is one clock and `dlock_mongos=allow` is safe; with several routers it is
//! safe only while their clocks agree within the drift margin (default
//! TTL/100 + 2 ms), which dlock cannot check.
//!
//! # Guarantees and their limits
//!
//! * Mutual exclusion (S1) holds as long as the clock that judges expiry
//!   (above) runs at a sane rate, and a clock that takes over judging (a new
//!   primary after an election, another router) is not **ahead** of the one
//!   that wrote `expiresAt` by more than the session's drift margin: a clock
//!   ahead frees holds early (unsafe); a clock behind only keeps them longer
//!   (a delay, not a double grant).
//! * Tokens (S2) are durable: they live in majority-committed, journaled
//!   documents that are never deleted.
//! * Recovery (L1): a crashed holder's lock is free `ttl` after its last
//!   renewal reached the server; waiters notice at once (they wait for the
//!   server-reported expiry), so the bound is one round trip.
//! * Errors: a refused password is [`Error::Auth`]; an untrusted server
//!   certificate or a server that does not speak TLS is [`Error::Config`],
//!   reported at connect without waiting out server selection. Neither
//!   message carries the password.
//!
//! # Compatibility
//!
//! Every grant is one `findAndModify`, whose update is an
//! aggregation pipeline reading `$$NOW` inside `$replaceWith` →
//! `$mergeObjects` → a document literal, and whose projection computes
//! `expiresAt − $$NOW`. **Connect runs that take once** on a scratch document
//! of the session collection (deleted at once; swept by the TTL index if a
//! cancelled connect leaves it) and refuses a server that rejects it, or
//! runs it differently from MongoDB, with [`Error::Config`] naming the
//! missing feature and the server's code — so a server that cannot lock
//! fails at connect, never at the first acquire. It then leaves an
//! attempt's tombstone (the update an attempt's end writes when a take of
//! it may still be on the wire: a `$filter` by `$$NOW` inside `$let`) on a
//! second scratch document and checks that the attempt's take is refused
//! (S5 reads the tombstones as `$ended.o`). A server whose `hello`
//! reports a wire version below 9 (MongoDB 4.2 or older) is refused the same
//! way before the probe.
//!
//! | server | status |
//! |---|---|
//! | MongoDB 4.4 – 8.x (`mongod`: replica set, standalone; `mongos` with `dlock_mongos=allow`) | supported: update pipelines and `$$NOW` are 4.2, expressions in `findAndModify` projections 4.4. **Not run here** against a genuine `mongod` (none installable); the adapter's queries follow MongoDB's documented semantics and are checked on the wire below |
//! | MongoDB 4.2 and older | refused at connect (wire version) |
//! | Microsoft DocumentDB (the open-source `documentdb` PostgreSQL extension and its gateway) | works with `documentdb.enableNowSystemVariable` and `documentdb.enableVariablesSupportForWriteCommands` on **and** a fix for `$$NOW` in a document literal nested in an expression (the `mongo-wire` build carries it as a one-line patch): this is the server every test here runs on. Stock settings refuse `$$NOW` in write commands, and the unpatched engine refuses the nested literal with code 9 (`FailedToParse`, "The $$NOW operator cannot be used within this specific context"): connect then fails with `Error::Config` (mapping unit-tested; the refusal path itself is run on the real server with a pipeline it refuses, not on an unpatched build). Presents as `mongos` (`dlock_mongos=allow`; one gateway process is one clock), no change streams (waiters poll) |
//! | FerretDB 2.x | the same DocumentDB engine behind FerretDB's own gateway: whether a release enables the settings above and carries the fix is **not verified**; the probe decides at connect |
//! | FerretDB 1.x | **not verified**; its own translation layer, which is not known to run update pipelines: expect the probe to refuse it |
//! | Azure Cosmos DB for MongoDB (vCore) | built on DocumentDB, with settings the user does not control: **not verified**; the probe decides |
//! | Azure Cosmos DB for MongoDB (RU) | a different engine with its own subset of the API: **not verified**; the probe decides |
//! | Amazon DocumentDB | **not verified**; its published list of supported aggregation operators (consulted, not tested) does not name `$$NOW`: expect the probe to refuse it |
//!
//! A service that passes the probe runs the take as MongoDB does; what the
//! probe cannot see is each service's clock and consistency model (see
//! "Deployments" and "Guarantees").
//!
//! # What was verified, and on what
//!
//! Against the mongo-wire server of `scripts/services` (Microsoft DocumentDB
//! on PostgreSQL 15 behind its gateway, built with the fix above; `hello`
//! says `isdbgrid` and wire version 21, change streams are refused with code
//! 115, duplicate keys from `findAndModify` come back as 11000 with
//! `codeName` `SqlState(E23505)`), in CI and on every developer machine:
//!
//! * the whole conformance suite, with every client behind the suite's
//!   fault proxy (`directConnection=true`): lost replies, delays,
//!   blackholes, cuts, and server kill -9 / restart / SIGSTOP; the cases
//!   that need a second server or FIFO say they are skipped and why;
//! * `tests/seeds.rs`: the seeds' semantics read back with the raw driver —
//!   the `locks` document's fields, `when`/`expiresAt`/`ping` written by the
//!   server's clock, the session document pinged with and without holds and
//!   removed at close, takeover of a holder that stopped renewing (granted
//!   only once its `expiresAt` passed by the server's clock, with the next
//!   token and the old holder in `prev`, whose late renewal and release are
//!   refused), and tokens that rise by one per grant across releases,
//!   takeover and [`force_release`](Backend::force_release) (the path of
//!   `dlock release --force`);
//! * `tests/auth.rs`: a wrong password is [`Error::Auth`], an untrusted
//!   certificate [`Error::Config`] at once, a `mongos` refused without
//!   `dlock_mongos=allow`;
//! * the connect probe, on a pipeline the server runs and on ones it refuses
//!   or runs differently;
//! * `dlock bench` and `dlock torture` on a `mongodb://` URL.
//!
//! **Not verified** (no genuine `mongod` can be installed there): a real
//! `mongod` of any version; change streams and wake-up through them
//! (replica sets, sharded clusters); error codes and labels during elections
//! and shutdowns of a replica set; several real `mongos` routers; and
//! `mongodb+srv://` DNS records (parsed by the driver; the wire-fault harness
//! refuses them). `DLOCK_TEST_MONGO_URL` points every test at a real
//! deployment (see the README, "Services for tests").

mod client;
mod fence;
mod floor;
mod notify;
mod options;
mod probe;
mod query;
mod store;
#[cfg(test)]
mod test_server;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc};
use mongodb::options::{
    ClientOptions, CollectionOptions, ReadConcern, ReadPreference, ReturnDocument,
    SelectionCriteria, WriteConcern,
};
use mongodb::{Client, Collection, IndexModel};

use dlock_core::wake::WakeHub;
pub use fence::MongoFence;
pub use floor::MongoFloor;
pub use options::{DEFAULT_DATABASE, DEFAULT_LOCKS, DEFAULT_SESSIONS, MongoOptions, MongosPolicy};
pub use query::SESSION_SWEEP;
use store::{Class, classify, error_code, map_err, token_of};

/// The URL scheme, as reported in errors and logs (also for `mongodb+srv`).
pub(crate) const SCHEME: &str = "mongodb";

/// The smallest TTL: the server's clock has millisecond resolution, and a
/// majority write plus a renewal round must fit comfortably.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// The oldest server supported: MongoDB 4.4 (wire version 9), for update
/// pipelines with `$$NOW` (4.2) and expressions in `findAndModify`
/// projections (4.4).
pub const MIN_WIRE_VERSION: i32 = 9;

/// dlock's server-selection timeout when the URL sets none.
const SERVER_SELECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// What kind of deployment the backend talks to, as `hello` reported it at
/// connect time. It decides how waiters wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deployment {
    /// One `mongod` without a replica set: no change streams; waiters poll.
    Standalone,
    /// A replica set (`hello` reports `setName`): change streams.
    ReplicaSet,
    /// A sharded cluster through `mongos` (`hello` says `isdbgrid`): change
    /// streams.
    Sharded,
}

impl Deployment {
    /// Whether the deployment supports change streams.
    pub fn has_change_streams(self) -> bool {
        matches!(self, Deployment::ReplicaSet | Deployment::Sharded)
    }

    /// Reads a `hello` (or `isMaster`) reply.
    fn from_hello(hello: &Document) -> Self {
        if matches!(hello.get("msg"), Some(Bson::String(m)) if m == "isdbgrid") {
            Deployment::Sharded
        } else if hello.contains_key("setName") {
            Deployment::ReplicaSet
        } else {
            Deployment::Standalone
        }
    }
}

/// The MongoDB [`Adapter`](dlock_core::Adapter): `mongodb://` and `mongodb+srv://` URLs, opened
/// with [`MongoBackend::connect`].
///
/// ```no_run
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// let registry = dlock_core::Registry::new();
/// registry.register(dlock_mongo::MongoAdapter)?;
/// let backend = registry
///     .connect("mongodb://db1:27017,db2:27017/?replicaSet=rs0&dlock_db=ops")
///     .await?;
/// assert!(backend.capabilities().notify_wakeup); // a replica set: change streams
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct MongoAdapter;

dlock_core::impl_adapter!(MongoAdapter, name: SCHEME, schemes: &["mongodb", "mongodb+srv"], connect: MongoBackend::connect, floor: MongoFloor::connect);

/// A lock service on one MongoDB deployment (see the [crate docs](crate)).
///
/// Cheap to clone; clones share the driver's connection pool and the
/// change stream.
#[derive(Clone)]
pub struct MongoBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// The driver client requests go through, replaced when it wedges.
    pub(crate) clients: client::Clients,
    pub(crate) hub: Arc<WakeHub>,
    /// Whether the change stream is up (waiters rely on it rather than poll).
    pub(crate) stream_live: Arc<AtomicBool>,
    options: MongoOptions,
    deployment: Deployment,
    /// The change stream's task, if one opened at connect (it reopens the
    /// stream when it breaks); kept for its `Drop`, which stops it.
    _watcher: Option<AbortOnDrop>,
    /// Whether the capabilities promise change-stream wake-ups (see connect).
    notify_promised: bool,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl MongoBackend {
    /// Connects to a `mongodb://` or `mongodb+srv://` URL (see the [crate
    /// docs](crate)), checks the server version, creates the indexes if
    /// missing and, where the deployment supports them, opens the wake-up
    /// change stream.
    ///
    /// Errors: a malformed URL or an unknown scheme is [`Error::InvalidUrl`];
    /// an unreachable server (after the server-selection timeout) is
    /// [`Error::Unavailable`]; failed authentication is [`Error::Auth`]; an
    /// untrusted server certificate, a TLS failure, or a `mongos` without
    /// `dlock_mongos=allow` is [`Error::Config`]; so is a server older than
    /// 4.4, or one that refuses (or mis-runs) the take's update pipeline
    /// with `$$NOW`, which connect runs once on a scratch document (see
    /// "Compatibility" in the [crate docs](crate)), naming what is missing.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is left behind but idempotently created indexes
    /// and, if cancelled mid-probe, the probe's scratch document in the
    /// session collection (its TTL index sweeps it).
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        Self::with_options(MongoOptions::from_url(url)?).await
    }

    /// Connects with explicit options.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`MongoBackend::connect`].
    pub async fn with_options(options: MongoOptions) -> Result<Self, Error> {
        let mut client_options = ClientOptions::parse(options.driver_url())
            .await
            .map_err(|e| {
                if classify(&e) == Class::Transient {
                    // mongodb+srv: the DNS look-up failed.
                    map_err(e)
                } else {
                    options.driver_refused("not a valid MongoDB URL", &e)
                }
            })?;
        if client_options.server_selection_timeout.is_none() {
            client_options.server_selection_timeout = Some(SERVER_SELECTION_TIMEOUT);
        }
        if client_options.app_name.is_none() {
            client_options.app_name = Some("dlock".to_owned());
        }
        let clients = client::Clients::new(client::Spec {
            options: client_options,
            database: options.database().to_owned(),
            locks: options.locks().to_owned(),
            sessions: options.sessions().to_owned(),
            collection_options: collection_options(),
        })
        .map_err(|e| options.driver_refused("the driver cannot use it", &e))?;
        let conn = clients.current();
        let hello = hello_or_fatal(&conn).await?;
        let wire = hello
            .get("maxWireVersion")
            .and_then(|v| store::int_of(Some(v)))
            .unwrap_or(0);
        if wire < i64::from(MIN_WIRE_VERSION) {
            return Err(Error::Config(format!(
                "{SCHEME}: the server speaks wire version {wire} (MongoDB 4.2 or older); \
                 dlock-mongo needs MongoDB 4.4 or newer (wire version {MIN_WIRE_VERSION}) for \
                 {}",
                probe::FEATURE
            )));
        }
        let deployment = Deployment::from_hello(&hello);
        if deployment == Deployment::Sharded {
            match options.mongos() {
                MongosPolicy::Refuse => {
                    return Err(Error::Config(format!(
                        "{SCHEME}: the server is a mongos router (a sharded cluster, or a \
                         Mongo-compatible service that presents as one): lock expiry would be \
                         judged by the clock of whichever router handles each request; add \
                         dlock_mongos=allow to the URL if every client uses one router, or all \
                         routers' clocks are kept within the session's drift margin of each \
                         other"
                    )));
                }
                MongosPolicy::Allow => tracing::warn!(
                    url = %options,
                    "connected through mongos (dlock_mongos=allow): lock expiry is judged by \
                     each request's router's clock; safe only while the routers' clocks agree \
                     within the session's drift margin"
                ),
            }
        }
        ensure_index(&conn.locks, query::session_index()).await?;
        ensure_index(&conn.sessions, query::ping_index()).await?;
        // Mongo-compatible servers claim versions whose features they lack:
        // run the take once, so that one that cannot fails here.
        probe::check(&clients).await?;
        let hub = Arc::new(WakeHub::default());
        let stream_live = Arc::new(AtomicBool::new(false));
        // What the capabilities promise: notifications wherever the server
        // has change streams, also when opening one failed for another
        // reason (a missing privilege, a blip): the suite's wake-up bounds
        // then catch the broken path instead of quietly allowing a poll.
        let mut notify_promised = deployment.has_change_streams();
        let watcher = if deployment.has_change_streams() {
            match notify::open(&conn.locks, None).await {
                Ok(stream) => {
                    stream_live.store(true, Ordering::Release);
                    Some(AbortOnDrop(tokio::spawn(notify::pump(
                        conn.locks.clone(),
                        stream,
                        Arc::downgrade(&hub),
                        stream_live.clone(),
                    ))))
                }
                // A router or Mongo-compatible service that has no change
                // streams says so (CommandNotSupported; "only supported on
                // replica sets"): expected, waiters poll.
                Err(e) if matches!(error_code(&e), Some(115 | 40573)) => {
                    notify_promised = false;
                    tracing::info!(
                        error = %e.kind,
                        "the server has no change streams; waiters will poll"
                    );
                    None
                }
                Err(e) => {
                    tracing::warn!(
                        error = %e.kind,
                        "cannot open a change stream on the lock collection; waiters will poll"
                    );
                    None
                }
            }
        } else {
            None
        };
        tracing::debug!(url = %options, ?deployment, "connected");
        Ok(Self {
            inner: Arc::new(Inner {
                clients,
                hub,
                stream_live,
                options,
                deployment,
                _watcher: watcher,
                notify_promised,
            }),
        })
    }

    /// The deployment kind detected at connect time.
    pub fn deployment(&self) -> Deployment {
        self.inner.deployment
    }

    /// Whether waiters are woken through a change stream right now (false on
    /// a standalone server, or while a broken stream is being reopened).
    pub fn change_streams(&self) -> bool {
        self.inner.stream_live.load(Ordering::Acquire)
    }

    /// The options in use.
    pub fn options(&self) -> &MongoOptions {
        &self.inner.options
    }

    /// Lock documents under `prefix` that are currently held (free documents
    /// are kept on purpose: they carry the token forward). For leak checks.
    ///
    /// # Cancel safety
    /// Cancel safe (read-only).
    pub async fn held_docs(&self, prefix: &str) -> Result<usize, Error> {
        name::check_prefix(prefix)?;
        let op = self.inner.clients.op(None);
        let r = op
            .conn
            .locks
            .count_documents(query::list_filter(prefix))
            .await;
        let n = op.done(r).map_err(map_err)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    fn info(&self, name: LockName, doc: &Document) -> Result<LockInfo, Error> {
        let holder = match doc.get("session") {
            Some(Bson::String(s)) => s.clone(),
            _ => String::new(),
        };
        let mut info = LockInfo::new(name, holder, token_of(doc.get("token"))?);
        info.why = match doc.get("why") {
            Some(Bson::String(s)) => Some(s.clone()),
            _ => None,
        };
        info.acquired_at = doc.get_datetime("when").ok().map(|d| d.to_system_time());
        info.expires_at = doc
            .get_datetime("expiresAt")
            .ok()
            .map(|d| d.to_system_time());
        Ok(info)
    }
}

/// Majority and journaled: on a replica set majority implies the journal
/// (by default), but on a standalone `mongod` majority is `w:1`, which
/// acknowledges before the journal flush: a `kill -9` could then lose the
/// last grant or token (S1, S2).
fn write_concern() -> WriteConcern {
    WriteConcern::builder()
        .w(mongodb::options::Acknowledgment::Majority)
        .journal(true)
        .build()
}

fn collection_options() -> CollectionOptions {
    CollectionOptions::builder()
        .write_concern(write_concern())
        .read_concern(ReadConcern::majority())
        .selection_criteria(SelectionCriteria::ReadPreference(ReadPreference::Primary))
        .build()
}

/// [`hello`] on a new client, or the first heartbeat failure that retrying
/// cannot cure (an untrusted TLS certificate), whichever comes first: the
/// driver would retry the latter until the server-selection timeout.
async fn hello_or_fatal(conn: &client::Conn) -> Result<Document, Error> {
    let mut fatal = conn.fatal.clone();
    tokio::select! {
        reply = hello(&conn.client) => reply,
        Ok(e) = async {
            fatal.wait_for(Option::is_some).await.map(|f| f.clone())
        } => Err(e.map_or_else(|| Error::Config(format!("{SCHEME}: TLS failed")), map_err)),
    }
}

/// `hello`, or `isMaster` on servers that do not know it.
async fn hello(client: &Client) -> Result<Document, Error> {
    let admin = client.database("admin");
    match admin.run_command(doc! { "hello": 1 }).await {
        Ok(reply) => Ok(reply),
        Err(e) if error_code(&e) == Some(59) => admin
            .run_command(doc! { "isMaster": 1 })
            .await
            .map_err(map_err),
        Err(e) => Err(map_err(e)),
    }
}

/// Creates `model` on `coll` unless an index on the same keys exists
/// (whatever its name). Concurrent creators of the same index all succeed.
async fn ensure_index(coll: &Collection<Document>, model: IndexModel) -> Result<(), Error> {
    if let Some(found) = find_index(coll, &model).await? {
        let want = model.options.as_ref().and_then(|o| o.expire_after);
        let have = found.options.as_ref().and_then(|o| o.expire_after);
        if want != have {
            tracing::warn!(
                collection = coll.name(),
                keys = %model.keys,
                ?want,
                ?have,
                "an index on these keys exists with another TTL; leaving it as it is"
            );
        }
        return Ok(());
    }
    let Err(e) = coll.create_index(model.clone()).await else {
        return Ok(());
    };
    // Another client may have created it meanwhile (or be building it).
    if find_index(coll, &model).await?.is_some() {
        return Ok(());
    }
    match error_code(&e) {
        // IndexOptionsConflict, IndexKeySpecsConflict: someone else's index
        // with our name; correctness does not depend on it.
        Some(85 | 86) => {
            tracing::warn!(collection = coll.name(), error = %e, "index not created");
            Ok(())
        }
        _ => Err(map_err(e)),
    }
}

/// The index on `model`'s keys, if `coll` has one.
async fn find_index(
    coll: &Collection<Document>,
    model: &IndexModel,
) -> Result<Option<IndexModel>, Error> {
    let existing: Vec<IndexModel> = match coll.list_indexes().await {
        Ok(cursor) => cursor.try_collect().await.map_err(map_err)?,
        // NamespaceNotFound: the collection does not exist yet.
        Err(e) if error_code(&e) == Some(26) => Vec::new(),
        Err(e) => return Err(map_err(e)),
    };
    Ok(existing
        .into_iter()
        .find(|i| same_keys(&i.keys, &model.keys)))
}

/// Whether two index key patterns are the same: same fields in the same
/// order, directions compared as numbers (the shell writes `1.0`, the driver
/// `1`).
fn same_keys(a: &Document, b: &Document) -> bool {
    fn number(v: &Bson) -> Option<f64> {
        match v {
            Bson::Int32(n) => Some(f64::from(*n)),
            Bson::Int64(n) => Some(*n as f64),
            Bson::Double(d) => Some(*d),
            _ => None,
        }
    }
    a.len() == b.len()
        && a.iter().zip(b.iter()).all(|((ka, va), (kb, vb))| {
            ka == kb
                && match (number(va), number(vb)) {
                    (Some(x), Some(y)) => x == y,
                    _ => va == vb,
                }
        })
}

impl fmt::Debug for MongoBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoBackend")
            .field("url", &self.inner.options.to_string())
            .field("database", &self.inner.options.database())
            .field("locks", &self.inner.options.locks())
            .field("sessions", &self.inner.options.sessions())
            .field("deployment", &self.inner.deployment)
            .finish()
    }
}

#[async_trait]
impl Backend for MongoBackend {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    /// Tokens are durable; wake-ups come from the change stream if one
    /// opened at connect (a replica set or sharded cluster that has them),
    /// else from a poll; a session survives reconnects. Not fair.
    fn capabilities(&self) -> Capabilities {
        let streams = self.inner.notify_promised;
        let mut caps = Capabilities::default();
        // Held locks survive a restart: lock documents are written with majority write concern, journaled.
        caps.restart_loses_locks = false;
        // Majority-committed, journaled lock documents, never deleted.
        caps.durable_tokens = true;
        caps.notify_wakeup = streams;
        // A free event, or a poll capped at 100 ms.
        caps.wakeup_bound = Duration::from_millis(if streams { 150 } else { 300 });
        // Waiters re-check at the holder's server-reported expiry.
        caps.recovery_bound = Duration::from_secs(1);
        // A session is its lock documents' `expiresAt`: nothing in the store
        // dies with a connection.
        caps.survives_reconnect = true;
        // An attempt that ends while a take of it may still be on the wire
        // joins its document's `ended` list, which that take meets.
        caps.refuses_late_takes = true;
        caps
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        Ok(Arc::new(
            store::MongoSession::open(self.inner.clone(), id, options).await?,
        ))
    }

    /// `ping` on the `admin` database: one plain round trip.
    async fn ping(&self) -> Result<(), Error> {
        let op = self.inner.clients.op(None);
        let r = op
            .conn
            .client
            .database("admin")
            .run_command(doc! { "ping": 1 })
            .await;
        op.done(r).map_err(map_err)?;
        Ok(())
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let op = self.inner.clients.op(None);
        let r = op
            .conn
            .locks
            .find_one(query::held_filter(name))
            .projection(query::info_projection())
            .await;
        let doc = op.done(r).map_err(map_err)?;
        doc.map(|d| self.info(name.clone(), &d)).transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let op = self.inner.clients.op(None);
        let r = async {
            op.conn
                .locks
                .find(query::list_filter(prefix))
                .sort(doc! { "_id": 1 })
                .projection(query::info_projection())
                .await?
                .try_collect::<Vec<Document>>()
                .await
        }
        .await;
        let docs = op.done(r).map_err(map_err)?;
        docs.iter()
            .map(|d| {
                let name = match d.get("_id") {
                    Some(Bson::String(s)) => LockName::new(s).ok(),
                    _ => None,
                }
                .ok_or_else(|| {
                    Error::protocol(
                        SCHEME,
                        format!(
                            "invalid lock name {:?} in the lock collection",
                            d.get("_id")
                        ),
                    )
                })?;
                self.info(name, d)
            })
            .collect()
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        let op = self.inner.clients.op(None);
        let r = op
            .conn
            .locks
            .find_one(query::validate_filter(name, token.get()))
            .projection(doc! { "_id": 1 })
            .await;
        let found = op.done(r).map_err(map_err)?;
        Ok(found.is_some())
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let op = self.inner.clients.op(None);
        let r = op
            .conn
            .locks
            .find_one_and_update(query::held_filter(name), query::free_update())
            .return_document(ReturnDocument::Before)
            .projection(query::info_projection())
            .await;
        let old = op.done(r).map_err(map_err)?;
        let Some(old) = old else { return Ok(false) };
        tracing::info!(
            lock = %name,
            old_session = ?old.get("session"),
            old_token = ?old.get("token"),
            old_why = ?old.get("why"),
            "force-released"
        );
        self.inner.hub.wake_all(name.as_str());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deployment_from_hello() {
        assert_eq!(
            Deployment::from_hello(&doc! { "isWritablePrimary": true, "maxWireVersion": 21 }),
            Deployment::Standalone
        );
        assert_eq!(
            Deployment::from_hello(&doc! { "setName": "rs0", "maxWireVersion": 21 }),
            Deployment::ReplicaSet
        );
        assert_eq!(
            Deployment::from_hello(&doc! { "msg": "isdbgrid", "maxWireVersion": 21 }),
            Deployment::Sharded
        );
        assert!(!Deployment::Standalone.has_change_streams());
        assert!(Deployment::ReplicaSet.has_change_streams());
        assert!(Deployment::Sharded.has_change_streams());
    }

    #[test]
    fn index_keys_compare_by_value() {
        assert!(same_keys(&doc! { "session": 1 }, &doc! { "session": 1.0 }));
        assert!(same_keys(&doc! { "ping": 1_i64 }, &doc! { "ping": 1 }));
        assert!(!same_keys(&doc! { "ping": 1 }, &doc! { "ping": -1 }));
        assert!(!same_keys(
            &doc! { "a": 1, "b": 1 },
            &doc! { "b": 1, "a": 1 }
        ));
        assert!(!same_keys(&doc! { "a": 1 }, &doc! { "a": 1, "b": 1 }));
        assert!(!same_keys(&doc! { "a": "hashed" }, &doc! { "a": 1 }));
    }

    #[test]
    fn collections_use_majority_on_the_primary() {
        let o = collection_options();
        let w = o.write_concern.expect("a write concern");
        assert_eq!(w.w, Some(mongodb::options::Acknowledgment::Majority));
        assert_eq!(w.journal, Some(true));
        assert_eq!(
            o.read_concern.map(|r| r.level),
            Some(ReadConcern::majority().level)
        );
        assert!(matches!(
            o.selection_criteria,
            Some(SelectionCriteria::ReadPreference(ReadPreference::Primary))
        ));
    }

    #[tokio::test]
    async fn connect_refuses_bad_urls_before_any_network() {
        for url in [
            "redis://127.0.0.1:6379",
            "mongodb://",
            "mongodb://u:hunter2@h/?dlock_db=a.b",
        ] {
            dlock_conformance::unit::assert_refused(url, MongoBackend::connect(url).await, "");
        }
    }
}
