//! A session is a lease; an attempt is one key in the name's queue.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Busy, Claim, ExpiryModel, Hold, RawSession, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use etcd_client::{
    Compare, CompareOp, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse,
};
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::time::{Instant, sleep_until};

use crate::watch::Deleted;
use crate::{Inner, Repeat};

/// The most operations etcd takes in one txn by default (`--max-txn-ops`).
const MAX_TXN_OPS: usize = 128;

/// How many of the keys ahead a waiter reads (the nearest): a waiter
/// further back reads again once those are gone.
const AHEAD_READ: i64 = 16;

/// How long a waiter whose queue watch ended pauses before it reads again
/// (and makes another): a watch that keeps ending at once must not turn
/// waiters into a loop of requests.
const WATCH_ENDED_PAUSE: Duration = Duration::from_millis(50);

pub(crate) struct EtcdSession {
    inner: Arc<Inner>,
    id: SessionId,
    lease: i64,
    ttl: Duration,
    /// The core's limit on one request of this session.
    request_timeout: Duration,
    /// The lease's keep-alive stream between renewals. A renewal takes it
    /// out for its exchange and puts it back only once answered, so a
    /// renewal cut off by its timeout drops the stream with it: the late
    /// answer can never be read as the answer to a later keep-alive (whose
    /// local deadline would then count from the wrong send time, S4).
    keeper: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
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

/// `prefix/%abandoned/<flat name>/<lease>-<attempt>`: the tombstone of an
/// attempt key. Outside every queue range (`%` is never the first byte of a
/// flat lock name), inside the prefix (the range an etcd role grants).
fn tombstone_of(inner: &Inner, key: &str) -> String {
    let rest = key
        .strip_prefix(&format!("{}/", inner.prefix))
        .unwrap_or(key);
    format!("{}/%abandoned/{rest}", inner.prefix)
}

impl EtcdSession {
    /// A fresh attempt at `name` whose keys carry `value` (holder and why),
    /// under its first key.
    fn new_claim(&self, name: &LockName, value: String) -> EtcdClaim {
        let mut attempt = EtcdClaim {
            inner: self.inner.clone(),
            name: name.clone(),
            queue: self.inner.queue(name),
            key_prefix: self.key_prefix(name),
            key: String::new(),
            tombstone: String::new(),
            value,
            lease: self.lease,
            own: None,
            sent: false,
            doubtful: false,
            fences: Vec::new(),
            ahead: None,
            first: false,
            // A quarter of the take's request timeout, the rest for its
            // other requests: a creation that takes longer leaves this wait
            // on the fallback timer rather than the take cut off.
            watch_limit: self.request_timeout / 4,
        };
        attempt.new_key();
        attempt
    }

    pub(crate) async fn open(
        inner: Arc<Inner>,
        id: SessionId,
        ttl: Duration,
        request_timeout: Duration,
    ) -> Result<Self, Error> {
        let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        // A grant repeated after a lost reply leaves an unused lease that
        // expires after one TTL.
        let granted = inner
            .call(Repeat::Idempotent, |client| {
                let mut leases = client.lease_client();
                async move { leases.grant(seconds as i64, None).await }
            })
            .await?;
        Ok(Self {
            lease: granted.id(),
            // etcd may raise a TTL below its minimum: run with what it granted.
            ttl: Duration::from_secs(granted.ttl().max(1) as u64),
            request_timeout,
            inner,
            id,
            keeper: tokio::sync::Mutex::new(None),
        })
    }

    /// `prefix/<name>/<lease>-`: every key of this session on `name` starts so.
    fn key_prefix(&self, name: &LockName) -> String {
        format!("{}{:x}-", self.inner.queue(name), self.lease)
    }

    fn owns(&self, hold: &Hold) -> bool {
        hold.key.starts_with(&self.key_prefix(&hold.name))
    }

    fn lost(&self) -> Error {
        Error::session_lost(
            self.id.to_string(),
            "its lease expired on the server, or the session was closed",
        )
    }

    /// Whether each hold's key is still there with its token, on this lease.
    async fn check(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        // etcd refuses a txn of more than `--max-txn-ops` operations (128 by
        // default): the reads go in chunks, all sent at once.
        let chunks = holds.chunks(MAX_TXN_OPS).map(|chunk| async move {
            let reads: Vec<TxnOp> = chunk
                .iter()
                .map(|h| TxnOp::get(h.key.as_str(), None))
                .collect();
            let resp = self
                .inner
                .txn(Repeat::Idempotent, Txn::new().and_then(reads))
                .await?;
            let answers = resp.op_responses();
            if answers.len() != chunk.len() {
                return Err(Error::protocol(
                    "etcd",
                    "renewal read answered for a different number of keys",
                ));
            }
            Ok(chunk
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
                .collect::<Vec<bool>>())
        });
        let answers = futures::future::try_join_all(chunks).await?;
        Ok(answers.into_iter().flatten().collect())
    }

    /// One keep-alive of the lease, answered by etcd's leader (followers
    /// forward lease renewals to it).
    pub(crate) async fn keep_alive(&self) -> Result<(), Error> {
        let mut slot = self.keeper.lock().await;
        // Out of the slot for the exchange: if this future is dropped, the
        // stream goes with it (see `keeper`).
        if let Some((mut keeper, mut stream)) = slot.take() {
            let named = |e| crate::map_err(e).in_session(&self.id.to_string());
            let answer = match keeper.keep_alive().await {
                Ok(()) => stream.message().await,
                Err(e) => Err(e),
            };
            match answer.map_err(named) {
                Ok(Some(resp)) if resp.ttl() > 0 => {
                    *slot = Some((keeper, stream));
                    return Ok(());
                }
                // TTL 0: etcd no longer knows the lease (it expired or was
                // revoked).
                Ok(Some(_)) => return Err(self.lost()),
                // A member that lost its leader ends its keep-alive
                // streams ("no leader"): this renewal goes on with a new
                // stream, which the client may open on another member.
                Ok(None) => tracing::debug!("lease keep-alive stream closed; opening another"),
                Err(e) if e.is_retryable() => {
                    tracing::debug!(error = %e, "lease keep-alive stream failed; opening another");
                }
                Err(e) => return Err(e),
            }
        }
        // Opening the stream sends one keep-alive and reads its answer (a
        // lease etcd no longer knows fails here): that is this renewal's
        // keep-alive. A keep-alive is idempotent, so a refused one is sent
        // again at once, as etcd's own client does: a member cut off from
        // its peers refuses it ("no leader") and the next try may reach
        // one that is not. Waiting for the next renewal instead cost a
        // session whose tries kept landing on that member (CI:
        // node_isolated_from_peers).
        let open = self
            .inner
            .call(Repeat::Idempotent, |client| {
                let mut leases = client.lease_client();
                async move { leases.keep_alive(self.lease).await }
            })
            .await
            .map_err(|e| e.in_session(&self.id.to_string()))?;
        *slot = Some(open);
        Ok(())
    }
}

/// Marks the client stalled if dropped armed (a renewal cut off).
struct Stuck<'a>(Option<&'a Inner>);

impl Drop for Stuck<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.0 {
            inner.stalled();
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

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        let value = format!("{}\n{}", self.id, why.unwrap_or_default());
        Ok(Box::new(self.new_claim(name, value)))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        // Cut off by the core's request timeout (dropped), the renewal
        // leaves the client marked stalled: the next request replaces it.
        let mut stuck = Stuck(Some(&self.inner));
        let answers = match self.keep_alive().await {
            Ok(()) => self.check(holds).await,
            Err(e) => Err(e),
        };
        stuck.0 = None;
        answers
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        if !self.owns(hold) {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        // No late create can bring the key back: the txn that granted it
        // fenced off every create sent before (see `EtcdClaim::doubtful`).
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                hold.key.as_str(),
                CompareOp::Equal,
                hold.token.get() as i64,
            )])
            .and_then(vec![TxnOp::delete(hold.key.as_str(), None)]);
        let resp = self.inner.txn(Repeat::Unsent, txn).await?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(Error::NotHeld {
                name: hold.name.to_string(),
            })
        }
    }

    async fn close(&self, _holds: &[Hold]) -> Result<(), Error> {
        // Revoking the lease deletes every key attached to it at once
        // (tombstones included).
        let revoked = self.inner.call(Repeat::Idempotent, |client| {
            let mut leases = client.lease_client();
            async move { leases.revoke(self.lease).await }
        });
        match revoked.await {
            Ok(_) | Err(Error::SessionLost { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// One key in one name's queue.
struct EtcdClaim {
    inner: Arc<Inner>,
    name: LockName,
    queue: String,
    /// `prefix/<name>/<lease>-`.
    key_prefix: String,
    /// The attempt's key in the queue (a new one if the old one vanished).
    key: String,
    /// The key's tombstone: while it exists, no create of `key` succeeds.
    tombstone: String,
    value: String,
    lease: i64,
    /// The key's create revision once it exists: the fencing token.
    own: Option<i64>,
    /// Whether a create was ever sent.
    sent: bool,
    /// Whether a create of `key` was sent whose answer never came and that
    /// no tombstone fences yet. Such a create may still be applied later
    /// (requests travel on their own HTTP/2 streams, and one held in the
    /// network reaches etcd whenever it does), also after the key was
    /// deleted, where it would leave an orphan that blocks the queue for as
    /// long as the lease lives. Every create compares the key's tombstone
    /// absent, and while this is set the next txn of the attempt (the
    /// retried enqueue, or the clean-up) writes the tombstone: whatever
    /// lands after it creates nothing. Tombstones live on the session's
    /// lease and exist only for attempts that met a fault.
    doubtful: bool,
    /// Tombstones of earlier keys of this attempt still to be written.
    fences: Vec<String>,
    /// The keys ahead of ours, as the last look found them, and how to
    /// hear of their deletion (see `wait`).
    ahead: Option<Ahead>,
    /// Every key ahead of ours is gone: ours is first (see `wait`).
    first: bool,
    /// How long a take waits for the queue's watch to be made.
    watch_limit: Duration,
}

/// The keys ahead of a waiter's key.
struct Ahead {
    /// The keys a read found ahead, less those since deleted.
    keys: HashSet<Vec<u8>>,
    /// Whether the read found every key ahead (it reads at most
    /// `AHEAD_READ`, the nearest).
    all: bool,
    /// The queue's deletions since before that read (see [`crate::watch`]);
    /// `None` if no watch was made.
    deleted: Option<broadcast::Receiver<Deleted>>,
}

impl fmt::Debug for EtcdClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdClaim")
            .field("key", &self.key)
            .field("own", &self.own)
            .field("doubtful", &self.doubtful)
            .finish()
    }
}

impl EtcdClaim {
    /// Moves to a fresh key: at the start, and when the old one vanished
    /// (it cannot be created again once its tombstone exists). A doubtful
    /// old key's tombstone is written with the next txn.
    fn new_key(&mut self) {
        if std::mem::take(&mut self.doubtful) {
            self.fences.push(std::mem::take(&mut self.tombstone));
        }
        self.key = format!("{}{:016x}", self.key_prefix, rand::random::<u64>());
        self.tombstone = tombstone_of(&self.inner, &self.key);
        self.own = None;
        self.ahead = None;
        self.first = false;
    }

    /// The tombstone puts the next txn must carry (see `doubtful`).
    fn fencing(&self) -> Vec<TxnOp> {
        let own = self.doubtful.then_some(&self.tombstone);
        self.fences
            .iter()
            .chain(own)
            .map(|t| {
                TxnOp::put(
                    t.as_str(),
                    "",
                    Some(PutOptions::new().with_lease(self.lease)),
                )
            })
            .collect()
    }

    /// The enqueue txn: create the key unless it or its tombstone exists,
    /// and read who is first; carries the tombstones `fencing` asks for.
    fn enqueue_txn(&self) -> Txn {
        let head = || {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1)
                .with_keys_only();
            TxnOp::get(self.queue.as_str(), Some(options))
        };
        let mut then = vec![
            TxnOp::put(
                self.key.as_str(),
                self.value.as_str(),
                Some(PutOptions::new().with_lease(self.lease)),
            ),
            head(),
        ];
        let mut or_else = vec![TxnOp::get(self.key.as_str(), None), head()];
        then.extend(self.fencing());
        or_else.extend(self.fencing());
        Txn::new()
            .when(vec![
                Compare::create_revision(self.key.as_str(), CompareOp::Equal, 0),
                Compare::create_revision(self.tombstone.as_str(), CompareOp::Equal, 0),
            ])
            .and_then(then)
            .or_else(or_else)
    }

    /// Creates the attempt's key (or finds it, after a lost reply); returns
    /// its create revision and whether it is first in line — read in the same
    /// txn, so an uncontended take is one round trip. `None`: the key cannot
    /// be created any more (its tombstone exists and the key is gone).
    async fn enqueue(&mut self) -> Result<Option<(i64, bool)>, Error> {
        let txn = self.enqueue_txn();
        self.sent = true;
        // Doubtful from the moment it is sent until answered (a dropped
        // future leaves it so).
        self.doubtful = true;
        let resp = self.inner.txn(Repeat::Unsent, txn).await?;
        // Answered: it fenced off every earlier create, and itself is done.
        self.doubtful = false;
        self.fences.clear();
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
            return Ok(Some((revision, is_first)));
        }
        match answers.first() {
            Some(TxnOpResponse::Get(get)) => {
                Ok(get.kvs().first().map(|kv| (kv.create_revision(), is_first)))
            }
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

    /// Removes the key (and fences off creates still in flight). Idempotent:
    /// safe to run again after an error or a cut-off run.
    async fn clean_up(&mut self) -> Result<(), Error> {
        // No longer waiting: let the queue's watch go when unused.
        self.ahead = None;
        if !self.sent {
            return Ok(());
        }
        // The key is this attempt's alone: delete it whatever its revision.
        let mut then = vec![TxnOp::delete(self.key.as_str(), None)];
        then.extend(self.fencing());
        let txn = Txn::new().and_then(then);
        let deleted = self.inner.txn(Repeat::Idempotent, txn);
        match deleted.await {
            // The lease is gone: so is every key on it.
            Ok(_) | Err(Error::SessionLost { .. }) => {}
            Err(e) => return Err(e),
        }
        self.doubtful = false;
        self.fences.clear();
        Ok(())
    }
}

#[async_trait]
impl Claim for EtcdClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        if let (true, Some(own)) = (std::mem::take(&mut self.first), self.own) {
            return Ok(self.granted(own));
        }
        self.ahead = None;
        for _ in 0..3 {
            let own = match self.own {
                Some(own) => own,
                None => {
                    let Some((own, first)) = self.enqueue().await? else {
                        // Fenced and gone: queue again under a new key.
                        self.new_key();
                        continue;
                    };
                    self.own = Some(own);
                    if first {
                        return Ok(self.granted(own));
                    }
                    own
                }
            };
            // Hear of deletions from before the read on (see `wait`).
            let deleted = self.inner.subscribe(&self.queue, self.watch_limit).await;
            // One round trip: our key is still there, and the keys ahead.
            let ahead = GetOptions::new()
                .with_prefix()
                .with_max_create_revision(own - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(AHEAD_READ)
                .with_keys_only();
            let txn = Txn::new()
                .when(vec![Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    own,
                )])
                .and_then(vec![TxnOp::get(self.queue.as_str(), Some(ahead))]);
            let resp = self.inner.txn(Repeat::Idempotent, txn).await?;
            if !resp.succeeded() {
                // Our key is gone (its lease expired, or it was deleted):
                // enqueue again, at the back, under a new key.
                self.new_key();
                continue;
            }
            let ahead = match resp.op_responses().into_iter().next() {
                Some(TxnOpResponse::Get(get)) => Ahead {
                    keys: get.kvs().iter().map(|kv| kv.key().to_vec()).collect(),
                    all: !get.more(),
                    deleted,
                },
                _ => return Err(Error::protocol("etcd", "unexpected txn answer")),
            };
            if ahead.keys.is_empty() && ahead.all {
                return Ok(self.granted(own));
            }
            self.ahead = Some(ahead);
            return Ok(Take::Busy(Busy::default()));
        }
        Err(Error::unavailable(
            "etcd",
            "own queue key keeps disappearing",
        ))
    }

    /// Waits until every key the last look found ahead is deleted. Ours is
    /// then first if that look found all of them, and the next `try_take`
    /// grants without asking (the handoff saves a round trip): keys made
    /// later have higher create revisions and queue behind ours, and a
    /// deleted key is never made again (a new key of an attempt is another
    /// key; a late create of the old one meets its tombstone). The grant is
    /// ours as of the last deletion's revision, when our key still existed
    /// if our lease did: only the head can be force-released, which ours
    /// was not before that deletion, and a lease gone by then is past the
    /// core's session deadline (S4: a grant after it is refused), as is a
    /// closed session's. A force-release of ours after it is one of a
    /// holder's, heard of at the next renewal. Without a watch, or when the
    /// watch ends or this waiter falls behind it, or our own key is
    /// deleted, the next `try_take` reads again.
    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let Some(Ahead {
            keys,
            all,
            deleted: Some(deleted),
        }) = self.ahead.as_mut()
        else {
            sleep_until(until).await;
            return Ok(());
        };
        let mine = self.key.as_bytes();
        let has_mine = |batch: &Deleted| batch.iter().any(|k| k.as_slice() == mine);
        loop {
            tokio::select! {
                batch = deleted.recv() => match batch {
                    Ok(batch) => {
                        if has_mine(&batch) {
                            self.ahead = None;
                            return Ok(());
                        }
                        for key in batch.iter() {
                            keys.remove(key);
                        }
                        if keys.is_empty() {
                            // Not on a key of ours already seen deleted (or
                            // perhaps, if this waiter fell behind).
                            let mut gone = false;
                            loop {
                                match deleted.try_recv() {
                                    Ok(batch) => gone |= has_mine(&batch),
                                    Err(TryRecvError::Lagged(_)) => gone = true,
                                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                                }
                            }
                            self.first = *all && !gone;
                            self.ahead = None;
                            return Ok(());
                        }
                    }
                    Err(RecvError::Lagged(_)) => {
                        self.ahead = None;
                        return Ok(());
                    }
                    Err(RecvError::Closed) => {
                        self.ahead = None;
                        sleep_until(until.min(Instant::now() + WATCH_ENDED_PAUSE)).await;
                        return Ok(());
                    }
                },
                _ = sleep_until(until) => return Ok(()),
            }
        }
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        self.clean_up().await
    }
}

/// Against the real server from `scripts/services` (`DLOCK_TEST_ETCD_URL`),
/// through the conformance suite's fault proxy.
#[cfg(test)]
mod server_tests {
    use super::*;
    use crate::EtcdBackend;
    use dlock_conformance::wire::{Fault, Flow, Link, ProxyLink};
    use dlock_core::url::StoreUrl;
    use tokio::time::{sleep, timeout};

    fn url() -> Option<StoreUrl> {
        if dlock_conformance::skip_requested("etcd", "session server test") {
            return None;
        }
        let url = std::env::var("DLOCK_TEST_ETCD_URL")
            .unwrap_or_else(|_| "etcd://127.0.0.1:12379".into());
        Some(StoreUrl::parse(&url).expect("DLOCK_TEST_ETCD_URL"))
    }

    async fn session_over(link: &ProxyLink, url: &StoreUrl) -> EtcdSession {
        let via = url.with_hosts(&link.addrs().unwrap()).unwrap();
        let backend = EtcdBackend::connect(&via)
            .await
            .expect("etcd up (scripts/services up etcd)");
        session(&backend).await
    }

    /// Item 2 of issue 12: a keep-alive that timed out must not leave its
    /// late reply on the stream for the next keep-alive to take as its own.
    /// The second keep-alive's request never reaches etcd (held by the
    /// proxy), so any answer to it is a stale one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_keep_alive_reply_never_answers_a_later_request() {
        let Some(url) = url() else { return };
        let hosts: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
        let link = ProxyLink::start(&hosts).await.unwrap();
        let session = session_over(&link, &url).await;
        session.keep_alive().await.expect("a first keep-alive");
        link.set_all(Fault::Flows {
            to_server: Flow::Pass,
            to_client: Flow::Delay(Duration::from_millis(300)),
        });
        assert!(
            timeout(Duration::from_millis(100), session.keep_alive())
                .await
                .is_err(),
            "the delayed keep-alive did not time out"
        );
        sleep(Duration::from_millis(400)).await; // its reply has arrived by now
        link.set_all(Fault::Flows {
            to_server: Flow::Hold,
            to_client: Flow::Pass,
        });
        let second = timeout(Duration::from_millis(300), session.keep_alive()).await;
        link.heal();
        assert!(
            !matches!(second, Ok(Ok(()))),
            "a keep-alive whose request never reached etcd was confirmed (by the late reply of the one before)"
        );
    }

    /// Item 9 of issue 12: a lease etcd no longer knows (expired, revoked)
    /// is a lost session, on every path that meets it, never an outage
    /// retried forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_etcd_no_longer_knows_is_a_lost_session() {
        let Some(url) = url() else { return };
        let backend = connected(&url).await;
        let session = session(&backend).await;
        session.renew(&[]).await.expect("a first renewal");
        session
            .renew(&[])
            .await
            .expect("a renewal on the open stream");
        let mut leases = backend.inner.client().lease_client();
        leases.revoke(session.lease).await.unwrap();
        fn lost<T>(r: &Result<T, Error>) -> bool {
            matches!(r, Err(Error::SessionLost { .. }))
        }
        // On the open keep-alive stream (etcd answers TTL 0).
        let r = session.renew(&[]).await;
        assert!(lost(&r), "renewal on the open stream: {r:?}");
        // On a new stream (etcd-client: "lease keep alive error: lease not found").
        *session.keeper.lock().await = None;
        let r = session.renew(&[]).await;
        assert!(lost(&r), "renewal on a new stream: {r:?}");
        // A take that puts a key on the lease.
        let name = fresh_name("lease");
        let mut attempt = session.claim(&name, None).await.unwrap();
        let r = attempt.try_take().await.map(|_| ());
        assert!(lost(&r), "take: {r:?}");
    }

    async fn connected(url: &StoreUrl) -> EtcdBackend {
        EtcdBackend::connect(url)
            .await
            .expect("etcd up (scripts/services up etcd)")
    }

    /// A name no other run uses, under `adapter/`.
    fn fresh_name(what: &str) -> LockName {
        LockName::new(format!("adapter/{what}-{:08x}", rand::random::<u32>())).unwrap()
    }

    async fn session(backend: &EtcdBackend) -> EtcdSession {
        EtcdSession::open(
            backend.inner.clone(),
            SessionId::generate(None),
            Duration::from_secs(5),
            Duration::from_secs(1),
        )
        .await
        .unwrap()
    }

    async fn keys_of(backend: &EtcdBackend, name: &LockName) -> usize {
        backend.keys_under(name.as_str()).await.unwrap()
    }

    async fn claim_on(session: &EtcdSession, name: &LockName) -> EtcdClaim {
        session.new_claim(name, "test".into())
    }

    /// A hold of `name` by `holding`, and a claim of `waiting` queued
    /// behind it.
    async fn held_and_waiting(
        holding: &EtcdSession,
        waiting: &EtcdSession,
        name: &LockName,
    ) -> (Hold, EtcdClaim) {
        let mut holder = claim_on(holding, name).await;
        let Take::Granted(held) = holder.try_take().await.unwrap() else {
            panic!("not granted")
        };
        let mut waiter = claim_on(waiting, name).await;
        assert!(matches!(waiter.try_take().await.unwrap(), Take::Busy(_)));
        (held, waiter)
    }

    /// S1 (issue 15's handoff without a read): a waiter is granted without
    /// asking only once every key its last read found ahead is deleted, and
    /// only if that read found all of them; never on a key of its own that
    /// it has seen deleted.
    #[tokio::test]
    async fn the_keys_ahead_gone_grant_only_the_one_they_were_ahead_of() {
        let Some(url) = url() else { return };
        let backend = connected(&url).await;
        let session = session(&backend).await;
        let name = fresh_name("ahead");
        let busy = |take: Take| matches!(take, Take::Busy(_));
        let soon = || Instant::now() + Duration::from_secs(5);
        let briefly = || Instant::now() + Duration::from_millis(300);
        let ahead = |claim: &EtcdClaim| {
            let mut keys: Vec<Vec<u8>> = claim
                .ahead
                .as_ref()
                .map(|a| a.keys.iter().cloned().collect())
                .unwrap_or_default();
            keys.sort();
            keys
        };

        let mut holder = claim_on(&session, &name).await;
        let Take::Granted(held) = holder.try_take().await.unwrap() else {
            panic!("not granted")
        };
        let mut second = claim_on(&session, &name).await;
        assert!(busy(second.try_take().await.unwrap()));
        let mut third = claim_on(&session, &name).await;
        assert!(busy(third.try_take().await.unwrap()));
        assert_eq!(ahead(&third).len(), 2);
        // A key ahead goes while another stays: the wait goes on (to its
        // deadline), and the next look finds the one left.
        second.abandon().await.unwrap();
        third.wait(briefly()).await.unwrap();
        assert!(!third.first, "first with the holder still ahead");
        assert_eq!(ahead(&third), vec![held.key.clone().into_bytes()]);
        assert!(busy(third.try_take().await.unwrap()), "granted while held");
        let mut fourth = claim_on(&session, &name).await;
        assert!(busy(fourth.try_take().await.unwrap()));

        // The holder was the last key ahead of the third: its release grants
        // it, without another read; the fourth, behind the third, waits on.
        let (waited, ()) = tokio::join!(third.wait(soon()), async {
            sleep(Duration::from_millis(100)).await;
            session.release(&held).await.unwrap();
        });
        waited.unwrap();
        assert!(third.first, "the handoff did not skip the read");
        let Take::Granted(next) = third.try_take().await.unwrap() else {
            panic!("not granted after the release")
        };
        assert!(next.token > held.token);
        fourth.wait(briefly()).await.unwrap();
        assert!(!fourth.first, "first behind a holder");
        fourth.abandon().await.unwrap();

        // A waiter whose read found only some of the keys ahead reads again
        // once those are gone, rather than taking itself for first.
        let mut fifth = claim_on(&session, &name).await;
        assert!(busy(fifth.try_take().await.unwrap()));
        fifth.ahead.as_mut().unwrap().all = false;
        session.release(&next).await.unwrap();
        fifth.wait(soon()).await.unwrap();
        assert!(!fifth.first, "first on a partial read");
        let Take::Granted(then) = fifth.try_take().await.unwrap() else {
            panic!("not granted after the read")
        };

        // The next in line, force-released as soon as it is first, is not
        // granted on the key it saw deleted, and queues again under a new
        // key.
        let mut sixth = claim_on(&session, &name).await;
        assert!(busy(sixth.try_take().await.unwrap()));
        let mut heard = backend
            .inner
            .subscribe(&sixth.queue, Duration::from_secs(2))
            .await
            .expect("the queue's watch");
        session.release(&then).await.unwrap();
        assert!(
            dlock_core::Backend::force_release(&backend, &name)
                .await
                .unwrap()
        );
        // Both deletions are sent to the waiters before the wait looks.
        let mut keys = Vec::new();
        while keys.len() < 2 {
            let batch = timeout(Duration::from_secs(5), heard.recv()).await;
            keys.extend(batch.expect("deletions heard of").unwrap().iter().cloned());
        }
        assert!(keys.contains(&sixth.key.clone().into_bytes()));
        sixth.wait(soon()).await.unwrap();
        assert!(!sixth.first, "granted on a key force-released");
        let Take::Granted(last) = sixth.try_take().await.unwrap() else {
            panic!("not granted under a new key")
        };
        assert!(last.token > then.token);
        session.release(&last).await.unwrap();
        session.close(&[]).await.unwrap();
    }

    /// Issue 15 (handoff latency): a waiter hears of the release through
    /// the queue's watch, made before it waited, and is granted on that
    /// alone: nothing it sends after the release is needed (its requests
    /// are held from then on). Before the shared watch, each wait made a
    /// watch of its own (which etcd may serve ~100 ms late) and read again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_is_granted_on_the_release_alone() {
        let Some(url) = url() else { return };
        let hosts: Vec<String> = url.hosts().iter().map(ToString::to_string).collect();
        let link = ProxyLink::start(&hosts).await.unwrap();
        let waiting = session_over(&link, &url).await;
        let backend = connected(&url).await;
        let holding = session(&backend).await;
        let name = fresh_name("alone");

        let (held, mut waiter) = held_and_waiting(&holding, &waiting, &name).await;
        link.set_all(Fault::Flows {
            to_server: Flow::Hold,
            to_client: Flow::Pass,
        });
        holding.release(&held).await.unwrap();
        let until = Instant::now() + Duration::from_secs(3);
        let granted = timeout(Duration::from_secs(4), async {
            waiter.wait(until).await.unwrap();
            waiter.try_take().await
        })
        .await;
        link.heal();
        let Ok(Ok(Take::Granted(next))) = granted else {
            panic!("not granted on the release alone: {granted:?}")
        };
        assert!(next.token > held.token);
        waiting.release(&next).await.unwrap();
        waiting.close(&[]).await.unwrap();
        holding.close(&[]).await.unwrap();
    }

    /// A queue watch that ends (here: ended as when the client is replaced
    /// after a stuck request) sends its waiters back to read at once,
    /// rather than leaving them on the fallback timer; the next take makes
    /// a new watch, through which the release is heard of.
    #[tokio::test]
    async fn an_ended_watch_sends_its_waiters_back_to_read() {
        let Some(url) = url() else { return };
        let backend = connected(&url).await;
        let session = session(&backend).await;
        let name = fresh_name("ended");
        let (held, mut waiter) = held_and_waiting(&session, &session, &name).await;
        backend.inner.watches.end_all();
        let soon = Instant::now() + Duration::from_secs(5);
        timeout(Duration::from_secs(1), waiter.wait(soon))
            .await
            .expect("the waiter of an ended watch stayed on the timer")
            .unwrap();
        assert!(!waiter.first);
        assert!(matches!(waiter.try_take().await.unwrap(), Take::Busy(_)));
        let (waited, ()) = tokio::join!(waiter.wait(soon), async {
            sleep(Duration::from_millis(100)).await;
            session.release(&held).await.unwrap();
        });
        waited.unwrap();
        assert!(
            waiter.first,
            "the release was not heard of on the new watch"
        );
        let Take::Granted(next) = waiter.try_take().await.unwrap() else {
            panic!("not granted")
        };
        session.release(&next).await.unwrap();
        session.close(&[]).await.unwrap();
    }

    /// Item 13 of issue 12 (clean abandon, S5): a create whose answer never
    /// came and that reaches etcd only after the attempt was abandoned (or
    /// after its retried take was granted and released) creates nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_landing_after_the_clean_up_creates_nothing() {
        let Some(url) = url() else { return };
        let backend = connected(&url).await;
        let session = session(&backend).await;
        let kv = || backend.inner.client().kv_client();
        let name = fresh_name("late");

        // Abandoned while its create is in flight.
        let mut attempt = claim_on(&session, &name).await;
        let late = attempt.enqueue_txn();
        attempt.sent = true;
        attempt.doubtful = true; // sent, never answered
        attempt.clean_up().await.unwrap();
        kv().txn(late).await.unwrap();
        assert_eq!(
            keys_of(&backend, &name).await,
            0,
            "the late create made an orphan"
        );

        // Granted by a retry, then released.
        let mut attempt = claim_on(&session, &name).await;
        let late = attempt.enqueue_txn();
        attempt.sent = true;
        attempt.doubtful = true;
        let Take::Granted(hold) = attempt.try_take().await.unwrap() else {
            panic!("not granted")
        };
        session.release(&hold).await.unwrap();
        kv().txn(late).await.unwrap();
        assert_eq!(
            keys_of(&backend, &name).await,
            0,
            "the late create made an orphan after a release"
        );

        // Without doubt no tombstone is written.
        let mut attempt = claim_on(&session, &name).await;
        let Take::Granted(hold) = attempt.try_take().await.unwrap() else {
            panic!("not granted")
        };
        session.release(&hold).await.unwrap();
        let tombstones = kv()
            .get(
                format!("{}/%abandoned/", backend.inner.prefix),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .unwrap();
        let lease = format!("{:x}-", session.lease);
        let ours = tombstones
            .kvs()
            .iter()
            .filter(|kv| kv.key_str().is_ok_and(|k| k.contains(&lease)))
            .count();
        assert_eq!(
            ours, 2,
            "one tombstone per doubtful attempt, none for the clean one"
        );
        session.close(&[]).await.unwrap();
    }
}
