//! A session is a lease; an attempt is one key in the name's queue.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Attempt, Busy, ExpiryModel, Hold, RawSession, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    LeaseTimeToLiveOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
    WatchStream,
};
use tokio::time::{Instant, sleep_until};

use crate::{Inner, map_err};

/// How long an abandoned key is watched for: longer than any request of
/// the client can be in flight (its request timeout is 1.5 s).
const REMEMBER_ABANDONED: Duration = Duration::from_secs(10);

pub(crate) struct EtcdSession {
    inner: Arc<Inner>,
    id: SessionId,
    lease: i64,
    ttl: Duration,
    keeper: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// Keys of abandoned attempts, remembered for [`REMEMBER_ABANDONED`]: a
    /// put still in flight when its attempt was dropped can land after the
    /// abandon's delete (they travel on different HTTP/2 streams) and would
    /// then live as long as the lease. The renewal round deletes such keys,
    /// so an orphan lives at most one renewal period (S5).
    abandoned: Arc<Mutex<HashMap<String, Instant>>>,
}

impl fmt::Debug for EtcdSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdSession")
            .field("id", &self.id)
            .field("lease", &format_args!("{:x}", self.lease))
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl EtcdSession {
    pub(crate) async fn open(
        inner: Arc<Inner>,
        id: SessionId,
        ttl: Duration,
    ) -> Result<Self, Error> {
        let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let granted = crate::retrying(|| {
            let mut leases = inner.client.lease_client();
            async move { leases.grant(seconds as i64, None).await.map_err(map_err) }
        })
        .await?;
        Ok(Self {
            lease: granted.id(),
            // etcd may raise a TTL below its minimum: run with what it granted.
            ttl: Duration::from_secs(granted.ttl().max(1) as u64),
            inner,
            id,
            keeper: tokio::sync::Mutex::new(None),
            abandoned: Arc::default(),
        })
    }

    /// Deletes keys of abandoned attempts that reappeared on the lease.
    async fn sweep_orphans(&self) -> Result<(), Error> {
        {
            let mut abandoned = self.abandoned.lock().unwrap();
            abandoned.retain(|_, at| at.elapsed() < REMEMBER_ABANDONED);
            if abandoned.is_empty() {
                return Ok(());
            }
        }
        let mut leases = self.inner.client.lease_client();
        let ttl = leases
            .time_to_live(self.lease, Some(LeaseTimeToLiveOptions::new().with_keys()))
            .await
            .map_err(map_err)?;
        let orphans: Vec<TxnOp> = {
            let abandoned = self.abandoned.lock().unwrap();
            ttl.keys()
                .iter()
                .filter_map(|k| std::str::from_utf8(k).ok())
                .filter(|k| abandoned.contains_key(*k))
                .map(|k| {
                    tracing::info!(key = k, "deleting an orphaned queue key");
                    TxnOp::delete(k, None)
                })
                .collect()
        };
        if !orphans.is_empty() {
            let mut kv = self.inner.client.kv_client();
            kv.txn(Txn::new().and_then(orphans))
                .await
                .map_err(map_err)?;
        }
        Ok(())
    }

    /// `prefix/<name>/<lease>-`: every key of this session on `name` starts so.
    fn key_prefix(&self, name: &LockName) -> String {
        format!("{}{:x}-", self.inner.queue(name), self.lease)
    }

    fn owns(&self, hold: &Hold) -> bool {
        hold.key.starts_with(&self.key_prefix(&hold.name))
    }

    async fn keep_alive(&self) -> Result<(), Error> {
        let mut slot = self.keeper.lock().await;
        if slot.is_none() {
            let mut leases = self.inner.client.lease_client();
            *slot = Some(leases.keep_alive(self.lease).await.map_err(map_err)?);
        }
        let (keeper, stream) = slot.as_mut().expect("just set");
        let answer = match keeper.keep_alive().await {
            Ok(()) => stream.message().await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(Some(resp)) if resp.ttl() > 0 => Ok(()),
            Ok(Some(_)) => Err(Error::SessionLost {
                session: self.id.to_string(),
            }),
            Ok(None) => {
                *slot = None;
                Err(Error::unavailable("etcd", "lease keep-alive stream closed"))
            }
            Err(e) => {
                *slot = None;
                Err(map_err(e))
            }
        }
    }
}

#[async_trait]
impl RawSession for EtcdSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::Session
    }

    async fn attempt(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Attempt>, Error> {
        let key = format!("{}{:016x}", self.key_prefix(name), rand::random::<u64>());
        Ok(Box::new(EtcdAttempt {
            inner: self.inner.clone(),
            abandoned: self.abandoned.clone(),
            name: name.clone(),
            queue: self.inner.queue(name),
            key,
            value: format!("{}\n{}", self.id, why.unwrap_or_default()),
            lease: self.lease,
            own: None,
            sent: false,
            ahead: None,
            watching: None,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        self.keep_alive().await?;
        self.sweep_orphans().await?;
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        let reads: Vec<TxnOp> = holds
            .iter()
            .map(|h| TxnOp::get(h.key.as_str(), None))
            .collect();
        let mut kv = self.inner.client.kv_client();
        let resp = kv.txn(Txn::new().and_then(reads)).await.map_err(map_err)?;
        let answers = resp.op_responses();
        if answers.len() != holds.len() {
            return Err(Error::protocol(
                "etcd",
                "renewal read answered for a different number of keys",
            ));
        }
        Ok(holds
            .iter()
            .zip(answers)
            .map(|(hold, answer)| match answer {
                TxnOpResponse::Get(get) => {
                    self.owns(hold)
                        && get.kvs().first().is_some_and(|kv| {
                            kv.create_revision() as u64 == hold.token.get()
                                && kv.lease() == self.lease
                        })
                }
                _ => false,
            })
            .collect())
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        if !self.owns(hold) {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        let mut kv = self.inner.client.kv_client();
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                hold.key.as_str(),
                CompareOp::Equal,
                hold.token.get() as i64,
            )])
            .and_then(vec![TxnOp::delete(hold.key.as_str(), None)]);
        let resp = kv.txn(txn).await.map_err(map_err)?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(Error::NotHeld {
                name: hold.name.to_string(),
            })
        }
    }

    async fn close(&self, _holds: &[Hold]) -> Result<(), Error> {
        // Revoking the lease deletes every key attached to it at once.
        let mut leases = self.inner.client.lease_client();
        match leases.revoke(self.lease).await.map_err(map_err) {
            Ok(_) | Err(Error::SessionLost { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// One key in one name's queue.
struct EtcdAttempt {
    inner: Arc<Inner>,
    /// The session's recently abandoned keys.
    abandoned: Arc<Mutex<HashMap<String, Instant>>>,
    name: LockName,
    queue: String,
    key: String,
    value: String,
    lease: i64,
    /// The key's create revision once it exists: the fencing token.
    own: Option<i64>,
    sent: bool,
    /// The key just ahead of ours, and the revision at which it was seen.
    ahead: Option<(Vec<u8>, i64)>,
    watching: Option<(Vec<u8>, WatchStream)>,
}

impl fmt::Debug for EtcdAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAttempt")
            .field("key", &self.key)
            .field("own", &self.own)
            .finish()
    }
}

impl EtcdAttempt {
    /// Creates the attempt's key (or finds it, after a lost reply); returns
    /// its create revision and whether it is first in line — read in the same
    /// txn, so an uncontended take is one round trip.
    async fn enqueue(&mut self) -> Result<(i64, bool), Error> {
        let head = || {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1)
                .with_keys_only();
            TxnOp::get(self.queue.as_str(), Some(options))
        };
        let mut kv = self.inner.client.kv_client();
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                self.key.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![
                TxnOp::put(
                    self.key.as_str(),
                    self.value.as_str(),
                    Some(PutOptions::new().with_lease(self.lease)),
                ),
                head(),
            ])
            .or_else(vec![TxnOp::get(self.key.as_str(), None), head()]);
        self.sent = true;
        let resp = kv.txn(txn).await.map_err(map_err)?;
        let answers = resp.op_responses();
        let first = match answers.get(1) {
            Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.key().to_vec()),
            _ => return Err(Error::protocol("etcd", "unexpected txn answer")),
        };
        let is_first = first.as_deref() == Some(self.key.as_bytes());
        if resp.succeeded() {
            let revision = resp
                .header()
                .map(|h| h.revision())
                .ok_or_else(|| Error::protocol("etcd", "txn without header"))?;
            return Ok((revision, is_first));
        }
        match answers.first() {
            Some(TxnOpResponse::Get(get)) => get
                .kvs()
                .first()
                .map(|kv| (kv.create_revision(), is_first))
                .ok_or_else(|| Error::protocol("etcd", "own key vanished inside a txn")),
            _ => Err(Error::protocol("etcd", "unexpected txn answer")),
        }
    }

    fn granted(&self, own: i64) -> Take {
        Take::Granted(Hold {
            name: self.name.clone(),
            token: FencingToken::new(own as u64),
            key: self.key.clone(),
        })
    }
}

#[async_trait]
impl Attempt for EtcdAttempt {
    async fn try_take(&mut self) -> Result<Take, Error> {
        for _ in 0..2 {
            let own = match self.own {
                Some(own) => own,
                None => {
                    let (own, first) = self.enqueue().await?;
                    self.own = Some(own);
                    if first {
                        return Ok(self.granted(own));
                    }
                    own
                }
            };
            // One round trip: our key is still there, and who is just ahead.
            let mut kv = self.inner.client.kv_client();
            let ahead = GetOptions::new()
                .with_prefix()
                .with_max_create_revision(own - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(1)
                .with_keys_only();
            let txn = Txn::new()
                .when(vec![Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    own,
                )])
                .and_then(vec![TxnOp::get(self.queue.as_str(), Some(ahead))]);
            let resp = kv.txn(txn).await.map_err(map_err)?;
            if !resp.succeeded() {
                // Our key is gone (its lease expired, or it was deleted):
                // enqueue again, at the back.
                self.own = None;
                continue;
            }
            let revision = resp.header().map(|h| h.revision()).unwrap_or(own);
            let first_ahead = match resp.op_responses().into_iter().next() {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.key().to_vec()),
                _ => return Err(Error::protocol("etcd", "unexpected txn answer")),
            };
            return Ok(match first_ahead {
                None => self.granted(own),
                Some(key) => {
                    self.ahead = Some((key, revision + 1));
                    Take::Busy(Busy::default())
                }
            });
        }
        Err(Error::unavailable(
            "etcd",
            "own queue key keeps disappearing",
        ))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let Some((ahead, _)) = self.ahead.clone() else {
            sleep_until(until).await;
            return Ok(());
        };
        if self.watching.as_ref().is_none_or(|(k, _)| *k != ahead) {
            // Watch "from now" (no start revision): etcd serves a watcher whose
            // start revision is at or below its current revision from the
            // unsynced group, which a 100 ms loop drains — under contention,
            // "read revision + 1" is already in the past when the watch is
            // created. Wait for the watch to exist, then look once more: a
            // deletion before that read is seen by the read, one after it by
            // the watch.
            let mut watch = self.inner.client.watch_client();
            let mut stream = watch.watch(ahead.clone(), None).await.map_err(map_err)?;
            match stream.message().await {
                Ok(Some(created)) if created.created() && !created.canceled() => {}
                Ok(Some(other)) => {
                    return Err(Error::unavailable(
                        "etcd",
                        format!("watch not created: {}", other.cancel_reason()),
                    ));
                }
                Ok(None) => return Err(Error::unavailable("etcd", "watch stream closed")),
                Err(e) => return Err(map_err(e)),
            }
            let mut kv = self.inner.client.kv_client();
            let present = kv
                .get(ahead.clone(), Some(GetOptions::new().with_count_only()))
                .await
                .map_err(map_err)?
                .count()
                > 0;
            if !present {
                return Ok(());
            }
            self.watching = Some((ahead, stream));
        }
        let (_, stream) = self.watching.as_mut().expect("just set");
        loop {
            tokio::select! {
                message = stream.message() => match message {
                    Ok(Some(resp)) => {
                        if resp.canceled() {
                            self.watching = None;
                            return Err(Error::unavailable("etcd", format!("watch cancelled: {}", resp.cancel_reason())));
                        }
                        if resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                            self.watching = None;
                            return Ok(());
                        }
                    }
                    Ok(None) => {
                        self.watching = None;
                        return Err(Error::unavailable("etcd", "watch stream closed"));
                    }
                    Err(e) => {
                        self.watching = None;
                        return Err(map_err(e));
                    }
                },
                _ = sleep_until(until) => return Ok(()),
            }
        }
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        if !self.sent {
            return Ok(());
        }
        // Remembered first, so that the renewal sweep deletes the key if this
        // delete fails, or if a put still in flight lands after it.
        self.abandoned
            .lock()
            .unwrap()
            .insert(self.key.clone(), Instant::now());
        // The key is this attempt's alone: delete it whatever its revision.
        let mut kv = self.inner.client.kv_client();
        kv.delete(self.key.as_str(), None).await.map_err(map_err)?;
        Ok(())
    }
}
