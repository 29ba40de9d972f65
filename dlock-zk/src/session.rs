//! A session is a ZooKeeper session; an attempt is one protected
//! ephemeral-sequential node in the name's queue.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Busy, Claim, ExpiryModel, Hold, RawSession, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};
use zookeeper_client as zk;

use crate::{Inner, map_err};

/// Reads per renewal multi-read. A lock node answers its data (holder id,
/// session timeout and a `why` of at most 512 bytes: under 800 bytes) and
/// its stat (~70 bytes), so a chunk's answer stays below `jute.maxbuffer`
/// (1 MiB) even with every `why` at its longest.
const MULTI_READ_CHUNK: usize = 1000;

/// How long an emptied lock parent stays after this session's last release
/// of the name before the session removes it. A name locked again within it
/// (a hot lock, a job every second) finds its parent and is taken with one
/// request (the create's multi, which also tells whether the node is alone)
/// instead of three (a multi that fails, the multi that creates parent and
/// node, a list). Parents are
/// containers, so the server would remove them anyway, but only about a
/// minute later and at most 10,000 a minute (`znode.container.*`).
const TIDY_DELAY: Duration = Duration::from_secs(2);

/// Sorts queue nodes `<guid>-lock-<sequence>` by sequence (the guids differ,
/// so plain string order would be wrong).
pub(crate) fn sorted(mut children: Vec<String>) -> Vec<String> {
    children.sort_by_key(|c| sequence_of(c));
    children
}

fn sequence_of(node: &str) -> i64 {
    node.rsplit_once("-lock-")
        .and_then(|(_, seq)| seq.parse().ok())
        .unwrap_or(i64::MAX)
}

/// A hold's key: the node's path and, after a `#`, its czxid (the token),
/// so that a release checks the token without a read.
fn key_of(path: &str, czxid: i64) -> String {
    format!("{path}#{czxid}")
}

/// The path and czxid of a hold's key.
fn parse_key(key: &str) -> Option<(&str, i64)> {
    let (path, czxid) = key.rsplit_once('#')?;
    Some((path, czxid.parse().ok()?))
}

pub(crate) struct ZkSession {
    inner: Arc<Inner>,
    client: zk::Client,
    id: SessionId,
    /// The TTL the core counts with: the negotiated session timeout less
    /// the leader's report lag (see the crate docs).
    ttl: Duration,
    /// The ZooKeeper session id in hex: every node of this session starts
    /// with it (ownership check, protected mode).
    zk_id: String,
    /// Lock parents this session emptied, by when it last released their
    /// name: each is removed [`TIDY_DELAY`] after that, or when the session
    /// closes.
    emptied: Arc<Mutex<HashMap<String, Instant>>>,
    /// Set once `close` has removed the pending parents.
    closing: AtomicBool,
    /// One task per entry of `emptied`, off the release path; aborted with
    /// the session.
    tidying: Mutex<JoinSet<()>>,
    /// In an ensemble, the task that sends a request every `touch_gap`
    /// (see [`touch_regularly`]); aborted with the session.
    _touching: JoinSet<()>,
}

/// Sends a cheap read every `every`, whether or not earlier ones were
/// answered, for as long as the client lives. The report-lag bound (crate
/// docs) needs the follower to hear from this session at least every
/// `touch_gap`; the driver's own pings cannot promise it, since it sends the
/// next ping only once the last one was answered, so replies delayed by D
/// would stretch the gap by D (found by the adversarial review).
fn touch_regularly(client: zk::Client, every: Duration) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if client.state().is_terminated() {
                return;
            }
            // The request is sent by this call; its answer is not needed
            // (dropping the future does not cancel the request).
            drop(client.check_stat("/"));
        }
    });
    tasks
}

impl fmt::Debug for ZkSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkSession")
            .field("id", &self.id)
            .field("zk_session", &self.zk_id)
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl ZkSession {
    pub(crate) async fn open(
        inner: Arc<Inner>,
        id: SessionId,
        ttl: Duration,
    ) -> Result<Self, Error> {
        let client = inner.config.connect(ttl).await?;
        // The ensemble may negotiate the timeout: run with what it granted,
        // less what the leader may not have heard yet.
        let negotiated = client.session_timeout();
        let lag = inner.report_lag(negotiated);
        let ttl = negotiated.saturating_sub(lag).max(Duration::from_millis(1));
        tracing::debug!(session = %id, ?negotiated, ?lag, ?ttl, "zookeeper session opened");
        let touching = if lag.is_zero() {
            // A standalone server touches sessions as requests arrive.
            JoinSet::new()
        } else {
            touch_regularly(client.clone(), crate::touch_gap(negotiated))
        };
        Ok(Self {
            _touching: touching,
            ttl,
            zk_id: format!("{:x}", client.session_id().0),
            inner,
            client,
            id,
            emptied: Arc::default(),
            closing: AtomicBool::new(false),
            tidying: Mutex::new(JoinSet::new()),
        })
    }

    /// Whether the node at `path` was created by this session.
    fn owns(&self, path: &str) -> bool {
        path.rsplit('/')
            .next()
            .is_some_and(|node| node.starts_with(&format!("{}-", self.zk_id)))
    }

    /// Deletes the lock's parent if it is empty, [`TIDY_DELAY`] after the
    /// session's last release of the name, in a task of the session. Safe at
    /// any time: a parent with nodes is not deleted, and a create that finds
    /// no parent makes one in the same multi as its node.
    ///
    /// Once the session is closing, the parent is removed at once (a
    /// release the core finishes in the background may end after `close`
    /// removed the pending ones).
    async fn tidy(&self, name: &LockName) {
        let parent = self.inner.parent(name);
        if self.closing.load(Ordering::Acquire) {
            remove_if_empty(&self.client, &parent).await;
            return;
        }
        let first = lock(&self.emptied)
            .insert(parent.clone(), Instant::now())
            .is_none();
        if !first {
            return; // its task sees the later release and waits on
        }
        let (client, emptied) = (self.client.clone(), self.emptied.clone());
        let mut tasks = lock(&self.tidying);
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            loop {
                let due = match lock(&emptied).get(&parent) {
                    Some(released) => *released + TIDY_DELAY,
                    None => return, // removed by close
                };
                if Instant::now() < due {
                    sleep_until(due).await;
                    continue;
                }
                remove_if_empty(&client, &parent).await;
                // The entry stays until the delete was answered (so that a
                // close meanwhile deletes it again, and waits for that); a
                // release meanwhile starts the wait over.
                let mut emptied = lock(&emptied);
                match emptied.get(&parent) {
                    Some(released) if *released + TIDY_DELAY > Instant::now() => {}
                    _ => {
                        emptied.remove(&parent);
                        return;
                    }
                }
            }
        });
    }

    /// Removes every parent still waiting for its delay, now: every delete
    /// is sent before any answer is awaited (zookeeper-client queues a
    /// request when it is called), so a timeout around `close` cannot leave
    /// some unsent.
    async fn tidy_now(&self) {
        self.closing.store(true, Ordering::Release);
        let mut tasks = std::mem::take(&mut *lock(&self.tidying));
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        let parents: Vec<String> = lock(&self.emptied).drain().map(|(p, _)| p).collect();
        let deletes: Vec<_> = parents
            .iter()
            .map(|parent| self.client.delete(parent, None))
            .collect();
        for (parent, delete) in parents.iter().zip(deletes) {
            removed_if_empty(delete.await, parent);
        }
    }
}

#[async_trait]
impl RawSession for ZkSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::Session
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(ZkClaim {
            inner: self.inner.clone(),
            client: self.client.clone(),
            name: name.clone(),
            parent: self.inner.parent(name),
            guid: format!("{}-{:016x}", self.zk_id, rand::random::<u64>()),
            // (the timeout the ensemble granted: see `crate::node_data`)
            data: crate::node_data::encode(self.id.as_str(), self.client.session_timeout(), why),
            node: None,
            sent: false,
            ahead: None,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        // Both sent now, in this order: the read waits on the server for the
        // sync, which the leader answers only while it holds the session
        // open (see the crate docs).
        let synced = self.client.sync(&self.inner.config.root);
        // One multi-read per chunk, all sent now (pipelined on the session's
        // connection): one multi of thousands of reads would answer more
        // than the server's `jute.maxbuffer` (1 MiB) and cost the
        // connection.
        let mut reads = Vec::new();
        for chunk in holds.chunks(MULTI_READ_CHUNK) {
            let mut reader = self.client.new_multi_reader();
            for hold in chunk {
                let path = parse_key(&hold.key).map_or(hold.key.as_str(), |(p, _)| p);
                reader.add_get_data(path).map_err(map_err)?;
            }
            reads.push(reader.commit());
        }
        synced.await.map_err(map_err)?;
        let mut results = Vec::with_capacity(holds.len());
        for read in reads {
            results.extend(read.await.map_err(map_err)?);
        }
        if results.len() != holds.len() {
            return Err(Error::protocol(
                "zk",
                "multi-read answered for a different number of nodes",
            ));
        }
        let session = self.client.session_id().0;
        Ok(holds
            .iter()
            .zip(results)
            .map(|(hold, result)| match (result, parse_key(&hold.key)) {
                (zk::MultiReadResult::Data { stat, .. }, Some((path, czxid))) => {
                    self.owns(path)
                        && czxid as u64 == hold.token.get()
                        && stat.czxid == czxid
                        && stat.ephemeral_owner == session
                }
                _ => false,
            })
            .collect())
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let not_held = || Error::NotHeld {
            name: hold.name.to_string(),
        };
        let Some((path, czxid)) = parse_key(&hold.key) else {
            return Err(not_held());
        };
        if !self.owns(path) || czxid as u64 != hold.token.get() {
            return Err(not_held());
        }
        // One request, so that a release whose reply is lost has happened.
        // The path names this grant alone: the attempt's guid is never
        // reused, and an attempt creates no node after its grant.
        match self.client.delete(path, None).await {
            Ok(()) => {}
            Err(zk::Error::NoNode) => return Err(not_held()),
            Err(e) => return Err(map_err(e)),
        }
        self.tidy(&hold.name).await;
        Ok(())
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        // The session itself ends when its client is dropped (with the
        // session); free the holds now so others need not wait for that.
        // Every delete is sent before any answer is awaited.
        let deletes: Vec<_> = holds
            .iter()
            .filter_map(|hold| {
                let (path, _) = parse_key(&hold.key)?;
                self.owns(path)
                    .then(|| (&hold.name, self.client.delete(path, None)))
            })
            .collect();
        let mut first_error = None;
        for (name, delete) in deletes {
            match delete.await {
                Ok(()) | Err(zk::Error::NoNode) => {
                    lock(&self.emptied).insert(self.inner.parent(name), Instant::now());
                }
                Err(e) => {
                    first_error.get_or_insert(map_err(e));
                }
            }
        }
        // Also after a failed delete: what can be tidied is.
        self.tidy_now().await;
        first_error.map_or(Ok(()), Err)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deletes a lock's parent node if it has no children left (it is a
/// container node, so ZooKeeper would also delete it, but only on its next
/// container sweep). ZooKeeper refuses to delete a parent that has a child,
/// and a waiter that finds the parent gone creates both in one multi, so
/// this never strands a waiter.
async fn remove_if_empty(client: &zk::Client, parent: &str) {
    removed_if_empty(client.delete(parent, None).await, parent);
}

/// Logs a parent's delete that failed for another reason than having nodes
/// or being gone already.
fn removed_if_empty(result: Result<(), zk::Error>, parent: &str) {
    match result {
        Ok(()) | Err(zk::Error::NotEmpty | zk::Error::NoNode) => {}
        Err(e) => tracing::debug!(error = %e, parent, "could not remove an empty lock node"),
    }
}

/// One node in one name's queue.
struct ZkClaim {
    inner: Arc<Inner>,
    client: zk::Client,
    name: LockName,
    parent: String,
    /// `<zk session>-<attempt>`: finds the node again after a lost reply.
    guid: String,
    data: Vec<u8>,
    /// The node's name and czxid once created.
    node: Option<(String, i64)>,
    /// Whether a create was sent (its outcome may be unknown).
    sent: bool,
    /// The full path of the node just ahead of ours.
    ahead: Option<String>,
}

impl fmt::Debug for ZkClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkClaim")
            .field("name", &self.name)
            .field("guid", &self.guid)
            .field("node", &self.node)
            .finish()
    }
}

impl ZkClaim {
    /// Protected mode: the node this attempt created, if a create whose reply
    /// was lost did succeed.
    ///
    /// After a connection loss the client may be talking to another server,
    /// which may not yet have applied a create the leader accepted: `sync`
    /// first (sent together with the listing, which the server answers after
    /// the sync). A create still on its way is then either applied before
    /// the sync (and found) or refused by the leader (the session moved, or
    /// the same server keeps the session's requests in order): once this
    /// finds nothing, no create of this attempt can land later.
    async fn find_own(&self) -> Result<Option<(String, i64)>, Error> {
        let synced = self.client.sync(&self.parent);
        let listed = self.client.list_children(&self.parent);
        synced.await.map_err(map_err)?;
        let children = match listed.await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(map_err(e)),
        };
        let prefix = format!("{}-lock-", self.guid);
        let Some(node) = children.into_iter().find(|c| c.starts_with(&prefix)) else {
            return Ok(None);
        };
        match self
            .client
            .check_stat(&format!("{}/{node}", self.parent))
            .await
            .map_err(map_err)?
        {
            Some(stat) => Ok(Some((node, stat.czxid))),
            None => Ok(None),
        }
    }

    /// The queue, sorted (empty if the parent is gone).
    async fn list(&self) -> Result<Vec<String>, Error> {
        match self.client.list_children(&self.parent).await {
            Ok(c) => Ok(sorted(c)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(e) => Err(map_err(e)),
        }
    }

    /// [`create`](Self::create), then the queue. The create is a `multi`
    /// with an empty `setData` of the parent, whose answer carries the
    /// parent's stat after the create: where the parent has one child, that
    /// child is the new node, first in the queue, and no list is needed (a
    /// list sent behind a create came back ~0.2 ms after it here, 2026-11-28).
    /// Otherwise the queue is listed. Where the parent is gone, the multi
    /// fails as a whole (NoNode) and the slow path runs (the create's multi
    /// with the parent, then a list).
    async fn create_and_list(&mut self) -> Result<((String, i64), Vec<String>), Error> {
        let path = format!("{}/{}-lock-", self.parent, self.guid);
        let options = zk::CreateMode::EphemeralSequential.with_acls(self.inner.config.acls());
        let mut writer = self.client.new_multi_writer();
        writer
            .add_create(&path, &self.data, &options)
            .map_err(map_err)?;
        writer
            .add_set_data(&self.parent, &[], None)
            .map_err(map_err)?;
        self.sent = true;
        let (created, stat, parent) = match writer.commit().await {
            Ok(results) => match <[_; 2]>::try_from(results) {
                Ok(
                    [
                        zk::MultiWriteResult::Create { path, stat },
                        zk::MultiWriteResult::SetData { stat: parent },
                    ],
                ) => (path, stat, parent),
                _ => return Err(Error::protocol("zk", "create multi answered oddly")),
            },
            Err(zk::MultiWriteError::OperationFailed {
                source: zk::Error::NoNode,
                ..
            }) => {
                let n = self.create(true).await?;
                return Ok((n, self.list().await?));
            }
            Err(e) => return Err(map_err(e.into())),
        };
        let node = created.rsplit('/').next().unwrap_or_default().to_owned();
        // A multi is one transaction with one zxid: the node's czxid is the
        // parent's mzxid (the only czxid servers with ZOOKEEPER-4026 give,
        // 3.8.0 among them: a multi's create answered without a stat).
        let czxid = if stat.is_invalid() {
            parent.mzxid
        } else {
            stat.czxid
        };
        let queue = if parent.num_children == 1 {
            vec![node.clone()]
        } else {
            self.list().await?
        };
        Ok(((node, czxid), queue))
    }

    /// Creates the attempt's node (and the lock's container parent if
    /// needed; straight away if `parent_gone`, as a create just said);
    /// returns its name and czxid.
    async fn create(&mut self, mut parent_gone: bool) -> Result<(String, i64), Error> {
        let path = format!("{}/{}-lock-", self.parent, self.guid);
        let acls = self.inner.config.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        let container = zk::CreateMode::Container.with_acls(acls);
        for _ in 0..8 {
            self.sent = true;
            if !std::mem::take(&mut parent_gone) {
                match self.client.create(&path, &self.data, &options).await {
                    Ok((stat, sequence)) => {
                        let node = format!("{}-lock-{sequence}", self.guid);
                        return Ok((node, stat.czxid));
                    }
                    Err(zk::Error::NoNode) => {}
                    Err(e) => return Err(map_err(e)),
                }
            }
            // The parent is gone (never created, or removed when its last
            // node left): create it and the node in one multi, so that a
            // removal in between cannot leave the node without a parent.
            let mut writer = self.client.new_multi_writer();
            writer
                .add_create(&self.parent, &[], &container)
                .map_err(map_err)?;
            writer
                .add_create(&path, &self.data, &options)
                .map_err(map_err)?;
            match writer.commit().await {
                Ok(results) => {
                    let Some(zk::MultiWriteResult::Create { path, stat }) =
                        results.into_iter().nth(1)
                    else {
                        return Err(Error::protocol("zk", "multi create answered oddly"));
                    };
                    let node = path.rsplit('/').next().unwrap_or_default().to_owned();
                    let czxid = if stat.is_invalid() {
                        // Some servers answer a multi's create without a
                        // stat (ZOOKEEPER-4026): read it.
                        match self.client.check_stat(&path).await.map_err(map_err)? {
                            Some(stat) => stat.czxid,
                            None => continue, // gone already: look again
                        }
                    } else {
                        stat.czxid
                    };
                    return Ok((node, czxid));
                }
                // Someone created the parent meanwhile: a plain create again.
                Err(zk::MultiWriteError::OperationFailed {
                    source: zk::Error::NodeExists,
                    ..
                }) => {}
                Err(e) => return Err(map_err(e.into())),
            }
        }
        Err(Error::unavailable(
            "zk",
            "the lock's parent node keeps disappearing",
        ))
    }

    /// Removes this attempt's node, if it has one (also one whose create's
    /// reply was lost). Idempotent.
    async fn clean_up(&mut self) -> Result<(), Error> {
        if self.node.is_none() && self.sent {
            self.node = self.find_own().await?;
            if self.node.is_none() {
                self.sent = false; // nothing was created, nothing will be
            }
        }
        if let Some((node, _)) = &self.node {
            match self
                .client
                .delete(&format!("{}/{node}", self.parent), None)
                .await
            {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map_err(e)),
            }
            self.node = None;
            self.sent = false;
            remove_if_empty(&self.client, &self.parent).await;
        }
        Ok(())
    }
}

#[async_trait]
impl Claim for ZkClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        for _ in 0..2 {
            if self.node.is_none() && self.sent {
                self.node = self.find_own().await?;
            }
            let ((node, czxid), children) = match self.node.clone() {
                Some(n) => (n, self.list().await?),
                None => {
                    let (n, children) = self.create_and_list().await?;
                    self.node = Some(n.clone());
                    (n, children)
                }
            };
            let Some(position) = children.iter().position(|c| *c == node) else {
                // Our node is gone (deleted, or its session expired): join
                // the queue again, at the back.
                self.node = None;
                self.sent = false;
                continue;
            };
            if position == 0 {
                return Ok(Take::Granted(Hold {
                    name: self.name.clone(),
                    token: FencingToken::new(czxid as u64),
                    key: key_of(&format!("{}/{node}", self.parent), czxid),
                }));
            }
            self.ahead = Some(format!("{}/{}", self.parent, children[position - 1]));
            return Ok(Take::Busy(Busy::default()));
        }
        Err(Error::unavailable(
            "zk",
            "own queue node keeps disappearing",
        ))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let Some(ahead) = self.ahead.clone() else {
            sleep_until(until).await;
            return Ok(());
        };
        // Exists-watch on the predecessor only (no herd); set and checked in
        // one request, so a deletion in between cannot be missed.
        let (stat, watcher) = self
            .client
            .check_and_watch_stat(&ahead)
            .await
            .map_err(map_err)?;
        if stat.is_none() {
            return Ok(());
        }
        tokio::select! {
            _ = watcher.changed() => {}
            _ = sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        self.clean_up().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_order_is_by_sequence_not_guid() {
        let nodes = vec![
            "ffff-1-lock-0000000003".to_owned(),
            "aaaa-2-lock-0000000010".to_owned(),
            "0000-3-lock-0000000001".to_owned(),
        ];
        assert_eq!(
            sorted(nodes),
            [
                "0000-3-lock-0000000001",
                "ffff-1-lock-0000000003",
                "aaaa-2-lock-0000000010"
            ]
        );
    }
}

/// Against the real server from `scripts/services` (`DLOCK_TEST_ZK_URL`).
#[cfg(test)]
mod server_tests {
    use super::*;
    use crate::ZkBackend;

    /// Protected mode: a create whose reply was lost is found by its guid on
    /// the retry; no second node, no orphan.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn protected_create_finds_its_node_after_a_lost_reply() {
        if dlock_conformance::skip_requested(
            "zk",
            "protected_create_finds_its_node_after_a_lost_reply",
        ) {
            return;
        }
        let url =
            std::env::var("DLOCK_TEST_ZK_URL").unwrap_or_else(|_| "zk://127.0.0.1:12181".into());
        let backend = ZkBackend::connect(&format!("{url}/dlock-test"))
            .await
            .expect("zk up (scripts/services up zk)");
        let session = ZkSession::open(
            backend.inner.clone(),
            SessionId::generate(None),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let name = LockName::new(format!("protected/{:08x}", rand::random::<u32>())).unwrap();
        let mut attempt = ZkClaim {
            inner: session.inner.clone(),
            client: session.client.clone(),
            name: name.clone(),
            parent: session.inner.parent(&name),
            guid: format!("{}-{:016x}", session.zk_id, rand::random::<u64>()),
            data: b"test".to_vec(),
            node: None,
            sent: false,
            ahead: None,
        };
        // The create reaches the server, but its reply is lost.
        let (node, czxid) = attempt.create(false).await.unwrap();
        attempt.node = None;
        assert!(attempt.sent);
        let Take::Granted(hold) = attempt.try_take().await.unwrap() else {
            panic!("the retried take did not find its own node");
        };
        assert_eq!(hold.token.get(), czxid as u64);
        assert!(parse_key(&hold.key).unwrap().0.ends_with(&node));
        let children = session
            .client
            .list_children(&session.inner.parent(&name))
            .await
            .unwrap();
        assert_eq!(children, [node], "a second node was created");
        attempt.abandon().await.unwrap();
        assert_eq!(
            backend.nodes_under(name.as_str()).await.unwrap(),
            0,
            "abandon left nodes"
        );
    }
}
