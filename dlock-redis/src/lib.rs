//! dlock on Redis: one instance (`redis://`, `rediss://`), Redlock over N
//! independent masters (`redlock://h1:p1,h2:p2,h3:p3`), or a Redis Cluster
//! (`redis+cluster://h1:p1,h2:p2`, `rediss+cluster://`).
//!
//! # How it works
//!
//! * **Take**: one Lua script per node sets the lock hash (`owner`, `session`,
//!   `token`, `why`, `at`) with `PX ttl` if the key is free, and issues the
//!   fencing token in the same atomic step: `max(last + 1, TIME in µs)`, where
//!   `last` is kept in `P:{name}:t` for 10 s after a release. **Tokens stay
//!   strictly increasing even when Redis restarts without persistence**, under
//!   one assumption: *the server's clock never steps back* (use a monotonic
//!   NTP discipline, slewing rather than stepping).
//! * **Release / renewal**: owner- and token-checked scripts (compare, then
//!   `DEL` and `PUBLISH` on the name's channel; compare, then `PEXPIRE`), run
//!   by `EVALSHA` with a `NOSCRIPT` fallback. One script renews every lock a
//!   session holds: one round trip per period.
//! * **Wake-up**: waiters subscribe to the name's channel through one pub/sub
//!   connection per node, kept by a task that subscribes exactly the channels
//!   with waiters in this process (no leaked channels). A waiter's first wait
//!   returns once the task has subscribed its channel (or found the
//!   connection down, or the request time limit passed), and the core then
//!   re-checks, so a release just before the subscription is not missed;
//!   after a gap in the pub/sub connection every waiter is woken to re-check. Waiters also wake at the holder's `PTTL`
//!   and on the core's fallback timer.
//! * **Connections**: one multiplexed command connection per node, opened at
//!   first use. A connection can die silently (requests hang, nothing closes
//!   it); so a request that fails at the connection level, or goes
//!   unanswered past its time limit (or is cut off by the core's request
//!   timeout) while the connection answered nothing else meanwhile, makes
//!   the **next request use a new connection**, and the node's pub/sub
//!   connection is probed (`PING`) and replaced if it does not answer. A
//!   session's requests are limited by its request timeout (for Redlock,
//!   ¾ of it per node, so that one silent node fails alone while the
//!   majority's answers still count).
//! * **Keys** carry the name in a hash tag (`dlock:{name}`), so one lock's keys
//!   (hold, last token, release receipt, tombstones) and its channel share a
//!   Cluster slot.
//! * **Tombstones**: an attempt a take of which was cut off in flight (it
//!   may still reach the node, after the attempt's release and other
//!   clients' grants) leaves `dlock:{name}:x:<attempt>` in its release or
//!   abandon script, for two minutes (or a TTL if longer); the take script
//!   grants nothing while it exists (`refuses_late_takes`). A Cluster node given as `redis://` is refused with
//!   [`Error::Config`] naming `redis+cluster://` (seen by `INFO` at connect,
//!   or by a `MOVED`, `ASK`, `CLUSTERDOWN`, `CROSSSLOT` or `TRYAGAIN` reply),
//!   never retried; so is a standalone server given as `redis+cluster://`.
//!   `READONLY` (a replica, e.g. during a failover) is
//!   [`Error::Unavailable`]: retried, on a new connection.
//! * `list` uses `SCAN` (on every master of a cluster), never `KEYS`.
//!
//! # Redis Cluster
//!
//! `redis+cluster://[user:password@]h1:p1,h2:p2,...` names seed nodes; the
//! driver (`redis::cluster_async`) learns the slot map from them and sends
//! each script to the master of its keys' slot, which every script's keys
//! share. What changes against one server:
//!
//! * **Renewal**: one script per slot that holds a lock of the session (its
//!   keys must share a slot), all sent at once: one round trip per period,
//!   but O(slots held) requests, not O(1). A master that does not answer
//!   costs only its own holds (they are
//!   [`Renewed::Unknown`](dlock_core::backend::Renewed::Unknown) until its
//!   replica takes over, lost if that outlasts their lease); set
//!   `cluster-require-full-coverage no` on the cluster so that the other
//!   masters serve on while one shard fails over.
//! * **The restart guard** keeps one record per slot (`P:boot:{T}`, with `T`
//!   a tag that hashes to the slot), so that it sits in the slot of the
//!   locks it guards; [`Backend::wait_ready`] starts and waits out the
//!   records of all 16,384 slots (a slot first used later waits `max_ttl`
//!   then; this runs 16,384 scripts, and reports the slowest slot).
//! * **Wake-ups** subscribe on one seed (the next one after a failure): a
//!   `PUBLISH` reaches every node of a cluster.
//! * **Redirections**: the driver follows `MOVED` and `ASK` and sends a
//!   request again when its connection broke. A take or renewal sent twice
//!   grants or extends the same attempt's hold; a release or force-release
//!   leaves a receipt of its request for 10 s, so that sent twice it does
//!   nothing more and answers as the first did (without it, a release that
//!   took effect answered "not held", and a force-release sent again could
//!   break the hold of whoever took the lock meanwhile). A request to a
//!   master that stops answering replaces the cluster connection (make
//!   before break: the other masters' requests go on) so that the slot
//!   map is read afresh, and the driver gives a seed that accepts but never
//!   answers 1.25 s before connecting without it.
//! * **Failover** ([below](#eviction-and-failover)): a replica promoted
//!   after its master died may lack the last grants (replication is
//!   asynchronous), so without the restart guard a failover can lose a
//!   held lock ([`Capabilities::restart_loses_locks`]); its holder hears of
//!   it at its next renewal. With `restart_guard=true` the promoted replica
//!   grants nothing in a slot for `max_ttl` — after every failover, planned
//!   ones too (and an aborted `FAILOVER`, which gives the old master a new
//!   replication id): the new master's holds are then lost, and its slots
//!   wait.
//!   **Tokens** after a failover are floored by the new master's `TIME`, as
//!   after a restart (the last-token key may not have reached it), so they
//!   never go back as long as the new master's clock is not behind the old
//!   one's by more than the time from the old master's last grant to the
//!   new master's first: in a partition the old master may grant until it
//!   notices, about `cluster-node-timeout`, and the replica is promoted
//!   some 0.5–1 s after that, so keep the nodes' clocks within a few
//!   hundred milliseconds (NTP). A forced failover (`CLUSTER FAILOVER
//!   FORCE` or `TAKEOVER`) can leave less; a slot moved by resharding takes
//!   its last-token key along while it lives (10 s after a release), then
//!   has only the clock floor too.
//! * Every request to a cluster may take ¾ of the session's request
//!   timeout (as a Redlock node's), so that a renewal returns what the
//!   other masters answered before the core gives up on it.
//! * Names are sharded: a client cut off from the master of a name's slot
//!   cannot lock that name ([`Capabilities::sharded`]).
//! * `address_map=ANNOUNCED:PORT>REACHED:PORT,...` reaches nodes that
//!   announce addresses the client cannot use (NAT, containers).
//! * [`RedisBackend::data_connection`] is for one server; for fenced data
//!   in a cluster, open a `redis::cluster_async::ClusterConnection` and use
//!   [`RedisFence`] on it (its key and the data's in one hash slot).
//!
//! # URL options
//!
//! `redis://[user:password@]host:port[/db][?options]`, `rediss://...` (TLS),
//! `redlock://[user:password@]h1:p1,h2:p2,h3:p3[/db][?options]` (the same
//! credentials and options for every node),
//! `redis+cluster://[user:password@]h1:p1,h2:p2[?options]` and
//! `rediss+cluster://...` (TLS; a cluster has only database 0). Passwords are percent-encoded
//! (`p%40ss` for `p@ss`) and never shown in errors or logs. Unknown options
//! are refused.
//!
//! | option | meaning |
//! |---|---|
//! | `dlock_prefix=NAME` | key prefix (default `dlock`) |
//! | `restart_guard=true` | Redis and Redis Cluster: turn the restart guard on (below); Redlock always has it |
//! | `max_ttl=60s` | with the guard: the largest TTL a session may use, and how long a restarted node waits (default 60 s) |
//! | `allow_eviction=true` | accept a server whose `maxmemory-policy` may evict held locks (below) |
//! | `tls=true` | `redlock://`: reach the nodes over TLS (`rediss://` does for one node) |
//! | `address_map=A:P>B:Q,...` | `redis+cluster://`: connect to `B:Q` when the cluster announces `A:P` |
//! | `tls_ca=PATH` | PEM file of the CA that signed the server's certificate (default: the webpki roots) |
//! | `tls_cert=PATH`, `tls_key=PATH` | PEM client certificate and key (mutual TLS) |
//! | `tls_insecure=true` (or `#insecure`) | do not verify the server's certificate (tests only) |
//! | `protocol=resp3` | passed to the driver |
//!
//! Credentials the server refuses (`WRONGPASS`, `NOAUTH`, a client
//! certificate it rejects) are [`Error::Auth`], a server certificate that is
//! not trusted is [`Error::Config`]: neither is retried. With ACLs, the user
//! needs `EVAL`, `EVALSHA`, `SCRIPT`, `INFO`, `PING`, `PUBLISH`, `SUBSCRIBE`,
//! `UNSUBSCRIBE`, `SCAN`, `PTTL`, `PUBSUB` and the keys and channels under
//! the prefix (`~dlock:* &dlock:*`).
//!
//! # Eviction and failover
//!
//! Every lock key has a TTL, so any `maxmemory-policy` but `noeviction` —
//! `volatile-*` as much as `allkeys-*` — can evict a *held* lock under memory
//! pressure, and another client then gets it. Every new connection checks
//! the policy (`INFO`): with a `maxmemory` set, an evicting policy is refused
//! with [`Error::Config`] unless the URL says `allow_eviction=true`; without
//! a `maxmemory` nothing is evicted yet, and dlock logs a warning. (Where the
//! user may not run `INFO`, dlock cannot check and logs a warning.)
//!
//! Redis replication is asynchronous: a **failover** (Sentinel, a managed
//! service) can promote a replica that missed the latest grants, and a lock
//! held on the old master is then free on the new one. Without the restart
//! guard that is a lost lock (its holder hears of it at its next renewal, but
//! another client may be granted first; fencing tokens still increase). With
//! the guard, the promoted replica is a server process the guard's record
//! (replicated from the old master) does not name, so it grants nothing for
//! `max_ttl`. Neither helps when the old master keeps serving clients that
//! still reach it (a partition): `min-replicas-to-write 1` on the master
//! bounds that.
//!
//! # The restart guard: what exactly is guaranteed
//!
//! A node with the guard on (always for Redlock; `restart_guard=true` for
//! Redis; per slot on a Redis Cluster) keeps a record `P:boot` = (`run_id`
//! and `master_replid`, `since`): the `run_id` of the server process (from
//! `INFO server`: drawn at random by every Redis process when it starts,
//! never persisted, so no RDB, AOF or replication can bring an old one back),
//! its replication id (from `INFO replication`: drawn anew when a replica is
//! promoted, so that a replica that was master before, demoted, and promoted
//! again — keeping a record of its own first term — starts over; a new id
//! without a promotion, when the replication backlog is created or freed,
//! is recorded without starting over), and the server time at which dlock
//! first saw them. The take and renew scripts read
//! both **inside the same atomic script** that grants or renews; if the
//! record is missing or names another process or term (a restart with or
//! without data, a restore from any snapshot, a promoted replica, a
//! `FLUSHALL`), the script writes a new record and refuses; until the record
//! is `max_ttl` old it grants nothing and confirms no renewal.
//!
//! **Guarantee**: a node grants a lock, or confirms a renewal, only while it
//! runs a server process, in a term as master, that dlock has seen for at
//! least `max_ttl` by that server's clock. Any hold it granted or renewed
//! before that term started — which the process may have forgotten, or may
//! remember from an older snapshot or an older term — was granted or renewed
//! at least `max_ttl` earlier, and has expired (its TTL is at most
//! `max_ttl`). So no data loss or rollback
//! on the node lets it grant a lock it may still hold for someone, or vouch
//! for a hold it may have lost.
//!
//! Under these assumptions: every client of the deployment uses the same
//! `max_ttl` (a client with a smaller one waits less than another's TTL);
//! the server's clock neither jumps forward (that shortens the wait, and
//! expires keys early anyway) nor back (tokens); data is not rolled back
//! without a new process (`DEBUG RELOAD`, disabled by default since Redis 7,
//! is outside). The replication-id check needs Redis 4 or later (older
//! servers report no `master_replid`: only the `run_id` counts there), and
//! sees a promotion only until the promoted master's replication backlog is
//! freed (`repl-backlog-ttl`, default 3600 s: keep it at least `max_ttl`, or
//! 0 for never). A record written by a dlock before this check is adopted
//! as it is; the check applies from the next record the node writes.
//!
//! **Cost**: after every restart or failover, and the first time dlock sees
//! a server, the node waits `max_ttl` (default 60 s; set it close to the TTL
//! you use) before it grants. [`Backend::wait_ready`] takes that wait
//! up front, e.g. at service start.
//!
//! **Single Redis: guard opt-in.** Without it (the default), a restart
//! without persistence, a restore from an older snapshot or AOF, a failover
//! or a `FLUSHALL` loses held locks: each holder learns at its next renewal
//! (within the renewal period, TTL/3 by default), but another client may be
//! granted the lock first, so two clients may both believe they hold it for
//! up to one renewal period; fencing tokens still increase, so a
//! [`FenceGate`](dlock_core::FenceGate) refuses the stale holder. That is the
//! usual trade for a single Redis (fast, always available at once); turn the
//! guard on when that window matters more than a `max_ttl` wait after every
//! restart or failover.
//!
//! # Redlock: what it guarantees and what it does not
//!
//! A grant needs the take script to succeed on a majority (N/2+1) **of the
//! configured N nodes** — never of the nodes reachable now: two clients that
//! each see a different majority of live nodes still overlap in one — within
//! the validity time `ttl − elapsed − drift`, elapsed measured from before
//! the first request; a failed attempt releases on every node. A node that
//! cannot be reached when a client connects stays part of its backend and is
//! connected when it comes back; connecting fails
//! ([`Error::Unavailable`]) unless a majority answers. This is Redis's own
//! algorithm, and Martin Kleppmann's critique applies: its mutual exclusion
//! rests on *timing assumptions* — bounded clock drift between the nodes and
//! the client, bounded network delay and process pauses. A client paused past
//! its validity, or a node whose clock jumps, can make two clients believe
//! they hold the lock. dlock's local deadline (S4) makes the client *learn* of
//! the loss in time when it is not paused, but only fencing makes the
//! *resource* safe.
//!
//! Fencing tokens under Redlock: each node proposes `max(last + 1, TIME µs)`;
//! the client takes the quorum's largest and writes it back to the lock and
//! last-token key on every node of its quorum (the grant fails unless a
//! majority accepts it). Any later grant needs a majority, which overlaps
//! ours in at least one node, whose `last` is ours — Redlock nodes keep the
//! last-token key for good (one small key per lock name), so this holds
//! whatever the skew between the nodes' clocks. A node that lost or rolled
//! back its data has only its clock as a floor: tokens strictly increase **as
//! long as the nodes' clocks never step back and such a node stays out of
//! quorums for `max_ttl` (the restart guard above enforces that) with a
//! clock no more than `max_ttl` behind the node that issued the last token**.
//! A renewal is confirmed by a majority of the nodes; a hold the answering
//! nodes neither confirm nor rule out (some silent, the others split) is
//! left as it is until its deadline, then reported lost (`Expired`), not
//! revoked at once.
//!
//! Tokens are *not* monotonic if those assumptions break; when correctness
//! matters more than availability, prefer a consensus store (etcd,
//! ZooKeeper).
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//! let backend = dlock_redis::RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("jobs/import")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # As a pluggable adapter
//!
//! [`RedisAdapter`] is this crate's [`Adapter`](dlock_core::Adapter): it answers to
//! [`SCHEMES`] (`redis`, `rediss`, `redlock`, `redis+cluster`,
//! `rediss+cluster`), so that a [`Registry`]
//! (`dlocks::connect` uses [`dlock_core::registry()`]) opens these URLs like
//! any other store's. What a backend promises beyond the safety invariants
//! is its [`Backend::capabilities`]: notified wake-ups (pub/sub), tokens that
//! survive a restart (the server-clock floor), sessions that survive a
//! reconnect; held locks lost in a restart unless the restart guard is on.
//!
//! [`Registry`]: dlock_core::Registry
//! [`Capabilities::restart_loses_locks`]: dlock_core::Capabilities::restart_loses_locks
//! [`Capabilities::sharded`]: dlock_core::Capabilities::sharded

mod conn;
mod fence;
mod floor;
mod node;
mod options;
mod script;
mod session;
mod slots;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::url::StoreUrl;
use dlock_core::{
    Backend, Capabilities, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use futures::future::join_all;

pub use fence::RedisFence;
pub use floor::RedisFloor;
use node::{CONNECT_TIMEOUT, Node, Record};
use options::RedisOptions;
pub use options::{DEFAULT_MAX_TTL, DEFAULT_PREFIX};
/// The redis crate this crate speaks (its connections are what
/// [`RedisFence`] writes on).
pub use redis;

/// The smallest TTL: `PX` has millisecond resolution and a renewal round trip
/// must fit well inside a third of it.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// How long one node may take to answer an admin call (`inspect`, `list`,
/// `validate`, `force_release`, `ping`, `wait_ready`); session requests use
/// the session's request timeout instead.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The URL schemes of this crate: `redis`, `rediss` (TLS), `redlock`, and
/// Redis Cluster's `redis+cluster` and `rediss+cluster` (TLS).
pub const SCHEMES: &[&str] = &[
    "redis",
    "rediss",
    "redlock",
    "redis+cluster",
    "rediss+cluster",
];

/// The Redis and Redlock [`Adapter`](dlock_core::Adapter): opens the [`SCHEMES`] with
/// [`RedisBackend::connect`].
///
/// ```no_run
/// # async fn demo() -> Result<(), dlock_core::Error> {
/// use dlock_redis::RedisAdapter;
///
/// dlock_core::registry().register(RedisAdapter)?;
/// let backend = dlock_core::registry()
///     .connect("redlock://h1:6379,h2:6379,h3:6379?max_ttl=30s")
///     .await?;
/// assert!(backend.capabilities().notify_wakeup);
/// assert!(!backend.capabilities().restart_loses_locks); // Redlock guards restarts
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisAdapter;

dlock_core::impl_adapter!(RedisAdapter, name: "redis", schemes: SCHEMES, connect: RedisBackend::connect, floor: RedisFloor::connect);

impl Inner {
    /// Refuses a Redlock whose reachable nodes include one server twice
    /// (`127.0.0.1:6379` and `127.1:6379`, `localhost` and `127.0.0.1`):
    /// its "majority" would be fewer servers than it counts (S1). Nodes
    /// unreachable now are not compared.
    async fn refuse_duplicate_servers(&self) -> Result<(), Error> {
        let ids = join_all(self.nodes.iter().map(|n| n.run_id(ADMIN_TIMEOUT))).await;
        let mut seen: Vec<(&str, &str)> = Vec::new();
        for (node, id) in self.nodes.iter().zip(&ids) {
            let Ok(id) = id else { continue };
            if let Some((other, _)) = seen.iter().find(|(_, seen_id)| *seen_id == id.as_str()) {
                return Err(Error::Config(format!(
                    "redlock: {other} and {} are the same Redis server (one run_id): \
                     a majority must count independent servers",
                    node.shown
                )));
            }
            seen.push((&node.shown, id));
        }
        Ok(())
    }
}

/// A lock service on Redis or Redlock (see the [crate docs](crate)).
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// Every configured node, reachable or not: a node down now is connected
    /// when it comes back.
    pub(crate) nodes: Vec<Node>,
    pub(crate) options: RedisOptions,
}

impl Inner {
    /// Majority of the *configured* nodes (1 for a single instance), never of
    /// the reachable ones: two clients that each see a different majority
    /// of the live nodes still overlap in one node.
    pub(crate) fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// How long a node must have been seen up before it may grant (the
    /// restart guard; zero when off).
    pub(crate) fn min_uptime(&self) -> Duration {
        if self.options.restart_guard {
            self.options.max_ttl
        } else {
            Duration::ZERO
        }
    }

    /// How long one node may take to answer a session's request. With
    /// several nodes, less than the session's request timeout, so that one
    /// silent node fails alone and the majority's answers still count; on
    /// a cluster likewise, so that a renewal returns what the other masters
    /// answered before the core cuts it off.
    pub(crate) fn node_limit(&self, request_timeout: Duration) -> Duration {
        if self.nodes.len() > 1 || self.options.cluster {
            request_timeout * 3 / 4
        } else {
            request_timeout
        }
    }
}

impl RedisBackend {
    /// A connection to the node of a `redis://` or `rediss://` URL, with
    /// the URL's TLS and credentials: for writes of the protected data
    /// through [`RedisFence`], e.g. by `dlock fence`. [`Error::Config`] for
    /// a Redlock URL (its nodes are independent: data on one of them is not
    /// on the others).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn data_connection(&self) -> Result<redis::aio::MultiplexedConnection, Error> {
        let [node] = self.inner.nodes.as_slice() else {
            return Err(Error::Config(
                "redlock: fenced data lives on one Redis server: use its redis:// URL".into(),
            ));
        };
        if node.cluster {
            return Err(Error::Config(
                "redis+cluster: RedisFence writes on any connection to the cluster (a \
                 redis::cluster_async::ClusterConnection), with the fence key and the data \
                 key in one hash slot; data_connection gives one server's"
                    .into(),
            ));
        }
        let conn = node
            .request(ADMIN_TIMEOUT, |c| async move { Ok(c) })
            .await?;
        match conn {
            conn::Conn::Single(c) => Ok(c),
            conn::Conn::Cluster(_) => unreachable!("checked above"),
        }
    }

    /// Connects to `redis://`, `rediss://` or `redlock://` (see the crate
    /// docs for the URL options), given as text or as a [`StoreUrl`].
    ///
    /// Every configured node stays part of the backend: one that cannot be
    /// reached now is connected at its first later use. For Redlock, a
    /// majority of the nodes must answer now, else [`Error::Unavailable`].
    /// A node that refuses the credentials ([`Error::Auth`]), is a Redis
    /// Cluster node, or may evict held locks ([`Error::Config`]) fails the
    /// connect whatever the others say.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url = url.try_into()?;
        let options = RedisOptions::from_url(&url)?;
        let certificates = load_tls(&options)?;
        if options.tls {
            // rustls picks no provider by itself when the build enables
            // none or several; without one every TLS connect panics. An
            // application that installed its own keeps it.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let invalid = |e: redis::RedisError| {
            url.invalid(format!(
                "not a valid Redis URL ({})",
                e.detail().unwrap_or("bad syntax")
            ))
        };
        // The driver gets the nodes' URLs with their password; nothing
        // else ever shows it.
        let mut clients = Vec::with_capacity(options.nodes.len());
        for node in &options.nodes {
            clients.push(
                match &certificates {
                    Some(certs) => redis::Client::build_with_tls(node.url.expose(), certs.clone()),
                    None => redis::Client::open(node.url.expose()),
                }
                .map_err(invalid)?,
            );
        }
        let keep_last_ms = if options.redlock {
            node::KEEP_LAST_FOREVER
        } else {
            node::KEEP_LAST_MS
        };
        let node = |target, shown: &str| {
            Node::new(
                target,
                options.prefix.clone(),
                shown.to_owned(),
                options.allow_eviction,
                keep_last_ms,
            )
        };
        let nodes = if options.cluster {
            // No driver response timeout: requests are bounded by dlock's
            // own limits. The driver follows MOVED and ASK and sends a
            // request again when its connection broke: takes and renewals
            // are the same attempt's again, releases and force-releases
            // leave a receipt of their request (see script::RELEASE).
            let mut builder = redis::cluster::ClusterClientBuilder::new(
                options.nodes.iter().map(|n| n.url.expose()),
            )
            // The driver connects to every seed at once and waits for all:
            // a seed that accepts but never answers (a stopped host) must
            // not take dlock's whole connect.
            .connection_timeout(CONNECT_TIMEOUT / 4);
            if let Some(certs) = &certificates {
                builder = builder.certs(certs.clone());
            }
            if !options.address_map.is_empty() {
                let node = |(host, port): &(String, u16)| {
                    redis::cluster::NodeAddress::new(host.as_str(), *port)
                };
                builder = builder.node_address_map(
                    options
                        .address_map
                        .iter()
                        .map(|(from, to)| (node(from), node(to)))
                        .collect(),
                );
            }
            let client = builder.build().map_err(invalid)?;
            let shown = format!(
                "{}://{}",
                url.scheme(),
                options
                    .nodes
                    .iter()
                    .map(|n| n.host.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            );
            vec![node(
                node::Target::Cluster {
                    client,
                    seeds: clients,
                },
                &shown,
            )]
        } else {
            clients
                .into_iter()
                .zip(&options.nodes)
                .map(|(client, n)| node(node::Target::Single(client), &n.shown))
                .collect()
        };
        let inner = Arc::new(Inner { nodes, options });
        let results = join_all(inner.nodes.iter().map(|n| n.connect(CONNECT_TIMEOUT))).await;
        let total = results.len();
        let mut reachable = 0;
        let mut first_error = None;
        for result in results {
            match result {
                Ok(()) => reachable += 1,
                // Retrying does not fix a wrong password or a bad server
                // setting: say so now rather than fail every request later.
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let quorum = inner.quorum();
        if reachable < quorum {
            let first = first_error.expect("a node failed");
            return Err(if total == 1 {
                first
            } else {
                Error::unavailable(
                    "redis",
                    format!(
                        "only {reachable} of {total} Redlock nodes reachable, {quorum} needed: {first}"
                    ),
                )
            });
        }
        if inner.options.redlock {
            inner.refuse_duplicate_servers().await?;
        }
        if reachable < total {
            tracing::warn!(
                reachable,
                total,
                "some Redlock nodes are unreachable; they are connected when they come back"
            );
        }
        Ok(Self { inner })
    }

    /// Keys under `prefix` that would never expire plus subscribed channels:
    /// zero unless something leaked (for the conformance suite).
    pub async fn leftovers(&self, prefix: &str) -> Result<usize, Error> {
        let mut total = 0;
        for node in &self.inner.nodes {
            total += node.persistent_keys(prefix, ADMIN_TIMEOUT).await?;
        }
        Ok(total)
    }

    /// [`Backend::ready_in`]: how long until a majority of the nodes may
    /// grant (starting the guard's clock on a node dlock has not seen).
    async fn guards_out_in(&self) -> Result<Duration, Error> {
        let min_uptime = self.inner.min_uptime();
        if min_uptime.is_zero() {
            return Ok(Duration::ZERO);
        }
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.ready_in(min_uptime, ADMIN_TIMEOUT)),
        )
        .await;
        let mut waits: Vec<Duration> = answers.into_iter().filter_map(Result::ok).collect();
        check_answered(&self.inner, waits.len())?;
        waits.sort();
        // (the wait after which a majority may grant)
        Ok(waits[self.inner.quorum() - 1])
    }

    /// [`Backend::wait_ready`]: waits until a majority of the nodes may
    /// grant, at most `limit`.
    ///
    /// With the restart guard on (Redlock; Redis with `restart_guard=true`),
    /// a node refuses grants for `max_ttl` after dlock first sees its server
    /// process; this starts that clock on every node and waits it out. A
    /// no-op without the guard.
    ///
    /// # Cancel safety
    /// Cancel safe.
    async fn wait_guards_out(&self, limit: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let wait = self.guards_out_in().await?;
            if wait.is_zero() {
                return Ok(());
            }
            if tokio::time::Instant::now() + wait > deadline {
                return Err(Error::unavailable(
                    "redis",
                    format!("the restarted Redis nodes need {wait:?} more before they may grant"),
                ));
            }
            tokio::time::sleep(wait).await;
        }
    }
}

/// Reads the PEM files named by `tls_ca`, `tls_cert` and `tls_key`.
fn load_tls(options: &RedisOptions) -> Result<Option<redis::TlsCertificates>, Error> {
    let Some(files) = &options.tls_files else {
        return Ok(None);
    };
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|e| Error::Config(format!("cannot read {what} {}: {e}", path.display())))
    };
    let root_cert = files.ca.as_deref().map(|p| read("tls_ca", p)).transpose()?;
    let client_tls = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("tls_cert", cert)?,
            client_key: read("tls_key", key)?,
        }),
        _ => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.inner.options.url)
            .field("nodes", &self.inner.nodes.len())
            .finish()
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn scheme(&self) -> &'static str {
        if self.inner.options.redlock {
            "redlock"
        } else if self.inner.options.cluster {
            "redis+cluster"
        } else {
            "redis"
        }
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    async fn wait_ready(&self, limit: Duration) -> Result<(), Error> {
        self.wait_guards_out(limit).await
    }

    async fn ready_in(&self) -> Result<Duration, Error> {
        self.guards_out_in().await
    }

    fn capabilities(&self) -> Capabilities {
        capabilities(&self.inner.options)
    }

    /// With the restart guard, a session may not outlive `max_ttl`: a
    /// restarted node refuses grants for that long (see the crate docs).
    fn max_ttl(&self) -> Duration {
        if self.inner.options.restart_guard {
            self.inner.options.max_ttl
        } else {
            dlock_core::MAX_TTL
        }
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        let ttl = options.ttl_value();
        let limit = self.inner.node_limit(options.request_timeout_or_default());
        Ok(Arc::new(session::RedisSession::new(
            self.inner.clone(),
            id,
            ttl,
            limit,
        )))
    }

    /// `PING` on every node, concurrently; fails unless a majority answers.
    async fn ping(&self) -> Result<(), Error> {
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| async { n.ping(ADMIN_TIMEOUT).await.map(|()| true) }),
        )
        .await;
        majority(&self.inner, answers).map(drop)
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.inspect(name, ADMIN_TIMEOUT)),
        )
        .await;
        quorum_view(&self.inner, answers)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let scans = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.scan(prefix, ADMIN_TIMEOUT)),
        )
        .await;
        let mut names: Vec<_> = majority(&self.inner, scans)?
            .into_iter()
            .flatten()
            .collect();
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        for name in names {
            if let Some(info) = self.inspect(&name).await? {
                out.push(info);
            }
        }
        Ok(out)
    }

    async fn validate(&self, name: &LockName, token: FencingToken) -> Result<bool, Error> {
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.validate(name, token, ADMIN_TIMEOUT)),
        )
        .await;
        let ok = majority(&self.inner, answers)?
            .into_iter()
            .filter(|v| *v)
            .count();
        Ok(ok >= self.inner.quorum())
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.force_release(name, ADMIN_TIMEOUT)),
        )
        .await;
        let freed = majority(&self.inner, answers)?
            .into_iter()
            .filter(|v| *v)
            .count();
        if freed > 0 {
            tracing::info!(lock = %name, "force-released");
        }
        Ok(freed > 0)
    }
}

/// What a backend opened with `options` promises (see
/// [`Capabilities`]): the same for Redis and Redlock but for the restart
/// guard, which Redlock always has.
fn capabilities(options: &RedisOptions) -> Capabilities {
    let mut caps = Capabilities::default();
    // A release publishes on the name's channel, and every process with
    // waiters for the name wakes one of them through its pub/sub
    // connection: O(processes), not O(1), waiters per release (no_herd
    // stays false). No queue: whoever takes first wins (fair stays false).
    caps.notify_wakeup = true;
    caps.wakeup_bound = Duration::from_millis(100);
    // A token is at least the server's TIME in µs, so tokens keep increasing
    // across a restart that lost every key (no persistence), as long as the
    // server's clock never steps back (see the crate docs).
    caps.durable_tokens = true;
    // `PX` expiry to the millisecond; Redis expires a key when it is next
    // touched, so a take just after the TTL finds it free.
    caps.recovery_bound = Duration::from_millis(500);
    // Sessions are client-side: a new connection carries on with the same
    // keys, which live on their own TTL.
    caps.survives_reconnect = true;
    // Without persistence a restart forgets held locks; the restart guard
    // keeps a restarted node from granting until they have expired.
    caps.restart_loses_locks = !options.restart_guard;
    // A Redis Cluster keeps each name on the master of its slot.
    caps.sharded = options.cluster;
    // An attempt that ends with a take of it unanswered leaves a tombstone
    // in the lock's slot that refuses that take for two minutes (or a TTL).
    caps.refuses_late_takes = true;
    caps
}

/// The nodes' answers, dropping the failures; the first error if none answered.
pub(crate) fn answers<T>(results: Vec<Result<T, Error>>) -> Result<Vec<T>, Error> {
    let mut answers = Vec::with_capacity(results.len());
    let mut first_error = None;
    for result in results {
        match result {
            Ok(v) => answers.push(v),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if answers.is_empty() => Err(e),
        _ => Ok(answers),
    }
}

/// Counts `true` answers and answers at all; the first error if none answered.
pub(crate) fn count(results: Vec<Result<bool, Error>>) -> Result<(usize, usize), Error> {
    let answers = answers(results)?;
    Ok((answers.iter().filter(|v| **v).count(), answers.len()))
}

/// The answers of a majority of the nodes; fails with the first error if
/// none answered, else unless a majority did (a decision on fewer is a guess).
pub(crate) fn majority<T>(inner: &Inner, results: Vec<Result<T, Error>>) -> Result<Vec<T>, Error> {
    let answers = answers(results)?;
    check_answered(inner, answers.len())?;
    Ok(answers)
}

/// Fails unless a majority of the nodes answered (else a decision is a guess).
pub(crate) fn check_answered(inner: &Inner, answered: usize) -> Result<(), Error> {
    if answered < inner.quorum() {
        Err(Error::unavailable(
            "redis",
            format!(
                "only {answered} of {} Redis nodes answered, {} needed",
                inner.nodes.len(),
                inner.quorum()
            ),
        ))
    } else {
        Ok(())
    }
}

/// The holder a majority of the nodes agree on: the same attempt (owner).
/// Its token is the one a majority records; before a Redlock grant's token
/// was written back (its reply lost), the nodes still record their own
/// proposals, and the largest is shown.
fn quorum_view(
    inner: &Inner,
    answers: Vec<Result<Option<Record>, Error>>,
) -> Result<Option<LockInfo>, Error> {
    let records: Vec<Record> = majority(inner, answers)?.into_iter().flatten().collect();
    let quorum = inner.quorum();
    for record in &records {
        let agreeing: Vec<&Record> = records
            .iter()
            .filter(|o| o.owner == record.owner && o.info.holder == record.info.holder)
            .collect();
        if agreeing.len() < quorum {
            continue;
        }
        let by_token = |t: FencingToken| agreeing.iter().filter(|o| o.info.token == t).count();
        let chosen = agreeing
            .iter()
            .find(|o| by_token(o.info.token) >= quorum)
            .or_else(|| agreeing.iter().max_by_key(|o| o.info.token))
            .expect("a majority agrees");
        return Ok(Some(chosen.info.clone()));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(url: &str) -> Capabilities {
        capabilities(&RedisOptions::from_url(&StoreUrl::parse(url).unwrap()).unwrap())
    }

    /// Each URL form's promises, pinned here: the conformance suite takes
    /// what it expects of each deployment from them.
    #[test]
    fn capabilities_follow_the_restart_guard() {
        let plain = caps("redis://h");
        assert!(plain.notify_wakeup && plain.durable_tokens && plain.survives_reconnect);
        assert!(!plain.fair && !plain.no_herd);
        assert!(plain.restart_loses_locks, "no guard, no persistence");
        assert_eq!(plain.wakeup_bound, Duration::from_millis(100));
        assert_eq!(plain.recovery_bound, Duration::from_millis(500));
        for url in ["rediss://h:1", "redis://h?restart_guard=false"] {
            assert_eq!(caps(url), plain, "{url}");
        }
        let mut guarded = plain.clone();
        guarded.restart_loses_locks = false;
        let mut cluster = plain.clone();
        cluster.sharded = true;
        assert_eq!(caps("redis+cluster://a:1,b:2"), cluster);
        let mut guarded_cluster = cluster.clone();
        guarded_cluster.restart_loses_locks = false;
        assert_eq!(
            caps("rediss+cluster://a:1?restart_guard=true&max_ttl=2s"),
            guarded_cluster
        );
        for url in [
            "redis://h?restart_guard=true",
            "rediss://h?restart_guard=true&max_ttl=2s",
            "redlock://a,b,c",
            "redlock://a,b,c?tls=true&max_ttl=2s&restart_guard=true",
        ] {
            assert_eq!(caps(url), guarded, "{url}");
        }
    }

    #[test]
    fn the_adapter_names_its_schemes() {
        assert_eq!(dlock_core::Adapter::schemes(&RedisAdapter), SCHEMES);
        let registry = dlock_core::Registry::new();
        registry.register(RedisAdapter).unwrap();
        assert_eq!(
            registry.schemes(),
            [
                "redis",
                "redis+cluster",
                "rediss",
                "rediss+cluster",
                "redlock"
            ]
        );
    }

    #[tokio::test]
    async fn the_adapter_refuses_bad_urls_before_connecting() {
        let registry = dlock_core::Registry::new();
        registry.register(RedisAdapter).unwrap();
        let url = "redis://:hunter2@127.0.0.1:1?max_tll=5s";
        dlock_conformance::unit::assert_refused(url, registry.connect(url).await, "max_tll");
    }
}
