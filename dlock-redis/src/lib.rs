//! dlock on Redis: one instance (`redis://`, `rediss://`) or Redlock over N
//! independent masters (`redlock://h1:p1,h2:p2,h3:p3`).
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
//! * **Wake-up**: waiters subscribe to the name's channel through one shared
//!   pub/sub connection per node (channels are unsubscribed when their last
//!   waiter goes); the first wait subscribes and then re-checks at once, so a
//!   release just before the subscription is not missed; waiters also wake at
//!   the holder's `PTTL` and on the core's fallback timer.
//! * **Keys** carry the name in a hash tag (`dlock:{name}`), so one lock's keys
//!   share a Cluster slot. **Redis Cluster is not supported yet**: renewal
//!   batches keys of many slots into one script.
//! * `list` uses `SCAN`, never `KEYS`.
//!
//! # Redlock: what it guarantees and what it does not
//!
//! A grant needs the take script to succeed on a majority (N/2+1) of nodes
//! within the validity time `ttl − elapsed − drift`, elapsed measured from
//! before the first request; a failed attempt releases on every node. This is
//! Redis's own algorithm, and Martin Kleppmann's critique applies: its mutual
//! exclusion rests on *timing assumptions* — bounded clock drift between the
//! nodes and the client, bounded network delay and process pauses. A client
//! paused past its validity, or a node whose clock jumps, can make two clients
//! believe they hold the lock. dlock's local deadline (S4) makes the client
//! *learn* of the loss in time when it is not paused, but only fencing makes
//! the *resource* safe.
//!
//! Fencing tokens under Redlock: each node proposes `max(last + 1, TIME µs)`;
//! the client takes the quorum's largest and writes it back to the lock and
//! last-token key on every node of its quorum (the grant fails unless a
//! majority accepts it). Any later grant needs a majority, which overlaps
//! ours in at least one node, whose `last` is ours: so tokens strictly
//! increase **as long as the nodes' clocks never step back and a node that
//! lost its data (restart without persistence) stays out of quorums until its
//! old locks have expired**. dlock enforces the latter itself: a node refuses
//! grants until it has been up for `max_ttl` (default 60 s, URL option
//! `max_ttl=30s`; sessions may not use a longer TTL) — the "delayed restart"
//! of the Redis docs, without relying on operators. Tokens are *not*
//! monotonic if those assumptions break; when correctness matters more than
//! availability, prefer a consensus store (etcd, ZooKeeper).
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

mod node;
mod options;
mod script;
mod session;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::RawSession;
use dlock_core::{
    Backend, Error, FencingToken, LockInfo, LockName, SessionId, SessionOptions, name,
};
use futures::future::join_all;

use node::Node;
pub use options::DEFAULT_PREFIX;
use options::RedisOptions;

/// The smallest TTL: `PX` has millisecond resolution and a renewal round trip
/// must fit well inside a third of it.
pub const MIN_TTL: Duration = Duration::from_millis(100);

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A lock service on Redis or Redlock (see the [crate docs](crate)).
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) nodes: Vec<Node>,
    pub(crate) options: RedisOptions,
}

impl Inner {
    /// Majority of the nodes (1 for a single instance).
    pub(crate) fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// How long a node must be up before it may grant (Redlock only).
    pub(crate) fn min_uptime(&self) -> Duration {
        if self.options.redlock {
            self.options.max_ttl
        } else {
            Duration::ZERO
        }
    }
}

impl RedisBackend {
    /// Connects to `redis://`, `rediss://` or `redlock://` (see the crate docs).
    /// For Redlock, a majority of the nodes must answer.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let options = RedisOptions::from_url(url)?;
        let connecting = options.nodes.iter().map(|u| {
            let client = redis::Client::open(u.as_str())
                .map_err(|_| Error::invalid_url(url, "not a valid Redis URL"));
            let prefix = options.prefix.clone();
            let shown = dlock_core::url::redact(u);
            async move { Node::connect(client?, prefix, shown, CONNECT_TIMEOUT).await }
        });
        let results = join_all(connecting).await;
        let total = results.len();
        let mut nodes = Vec::new();
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(n) => nodes.push(n),
                Err(e) => errors.push(e),
            }
        }
        if nodes.len() < total / 2 + 1 {
            let first = errors.into_iter().next().expect("a failed node");
            return Err(if total == 1 {
                first
            } else {
                Error::unavailable(
                    "redis",
                    format!(
                        "only {} of {total} Redlock nodes reachable: {first}",
                        nodes.len()
                    ),
                )
            });
        }
        if nodes.len() < total {
            tracing::warn!(
                reachable = nodes.len(),
                total,
                "some Redlock nodes are unreachable"
            );
        }
        Ok(Self {
            inner: Arc::new(Inner { nodes, options }),
        })
    }

    /// Keys under `prefix` that would never expire plus subscribed channels:
    /// zero unless something leaked (for the conformance suite).
    pub async fn leftovers(&self, prefix: &str) -> Result<usize, Error> {
        let mut total = 0;
        for node in &self.inner.nodes {
            total += node.persistent_keys(prefix).await?;
        }
        Ok(total)
    }

    /// Waits until a majority of the nodes may grant, at most `limit`.
    ///
    /// A Redlock node refuses grants until it has been up for `max_ttl` since
    /// dlock first saw it (or saw it again after losing its data); this starts
    /// that clock on every node and waits it out. A no-op for plain Redis.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait_ready(&self, limit: Duration) -> Result<(), Error> {
        let min_uptime = self.inner.min_uptime();
        if min_uptime.is_zero() {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let answers = join_all(self.inner.nodes.iter().map(|n| n.ready_in(min_uptime))).await;
            let mut waits: Vec<Duration> = answers.into_iter().filter_map(Result::ok).collect();
            waits.sort();
            let quorum = self.inner.quorum();
            let Some(wait) = waits.get(quorum - 1).copied() else {
                return Err(Error::unavailable(
                    "redis",
                    "no majority of Redlock nodes answered",
                ));
            };
            if wait.is_zero() {
                return Ok(());
            }
            if tokio::time::Instant::now() + wait > deadline {
                return Err(Error::unavailable(
                    "redis",
                    format!("Redlock nodes need {wait:?} more before they may grant"),
                ));
            }
            tokio::time::sleep(wait).await;
        }
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.inner.options.shown)
            .field("nodes", &self.inner.nodes.len())
            .finish()
    }
}

#[async_trait]
impl Backend for RedisBackend {
    fn scheme(&self) -> &'static str {
        if self.inner.options.redlock {
            "redlock"
        } else {
            "redis"
        }
    }

    fn min_ttl(&self) -> Duration {
        MIN_TTL
    }

    async fn open(
        &self,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Arc<dyn RawSession>, Error> {
        let ttl = options.ttl_value();
        if self.inner.options.redlock && ttl > self.inner.options.max_ttl {
            return Err(Error::InvalidTtl {
                ttl,
                min: MIN_TTL,
                max: self.inner.options.max_ttl,
            });
        }
        Ok(Arc::new(session::RedisSession::new(
            self.inner.clone(),
            id,
            ttl,
        )))
    }

    /// `PING` on every node, concurrently; fails unless a majority answers.
    async fn ping(&self) -> Result<(), Error> {
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| async { n.ping().await.map(|()| true) }),
        )
        .await;
        let (_, answered) = count(answers)?;
        check_answered(&self.inner, answered)
    }

    async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let answers = join_all(self.inner.nodes.iter().map(|n| n.inspect(name))).await;
        quorum_view(&self.inner, answers)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<LockInfo>, Error> {
        name::check_prefix(prefix)?;
        let mut names = Vec::new();
        for node in &self.inner.nodes {
            match node.scan(prefix).await {
                Ok(n) => names.extend(n),
                Err(e) if self.inner.nodes.len() == 1 => return Err(e),
                Err(_) => {}
            }
        }
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
        let answers = join_all(self.inner.nodes.iter().map(|n| n.validate(name, token))).await;
        let (ok, answered) = count(answers)?;
        check_answered(&self.inner, answered)?;
        Ok(ok >= self.inner.quorum())
    }

    async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let answers = join_all(self.inner.nodes.iter().map(|n| n.force_release(name))).await;
        let (freed, answered) = count(answers)?;
        check_answered(&self.inner, answered)?;
        if freed > 0 {
            tracing::info!(lock = %name, "force-released");
        }
        Ok(freed > 0)
    }
}

/// Counts `true` answers and answers at all; the first error if none answered.
pub(crate) fn count(answers: Vec<Result<bool, Error>>) -> Result<(usize, usize), Error> {
    let mut yes = 0;
    let mut answered = 0;
    let mut first_error = None;
    for a in answers {
        match a {
            Ok(v) => {
                answered += 1;
                yes += usize::from(v);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match (answered, first_error) {
        (0, Some(e)) => Err(e),
        _ => Ok((yes, answered)),
    }
}

/// Fails unless a majority of the nodes answered (else a decision is a guess).
pub(crate) fn check_answered(inner: &Inner, answered: usize) -> Result<(), Error> {
    if answered < inner.quorum() {
        Err(Error::unavailable(
            "redis",
            format!(
                "only {answered} of {} Redis nodes answered",
                inner.nodes.len()
            ),
        ))
    } else {
        Ok(())
    }
}

/// The holder a majority of the nodes agree on.
fn quorum_view(
    inner: &Inner,
    answers: Vec<Result<Option<LockInfo>, Error>>,
) -> Result<Option<LockInfo>, Error> {
    let mut infos = Vec::new();
    let mut answered = 0;
    let mut first_error = None;
    for a in answers {
        match a {
            Ok(i) => {
                answered += 1;
                infos.extend(i);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if answered == 0 {
        return Err(first_error.expect("some node"));
    }
    check_answered(inner, answered)?;
    for info in &infos {
        let agree = infos
            .iter()
            .filter(|o| o.holder == info.holder && o.token == info.token)
            .count();
        if agree >= inner.quorum() {
            return Ok(Some(info.clone()));
        }
    }
    Ok(None)
}
