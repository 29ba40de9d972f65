//! Sessions (a write per hold and renewal, a revision cache that makes
//! renewals and releases one request) and claims.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use dlock_core::backend::{Busy, Claim, ExpiryModel, Hold, RawSession, RenewalReport, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId};
use futures::StreamExt;
use tokio::time::Instant;

use crate::SCHEME;
use crate::cut::CutTakes;
use crate::store::Free;
use crate::value::{Value, key_of};
use crate::{Inner, RENEWALS_IN_FLIGHT};

/// A session: nothing in the store (each hold expires on its own).
pub(crate) struct NatsSession {
    pub(crate) inner: Arc<Inner>,
    pub(crate) id: SessionId,
    pub(crate) ttl: Duration,
    /// The core's request timeout: how long a renewal write may outlive
    /// its round (see `write_on_revision`).
    pub(crate) request_timeout: Duration,
    pub(crate) revisions: Revisions,
    /// The take writes of its attempts left unanswered (S5): an attempt's
    /// end first makes them duplicates (see the `cut` module).
    pub(crate) cut: CutTakes,
}

/// The revision each of a session's holds was last written at, by owner
/// value: a renewal is then one conditional write and a release one
/// conditional purge, not a read first. Only a hint: the server refuses
/// both on a stale revision, and both then fall back to reading the key.
pub(crate) type Revisions = Arc<std::sync::Mutex<std::collections::HashMap<String, Written>>>;

/// What a session last wrote for one hold.
#[derive(Clone)]
pub(crate) struct Written {
    /// The store key (a hold's owner value names one lock, but a forged
    /// hold may pair it with another lock's name: the key is checked here,
    /// so that the forged hold's release is tried on its own lock's key).
    pub(crate) key: String,
    pub(crate) token: FencingToken,
    pub(crate) revision: u64,
    pub(crate) value: Bytes,
}

/// Records what a session wrote for the hold `owner`.
pub(crate) fn remember(
    revisions: &Revisions,
    owner: &str,
    key: &str,
    grant: (FencingToken, u64, Bytes),
) {
    let (token, revision, value) = grant;
    let written = Written {
        key: key.to_owned(),
        token,
        revision,
        value,
    };
    revisions.lock().unwrap().insert(owner.to_owned(), written);
}

impl fmt::Debug for NatsSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSession").field("id", &self.id).finish()
    }
}

impl NatsSession {
    /// What this session last wrote for `hold` under `key`, if anything.
    pub(crate) fn known(&self, hold: &Hold, key: &str) -> Option<Written> {
        let revisions = self.revisions.lock().unwrap();
        let written = revisions.get(&hold.key)?;
        (written.key == key && written.token == hold.token).then(|| written.clone())
    }

    /// Removes the hold's message on the revision this session last wrote
    /// it at, in one request, so that a release whose reply is lost still
    /// takes effect (a read first would need its answer); reads the key
    /// only when that revision is unknown or gone (a renewal in flight
    /// moved it, or an earlier try of this release removed it).
    pub(crate) async fn release_once(&self, hold: &Hold) -> Result<(), Error> {
        if !self.id.issued(&hold.key) {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        let key = key_of(&hold.name);
        if let Some(written) = self.known(hold, &key)
            && self
                .inner
                .remove_exact(&key, written.revision, true)
                .await?
        {
            return Ok(());
        }
        if self
            .inner
            .delete_if(&key, Some(&hold.key), Some(hold.token))
            .await?
        {
            Ok(())
        } else {
            Err(Error::NotHeld {
                name: hold.name.to_string(),
            })
        }
    }

    /// Rewrites `hold` on the revision it was `written` at; false if the
    /// key moved since. The write runs in a task of its own, so that its
    /// answer is kept also when the core cuts the round off first: dropped
    /// unanswered, a write that landed left a stale revision (that hold's
    /// next renewal then took three round trips: a refused write, a read,
    /// a write) and marked the connection as dead (the next requests went
    /// to a new one), so that under load each cut round made the next one
    /// slower, until holds were lost (`ten_thousand_names` in CI). The
    /// task gives up after twice the core's request timeout, so that a
    /// silently dead connection is still replaced within about one
    /// renewal period (L3: `renewal_on_dead_connection`), not only after
    /// the request's own 5 s.
    async fn write_on_revision(
        &self,
        hold: &Hold,
        key: &str,
        written: Written,
    ) -> Result<bool, Error> {
        let (inner, revisions) = (self.inner.clone(), self.revisions.clone());
        let (key, owner) = (key.to_owned(), hold.key.clone());
        let limit = 2 * self.request_timeout;
        let write = tokio::spawn(async move {
            let update = inner.update_at(&key, written.value, written.revision);
            let next = tokio::time::timeout(limit, update)
                .await
                .map_err(|_| Error::unavailable(SCHEME, "request timed out"))??;
            if let Some(next) = next {
                // (only if still there: a release may have begun meanwhile;
                // and never back: a later write may have answered first)
                if let Some(entry) = revisions.lock().unwrap().get_mut(&owner) {
                    entry.revision = entry.revision.max(next);
                }
            }
            Ok::<_, Error>(next.is_some())
        });
        match write.await {
            Ok(written) => written,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(Error::unavailable(SCHEME, "renewal cancelled")),
        }
    }

    /// Rewrites one hold on its known revision; reads the key first only
    /// when that revision is unknown or stale.
    pub(crate) async fn renew_one(&self, hold: &Hold) -> Result<bool, Error> {
        if !self.id.issued(&hold.key) {
            return Ok(false);
        }
        let key = key_of(&hold.name);
        if let Some(written) = self.known(hold, &key) {
            // (a write on `revision` succeeds only if nothing else wrote the
            // key since this session did: it is still this hold)
            if self.write_on_revision(hold, &key, written).await? {
                return Ok(true);
            }
        }
        match self.inner.extend(&key, &hold.key, Some(hold.token)).await? {
            Some(grant) => {
                remember(&self.revisions, &hold.key, &key, grant);
                Ok(true)
            }
            None => {
                self.revisions.lock().unwrap().remove(&hold.key);
                Ok(false)
            }
        }
    }
}

#[async_trait]
impl RawSession for NatsSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::PerHold
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(NatsClaim {
            inner: self.inner.clone(),
            key: key_of(name),
            name: name.clone(),
            value: Value {
                owner: self.id.claim_owner(),
                token: None,
                session: self.id.to_string(),
                why: why.unwrap_or_default().replace('\n', " "),
            },
            sent: false,
            watch: None,
            revisions: self.revisions.clone(),
            cut: self.cut.clone(),
            first_before: None,
            key_seen: 0,
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        let report = RenewalReport::new(holds.len());
        self.renew_into(holds, &report).await?;
        report.still_held(crate::SCHEME)
    }

    /// A write per hold (KV keys expire one by one), each answer recorded
    /// as it comes: a round cut off at its request timeout keeps the holds
    /// it renewed. A bounded number in flight (10,000 at once took longer
    /// than 256 at a time), sent in the core's order (nearest deadline
    /// first). A hold whose write failed stays unanswered; the first such
    /// error is returned once the others are in.
    async fn renew_into(&self, holds: &[Hold], report: &RenewalReport) -> Result<(), Error> {
        let renewals: Vec<_> = (holds.iter().enumerate())
            .map(|(i, hold)| async move { (i, self.renew_one(hold).await) })
            .collect();
        let mut answers = futures::stream::iter(renewals).buffer_unordered(RENEWALS_IN_FLIGHT);
        let mut first_error = None;
        while let Some((i, answer)) = answers.next().await {
            match answer {
                Ok(held) => report.record(i, held.into()),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        // (the check of `release_once` first: another session's hold is not
        // this session's to end)
        if self.id.issued(&hold.key) {
            self.inner.refuse_late(&self.cut, &hold.key).await?;
        }
        let result = self.release_once(hold).await;
        if !result.as_ref().is_err_and(Error::is_retryable) {
            // (kept for a retry: its first delete may have gone unanswered)
            self.revisions.lock().unwrap().remove(&hold.key);
        }
        result
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        for r in futures::future::join_all(holds.iter().map(|h| self.release(h))).await {
            match r {
                Ok(()) | Err(Error::NotHeld { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        // (also the attempts whose clean-up did not get through before the
        // session ended: their late writes too are made duplicates)
        let owners = self.cut.owners();
        for r in
            futures::future::join_all(owners.iter().map(|o| self.inner.refuse_late(&self.cut, o)))
                .await
        {
            r?;
        }
        Ok(())
    }
}

/// One client's claim on one lock: its owner value and, once it waits, a
/// watch of the key.
pub(crate) struct NatsClaim {
    pub(crate) inner: Arc<Inner>,
    pub(crate) key: String,
    pub(crate) name: LockName,
    pub(crate) value: Value,
    /// Whether a create was sent (abandon must then delete what it made).
    pub(crate) sent: bool,
    /// The subscription to the key's release announcements.
    pub(crate) watch: Option<async_nats::Subscriber>,
    pub(crate) revisions: Revisions,
    /// The session's unanswered take writes (see [`NatsSession::cut`]).
    pub(crate) cut: CutTakes,
    /// The highest sequence this process had seen when this claim first
    /// sent a take: a message of this claim (its owner value is its own)
    /// at or below it was given a sequence again.
    pub(crate) first_before: Option<u64>,
    /// The highest revision of its key this claim saw another client's
    /// hold at: a message of this claim at or below it was given a
    /// sequence again.
    pub(crate) key_seen: u64,
}

impl fmt::Debug for NatsClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsClaim")
            .field("name", &self.name)
            .field("owner", &self.value.owner)
            .finish()
    }
}

impl NatsClaim {
    /// The grant of this claim's write at `revision` (the take's token).
    pub(crate) fn granted(&self, revision: u64) -> (FencingToken, u64, Bytes) {
        let token = FencingToken::new(revision);
        let value = Value {
            token: Some(token),
            ..self.value.clone()
        };
        (token, revision, value.encode())
    }
}

#[async_trait]
impl Claim for NatsClaim {
    async fn try_take(&mut self) -> Result<Take, Error> {
        self.sent = true;
        // Writes judged by the server (`write_if_free`): one write if the key
        // has no message (free, expired, or released with its purge marker
        // cleared), else a read and a write on the marker (a release not yet
        // cleared), then on nothing again if the marker went meanwhile. KV's
        // `create` would be two requests after a delete marker, so a take
        // whose first reply is lost could not take effect.
        let before = self.inner.highest();
        let first_before = *self.first_before.get_or_insert(before);
        let granted = match self
            .inner
            .write_if_free(
                &self.key,
                self.value.encode(),
                Some((&self.cut, &self.value.owner)),
            )
            .await?
        {
            Free::Written(revision) => {
                Some(self.granted(self.inner.fresh(&self.key, revision, before).await?))
            }
            Free::Raced => None,
            // Ours already (an earlier try's reply lost or late)? Then
            // extend it, as a fresh take would (rule 4), unless its
            // token is not above what this process saw before this
            // claim's first try, or what this claim saw of its key
            // since: a take written again at a sequence a server that
            // lost writes gave again (or one `fresh` refused but could
            // not remove). Then it goes, and the core takes again.
            Free::Held => match self
                .inner
                .extend(&self.key, &self.value.owner, None)
                .await?
            {
                Some((token, revision, _)) if token.get() <= first_before.max(self.key_seen) => {
                    let seen = first_before.max(self.key_seen);
                    let (key, token) = (&self.key, token.get());
                    return Err(self.inner.went_back(key, revision, token, seen).await);
                }
                other => other,
            },
        };
        if let Some(grant) = granted {
            let token = grant.0;
            remember(&self.revisions, &self.value.owner, &self.key, grant);
            return Ok(Take::Granted(Hold {
                name: self.name.clone(),
                token,
                key: self.value.owner.clone(),
            }));
        }
        let held = self.inner.held(&self.key).await?;
        if let Some(held) = held.as_ref().filter(|h| h.value.owner != self.value.owner) {
            self.key_seen = self.key_seen.max(held.revision);
        }
        let retry_after = held.map(|held| self.inner.left(held.created));
        Ok(Take::Busy(Busy { retry_after }))
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let Some(watch) = self.watch.as_mut() else {
            // Subscribe, then return at once: the core takes again, so a
            // release between the last take and the subscription is not
            // missed.
            let subject = self.inner.release_subject(&self.key);
            self.watch = Some(
                self.inner
                    .bounded(self.inner.conn().client.subscribe(subject))
                    .await?,
            );
            return Ok(());
        };
        tokio::select! {
            event = watch.next() => if event.is_none() {
                // The subscription ended: make a new one at the next wait.
                self.watch = None;
            },
            _ = tokio::time::sleep_until(until) => {}
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        self.watch = None;
        self.revisions.lock().unwrap().remove(&self.value.owner);
        if self.sent {
            let owner = &self.value.owner;
            self.inner.refuse_late(&self.cut, owner).await?;
            self.inner.delete_if(&self.key, Some(owner), None).await?;
        }
        Ok(())
    }
}
