//! One Redis server: a multiplexed command connection that is replaced as
//! soon as a request on it fails at the connection level, times out, or is
//! abandoned with its answer outstanding; one pub/sub connection for
//! wake-ups, kept by a task of its own; and the scripted operations.
//!
//! Why replace on a time-out: a connection can die silently (a NAT entry
//! dropped, a peer that vanished without a reset). Requests on it then hang
//! and nothing ever closes it, so a client that only reconnects on *closed*
//! connections never recovers. Here the next request after a time-out (the
//! adapter's own, or the core cutting a request off by dropping it) goes out
//! on a new connection, and the pub/sub connection is probed.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::backend::Doubtful;
use dlock_core::wake::{Waiter, WakeHub};
use dlock_core::{Error, FencingToken, LockInfo, LockName};
use futures::StreamExt;
use futures::future::{BoxFuture, FutureExt, Shared};
use redis::cluster::ClusterClient;
use redis::{AsyncConnectionConfig, Client, FromRedisValue, RedisError, Value};
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, sleep, timeout, timeout_at};

use crate::conn::Conn;
use crate::{script, slots};

/// How long a release's (or force-release's) receipt is kept on a cluster:
/// the same request sent again within this time (by the Cluster driver
/// after a reconnect, only while its caller waits, at most `limit`) answers
/// as the first did (see [`script::RELEASE`]). At least 10 s. 0 (none) on
/// one server and Redlock nodes, whose connections never resend.
fn receipt_ms(cluster: bool, limit: Duration) -> u64 {
    if !cluster {
        return 0;
    }
    u64::try_from(limit.as_millis().saturating_mul(2))
        .unwrap_or(u64::MAX)
        .max(10_000)
}

/// The tombstone key of attempt `owner` on the lock of `keys` (in the
/// lock's slot).
fn tombstone_key(keys: &Keys, owner: &str) -> String {
    format!("{}:{owner}", keys.tombstone)
}

/// A fresh receipt key for one release request of the lock of `keys`
/// (64 random bits; in the lock's slot).
fn receipt_key(keys: &Keys) -> String {
    format!("{}:{:016x}", keys.receipt, rand::random::<u64>())
}

/// How long a single Redis keeps the last-token key after a release (after
/// that its own clock in µs is the floor; see [`script`]). Redlock nodes
/// keep it for good ([`KEEP_LAST_FOREVER`]).
pub(crate) const KEEP_LAST_MS: u64 = 10_000;

/// `keep_last_ms` meaning "no expiry". Redlock needs it: its nodes' clocks
/// differ, so a floor from one node's clock says nothing about a token
/// another node issued; only a `last` kept on the node two quorums share
/// orders their tokens (found by the adversarial review: with the key gone
/// and a node 20 s ahead, a later grant got a smaller token).
pub(crate) const KEEP_LAST_FOREVER: u64 = 0;

/// The longest a new connection (TCP, TLS, AUTH and the server checks) may
/// take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the pub/sub connection may take to confirm a (un)subscription or
/// answer a probe before it is replaced.
const PUBSUB_TIMEOUT: Duration = Duration::from_secs(2);

const BACKEND: &str = "redis";

/// Maps a driver error to the core error by meaning (the node named, no
/// secret), and says whether the connection must be replaced.
pub(crate) fn map_err(shown: &str, e: &RedisError) -> (Error, bool) {
    use redis::ErrorKind as K;
    use redis::ServerErrorKind as S;
    let kind = e.kind();
    let code = e.code();
    if kind == K::AuthenticationFailed || matches!(code, Some("WRONGPASS" | "NOAUTH")) {
        // The driver's and the server's messages name no password.
        let reason = format!("{shown}: {e}");
        return (
            Error::Auth {
                backend: BACKEND,
                reason,
            },
            true,
        );
    }
    if matches!(
        kind,
        K::Server(S::Moved | S::Ask | S::ClusterDown | S::CrossSlot | S::TryAgain)
    ) {
        return (
            cluster_refused(shown, code.unwrap_or("cluster error")),
            false,
        );
    }
    // TLS failures that retrying cannot fix (rustls's messages, wrapped in
    // an I/O error by the driver).
    let text = e.to_string();
    if text.contains("invalid peer certificate") {
        return (
            Error::Config(format!(
                "{shown}: TLS: the server's certificate is not trusted ({text}); give the CA \
                 that signed it with tls_ca=PATH"
            )),
            true,
        );
    }
    if [
        "CertificateRequired",
        "BadCertificate",
        "UnknownCA",
        "AccessDenied",
    ]
    .iter()
    .any(|alert| text.contains(&format!("received fatal alert: {alert}")))
    {
        return (
            Error::Auth {
                backend: BACKEND,
                reason: format!("{shown}: the server refused the TLS client certificate ({text})"),
            },
            true,
        );
    }
    if kind == K::Server(S::NoPerm) {
        return (
            Error::backend(
                BACKEND,
                format!("{shown}: the Redis user lacks a permission dlock needs (ACL): {e}"),
            ),
            false,
        );
    }
    let replace = e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        // A master demoted to replica in a failover: a new connection may
        // reach the new master (same address behind a VIP or DNS name).
        || kind == K::Server(S::ReadOnly);
    let transient = replace
        || matches!(kind, K::Server(S::BusyLoading | S::MasterDown))
        || matches!(code, Some("BUSY" | "OOM"));
    let error = if transient {
        Error::unavailable(BACKEND, format!("{shown}: {e}"))
    } else if matches!(kind, K::Parse | K::UnexpectedReturnType) {
        Error::protocol(BACKEND, format!("{shown}: {e}"))
    } else {
        Error::backend(BACKEND, format!("{shown}: {e}"))
    };
    (error, replace)
}

fn cluster_refused(shown: &str, what: &str) -> Error {
    Error::Config(format!(
        "{shown} is a Redis Cluster node ({what}): give the cluster's nodes as \
         redis+cluster://h1:p1,h2:p2,... (or rediss+cluster:// for TLS)"
    ))
}

/// [`map_err`] for a Redis Cluster: a slot moving or failing over
/// (`MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`) is transient, and the driver
/// follows the new slot map itself, so the connection stays; `CROSSSLOT`
/// would be a bug of dlock's (every script's keys share the name's slot).
pub(crate) fn map_cluster_err(shown: &str, e: &RedisError) -> (Error, bool) {
    use redis::ErrorKind as K;
    use redis::ServerErrorKind as S;
    match e.kind() {
        K::Server(S::Moved | S::Ask | S::ClusterDown | S::TryAgain) => (
            Error::unavailable(
                BACKEND,
                format!("{shown}: a slot is moving or failing over: {e}"),
            ),
            false,
        ),
        // The driver wraps a refusal of every seed in an I/O error
        // ("Failed to create initial connections"), without its code.
        _ if ["WRONGPASS", "NOAUTH", "invalid username-password"]
            .iter()
            .any(|refusal| e.to_string().contains(refusal)) =>
        {
            (
                Error::Auth {
                    backend: BACKEND,
                    reason: format!("{shown}: {e}"),
                },
                true,
            )
        }
        _ if e.to_string().contains("cluster support disabled") => (
            Error::Config(format!(
                "{shown}: a server there is not a Redis Cluster node (cluster support \
                 disabled): use redis://host:port for a standalone Redis"
            )),
            false,
        ),
        K::Server(S::CrossSlot) => (
            Error::protocol(
                BACKEND,
                format!("{shown}: keys of several slots in one request: {e}"),
            ),
            false,
        ),
        _ => map_err(shown, e),
    }
}

/// An [`Error`] that can be handed to every caller waiting on one connect.
#[derive(Debug, Clone)]
enum SharedError {
    Auth(String),
    Config(String),
    Backend(String),
    Unavailable(String),
}

impl From<Error> for SharedError {
    fn from(e: Error) -> Self {
        match e {
            Error::Auth { reason, .. } => Self::Auth(reason),
            Error::Config(m) => Self::Config(m),
            Error::Backend { source, .. } => Self::Backend(source.to_string()),
            other => Self::Unavailable(match other {
                Error::Unavailable { source, .. } => source.to_string(),
                e => e.to_string(),
            }),
        }
    }
}

impl From<SharedError> for Error {
    fn from(e: SharedError) -> Self {
        match e {
            SharedError::Auth(reason) => Error::Auth {
                backend: BACKEND,
                reason,
            },
            SharedError::Config(m) => Error::Config(m),
            SharedError::Backend(m) => Error::backend(BACKEND, m),
            SharedError::Unavailable(m) => Error::unavailable(BACKEND, m),
        }
    }
}

/// The key names of one lock.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub(crate) lock: String,
    pub(crate) last: String,
    /// The prefix of a release's receipt key (see [`script::RELEASE`]).
    pub(crate) receipt: String,
    /// The prefix of an attempt's tombstone key (see [`script::RELEASE`]).
    pub(crate) tombstone: String,
    pub(crate) channel: String,
    pub(crate) boot: String,
}

impl Keys {
    /// The keys of `name`; on a Redis Cluster the restart guard's record is
    /// the one of the name's slot (a script's keys must share a slot).
    pub(crate) fn new(prefix: &str, name: &LockName, cluster: bool) -> Self {
        let lock = format!("{prefix}:{{{name}}}");
        Self {
            last: format!("{lock}:t"),
            receipt: format!("{lock}:r"),
            tombstone: format!("{lock}:x"),
            channel: format!("{lock}:c"),
            boot: boot_key(prefix, cluster.then(|| slots::slot(name.as_str()))),
            lock,
        }
    }

    /// The cluster slot of these keys (names contain no braces, so the
    /// hash tag is the whole name).
    fn slot(&self, prefix: &str) -> u16 {
        let tag = &self.lock[prefix.len() + 2..self.lock.len() - 1];
        slots::slot(tag)
    }
}

/// The restart guard's record: one per server (`P:boot`), or on a Redis
/// Cluster one per slot (`P:boot:{T}`, `T` a tag of the slot), so that it
/// sits in the slot of the locks it guards. Neither matches the lock-key
/// pattern `P:{...`.
fn boot_key(prefix: &str, slot: Option<u16>) -> String {
    match slot {
        None => format!("{prefix}:boot"),
        Some(slot) => format!("{prefix}:boot:{{{}}}", slots::tag_of(slot)),
    }
}

/// What a take script answered.
pub(crate) enum Taken {
    Granted(FencingToken),
    Busy(Duration),
}

/// What one node says about a lock (for `inspect`).
pub(crate) struct Record {
    pub(crate) info: LockInfo,
    /// The attempt that holds it: nodes agree on a holder by this.
    pub(crate) owner: String,
}

type Connecting = Shared<BoxFuture<'static, Result<Live, SharedError>>>;

/// What a node connects to.
// (One per node, made once: the size of the driver's clients does not matter.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum Target {
    /// One server.
    Single(Client),
    /// A Redis Cluster: one driver client routing by slot, and a client per
    /// seed for wake-ups (a `PUBLISH` reaches every node of a cluster, so
    /// any one node serves a subscriber).
    Cluster {
        client: ClusterClient,
        seeds: Vec<Client>,
    },
}

impl Target {
    fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster { .. })
    }

    /// The servers a pub/sub connection may be opened on, in order of
    /// preference.
    fn pubsub_clients(&self) -> Vec<Client> {
        match self {
            Target::Single(c) => vec![c.clone()],
            Target::Cluster { seeds, .. } => seeds.clone(),
        }
    }
}

/// The command connection of one node, and how to make a new one.
struct Commands {
    target: Target,
    shown: String,
    allow_eviction: bool,
    /// The eviction warning is logged once per node.
    warned: AtomicBool,
    state: Mutex<ConnState>,
    generations: AtomicU64,
    /// The zero of [`Live::answered`].
    epoch: Instant,
}

/// A connection requests can use.
#[derive(Clone)]
struct Live {
    generation: u64,
    conn: Conn,
    /// When it last answered anything, in µs since [`Commands::epoch`]: a
    /// connection that answered after a request was sent is alive (that
    /// request is queued behind others), one that did not may be dead.
    answered: Arc<AtomicU64>,
}

#[derive(Default)]
struct ConnState {
    /// The connection requests use.
    live: Option<Live>,
    /// A connect under way, shared by everyone who needs it.
    connecting: Option<Connecting>,
}

impl Commands {
    /// The live connection, connecting first if there is none. The connect
    /// runs in a task of its own, so callers that give up (their deadline)
    /// do not cancel it for the next caller.
    async fn connection(self: &Arc<Self>, deadline: Instant) -> Result<Live, Error> {
        let pending = {
            let mut state = self.state.lock().unwrap();
            if let Some(live) = &state.live {
                return Ok(live.clone());
            }
            state
                .connecting
                .get_or_insert_with(|| self.spawn_connect())
                .clone()
        };
        match timeout_at(deadline, pending).await {
            Ok(r) => r.map_err(Error::from),
            Err(_) => Err(Error::unavailable(
                BACKEND,
                format!("{}: not connected in time", self.shown),
            )),
        }
    }

    fn spawn_connect(self: &Arc<Self>) -> Connecting {
        let this = self.clone();
        let task = tokio::spawn(async move {
            let opened = timeout(CONNECT_TIMEOUT, this.open())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "{}: connect timed out after {CONNECT_TIMEOUT:?}",
                            this.shown
                        ),
                    ))
                });
            let mut state = this.state.lock().unwrap();
            state.connecting = None;
            if let (Err(e), Some(old)) = (&opened, &state.live) {
                // A replacement made before breaking (a cluster's): nobody
                // waits for it, so say here why the old one stays.
                tracing::warn!(node = %this.shown, generation = old.generation, error = %e, "could not open a new connection; the old one serves on");
            }
            let conn = opened.map_err(SharedError::from)?;
            let generation = this.generations.fetch_add(1, Ordering::Relaxed) + 1;
            let live = Live {
                generation,
                conn,
                answered: Arc::new(AtomicU64::new(this.micros(Instant::now()))),
            };
            state.live = Some(live.clone());
            tracing::debug!(node = %this.shown, generation, "connected");
            Ok(live)
        });
        let shown = self.shown.clone();
        async move {
            task.await.unwrap_or_else(|e| {
                Err(SharedError::Unavailable(format!(
                    "{shown}: connect task failed: {e}"
                )))
            })
        }
        .boxed()
        .shared()
    }

    fn map_err(&self, e: &RedisError) -> (Error, bool) {
        if self.target.is_cluster() {
            map_cluster_err(&self.shown, e)
        } else {
            map_err(&self.shown, e)
        }
    }

    /// A new connection to a server (or cluster) dlock can use (see
    /// [`Commands::check`]).
    async fn open(&self) -> Result<Conn, Error> {
        let no_info =
            |e: &RedisError| e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm);
        match &self.target {
            Target::Single(client) => {
                // No driver response timeout: requests are bounded by
                // dlock's own limits, which replace the connection when
                // they expire.
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(None);
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(|e| self.map_err(&e).0)?;
                match redis::cmd("INFO").query_async::<String>(&mut conn).await {
                    Ok(info) => self.check(&self.shown, &info)?,
                    Err(e) if no_info(&e) => self.cannot_check(),
                    Err(e) => return Err(self.map_err(&e).0),
                }
                Ok(Conn::Single(conn))
            }
            Target::Cluster { client, .. } => {
                let mut conn = client
                    .get_async_connection()
                    .await
                    .map_err(|e| self.map_err(&e).0)?;
                // The driver sends INFO to every master and answers a map
                // of their addresses to their replies.
                let per_master = match redis::cmd("INFO").query_async::<Value>(&mut conn).await {
                    Ok(Value::Map(per_master)) => per_master,
                    Ok(other) => {
                        return Err(Error::protocol(
                            BACKEND,
                            format!("{}: INFO answered {other:?}", self.shown),
                        ));
                    }
                    Err(e) if no_info(&e) => {
                        self.cannot_check();
                        Vec::new()
                    }
                    Err(e) => return Err(self.map_err(&e).0),
                };
                for (address, info) in per_master {
                    let address =
                        String::from_redis_value(address).unwrap_or_else(|_| "a master".to_owned());
                    match info {
                        Value::ServerError(e) => {
                            let e = RedisError::from(e);
                            if no_info(&e) {
                                self.cannot_check();
                            } else {
                                return Err(self.map_err(&e).0);
                            }
                        }
                        info => {
                            let info = String::from_redis_value(info).map_err(|e| {
                                Error::protocol(
                                    BACKEND,
                                    format!("{}: INFO of {address}: {e}", self.shown),
                                )
                            })?;
                            self.check(&format!("{} ({address})", self.shown), &info)?;
                        }
                    }
                }
                Ok(Conn::Cluster(conn))
            }
        }
    }

    fn cannot_check(&self) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                node = %self.shown,
                "the Redis user may not run INFO: dlock cannot check maxmemory-policy \
                 (an evicting policy can drop held locks)"
            );
        }
    }

    /// Refuses servers dlock cannot use safely: Redis Cluster nodes given
    /// as one server (and servers given as a cluster), Sentinels, and an
    /// eviction policy that may delete held locks (every lock key has a
    /// TTL, so `volatile-*` policies evict them as readily as `allkeys-*`)
    /// unless `allow_eviction=true` says the risk is accepted.
    fn check(&self, shown: &str, info: &str) -> Result<(), Error> {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let is_cluster =
            field("redis_mode") == Some("cluster") || field("cluster_enabled") == Some("1");
        if is_cluster && !self.target.is_cluster() {
            return Err(cluster_refused(shown, "cluster_enabled:1"));
        }
        if !is_cluster && self.target.is_cluster() {
            return Err(Error::Config(format!(
                "{shown} is not a Redis Cluster node (cluster_enabled:0): use redis://host:port"
            )));
        }
        if field("redis_mode") == Some("sentinel") {
            return Err(Error::Config(format!(
                "{shown} is a Redis Sentinel, not a Redis server: give the master's address"
            )));
        }
        let policy = field("maxmemory_policy").unwrap_or("noeviction");
        let limit: u64 = field("maxmemory").and_then(|m| m.parse().ok()).unwrap_or(0);
        if policy == "noeviction" {
            return Ok(());
        }
        if limit > 0 && !self.allow_eviction {
            return Err(Error::Config(format!(
                "{shown}: maxmemory-policy {policy} with maxmemory {limit} may evict held locks \
                 (two holders at once); set maxmemory-policy noeviction, use a Redis of its own \
                 for locks, or add allow_eviction=true to the URL to accept the risk"
            )));
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                node = %shown,
                policy,
                maxmemory = limit,
                "maxmemory-policy may evict held locks (now, or once a maxmemory is set): \
                 two clients could then hold one lock; prefer noeviction"
            );
        }
        Ok(())
    }

    fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// Drops connection `generation` if it is still the live one: the next
    /// request connects anew. Returns whether it was.
    ///
    /// A cluster connection is replaced make-before-break: requests go on
    /// over it (its other masters still answer) while a new one, with the
    /// slot map read afresh, connects in the background and takes over
    /// when it is ready.
    fn retire(self: &Arc<Self>, generation: u64, why: &str) -> bool {
        let mut state = self.state.lock().unwrap();
        if state
            .live
            .as_ref()
            .is_none_or(|l| l.generation != generation)
        {
            return false;
        }
        tracing::debug!(node = %self.shown, generation, why, "replacing the connection");
        if self.target.is_cluster() {
            if state.connecting.is_none() {
                state.connecting = Some(self.spawn_connect());
            }
        } else {
            state.live = None;
        }
        true
    }
}

/// Holds renewed by one script (see [`Node::renew`]).
const RENEW_CHUNK: usize = 1000;

/// One Redis server.
pub(crate) struct Node {
    commands: Arc<Commands>,
    /// A Redis Cluster, reached through one routing client.
    pub(crate) cluster: bool,
    pub(crate) prefix: String,
    pub(crate) shown: String,
    /// How long the last-token key outlives a grant or release, in ms
    /// ([`KEEP_LAST_MS`], or [`KEEP_LAST_FOREVER`] for Redlock).
    keep_last_ms: u64,
    wakeups: Wakeups,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("url", &self.shown).finish()
    }
}

/// One request in flight: if it is dropped with its answer outstanding
/// (the core cut it off at its request timeout), the connection is
/// suspected like on a time-out of the adapter's own.
struct InFlight<'a> {
    node: &'a Node,
    live: Live,
    sent: Instant,
    limit: Duration,
    done: bool,
}

impl InFlight<'_> {
    /// A request on this connection got its answer (any answer, errors too).
    fn answered(&self) {
        let now = self.node.commands.micros(Instant::now());
        self.live.answered.fetch_max(now, Ordering::Relaxed);
    }

    /// The request went unanswered: replace the connection unless it
    /// answered something since this request was sent (then it is alive and
    /// busy, and replacing it would only add a connect to the load).
    ///
    /// On a cluster, answers from other masters say nothing of this
    /// request's: the connection is always replaced, and the new one reads
    /// the slot map afresh (a master stopped without closing its
    /// connections, then replaced by its replica, would otherwise be asked
    /// for ever: the driver learns of a failover only from an error).
    fn unanswered(&self, why: &str) {
        let sent = self.node.commands.micros(self.sent);
        if self.node.cluster || self.live.answered.load(Ordering::Relaxed) < sent {
            self.node.retire(self.live.generation, why);
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        // Dropped early (a caller cancelling at once) says nothing about the
        // connection; dropped after waiting a while for an answer, it does.
        if !self.done && self.sent.elapsed() >= self.limit / 2 {
            self.unanswered("request abandoned");
        }
    }
}

impl Node {
    /// A node that connects at its first request (or [`Node::connect`]).
    /// Must be called inside a Tokio runtime (it starts the wake-up task).
    pub(crate) fn new(
        target: Target,
        prefix: String,
        shown: String,
        allow_eviction: bool,
        keep_last_ms: u64,
    ) -> Self {
        let wakeups = Wakeups::start(target.pubsub_clients(), shown.clone());
        Self {
            cluster: target.is_cluster(),
            commands: Arc::new(Commands {
                target,
                shown: shown.clone(),
                allow_eviction,
                warned: AtomicBool::new(false),
                state: Mutex::default(),
                generations: AtomicU64::new(0),
                epoch: Instant::now(),
            }),
            prefix,
            shown,
            keep_last_ms,
            wakeups,
        }
    }

    /// Connects now (and checks the server), within `limit`.
    pub(crate) async fn connect(&self, limit: Duration) -> Result<(), Error> {
        self.commands
            .connection(Instant::now() + limit)
            .await
            .map(|_| ())
    }

    fn retire(&self, generation: u64, why: &str) {
        if self.commands.retire(generation, why) {
            // The pub/sub connection likely crosses the same dead path.
            self.wakeups.probe();
        }
    }

    /// Runs `op` on the live connection within `limit`. A connection-level
    /// error retires the connection (the next request uses a new one); so
    /// does a time-out, or `op` being dropped after waiting, unless the
    /// connection answered anything meanwhile.
    pub(crate) async fn request<T, F, Fut>(&self, limit: Duration, op: F) -> Result<T, Error>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let deadline = Instant::now() + limit;
        let live = self.commands.connection(deadline).await?;
        let conn = live.conn.clone();
        let mut in_flight = InFlight {
            node: self,
            live,
            sent: Instant::now(),
            limit: deadline.saturating_duration_since(Instant::now()),
            done: false,
        };
        let outcome = timeout_at(deadline, op(conn)).await;
        in_flight.done = true;
        match outcome {
            Ok(Ok(v)) => {
                in_flight.answered();
                Ok(v)
            }
            Ok(Err(e)) => {
                let (error, replace) = self.commands.map_err(&e);
                if replace {
                    self.retire(in_flight.live.generation, "connection error");
                } else {
                    in_flight.answered();
                }
                Err(error)
            }
            Err(_) => {
                in_flight.unanswered("request timed out");
                Err(Error::unavailable(
                    BACKEND,
                    format!("{}: no answer within {limit:?}", self.shown),
                ))
            }
        }
    }

    pub(crate) fn keys(&self, name: &LockName) -> Keys {
        Keys::new(&self.prefix, name, self.cluster)
    }

    pub(crate) async fn ping(&self, limit: Duration) -> Result<(), Error> {
        self.request(limit, |mut c| async move {
            redis::cmd("PING").query_async::<()>(&mut c).await
        })
        .await
    }

    /// The server process's `run_id` (`INFO server`): two configured nodes
    /// with one `run_id` are one server.
    pub(crate) async fn run_id(&self, limit: Duration) -> Result<String, Error> {
        let info: String = self
            .request(limit, |mut c| async move {
                redis::cmd("INFO").arg("server").query_async(&mut c).await
            })
            .await?;
        info.lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .map(|id| id.trim().to_owned())
            .ok_or_else(|| {
                Error::protocol(
                    BACKEND,
                    format!("{}: INFO server shows no run_id", self.shown),
                )
            })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn take(
        &self,
        keys: &Keys,
        owner: &str,
        session: &str,
        why: &str,
        ttl: Duration,
        min_uptime: Duration,
        limit: Duration,
    ) -> Result<Taken, Error> {
        let mut invocation = script::TAKE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.last)
            .key(&keys.boot)
            .key(tombstone_key(keys, owner))
            .arg(owner)
            .arg(session)
            .arg(why)
            .arg(ttl.as_millis() as u64)
            .arg(self.keep_last_ms)
            .arg(min_uptime.as_millis() as u64);
        let (granted, value): (i64, i64) = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        if granted == -1 {
            // Only a late copy meets its attempt's tombstone, and no one
            // waits for its answer.
            return Err(Error::protocol(
                BACKEND,
                "a take arrived after its attempt ended (tombstone)",
            ));
        }
        Ok(if granted == 1 {
            let token = u64::try_from(value)
                .ok()
                .filter(|t| *t > 0)
                .ok_or_else(|| Error::protocol(BACKEND, format!("take returned token {value}")))?;
            Taken::Granted(FencingToken::new(token))
        } else {
            Taken::Busy(Duration::from_millis(value.max(0) as u64))
        })
    }

    /// Owner-checked release; `token: None` releases whatever this owner
    /// holds. With `end` the attempt ends, and a take of it may still be
    /// on the wire: its tombstone refuses that take (see
    /// [`script::RELEASE`]).
    pub(crate) async fn release(
        &self,
        keys: &Keys,
        owner: &str,
        token: Option<FencingToken>,
        end: Option<Duration>,
        limit: Duration,
    ) -> Result<bool, Error> {
        let token = token.map(|t| t.get().to_string()).unwrap_or_default();
        let mut invocation = script::RELEASE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.last)
            .key(receipt_key(keys))
            .key(tombstone_key(keys, owner))
            .arg(owner)
            .arg(token)
            .arg(&keys.channel)
            .arg(self.keep_last_ms)
            .arg(receipt_ms(self.commands.target.is_cluster(), limit))
            .arg(end.map_or(0, |ttl| Doubtful::tombstone_life(ttl).as_millis() as u64));
        let released: i64 = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        Ok(released == 1)
    }

    /// Renews every `(keys, owner, token)` in a script per chunk (and per
    /// slot on a cluster); with the restart guard on (`min_uptime > 0`), a
    /// node that restarted confirms none. Tells `said` each hold's answer
    /// (by its index in `holds`) as its script answers; the holds of a
    /// script with no answer (on a cluster, their master failed while others
    /// answered) are not told; an error if no script answered.
    pub(crate) async fn renew(
        &self,
        holds: &[(Keys, &str, FencingToken)],
        ttl: Duration,
        min_uptime: Duration,
        limit: Duration,
        said: &(dyn Fn(usize, bool) + Sync),
    ) -> Result<(), Error> {
        if holds.is_empty() {
            return Ok(());
        }
        // On a cluster, a script's keys must share a slot: one group of
        // holds per slot, each with its slot's guard record. The answers
        // are put back in the holds' order.
        let mut groups: Vec<(Option<u16>, Vec<usize>)> = Vec::new();
        if self.cluster {
            let mut by_slot: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
            for (i, (keys, _, _)) in holds.iter().enumerate() {
                by_slot.entry(keys.slot(&self.prefix)).or_default().push(i);
            }
            groups.extend(by_slot.into_iter().map(|(slot, at)| (Some(slot), at)));
        } else {
            groups.push((None, (0..holds.len()).collect()));
        }
        // One script per RENEW_CHUNK holds, all sent at once on the one
        // connection (pipelined): still one round trip, but no single script
        // keeps the server from everyone else for long (a script is atomic:
        // 10,000 holds in one took ~35 ms).
        let chunks = groups
            .iter()
            .flat_map(|(slot, at)| at.chunks(RENEW_CHUNK).map(move |chunk| (*slot, chunk)));
        let chunks = chunks.map(|(slot, chunk)| {
            let mut invocation = script::RENEW.prepare_invoke();
            invocation
                .arg(ttl.as_millis() as u64)
                .arg(min_uptime.as_millis() as u64);
            for &i in chunk {
                let (keys, owner, token) = &holds[i];
                invocation
                    .key(&keys.lock)
                    .arg(*owner)
                    .arg(token.get().to_string());
            }
            invocation.key(boot_key(&self.prefix, slot));
            async move {
                let out: Result<Vec<i64>, Error> = self
                    .request(limit, |mut c| async move {
                        invocation.invoke_async(&mut c).await
                    })
                    .await;
                let out = out.and_then(|out| {
                    if out.len() == chunk.len() {
                        Ok(out)
                    } else {
                        Err(Error::protocol(
                            BACKEND,
                            "renew answered for a different number of locks",
                        ))
                    }
                });
                (chunk, out)
            }
        });
        // (each script's answers are passed on as they come: a round cut
        // off at its timeout keeps the holds of the scripts already answered)
        let mut chunks: futures::stream::FuturesUnordered<_> = chunks.collect();
        let mut first_error = None;
        let mut answered = false;
        while let Some((chunk, out)) = chunks.next().await {
            match out {
                Ok(out) => {
                    answered = true;
                    for (&i, v) in chunk.iter().zip(out) {
                        said(i, v == 1);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) if !answered => Err(e),
            _ => Ok(()),
        }
    }

    /// How long before this node may grant (the restart guard). On a
    /// cluster, before every slot may: the guard's record of each of the
    /// 16,384 slots is read (and started where missing), 64 requests at a
    /// time.
    pub(crate) async fn ready_in(
        &self,
        min_uptime: Duration,
        limit: Duration,
    ) -> Result<Duration, Error> {
        let slots: Vec<Option<u16>> = if self.cluster {
            (0..slots::SLOTS).map(Some).collect()
        } else {
            vec![None]
        };
        let waits = futures::stream::iter(slots)
            .map(|slot| {
                let mut invocation = script::READY.prepare_invoke();
                invocation
                    .key(boot_key(&self.prefix, slot))
                    .arg(min_uptime.as_millis() as u64);
                self.request(limit, |mut c| async move {
                    invocation.invoke_async::<i64>(&mut c).await
                })
            })
            .buffer_unordered(64);
        let left = waits
            .fold(Ok::<i64, Error>(0), |most, left| async move {
                Ok(most?.max(left?))
            })
            .await?;
        Ok(Duration::from_millis(left.max(0) as u64))
    }

    /// Writes the quorum's token to this node's hold (Redlock).
    pub(crate) async fn bump(
        &self,
        keys: &Keys,
        owner: &str,
        token: FencingToken,
        ttl: Duration,
        limit: Duration,
    ) -> Result<bool, Error> {
        let mut invocation = script::BUMP.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.last)
            .arg(owner)
            .arg(token.get().to_string())
            .arg(match self.keep_last_ms {
                KEEP_LAST_FOREVER => KEEP_LAST_FOREVER,
                keep => ttl.as_millis() as u64 + keep,
            });
        let done: i64 = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        Ok(done == 1)
    }

    pub(crate) async fn inspect(
        &self,
        name: &LockName,
        limit: Duration,
    ) -> Result<Option<Record>, Error> {
        let keys = self.keys(name);
        let mut invocation = script::INSPECT.prepare_invoke();
        invocation.key(&keys.lock);
        let reply: Option<Vec<String>> = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        let Some(v) = reply else { return Ok(None) };
        let bad = || Error::protocol(BACKEND, format!("unexpected lock record {v:?}"));
        let [session, token, why, at, pttl, now, owner] = v.as_slice() else {
            return Err(bad());
        };
        let num = |s: &str| s.parse::<i64>().map_err(|_| bad());
        let token = u64::try_from(num(token)?).map_err(|_| bad())?;
        let (at, pttl, now) = (num(at)?, num(pttl)?, num(now)?);
        if pttl <= 0 {
            return Ok(None);
        }
        let mut info = LockInfo::new(name.clone(), session.clone(), FencingToken::new(token));
        info.why = (!why.is_empty()).then(|| why.clone());
        info.acquired_at = Some(epoch_ms(at));
        info.expires_at = Some(epoch_ms(now + pttl));
        Ok(Some(Record {
            info,
            owner: owner.clone(),
        }))
    }

    /// The servers that hold keys: the one server, or on a cluster the
    /// address (`host:port`) of every master, from the driver's answer to
    /// `INFO`, which it sends to every master.
    async fn servers(&self, limit: Duration) -> Result<Vec<Option<String>>, Error> {
        if !self.cluster {
            return Ok(vec![None]);
        }
        let per_master: Value = self
            .request(limit, |mut c| async move {
                redis::cmd("INFO").arg("server").query_async(&mut c).await
            })
            .await?;
        let Value::Map(per_master) = per_master else {
            return Err(Error::protocol(
                BACKEND,
                format!("{}: INFO answered no map of masters", self.shown),
            ));
        };
        per_master
            .into_iter()
            .map(|(address, _)| {
                String::from_redis_value(address).map(Some).map_err(|e| {
                    Error::protocol(BACKEND, format!("{}: a master's address: {e}", self.shown))
                })
            })
            .collect()
    }

    /// Every key matching `pattern`, by `SCAN` (never `KEYS`) on every
    /// server that holds keys; `limit` per round trip.
    async fn scan_keys(&self, pattern: &str, limit: Duration) -> Result<Vec<String>, Error> {
        let mut all = Vec::new();
        for server in self.servers(limit).await? {
            let mut cursor = 0u64;
            loop {
                let scan = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .to_owned();
                let server = server.as_deref();
                let (next, keys): (u64, Vec<String>) = self
                    .request(
                        limit,
                        |mut c| async move { c.on_server(server, &scan).await },
                    )
                    .await?;
                all.extend(keys);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(all)
    }

    /// Names of held locks under `prefix`, by `SCAN` (never `KEYS`).
    pub(crate) async fn scan(&self, prefix: &str, limit: Duration) -> Result<Vec<LockName>, Error> {
        // Names contain no glob characters, so the prefix needs no escaping;
        // the trailing `}` excludes the `:t` last-token keys.
        let pattern = format!("{}:{{{prefix}*}}", self.prefix);
        let lock_prefix = format!("{}:{{", self.prefix);
        let mut names: Vec<LockName> = self
            .scan_keys(&pattern, limit)
            .await?
            .iter()
            .filter_map(|key| key.strip_prefix(&lock_prefix)?.strip_suffix('}'))
            .filter_map(|name| LockName::new(name).ok())
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Keys under `prefix` that would never expire (none should, but the
    /// last-token keys a Redlock node keeps by design) plus subscribed
    /// channels: the leak check of the conformance suite.
    pub(crate) async fn persistent_keys(
        &self,
        prefix: &str,
        limit: Duration,
    ) -> Result<usize, Error> {
        let mut count = 0;
        for key in self
            .scan_keys(&format!("{}:{{{prefix}*", self.prefix), limit)
            .await?
        {
            let kept_token = self.keep_last_ms == KEEP_LAST_FOREVER && key.ends_with(":t");
            let ttl: i64 = self
                .request(limit, |mut c| async move {
                    redis::cmd("PTTL").arg(&key).query_async(&mut c).await
                })
                .await?;
            if ttl == -1 && !kept_token {
                count += 1;
            }
        }
        let pattern = format!("{}:{{{prefix}*", self.prefix);
        let channels: Vec<String> = self
            .request(limit, |mut c| async move {
                redis::cmd("PUBSUB")
                    .arg("CHANNELS")
                    .arg(&pattern)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(count + channels.len())
    }

    pub(crate) async fn validate(
        &self,
        name: &LockName,
        token: FencingToken,
        limit: Duration,
    ) -> Result<bool, Error> {
        let keys = self.keys(name);
        let mut invocation = script::VALIDATE.prepare_invoke();
        invocation.key(&keys.lock).arg(token.get().to_string());
        let ok: i64 = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        Ok(ok == 1)
    }

    pub(crate) async fn force_release(
        &self,
        name: &LockName,
        limit: Duration,
    ) -> Result<bool, Error> {
        let keys = self.keys(name);
        let mut invocation = script::FORCE.prepare_invoke();
        invocation
            .key(&keys.lock)
            .key(&keys.last)
            .key(receipt_key(&keys))
            .arg(&keys.channel)
            .arg(self.keep_last_ms)
            .arg(receipt_ms(self.commands.target.is_cluster(), limit));
        let done: i64 = self
            .request(limit, |mut c| async move {
                invocation.invoke_async(&mut c).await
            })
            .await?;
        Ok(done == 1)
    }

    /// Registers a waiter on `channel` and waits (at most `limit`) until the
    /// node's pub/sub connection is subscribed to it, or has failed to
    /// connect. Never fails: a waiter without notifications still has the
    /// core's timers, and is woken when the connection comes back.
    pub(crate) async fn subscribe(&self, channel: &str, limit: Duration) -> Subscription {
        self.wakeups.subscribe(channel, limit).await
    }
}

fn epoch_ms(ms: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// State shared by a node's waiters and its wake-up task.
struct WakeShared {
    /// The waiters per channel (dlock-core's wake-up plumbing).
    hub: Arc<WakeHub>,
    /// Subscription requests, numbered.
    requests: AtomicU64,
    /// Something changed: a waiter came or went.
    kick: Notify,
    /// The command connection failed: check the pub/sub connection too.
    probe: Notify,
    /// Every subscription request numbered up to this has been handled by
    /// the wake-up task (subscribed, or the connection found down).
    served: watch::Sender<u64>,
}

/// The pub/sub side of a node: one task owns the connection and keeps it
/// subscribed to exactly the channels that have waiters in this process (no
/// leaked channels); every message wakes the longest-waiting waiter of its
/// channel here.
struct Wakeups {
    shared: Arc<WakeShared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Wakeups {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A waiter's registration; the channel is unsubscribed when its last
/// waiter goes.
pub(crate) struct Subscription {
    /// `Some` until dropped.
    waiter: Option<Waiter>,
    shared: Arc<WakeShared>,
}

impl Subscription {
    /// Resolves at the next release notification on the channel (or when
    /// the pub/sub connection came back after a gap).
    pub(crate) async fn notified(&self) {
        if let Some(w) = &self.waiter {
            w.notified().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some(waiter) = self.waiter.take() else {
            return;
        };
        let channel = waiter.key().to_owned();
        drop(waiter);
        if !self.shared.hub.has_waiters(&channel) {
            self.shared.kick.notify_one();
        }
    }
}

impl Wakeups {
    /// Starts the wake-up task, subscribing through `servers` (the first
    /// that answers; the next after a failure).
    fn start(servers: Vec<Client>, shown: String) -> Self {
        let (served, _) = watch::channel(0);
        let shared = Arc::new(WakeShared {
            hub: Arc::default(),
            requests: AtomicU64::new(0),
            kick: Notify::new(),
            probe: Notify::new(),
            served,
        });
        let task = tokio::spawn(run_wakeups(servers, shown, shared.clone()));
        Self { shared, task }
    }

    fn probe(&self) {
        self.shared.probe.notify_one();
    }

    async fn subscribe(&self, channel: &str, limit: Duration) -> Subscription {
        let shared = &self.shared;
        let subscription = Subscription {
            waiter: Some(shared.hub.subscribe(channel)),
            shared: shared.clone(),
        };
        // Registered first, numbered second: a reconcile that has seen this
        // number has seen the registration (see `run_wakeups`).
        let ticket = shared.requests.fetch_add(1, Ordering::SeqCst) + 1;
        shared.kick.notify_one();
        let mut served = shared.served.subscribe();
        let _ = timeout(limit, served.wait_for(|s| *s >= ticket)).await;
        subscription
    }
}

/// The wake-up task of one node: reconciles the subscribed channels with
/// the waiters' (connecting, reconnecting with back-off), forwards messages,
/// probes the connection when asked, and after a gap in the connection wakes
/// every waiter (a release may have gone unseen meanwhile).
async fn run_wakeups(servers: Vec<Client>, shown: String, shared: Arc<WakeShared>) {
    const FIRST_BACKOFF: Duration = Duration::from_millis(50);
    // The server the next pub/sub connection is opened on (a cluster's
    // seeds in turn: any node relays every PUBLISH of the cluster).
    let mut next = 0;
    let mut conn: Option<(redis::aio::PubSubSink, redis::aio::PubSubStream)> = None;
    let mut subscribed: HashSet<String> = HashSet::new();
    // Waiters lost notifications for a while: wake them once reconnected.
    let mut gap = false;
    let mut backoff = FIRST_BACKOFF;
    loop {
        // Numbered before the waiters are read: every request up to
        // `through` registered before this snapshot.
        let through = shared.requests.load(Ordering::SeqCst);
        let wanted: HashSet<String> = shared.hub.keys().into_iter().collect();
        let mut failure = None;
        if conn.is_none() && !wanted.is_empty() {
            let client = &servers[next % servers.len()];
            match timeout(CONNECT_TIMEOUT, client.get_async_pubsub()).await {
                Ok(Ok(pubsub)) => {
                    conn = Some(pubsub.split());
                    subscribed.clear();
                }
                Ok(Err(e)) => failure = Some(map_err(&shown, &e).0.to_string()),
                Err(_) => failure = Some("connect timed out".to_owned()),
            }
        }
        if let Some((sink, _)) = conn.as_mut() {
            let add: Vec<&String> = wanted.difference(&subscribed).collect();
            let remove: Vec<&String> = subscribed.difference(&wanted).collect();
            let reconcile = async {
                if !add.is_empty() {
                    sink.subscribe(&add).await?;
                }
                if !remove.is_empty() {
                    sink.unsubscribe(&remove).await?;
                }
                Ok::<_, RedisError>(())
            };
            match timeout(PUBSUB_TIMEOUT, reconcile).await {
                Ok(Ok(())) => subscribed = wanted,
                Ok(Err(e)) => failure = Some(e.to_string()),
                Err(_) => failure = Some("no answer".to_owned()),
            }
        } else {
            // Nobody waits: nobody missed anything.
            subscribed.clear();
            gap = false;
        }
        if let Some(why) = failure {
            tracing::warn!(node = %shown, error = %why, "redis pub/sub connection failed; waiters poll until it is back");
            next += 1;
            conn = None;
            subscribed.clear();
            gap = true;
            // Served: those waiters go on without notifications for now.
            shared.served.send_replace(through);
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
            continue;
        }
        backoff = FIRST_BACKOFF;
        shared.served.send_replace(through);
        if gap && conn.is_some() {
            gap = false;
            shared.hub.wake_everyone();
        }
        let mut dead = false;
        match conn.as_mut() {
            Some((sink, stream)) => {
                tokio::select! {
                    _ = shared.kick.notified() => {}
                    _ = shared.probe.notified() => {
                        let answered = timeout(PUBSUB_TIMEOUT, sink.ping::<redis::Value>()).await;
                        dead = !matches!(answered, Ok(Ok(_)));
                    }
                    msg = stream.next() => match msg {
                        // One waiter per release in this process (no herd); if
                        // it loses the race, the winner's release wakes the next.
                        Some(msg) => shared.hub.wake_first(msg.get_channel_name()),
                        None => dead = true,
                    },
                }
            }
            None => {
                tokio::select! {
                    _ = shared.kick.notified() => {}
                    _ = shared.probe.notified() => {}
                }
            }
        }
        if dead {
            tracing::debug!(node = %shown, "redis pub/sub connection lost; reconnecting");
            next += 1;
            conn = None;
            subscribed.clear();
            gap = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a server reply `-LINE` becomes in the driver.
    fn server_error(line: &str) -> RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .expect("a RESP error line")
            .extract_error()
            .expect_err("an error")
    }

    #[test]
    fn cluster_replies_name_redis_cluster_and_are_final() {
        for line in [
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "CLUSTERDOWN Hash slot not served",
            "CROSSSLOT Keys in request don't hash to the same slot",
            "TRYAGAIN Multiple keys request during rehashing of slot",
        ] {
            let (e, replace) = map_err("redis://h:1", &server_error(line));
            assert!(
                matches!(e, Error::Config(ref m) if m.contains("Redis Cluster") && m.contains("redis://h:1")),
                "{line}: {e:?}"
            );
            assert!(!e.is_retryable() && !replace, "{line}");
        }
    }

    #[test]
    fn on_a_cluster_slot_moves_are_retried_and_cross_slot_is_a_bug() {
        for line in [
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "CLUSTERDOWN Hash slot not served",
            "TRYAGAIN Multiple keys request during rehashing of slot",
        ] {
            let (e, replace) = map_cluster_err("c", &server_error(line));
            assert!(e.is_retryable() && !replace, "{line}: {e:?}");
        }
        let (e, _) = map_cluster_err(
            "c",
            &server_error("CROSSSLOT Keys in request don't hash to the same slot"),
        );
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
        let (e, _) = map_cluster_err(
            "c",
            &server_error("ERR This instance has cluster support disabled"),
        );
        assert!(
            matches!(e, Error::Config(ref m) if m.contains("redis://")),
            "{e:?}"
        );
        let wrapped = RedisError::from((
            redis::ErrorKind::Io,
            "Failed to create initial connections",
            "WRONGPASS invalid username-password pair or user is disabled.".to_owned(),
        ));
        let (e, _) = map_cluster_err("c", &wrapped);
        assert!(
            matches!(e, Error::Auth { .. }) && !e.is_retryable(),
            "{e:?}"
        );
        let (e, replace) = map_cluster_err(
            "c",
            &server_error("READONLY You can't write against a read only replica."),
        );
        assert!(e.is_retryable() && replace, "{e:?}");
    }

    #[test]
    fn failover_and_busy_replies_are_retryable() {
        let (e, replace) = map_err(
            "n",
            &server_error("READONLY You can't write against a read only replica."),
        );
        assert!(e.is_retryable() && replace, "{e:?}");
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "MASTERDOWN Link with MASTER is down",
            "BUSY Redis is busy running a script.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let (e, replace) = map_err("n", &server_error(line));
            assert!(e.is_retryable() && !replace, "{line}: {e:?}");
        }
    }

    #[test]
    fn refused_credentials_are_auth_errors() {
        for line in [
            "WRONGPASS invalid username-password pair or user is disabled.",
            "NOAUTH Authentication required.",
        ] {
            let (e, _) = map_err("n", &server_error(line));
            assert!(matches!(e, Error::Auth { .. }), "{line}: {e:?}");
            assert!(!e.is_retryable());
        }
        let (e, _) = map_err(
            "n",
            &server_error("NOPERM this user has no permissions to run the 'eval' command"),
        );
        assert!(
            matches!(e, Error::Backend { .. }) && e.to_string().contains("ACL"),
            "{e:?}"
        );
    }

    #[test]
    fn dead_connections_are_replaced() {
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        let (e, replace) = map_err("n", &io);
        assert!(e.is_retryable() && replace, "{e:?}");
    }
}
