//! One Redis server: a multiplexed command connection (reconnecting), one
//! shared pub/sub connection for wake-ups, and the scripted operations.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::wake::{Waiter, WakeHub};
use dlock_core::{Error, FencingToken, LockInfo, LockName};
use futures::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSubSink};
use redis::{Client, RedisError};

use crate::script;

/// How long the last-token key outlives a release (after that the server
/// clock in µs is the floor; see [`script`]).
pub(crate) const KEEP_LAST_MS: u64 = 10_000;

const BACKEND: &str = "redis";

/// Maps a driver error to the core error by meaning.
pub(crate) fn map_err(e: RedisError) -> Error {
    if e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading)
                | redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain)
                | redis::ErrorKind::Server(redis::ServerErrorKind::MasterDown)
        )
    {
        Error::unavailable(BACKEND, e)
    } else if matches!(
        e.kind(),
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
    ) {
        Error::protocol(BACKEND, e.to_string())
    } else {
        Error::backend(BACKEND, e)
    }
}

/// The key names of one lock.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub(crate) lock: String,
    pub(crate) last: String,
    pub(crate) channel: String,
    pub(crate) boot: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &LockName) -> Self {
        let lock = format!("{prefix}:{{{name}}}");
        Self {
            last: format!("{lock}:t"),
            channel: format!("{lock}:c"),
            boot: format!("{prefix}:boot"),
            lock,
        }
    }
}

/// What a take script answered.
pub(crate) enum Taken {
    Granted(FencingToken),
    Busy(Duration),
}

/// One Redis server.
pub(crate) struct Node {
    conn: ConnectionManager,
    pub(crate) prefix: String,
    pub(crate) shown: String,
    subs: Arc<Subscriptions>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("url", &self.shown).finish()
    }
}

impl Node {
    /// Connects (and checks the server answers) within `timeout`.
    pub(crate) async fn connect(
        client: Client,
        prefix: String,
        shown: String,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        let conn = tokio::time::timeout(timeout, client.get_connection_manager_with_config(config))
            .await
            .map_err(|_| Error::unavailable(BACKEND, format!("{shown}: connect timed out")))?
            .map_err(map_err)?;
        let subs = Arc::new(Subscriptions::new(client.clone()));
        Ok(Self {
            conn,
            prefix,
            shown,
            subs,
        })
    }

    pub(crate) fn keys(&self, name: &LockName) -> Keys {
        Keys::new(&self.prefix, name)
    }

    pub(crate) async fn ping(&self) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        redis::cmd("PING")
            .query_async::<()>(&mut conn)
            .await
            .map_err(map_err)
    }

    pub(crate) async fn take(
        &self,
        keys: &Keys,
        owner: &str,
        session: &str,
        why: &str,
        ttl: Duration,
        min_uptime: Duration,
    ) -> Result<Taken, Error> {
        let mut conn = self.conn.clone();
        let (granted, value): (i64, i64) = script::TAKE
            .key(&keys.lock)
            .key(&keys.last)
            .key(&keys.boot)
            .arg(owner)
            .arg(session)
            .arg(why)
            .arg(ttl.as_millis() as u64)
            .arg(KEEP_LAST_MS)
            .arg(min_uptime.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
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

    /// Owner-checked release; `token: None` releases whatever this owner holds.
    pub(crate) async fn release(
        &self,
        keys: &Keys,
        owner: &str,
        token: Option<FencingToken>,
    ) -> Result<bool, Error> {
        let mut conn = self.conn.clone();
        let token = token.map(|t| t.get().to_string()).unwrap_or_default();
        let released: i64 = script::RELEASE
            .key(&keys.lock)
            .key(&keys.last)
            .arg(owner)
            .arg(token)
            .arg(&keys.channel)
            .arg(KEEP_LAST_MS)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(released == 1)
    }

    /// Renews every `(keys, owner, token)` in one script.
    pub(crate) async fn renew(
        &self,
        holds: &[(Keys, &str, FencingToken)],
        ttl: Duration,
    ) -> Result<Vec<bool>, Error> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone();
        let mut invocation = script::RENEW.prepare_invoke();
        invocation.arg(ttl.as_millis() as u64);
        for (keys, owner, token) in holds {
            invocation
                .key(&keys.lock)
                .arg(*owner)
                .arg(token.get().to_string());
        }
        let out: Vec<i64> = invocation.invoke_async(&mut conn).await.map_err(map_err)?;
        if out.len() != holds.len() {
            return Err(Error::protocol(
                BACKEND,
                "renew answered for a different number of locks",
            ));
        }
        Ok(out.into_iter().map(|v| v == 1).collect())
    }

    /// Milliseconds before this node may grant (Redlock boot guard).
    pub(crate) async fn ready_in(&self, min_uptime: Duration) -> Result<Duration, Error> {
        let mut conn = self.conn.clone();
        let left: i64 = script::READY
            .key(format!("{}:boot", self.prefix))
            .arg(min_uptime.as_millis() as u64)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(Duration::from_millis(left.max(0) as u64))
    }

    /// Writes the quorum's token to this node's hold (Redlock).
    pub(crate) async fn bump(
        &self,
        keys: &Keys,
        owner: &str,
        token: FencingToken,
        ttl: Duration,
    ) -> Result<bool, Error> {
        let mut conn = self.conn.clone();
        let done: i64 = script::BUMP
            .key(&keys.lock)
            .key(&keys.last)
            .arg(owner)
            .arg(token.get().to_string())
            .arg(ttl.as_millis() as u64 + KEEP_LAST_MS)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(done == 1)
    }

    pub(crate) async fn inspect(&self, name: &LockName) -> Result<Option<LockInfo>, Error> {
        let keys = self.keys(name);
        let mut conn = self.conn.clone();
        let reply: Option<Vec<String>> = script::INSPECT
            .key(&keys.lock)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        let Some(v) = reply else { return Ok(None) };
        let bad = || Error::protocol(BACKEND, format!("unexpected lock record {v:?}"));
        let [session, token, why, at, pttl, now] = v.as_slice() else {
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
        Ok(Some(info))
    }

    /// Every key matching `pattern`, by `SCAN` (never `KEYS`).
    async fn scan_keys(&self, pattern: &str) -> Result<Vec<String>, Error> {
        let mut conn = self.conn.clone();
        let mut cursor = 0u64;
        let mut all = Vec::new();
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .map_err(map_err)?;
            all.extend(keys);
            if next == 0 {
                return Ok(all);
            }
            cursor = next;
        }
    }

    /// Names of held locks under `prefix`, by `SCAN` (never `KEYS`).
    pub(crate) async fn scan(&self, prefix: &str) -> Result<Vec<LockName>, Error> {
        // Names contain no glob characters, so the prefix needs no escaping;
        // the trailing `}` excludes the `:t` last-token keys.
        let pattern = format!("{}:{{{prefix}*}}", self.prefix);
        let lock_prefix = format!("{}:{{", self.prefix);
        let mut names: Vec<LockName> = self
            .scan_keys(&pattern)
            .await?
            .iter()
            .filter_map(|key| key.strip_prefix(&lock_prefix)?.strip_suffix('}'))
            .filter_map(|name| LockName::new(name).ok())
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Keys under `prefix` that would never expire (none should): the leak
    /// check of the conformance suite.
    pub(crate) async fn persistent_keys(&self, prefix: &str) -> Result<usize, Error> {
        let mut conn = self.conn.clone();
        let mut count = 0;
        for key in self
            .scan_keys(&format!("{}:{{{prefix}*", self.prefix))
            .await?
        {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .map_err(map_err)?;
            if ttl == -1 {
                count += 1;
            }
        }
        let channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .arg(format!("{}:{{{prefix}*", self.prefix))
            .query_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(count + channels.len())
    }

    pub(crate) async fn validate(
        &self,
        name: &LockName,
        token: FencingToken,
    ) -> Result<bool, Error> {
        let keys = self.keys(name);
        let mut conn = self.conn.clone();
        let ok: i64 = script::VALIDATE
            .key(&keys.lock)
            .arg(token.get().to_string())
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(ok == 1)
    }

    pub(crate) async fn force_release(&self, name: &LockName) -> Result<bool, Error> {
        let keys = self.keys(name);
        let mut conn = self.conn.clone();
        let done: i64 = script::FORCE
            .key(&keys.lock)
            .key(&keys.last)
            .arg(&keys.channel)
            .arg(KEEP_LAST_MS)
            .invoke_async(&mut conn)
            .await
            .map_err(map_err)?;
        Ok(done == 1)
    }

    /// Subscribes to `channel` on the node's shared pub/sub connection.
    pub(crate) async fn subscribe(&self, channel: &str) -> Result<Subscription, Error> {
        self.subs.clone().subscribe(channel).await
    }
}

fn epoch_ms(ms: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64)
}

/// The shared pub/sub connection of one node: channels are subscribed while
/// at least one waiter needs them (no leaked channels), and every message
/// wakes the longest-waiting waiter of its channel in this process.
struct Subscriptions {
    client: Client,
    /// The sink of the live connection, if any.
    state: tokio::sync::Mutex<Option<PubSubSink>>,
    /// The waiters per channel (dlock-core's wake-up plumbing).
    waiters: Arc<WakeHub>,
    /// The task reading the live connection; aborted with the hub.
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Subscriptions {
    fn drop(&mut self) {
        if let Some(reader) = self.reader.lock().unwrap().take() {
            reader.abort();
        }
    }
}

/// A waiter's registration; unsubscribes the channel when the last one goes.
pub(crate) struct Subscription {
    /// `Some` until dropped.
    waiter: Option<Waiter>,
    subs: Arc<Subscriptions>,
}

impl Subscription {
    /// Resolves at the next release notification on the channel.
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
        if !self.subs.waiters.has_waiters(&channel)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let subs = self.subs.clone();
            rt.spawn(async move { subs.unsubscribe_if_unused(&channel).await });
        }
    }
}

impl Subscriptions {
    fn new(client: Client) -> Self {
        Self {
            client,
            state: tokio::sync::Mutex::new(None),
            waiters: Arc::default(),
            reader: Mutex::new(None),
        }
    }

    async fn subscribe(self: Arc<Self>, channel: &str) -> Result<Subscription, Error> {
        let first = !self.waiters.has_waiters(channel);
        let subscription = Subscription {
            waiter: Some(self.waiters.subscribe(channel)),
            subs: self.clone(),
        };
        let mut state = self.state.lock().await;
        if state.is_none() {
            // A new connection subscribes every channel with waiters,
            // including this one.
            *state = Some(self.connect().await?);
        } else if first {
            let sink = state.as_mut().expect("checked above");
            if let Err(e) = sink.subscribe(channel).await {
                *state = None;
                return Err(map_err(e));
            }
        }
        Ok(subscription)
    }

    fn channels(&self) -> Vec<String> {
        self.waiters.keys()
    }

    /// Opens a pub/sub connection subscribed to every channel with waiters
    /// and starts its reader; the caller stores the sink.
    // Boxed with an explicit `Send`: the reader task calls it again to
    // reconnect, and a recursive `async fn` cannot prove it is `Send`.
    fn connect(self: &Arc<Self>) -> futures::future::BoxFuture<'_, Result<PubSubSink, Error>> {
        Box::pin(async move {
            let pubsub = self.client.get_async_pubsub().await.map_err(map_err)?;
            let (mut sink, mut stream) = pubsub.split();
            for channel in self.channels() {
                sink.subscribe(&channel).await.map_err(map_err)?;
            }
            let weak = Arc::downgrade(self);
            let reader = tokio::spawn(async move {
                while let Some(msg) = stream.next().await {
                    let Some(subs) = weak.upgrade() else { return };
                    // One waiter per release in this process (no herd); if it
                    // loses the race, the winner's release wakes the next.
                    subs.waiters.wake_first(msg.get_channel_name());
                }
                // Connection lost: reconnect and resubscribe while anyone waits;
                // waiters fall back to their timers meanwhile.
                loop {
                    let Some(subs) = weak.upgrade() else { return };
                    let mut state = subs.state.lock().await;
                    if subs.channels().is_empty() {
                        *state = None;
                        return;
                    }
                    match subs.connect().await {
                        Ok(connected) => {
                            *state = Some(connected);
                            return;
                        }
                        Err(e) => {
                            *state = None;
                            drop(state);
                            drop(subs);
                            tracing::warn!(error = %e, "redis pub/sub reconnect failed; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                }
            });
            *self.reader.lock().unwrap() = Some(reader);
            Ok(sink)
        })
    }

    async fn unsubscribe_if_unused(&self, channel: &str) {
        // Checked under the connection lock: a subscriber that registers
        // after this check subscribes again once it gets the lock.
        let mut state = self.state.lock().await;
        if self.waiters.has_waiters(channel) {
            return;
        }
        if let Some(sink) = state.as_mut()
            && sink.unsubscribe(channel).await.is_err()
        {
            *state = None;
        }
    }
}
