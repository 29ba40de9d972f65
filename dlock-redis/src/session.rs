//! Sessions and attempts over N nodes (N = 1 for plain Redis): every
//! decision is a majority of per-node script answers.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{
    Busy, Claim, Doubtful, ExpiryModel, Hold, RawSession, RenewalReport, Renewed, Take,
};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use futures::future::join_all;
use tokio::time::{Instant, sleep_until};

use crate::node::{Keys, Subscription, Taken};
use crate::{Inner, check_answered, count, majority};

pub(crate) struct RedisSession {
    inner: Arc<Inner>,
    id: SessionId,
    ttl: Duration,
    /// How long one node may take to answer one of this session's requests.
    limit: Duration,
    /// Attempts with a take that may still be on the wire: their end leaves
    /// a tombstone.
    doubtful: Doubtful,
}

impl RedisSession {
    pub(crate) fn new(inner: Arc<Inner>, id: SessionId, ttl: Duration, limit: Duration) -> Self {
        Self {
            inner,
            id,
            ttl,
            limit,
            doubtful: Doubtful::default(),
        }
    }

    /// Releases `hold` everywhere: the end of its attempt, so a doubtful
    /// one leaves its tombstone (see [`Doubtful::end_with`]).
    async fn end_hold(&self, hold: &Hold) -> Result<usize, Error> {
        let keys = Keys::new(
            &self.inner.options.prefix,
            &hold.name,
            self.inner.options.cluster,
        );
        self.doubtful
            .end_with(&hold.key, |doubtful| {
                let end = doubtful.then_some(self.ttl);
                release_everywhere(
                    &self.inner,
                    &keys,
                    &hold.key,
                    Some(hold.token),
                    end,
                    self.limit,
                )
            })
            .await
    }

    /// Whether `hold` was issued to this session (S3: another session's
    /// hold is refused even with the right key and token).
    fn owns(&self, hold: &Hold) -> bool {
        self.id.issued(&hold.key)
    }
}

impl fmt::Debug for RedisSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSession")
            .field("id", &self.id)
            .finish()
    }
}

/// Releases `owner`'s hold (any token if `None`) on every node; with `end`
/// (the attempt's TTL) its attempt ends and leaves a tombstone. How many
/// nodes released it.
async fn release_everywhere(
    inner: &Inner,
    keys: &Keys,
    owner: &str,
    token: Option<FencingToken>,
    end: Option<Duration>,
    limit: Duration,
) -> Result<usize, Error> {
    let answers = join_all(
        inner
            .nodes
            .iter()
            .map(|n| n.release(keys, owner, token, end, limit)),
    )
    .await;
    let (released, answered) = count(answers)?;
    if released == 0 {
        // Nobody released it: only a majority of answers makes that a "no".
        check_answered(inner, answered)?;
    }
    Ok(released)
}

#[async_trait]
impl RawSession for RedisSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::PerHold
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(RedisClaim {
            keys: Keys::new(&self.inner.options.prefix, name, self.inner.options.cluster),
            inner: self.inner.clone(),
            name: name.clone(),
            owner: self.id.claim_owner(),
            session: self.id.to_string(),
            why: why.unwrap_or_default().to_owned(),
            ttl: self.ttl,
            limit: self.limit,
            sent: false,
            doubtful: self.doubtful.clone(),
            subscriptions: None,
            backoff: None,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        let report = RenewalReport::new(holds.len());
        self.renew_into(holds, &report).await?;
        report.still_held("redis")
    }

    async fn renew_each(&self, holds: &[Hold]) -> Result<Vec<Renewed>, Error> {
        let report = RenewalReport::new(holds.len());
        self.renew_into(holds, &report).await?;
        Ok(report.answers())
    }

    /// A hold is held once a majority of the nodes confirmed it and lost
    /// once too many refused it for a majority to remain, each recorded as
    /// the answers come (on a cluster, one script per slot: a round cut off
    /// at its timeout keeps the slots already answered). The holds of a
    /// master that did not answer stay unknown (the others' are renewed);
    /// on Redlock, so do those the nodes that did not answer could still
    /// decide. An error, after recording, unless a majority of the nodes
    /// answered.
    async fn renew_into(&self, holds: &[Hold], report: &RenewalReport) -> Result<(), Error> {
        if holds.is_empty() {
            return Ok(());
        }
        let (prefix, cluster) = (&self.inner.options.prefix, self.inner.options.cluster);
        let request: Vec<_> = holds
            .iter()
            .map(|h| (Keys::new(prefix, &h.name, cluster), h.key.as_str(), h.token))
            .collect();
        for (i, hold) in holds.iter().enumerate() {
            if !self.owns(hold) {
                report.record(i, Renewed::Lost);
            }
        }
        let (nodes, quorum) = (self.inner.nodes.len(), self.inner.quorum());
        // (votes and refusals per hold)
        let tally = std::sync::Mutex::new(vec![(0usize, 0usize); holds.len()]);
        let said = |i: usize, held: bool| {
            let mut tally = tally.lock().unwrap_or_else(|e| e.into_inner());
            let (votes, refusals) = &mut tally[i];
            if held {
                *votes += 1;
                if *votes >= quorum {
                    report.record(i, Renewed::Held);
                }
            } else {
                *refusals += 1;
                if nodes - *refusals < quorum {
                    report.record(i, Renewed::Lost);
                }
            }
        };
        let min_uptime = self.inner.min_uptime();
        let answers = join_all(
            self.inner
                .nodes
                .iter()
                .map(|n| n.renew(&request, self.ttl, min_uptime, self.limit, &said)),
        )
        .await;
        majority(&self.inner, answers).map(|_| ())
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        let not_held = || Error::NotHeld {
            name: hold.name.to_string(),
        };
        if !self.owns(hold) {
            return Err(not_held());
        }
        let released = self.end_hold(hold).await?;
        if released == 0 {
            Err(not_held())
        } else {
            Ok(())
        }
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        let releases = holds
            .iter()
            .filter(|h| self.owns(h))
            .map(|h| self.end_hold(h));
        for r in join_all(releases).await {
            r?;
        }
        Ok(())
    }
}

/// A claim on one lock, on every node.
struct RedisClaim {
    inner: Arc<Inner>,
    name: LockName,
    keys: Keys,
    owner: String,
    session: String,
    why: String,
    ttl: Duration,
    /// How long one node may take to answer.
    limit: Duration,
    /// Whether a take was sent (abandon must then release everywhere).
    sent: bool,
    /// The session's doubtful attempts (see [`RedisSession`]).
    doubtful: Doubtful,
    /// Channel subscriptions, made at the first wait.
    subscriptions: Option<Vec<Subscription>>,
    /// After a split vote (some nodes granted, no majority), the next wait is
    /// a random back-off that ignores notifications, so that competing
    /// clients stop splitting the nodes between them (Redlock's retry rule).
    backoff: Option<Duration>,
}

impl fmt::Debug for RedisClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClaim")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish()
    }
}

#[async_trait]
impl Claim for RedisClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.sent = true;
        // Doubtful until every node answered: a take cut off here, or one
        // that failed on a node (its request may still reach it), may land
        // after this attempt ended.
        let sending = self.doubtful.sending(&self.owner);
        let inner = &self.inner;
        let min_uptime = inner.min_uptime();
        let answers = join_all(inner.nodes.iter().map(|n| {
            n.take(
                &self.keys,
                &self.owner,
                &self.session,
                &self.why,
                self.ttl,
                min_uptime,
                self.limit,
            )
        }))
        .await;
        if answers.iter().all(Result::is_ok) {
            sending.answered();
        }
        let mut tokens = Vec::new();
        let mut retry_after: Option<Duration> = None;
        let mut answered = 0;
        let mut first_error = None;
        for (i, a) in answers.into_iter().enumerate() {
            match a {
                Ok(Taken::Granted(t)) => {
                    answered += 1;
                    tokens.push((i, t));
                }
                Ok(Taken::Busy(after)) => {
                    answered += 1;
                    retry_after = Some(retry_after.map_or(after, |r| r.min(after)));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let quorum = inner.quorum();
        if tokens.len() >= quorum {
            let token = tokens.iter().map(|(_, t)| *t).max().expect("quorum > 0");
            if inner.nodes.len() == 1 || self.write_back(&tokens, token).await? >= quorum {
                return Ok(Take::Granted(Hold {
                    name: self.name.clone(),
                    token,
                    key: self.owner.clone(),
                }));
            }
        }
        // No majority: undo the partial grant at once so that others (and
        // our retry) are not blocked until those keys expire.
        if !tokens.is_empty() {
            let _ =
                release_everywhere(inner, &self.keys, &self.owner, None, None, self.limit).await;
            let spread = Duration::from_millis(2 + 3 * inner.nodes.len() as u64);
            self.backoff = Some(spread.mul_f64(rand::random::<f64>()));
        }
        if answered < quorum {
            return Err(
                first_error.unwrap_or_else(|| Error::unavailable("redis", "no majority answered"))
            );
        }
        Ok(Take::Busy(Busy { retry_after }))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        if let Some(backoff) = self.backoff.take() {
            sleep_until(until.min(Instant::now() + backoff)).await;
            return Ok(());
        }
        if self.subscriptions.is_none() {
            // Subscribe, then return at once: the core re-checks, so a
            // release between the last take and this subscription is seen.
            // Nodes whose pub/sub connection is down still register the
            // waiter: it is woken when the connection is back.
            let subs = join_all(
                self.inner
                    .nodes
                    .iter()
                    .map(|n| n.subscribe(&self.keys.channel, self.limit)),
            )
            .await;
            self.subscriptions = Some(subs);
            return Ok(());
        }
        let subs = self.subscriptions.as_ref().expect("checked");
        let notified = futures::future::select_all(subs.iter().map(|s| Box::pin(s.notified())));
        tokio::select! {
            _ = notified => {}
            _ = sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        // No more waiting: let the channels go now (the core may keep the
        // attempt while it retries the clean-up).
        self.subscriptions = None;
        if self.sent {
            let (inner, keys, owner) = (&self.inner, &self.keys, &self.owner);
            self.doubtful
                .end_with(owner, |doubtful| {
                    let end = doubtful.then_some(self.ttl);
                    release_everywhere(inner, keys, owner, None, end, self.limit)
                })
                .await?;
        }
        Ok(())
    }
}

impl RedisClaim {
    /// Redlock: writes the chosen token to the nodes that granted; returns on
    /// how many it landed.
    async fn write_back(
        &self,
        granted: &[(usize, FencingToken)],
        token: FencingToken,
    ) -> Result<usize, Error> {
        let bumps = granted.iter().map(|(i, _)| {
            self.inner.nodes[*i].bump(&self.keys, &self.owner, token, self.ttl, self.limit)
        });
        let (landed, _) = count(join_all(bumps).await)?;
        Ok(landed)
    }
}
