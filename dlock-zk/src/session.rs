//! A session is a ZooKeeper session; an attempt is one protected
//! ephemeral-sequential node in the name's queue.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Attempt, Busy, ExpiryModel, Hold, RawSession, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use tokio::time::{Instant, sleep_until};
use zookeeper_client as zk;

use crate::{Inner, map_err};

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

pub(crate) struct ZkSession {
    inner: Arc<Inner>,
    client: zk::Client,
    id: SessionId,
    ttl: Duration,
    /// The ZooKeeper session id in hex: every node of this session starts
    /// with it (ownership check, protected mode).
    zk_id: String,
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
        Ok(Self {
            // The ensemble may negotiate the timeout: run with what it granted.
            ttl: client.session_timeout(),
            zk_id: format!("{:x}", client.session_id().0),
            inner,
            client,
            id,
        })
    }

    /// Whether the node at `path` was created by this session.
    fn owns(&self, path: &str) -> bool {
        path.rsplit('/')
            .next()
            .is_some_and(|node| node.starts_with(&format!("{}-", self.zk_id)))
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

    async fn attempt(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Attempt>, Error> {
        Ok(Box::new(ZkAttempt {
            inner: self.inner.clone(),
            client: self.client.clone(),
            name: name.clone(),
            parent: self.inner.parent(name),
            guid: format!("{}-{:016x}", self.zk_id, rand::random::<u64>()),
            data: format!("{}\n{}", self.id, why.unwrap_or_default()).into_bytes(),
            node: None,
            sent: false,
            ahead: None,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        // Any request proves the session alive as of when it was sent; the
        // multi-read also checks every lock node in the same round trip.
        let mut reader = self.client.new_multi_reader();
        if holds.is_empty() {
            reader
                .add_get_data(&self.inner.config.root)
                .map_err(map_err)?;
        }
        for hold in holds {
            reader.add_get_data(&hold.key).map_err(map_err)?;
        }
        let results = reader.commit().await.map_err(map_err)?;
        if holds.is_empty() {
            return Ok(Vec::new());
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
            .map(|(hold, result)| match result {
                zk::MultiReadResult::Data { stat, .. } => {
                    self.owns(&hold.key)
                        && stat.czxid as u64 == hold.token.get()
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
        if !self.owns(&hold.key) {
            return Err(not_held());
        }
        let stat = self.client.check_stat(&hold.key).await.map_err(map_err)?;
        let Some(stat) = stat.filter(|s| s.czxid as u64 == hold.token.get()) else {
            return Err(not_held());
        };
        match self.client.delete(&hold.key, Some(stat.version)).await {
            Ok(()) => {}
            Err(zk::Error::NoNode | zk::Error::BadVersion) => return Err(not_held()),
            Err(e) => return Err(map_err(e)),
        }
        // Off the release path: the next holder should not wait for it.
        let client = self.client.clone();
        let parent = self.inner.parent(&hold.name);
        tokio::spawn(async move { remove_if_empty(&client, &parent).await });
        Ok(())
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        // The session itself ends when its client is dropped (with the
        // session); free the holds now so others need not wait for that.
        for hold in holds.iter().filter(|h| self.owns(&h.key)) {
            match self.client.delete(&hold.key, None).await {
                Ok(()) | Err(zk::Error::NoNode) => {
                    remove_if_empty(&self.client, &self.inner.parent(&hold.name)).await
                }
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(())
    }
}

/// Deletes a lock's parent node if it has no children left (it is a
/// container node, so ZooKeeper would also delete it, but only on its next
/// container sweep).
async fn remove_if_empty(client: &zk::Client, parent: &str) {
    match client.delete(parent, None).await {
        Ok(()) | Err(zk::Error::NotEmpty | zk::Error::NoNode) => {}
        Err(e) => tracing::debug!(error = %e, parent, "could not remove an empty lock node"),
    }
}

/// One node in one name's queue.
struct ZkAttempt {
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

impl fmt::Debug for ZkAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkAttempt")
            .field("name", &self.name)
            .field("guid", &self.guid)
            .field("node", &self.node)
            .finish()
    }
}

impl ZkAttempt {
    /// Protected mode: the node this attempt created, if a create whose reply
    /// was lost did succeed.
    async fn find_own(&self) -> Result<Option<(String, i64)>, Error> {
        let children = match self.client.list_children(&self.parent).await {
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

    /// Creates the attempt's node (and the lock's container parent if
    /// needed); returns its name and czxid.
    async fn create(&mut self) -> Result<(String, i64), Error> {
        let path = format!("{}/{}-lock-", self.parent, self.guid);
        let acls = self.inner.config.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        for _ in 0..3 {
            self.sent = true;
            match self.client.create(&path, &self.data, &options).await {
                Ok((stat, sequence)) => {
                    let node = format!("{}-lock-{sequence}", self.guid);
                    return Ok((node, stat.czxid));
                }
                Err(zk::Error::NoNode) => {
                    // The parent is gone (never created, or removed when its
                    // last node left): create it as a container node.
                    let container = zk::CreateMode::Container.with_acls(acls);
                    match self.client.create(&self.parent, &[], &container).await {
                        Ok(_) | Err(zk::Error::NodeExists) => {}
                        Err(e) => return Err(map_err(e)),
                    }
                }
                Err(e) => return Err(map_err(e)),
            }
        }
        Err(Error::unavailable(
            "zk",
            "the lock's parent node keeps disappearing",
        ))
    }
}

#[async_trait]
impl Attempt for ZkAttempt {
    async fn try_take(&mut self) -> Result<Take, Error> {
        for _ in 0..2 {
            if self.node.is_none() && self.sent {
                self.node = self.find_own().await?;
            }
            let (node, czxid) = match self.node.clone() {
                Some(n) => n,
                None => {
                    let n = self.create().await?;
                    self.node = Some(n.clone());
                    n
                }
            };
            let children = match self.client.list_children(&self.parent).await {
                Ok(c) => sorted(c),
                Err(zk::Error::NoNode) => Vec::new(),
                Err(e) => return Err(map_err(e)),
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
                    key: format!("{}/{node}", self.parent),
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
        if self.node.is_none() && self.sent {
            self.node = self.find_own().await?;
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
            remove_if_empty(&self.client, &self.parent).await;
        }
        Ok(())
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
        if std::env::var("DLOCK_TEST_SKIP").is_ok_and(|v| v.split(',').any(|s| s == "zk")) {
            eprintln!("SKIPPED zk protected create: DLOCK_TEST_SKIP names zk");
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
        let mut attempt = ZkAttempt {
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
        let (node, czxid) = attempt.create().await.unwrap();
        attempt.node = None;
        assert!(attempt.sent);
        let Take::Granted(hold) = attempt.try_take().await.unwrap() else {
            panic!("the retried take did not find its own node");
        };
        assert_eq!(hold.token.get(), czxid as u64);
        assert!(hold.key.ends_with(&node));
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
