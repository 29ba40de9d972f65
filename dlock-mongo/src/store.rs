//! The store primitives on MongoDB: sessions, attempts, error mapping.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock_core::backend::{Busy, Claim, Doubtful, ExpiryModel, Hold, RawSession, Take};
use dlock_core::{Error, FencingToken, LockName, SessionId, SessionOptions};
use futures::TryStreamExt;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, Document};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::options::ReturnDocument;
use tokio::time::Instant;

use crate::query::{self, HoldRef, STATE_HELD, TakeSpec};
use crate::{Inner, SCHEME};
use dlock_core::wake::{PollBackoff, Waiter};

/// Server error codes that mean "try again later": the node is not (or no
/// longer) a writable primary, is shutting down or recovering, a network or
/// time limit was hit, a write concern timed out, a write conflicted, or a
/// majority snapshot is not there yet.
const TRANSIENT_CODES: &[i32] = &[
    6,     // HostUnreachable
    7,     // HostNotFound
    50,    // MaxTimeMSExpired
    64,    // WriteConcernFailed (wtimeout: the outcome is unknown)
    89,    // NetworkTimeout
    91,    // ShutdownInProgress
    112,   // WriteConflict
    133,   // FailedToSatisfyReadPreference
    134,   // ReadConcernMajorityNotAvailableYet
    189,   // PrimarySteppedDown
    202,   // NetworkInterfaceExceededTimeLimit
    262,   // ExceededTimeLimit
    9001,  // SocketException
    10058, // LegacyNotPrimary
    10107, // NotWritablePrimary
    11600, // InterruptedAtShutdown
    11602, // InterruptedDueToReplStateChange
    13435, // NotPrimaryNoSecondaryOk
    13436, // NotPrimaryOrSecondary
];

/// Labels the driver and server put on errors worth retrying.
const TRANSIENT_LABELS: &[&str] = &[
    mongodb::error::RETRYABLE_WRITE_ERROR,
    mongodb::error::TRANSIENT_TRANSACTION_ERROR,
    mongodb::error::RETRYABLE_ERROR,
    mongodb::error::SYSTEM_OVERLOADED_ERROR,
];

/// Duplicate key: another client's upsert created the document first.
pub(crate) const DUPLICATE_KEY: i32 = 11000;

/// The server's error code, wherever the driver put it (command error, write
/// error, write-concern error, or a wrapped source).
pub(crate) fn error_code(e: &mongodb::error::Error) -> Option<i32> {
    let own = match e.kind.as_ref() {
        ErrorKind::Command(c) => Some(c.code),
        ErrorKind::Write(WriteFailure::WriteError(w)) => Some(w.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => Some(w.code),
        ErrorKind::InsertMany(m) => m
            .write_errors
            .as_ref()
            .and_then(|w| w.first().map(|w| w.code))
            .or_else(|| m.write_concern_error.as_ref().map(|w| w.code)),
        _ => None,
    };
    own.or_else(|| {
        std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<mongodb::error::Error>())
            .and_then(error_code)
    })
}

/// How an error is to be treated, by meaning (rule 7 of the adapter contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// Network, time-outs, elections, retryable labels: [`Error::Unavailable`].
    Transient,
    /// Credentials refused (a wrong user or password, a client certificate
    /// the server does not accept): [`Error::Auth`], never retried.
    Auth,
    /// Bad configuration (TLS files and trust, option values): [`Error::Config`].
    Config,
    /// A reply dlock cannot decode: [`Error::Protocol`].
    Garbled,
    /// Refused (auth, permissions, limits, validation): [`Error::Backend`].
    Refused,
}

/// The TLS failure behind an I/O error, if it is one (rustls reports
/// certificate and protocol failures inside the I/O error).
pub(crate) fn tls_failure(e: &mongodb::error::Error) -> Option<&rustls::Error> {
    match e.kind.as_ref() {
        ErrorKind::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}

/// Whether a TLS failure means the server refused our client certificate
/// (rather than us refusing its certificate, or the TLS setup failing).
fn client_cert_refused(e: &rustls::Error) -> bool {
    use rustls::AlertDescription as A;
    matches!(
        e,
        rustls::Error::AlertReceived(
            A::BadCertificate
                | A::CertificateRequired
                | A::CertificateUnknown
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::UnsupportedCertificate
                | A::UnknownCA
                | A::AccessDenied
        )
    )
}

/// A failure to reach the server that retrying cannot cure: TLS failing
/// (a certificate the client does not trust, a client certificate the
/// server refuses, a server that does not speak TLS).
pub(crate) fn is_fatal_transport(e: &mongodb::error::Error) -> bool {
    tls_failure(e).is_some()
}

pub(crate) fn classify(e: &mongodb::error::Error) -> Class {
    if let Some(tls) = tls_failure(e) {
        return if client_cert_refused(tls) {
            Class::Auth
        } else {
            Class::Config
        };
    }
    match e.kind.as_ref() {
        ErrorKind::Io(_)
        | ErrorKind::ConnectionPoolCleared { .. }
        | ErrorKind::ServerSelection { .. }
        | ErrorKind::DnsResolve { .. }
        | ErrorKind::Shutdown => return Class::Transient,
        ErrorKind::Authentication { .. } => return Class::Auth,
        ErrorKind::InvalidTlsConfig { .. } | ErrorKind::InvalidArgument { .. } => {
            return Class::Config;
        }
        ErrorKind::BsonDeserialization(_)
        | ErrorKind::BsonSerialization(_)
        | ErrorKind::InvalidResponse { .. }
        | ErrorKind::MissingResumeToken => return Class::Garbled,
        _ => {}
    }
    if TRANSIENT_LABELS.iter().any(|l| e.contains_label(l)) {
        return Class::Transient;
    }
    match error_code(e) {
        Some(code) if TRANSIENT_CODES.contains(&code) => Class::Transient,
        _ => Class::Refused,
    }
}

/// What a failed server selection or connection says, without the driver's
/// topology dump: the first server's own error where it gives one.
fn unreachable_text(e: &mongodb::error::Error) -> Option<String> {
    match e.kind.as_ref() {
        ErrorKind::ServerSelection { message, .. } => {
            // "... Servers: [ { Address: h:p, Type: Unknown, Error: Kind: I/O error: ..., labels: ..."
            let server = message.split("Address: ").nth(1).map(|rest| {
                let address = rest.split([',', ' ']).next().unwrap_or_default();
                let error = rest
                    .split_once("Error: Kind: ")
                    .map(|(_, why)| why.split(", labels").next().unwrap_or(why));
                (address, error)
            });
            Some(match server {
                Some((address, Some(why))) => format!("cannot connect to {address}: {why}"),
                Some((address, None)) => format!(
                    "no answer from {address} within the server selection timeout (serverSelectionTimeoutMS)"
                ),
                None => "no server could be selected within the server selection timeout (serverSelectionTimeoutMS)"
                    .to_owned(),
            })
        }
        ErrorKind::Io(io) => Some(format!("connection failed: {io}")),
        _ => None,
    }
}

/// Maps a driver error to the meaning-based core error.
pub(crate) fn map_err(e: mongodb::error::Error) -> Error {
    match classify(&e) {
        Class::Transient => match unreachable_text(&e) {
            Some(text) => Error::unavailable(SCHEME, text),
            None => Error::unavailable(SCHEME, e),
        },
        Class::Auth => Error::Auth {
            backend: SCHEME,
            reason: match (e.kind.as_ref(), tls_failure(&e)) {
                (ErrorKind::Authentication { message, .. }, _) => message.clone(),
                (_, Some(tls)) => format!("the server refused the client certificate ({tls})"),
                _ => e.kind.to_string(),
            },
        },
        Class::Config => match tls_failure(&e) {
            Some(rustls::Error::InvalidCertificate(why)) => Error::Config(format!(
                "{SCHEME}: TLS: the server's certificate is not trusted ({why:?}); \
                 check tlsCAFile (or the system's roots) and the host name"
            )),
            Some(tls) => Error::Config(format!(
                "{SCHEME}: TLS failed ({tls}); does the server speak TLS on this port?"
            )),
            None => Error::Config(format!("{SCHEME}: {}", e.kind)),
        },
        Class::Garbled => Error::protocol(SCHEME, e.to_string()),
        Class::Refused => Error::backend(SCHEME, e),
    }
}

/// A positive token from a stored number.
pub(crate) fn token_of(value: Option<&Bson>) -> Result<FencingToken, Error> {
    let n = match value {
        Some(Bson::Int64(n)) => Some(*n),
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        Some(Bson::Double(d)) if d.fract() == 0.0 && *d >= 1.0 && *d < 9.0e18 => Some(*d as i64),
        _ => None,
    };
    n.and_then(|n| u64::try_from(n).ok())
        .filter(|n| *n > 0)
        .map(FencingToken::new)
        .ok_or_else(|| {
            Error::protocol(
                SCHEME,
                format!("token {value:?} in the lock document is not a positive integer"),
            )
        })
}

/// An integer stored as any BSON numeric type (milliseconds, versions).
pub(crate) fn int_of(value: Option<&Bson>) -> Option<i64> {
    match value? {
        Bson::Int64(n) => Some(*n),
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Double(d) if d.is_finite() => Some(*d as i64),
        _ => None,
    }
}

fn str_of<'a>(doc: &'a Document, key: &str) -> Option<&'a str> {
    match doc.get(key) {
        Some(Bson::String(s)) => Some(s),
        _ => None,
    }
}

/// What one take reply means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TakeReply {
    /// The lock is this attempt's. `fresh`: granted by this very request.
    Granted { token: FencingToken, fresh: bool },
    /// Someone else holds it for `remaining` more (by the server's clock).
    Busy { remaining: Duration },
}

/// Interprets the take's post-image (projected by [`query::take_projection`]).
pub(crate) fn read_take(doc: &Document, owner: &str, ts: ObjectId) -> Result<TakeReply, Error> {
    let remaining = int_of(doc.get("remaining"))
        .ok_or_else(|| Error::protocol(SCHEME, "the take reply has no numeric `remaining`"))?;
    if str_of(doc, "who") == Some(owner) && remaining > 0 {
        let token = token_of(doc.get("token"))?;
        let fresh = matches!(doc.get("ts"), Some(Bson::ObjectId(t)) if *t == ts);
        return Ok(TakeReply::Granted { token, fresh });
    }
    Ok(TakeReply::Busy {
        remaining: Duration::from_millis(remaining.max(0) as u64),
    })
}

/// The previous holder in a fresh grant's `prev`, if the grant replaced a
/// hold that had expired without release (the seeds' takeover).
pub(crate) fn taken_over(doc: &Document) -> Option<&Document> {
    let prev = doc.get_document("prev").ok()?;
    let held = int_of(prev.get("state")) == Some(i64::from(STATE_HELD));
    (held && prev.contains_key("who")).then_some(prev)
}

pub(crate) struct MongoSession {
    inner: Arc<Inner>,
    id: SessionId,
    ttl: Duration,
    /// A request dlock-core gives up on after this long in the driver
    /// poisons the client (just under the session's request timeout).
    stall: Duration,
    /// Whether a background ping is in flight (at most one).
    pinging: Arc<AtomicBool>,
    /// Attempts with a take that may still be on the wire: their end leaves
    /// a tombstone first.
    doubtful: Doubtful,
}

/// Leaves attempt `owner`'s tombstone in `name`'s document, for the life
/// of a tombstone of holds of `ttl` (see [`query::tombstone_update`]),
/// creating the document if need be.
async fn leave_tombstone(
    inner: &Inner,
    name: &LockName,
    owner: &str,
    ttl: Duration,
    stall: Duration,
) -> Result<(), Error> {
    let life = Doubtful::tombstone_life(ttl);
    for _ in 0..2 {
        let op = inner.clients.op(Some(stall));
        let r = op
            .conn
            .locks
            .update_one(
                query::take_filter(name),
                query::tombstone_update(owner, life),
            )
            .await;
        if op.done(r).map_err(map_err)?.matched_count > 0 {
            return Ok(());
        }
        // No document (never taken): created as a take would, then marked.
        let op = inner.clients.op(Some(stall));
        let inserted = op.conn.locks.insert_one(query::take_filter(name)).await;
        match op.done(inserted) {
            Err(e) if error_code(&e) != Some(DUPLICATE_KEY) => return Err(map_err(e)),
            _ => {}
        }
    }
    Err(Error::unavailable(
        SCHEME,
        "the lock's document is missing right after it was created",
    ))
}

impl MongoSession {
    /// The end of `owner`'s attempt on `name`: its tombstone first if it
    /// is doubtful (see [`leave_tombstone`]).
    async fn tombstone_first(&self, name: &LockName, owner: &str) -> Result<(), Error> {
        let leave = || leave_tombstone(&self.inner, name, owner, self.ttl, self.stall);
        self.doubtful.tombstone_if_doubtful(owner, leave).await?;
        Ok(())
    }

    /// Creates the store side: the session's `sessions` document.
    pub(crate) async fn open(
        inner: Arc<Inner>,
        id: SessionId,
        options: &SessionOptions,
    ) -> Result<Self, Error> {
        let session = Self {
            inner,
            id,
            ttl: options.ttl_value(),
            stall: options.request_timeout_or_default() * 9 / 10,
            pinging: Arc::new(AtomicBool::new(false)),
            doubtful: Doubtful::default(),
        };
        session.ping(true).await?;
        Ok(session)
    }

    /// `ping = $$NOW` on the session's document (`upsert`: create it).
    async fn ping(&self, upsert: bool) -> Result<(), Error> {
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .sessions
            .update_one(query::ping_filter(self.id.as_str()), query::ping_update())
            .upsert(upsert)
            .await;
        op.done(r).map_err(map_err)?;
        Ok(())
    }

    /// The heartbeat of a session that holds locks, off the renewal's
    /// path: the holds' own `expiresAt` is what protects them; the ping only
    /// keeps the session's document fresh (for operators and the sweep). At
    /// most one at a time, given up (and its client poisoned) after the
    /// stall time like any request; never creates the document, so a ping
    /// that lands after `close` cannot bring it back.
    fn ping_in_background(&self) {
        if self.pinging.swap(true, Ordering::AcqRel) {
            return;
        }
        let (inner, id, pinging) = (self.inner.clone(), self.id.clone(), self.pinging.clone());
        let stall = self.stall;
        tokio::spawn(async move {
            let ping = async {
                let op = inner.clients.op(Some(stall));
                let r = op
                    .conn
                    .sessions
                    .update_one(query::ping_filter(id.as_str()), query::ping_update())
                    .await;
                op.done(r)
            };
            match tokio::time::timeout(stall, ping).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!(session = %id, error = %e, "session ping failed"),
                Err(_) => tracing::debug!(session = %id, "session ping timed out"),
            }
            pinging.store(false, Ordering::Release);
        });
    }

    fn refs<'a>(&self, holds: &'a [Hold]) -> Vec<HoldRef<'a>> {
        holds
            .iter()
            .map(|h| HoldRef {
                name: h.name.as_str(),
                owner: &h.key,
                token: h.token.get(),
            })
            .collect()
    }
}

impl fmt::Debug for MongoSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoSession")
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .finish()
    }
}

#[async_trait]
impl RawSession for MongoSession {
    fn ttl(&self) -> Duration {
        self.ttl
    }

    fn expiry(&self) -> ExpiryModel {
        ExpiryModel::PerHold
    }

    async fn claim(&self, name: &LockName, why: Option<&str>) -> Result<Box<dyn Claim>, Error> {
        Ok(Box::new(MongoClaim {
            subscription: Some(self.inner.hub.subscribe(name.as_str())),
            inner: self.inner.clone(),
            session: self.id.clone(),
            name: name.clone(),
            owner: self.id.claim_owner(),
            why: why.map(str::to_owned),
            ttl: self.ttl,
            stall: self.stall,
            sent: false,
            doubtful: self.doubtful.clone(),
            backoff: PollBackoff::default(),
        }))
    }

    async fn renew(&self, holds: &[Hold]) -> Result<Vec<bool>, Error> {
        if holds.is_empty() {
            // A waiter-only session: the ping is the heartbeat.
            self.ping(true).await?;
            return Ok(Vec::new());
        }
        let refs = self.refs(holds);
        let filter = query::renew_filter(self.id.as_str(), &refs);
        // One request on the renewal's path, whatever the number of holds.
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .locks
            .update_many(filter.clone(), query::renew_update(self.ttl))
            .await;
        let extended = op.done(r).map_err(map_err)?;
        self.ping_in_background();
        let distinct: HashSet<&str> = refs.iter().map(|r| r.name).collect();
        if extended.matched_count == holds.len() as u64 && distinct.len() == holds.len() {
            // Each `$or` branch matches at most one document (`_id`), so
            // every hold matched.
            return Ok(vec![true; holds.len()]);
        }
        // Some were lost: find out which are still ours (those that matched
        // were just extended, so they are still live now).
        let op = self.inner.clients.op(Some(self.stall));
        let r = async {
            op.conn
                .locks
                .find(filter)
                .projection(query::hold_projection())
                .await?
                .try_collect::<Vec<Document>>()
                .await
        }
        .await;
        let live: HashSet<(String, String, u64)> = op
            .done(r)
            .map_err(map_err)?
            .iter()
            .filter_map(|d| {
                let name = str_of(d, "_id")?.to_owned();
                let who = str_of(d, "who")?.to_owned();
                let token = token_of(d.get("token")).ok()?.get();
                Some((name, who, token))
            })
            .collect();
        Ok(holds
            .iter()
            .map(|h| live.contains(&(h.name.to_string(), h.key.clone(), h.token.get())))
            .collect())
    }

    async fn release(&self, hold: &Hold) -> Result<(), Error> {
        self.tombstone_first(&hold.name, &hold.key).await?;
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .locks
            .update_one(
                query::release_filter(&hold.name, self.id.as_str(), &hold.key, hold.token.get()),
                query::free_update(),
            )
            .await;
        let done = op.done(r).map_err(map_err)?;
        if done.matched_count == 0 {
            return Err(Error::NotHeld {
                name: hold.name.to_string(),
            });
        }
        self.inner.hub.wake_first(hold.name.as_str());
        Ok(())
    }

    async fn close(&self, holds: &[Hold]) -> Result<(), Error> {
        for hold in holds {
            self.tombstone_first(&hold.name, &hold.key).await?;
        }
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .locks
            .update_many(
                query::session_filter(self.id.as_str()),
                query::free_update(),
            )
            .await;
        op.done(r).map_err(map_err)?;
        for hold in holds {
            self.inner.hub.wake_first(hold.name.as_str());
        }
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .sessions
            .delete_one(query::ping_filter(self.id.as_str()))
            .await;
        op.done(r).map_err(map_err)?;
        Ok(())
    }
}

/// A claim on one lock. There is no queue: a busy claim waits for a
/// change-stream event (or polls) and tries again.
struct MongoClaim {
    inner: Arc<Inner>,
    session: SessionId,
    name: LockName,
    /// This attempt's identity in the `who` field.
    owner: String,
    why: Option<String>,
    ttl: Duration,
    /// See [`MongoSession`]'s `stall`.
    stall: Duration,
    subscription: Option<Waiter>,
    /// Whether a take was sent (so a grant may exist that abandon must free).
    sent: bool,
    /// The session's doubtful attempts (see [`MongoSession`]).
    doubtful: Doubtful,
    backoff: PollBackoff,
}

impl fmt::Debug for MongoClaim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoClaim")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish()
    }
}

impl MongoClaim {
    /// The take itself: creates the lock's document if missing, then one
    /// `findAndModify`.
    async fn take(&mut self) -> Result<Take, Error> {
        self.sent = true;
        let ts = ObjectId::new();
        let spec = TakeSpec {
            session: self.session.as_str(),
            owner: &self.owner,
            why: self.why.as_deref(),
            ts,
            ttl: self.ttl,
        };
        // No upsert: two upserts racing to create a lock's document were
        // both answered "granted, token 1" by the Mongo-wire server (`dlock
        // bench`'s hot lock: S2 "token 1 was issued twice"), and mongod
        // retries such a race only under conditions. So the document is
        // created first, as `{_id}` alone (what an upsert would have started
        // from; a duplicate key means another client created it), and the
        // take is a plain update of one existing document.
        let mut created = false;
        let doc = loop {
            let op = self.inner.clients.op(Some(self.stall));
            let reply = op
                .conn
                .locks
                .find_one_and_update(query::take_filter(&self.name), query::take_update(&spec))
                .return_document(ReturnDocument::After)
                .projection(query::take_projection())
                .await;
            match op.done(reply) {
                Ok(Some(doc)) => break doc,
                Err(e) => return Err(map_err(e)),
                // Another client's insert we saw as a duplicate key was rolled
                // back by a failover before our take: retryable.
                Ok(None) if created => {
                    return Err(Error::unavailable(
                        SCHEME,
                        "the lock's document is missing right after it was created",
                    ));
                }
                Ok(None) => {
                    let op = self.inner.clients.op(Some(self.stall));
                    let inserted = op
                        .conn
                        .locks
                        .insert_one(query::take_filter(&self.name))
                        .await;
                    match op.done(inserted) {
                        Ok(_) => {}
                        Err(e) if error_code(&e) == Some(DUPLICATE_KEY) => {}
                        Err(e) => return Err(map_err(e)),
                    }
                    created = true;
                }
            }
        };
        match read_take(&doc, &self.owner, ts)? {
            TakeReply::Granted { token, fresh } => {
                if fresh && let Some(prev) = taken_over(&doc) {
                    tracing::info!(
                        lock = %self.name,
                        token = %token,
                        old_session = str_of(prev, "session").unwrap_or(""),
                        old_who = str_of(prev, "who").unwrap_or(""),
                        old_why = str_of(prev, "why").unwrap_or(""),
                        old_token = ?int_of(prev.get("token")),
                        "took over a lock whose holder let it expire"
                    );
                }
                Ok(Take::Granted(Hold {
                    name: self.name.clone(),
                    token,
                    key: self.owner.clone(),
                }))
            }
            TakeReply::Busy { remaining } => Ok(Take::Busy(Busy {
                retry_after: Some(remaining),
            })),
        }
    }
}

#[async_trait]
impl Claim for MongoClaim {
    /// Doubtful until answered (see [`Doubtful`]).
    async fn try_take(&mut self) -> Result<Take, Error> {
        let sending = self.doubtful.sending(&self.owner);
        let taken = self.take().await;
        if taken.is_ok() {
            sending.answered();
        }
        taken
    }

    async fn wait(&mut self, until: Instant) -> Result<(), Error> {
        let (hub, name) = (&self.inner.hub, &self.name);
        let subscription = self
            .subscription
            .get_or_insert_with(|| hub.subscribe(name.as_str()));
        if self.inner.stream_live.load(Ordering::Acquire) {
            subscription.wait_until(until).await;
        } else {
            subscription.wait_polling(&mut self.backoff, until).await;
        }
        Ok(())
    }

    async fn abandon(&mut self) -> Result<(), Error> {
        // No longer waiting (its clean-up may be retried for a while): the
        // next waiter polls, and a release wakes that one.
        self.subscription = None;
        if !self.sent {
            return Ok(());
        }
        let (inner, name, owner) = (&self.inner, &self.name, &self.owner);
        let leave = || leave_tombstone(inner, name, owner, self.ttl, self.stall);
        self.doubtful.tombstone_if_doubtful(owner, leave).await?;
        let op = self.inner.clients.op(Some(self.stall));
        let r = op
            .conn
            .locks
            .update_one(
                query::abandon_filter(&self.name, &self.owner),
                query::free_update(),
            )
            .await;
        let done = op.done(r).map_err(map_err)?;
        if done.matched_count > 0 {
            self.inner.hub.wake_first(self.name.as_str());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    #[test]
    fn tokens_are_read_strictly() {
        assert_eq!(token_of(Some(&Bson::Int64(7))).unwrap().get(), 7);
        assert_eq!(token_of(Some(&Bson::Int32(3))).unwrap().get(), 3);
        assert_eq!(token_of(Some(&Bson::Double(4.0))).unwrap().get(), 4);
        for bad in [
            None,
            Some(Bson::Int64(0)),
            Some(Bson::Int64(-1)),
            Some(Bson::Double(1.5)),
            Some(Bson::String("1".into())),
            Some(Bson::Null),
        ] {
            assert!(
                matches!(token_of(bad.as_ref()), Err(Error::Protocol { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn take_replies() {
        let ts = ObjectId::new();
        let other_ts = ObjectId::new();
        let mine =
            doc! { "state": 2, "who": "s#1", "ts": ts, "token": 5_i64, "remaining": 900_i64 };
        assert_eq!(
            read_take(&mine, "s#1", ts).unwrap(),
            TakeReply::Granted {
                token: FencingToken::new(5),
                fresh: true
            }
        );
        // A retry after a lost reply finds its own grant: same token.
        assert_eq!(
            read_take(&mine, "s#1", other_ts).unwrap(),
            TakeReply::Granted {
                token: FencingToken::new(5),
                fresh: false
            }
        );
        // Someone else's: busy for the server-measured remainder.
        assert_eq!(
            read_take(&mine, "s#2", other_ts).unwrap(),
            TakeReply::Busy {
                remaining: Duration::from_millis(900)
            }
        );
        let expired_mine = doc! { "who": "s#1", "token": 5_i64, "remaining": -3_i64 };
        assert_eq!(
            read_take(&expired_mine, "s#1", ts).unwrap(),
            TakeReply::Busy {
                remaining: Duration::ZERO
            }
        );
        // $subtract of two dates may come back as a 32-bit or a double.
        let int32 = doc! { "who": "x", "token": 1_i64, "remaining": 40_i32 };
        assert_eq!(
            read_take(&int32, "s#1", ts).unwrap(),
            TakeReply::Busy {
                remaining: Duration::from_millis(40)
            }
        );
        assert!(matches!(
            read_take(&doc! { "who": "s#1", "token": 1_i64 }, "s#1", ts),
            Err(Error::Protocol { .. })
        ));
        assert!(matches!(
            read_take(
                &doc! { "who": "s#1", "token": "x", "remaining": 5_i64 },
                "s#1",
                ts
            ),
            Err(Error::Protocol { .. })
        ));
    }

    #[test]
    fn takeover_is_detected_from_prev() {
        let expired = doc! { "prev": { "state": 2, "session": "a", "who": "a#1", "why": "w", "token": 4_i64 } };
        let prev = taken_over(&expired).unwrap();
        assert_eq!(prev.get_str("who").unwrap(), "a#1");
        // A lock that had been released, or never taken, is not a takeover.
        assert!(taken_over(&doc! { "prev": { "state": 0, "token": 4_i64 } }).is_none());
        assert!(taken_over(&doc! { "prev": {} }).is_none());
        assert!(taken_over(&doc! {}).is_none());
    }

    fn command_error(code: i32) -> mongodb::error::Error {
        // The driver builds command errors from server replies; so do we.
        let reply = doc! { "ok": 0, "code": code, "codeName": "X", "errmsg": "m" };
        let err: mongodb::error::CommandError = mongodb::bson::from_document(reply).unwrap();
        mongodb::error::Error::from(ErrorKind::Command(err))
    }

    fn write_concern_error(code: i32, labels: &[&str]) -> mongodb::error::Error {
        let reply = doc! { "code": code, "codeName": "X", "errmsg": "m", "errorLabels": labels };
        let err: mongodb::error::WriteConcernError = mongodb::bson::from_document(reply).unwrap();
        mongodb::error::Error::from(ErrorKind::Write(WriteFailure::WriteConcernError(err)))
    }

    fn write_error(code: i32) -> mongodb::error::Error {
        let reply = doc! { "code": code, "errmsg": "m" };
        let err: mongodb::error::WriteError = mongodb::bson::from_document(reply).unwrap();
        mongodb::error::Error::from(ErrorKind::Write(WriteFailure::WriteError(err)))
    }

    #[test]
    fn errors_map_by_meaning() {
        use std::io;
        for kind in [io::ErrorKind::ConnectionRefused, io::ErrorKind::TimedOut] {
            let e = mongodb::error::Error::from(io::Error::from(kind));
            assert_eq!(classify(&e), Class::Transient);
            assert!(map_err(e).is_retryable());
        }
        // Not writable primary, shutting down, elections, wtimeout, conflicts.
        for code in [10107, 13435, 11600, 11602, 189, 91, 64, 112, 50, 9001] {
            let e = command_error(code);
            assert_eq!(classify(&e), Class::Transient, "{code}");
            assert!(matches!(map_err(e), Error::Unavailable { .. }), "{code}");
        }
        // Unauthorized, auth failed, bad value, duplicate key, validation.
        for code in [13, 18, 2, 11000, 121] {
            let e = command_error(code);
            assert_eq!(classify(&e), Class::Refused, "{code}");
            assert!(matches!(map_err(e), Error::Backend { .. }), "{code}");
        }
        // Codes are found in write errors and write-concern errors too.
        assert_eq!(error_code(&command_error(11000)), Some(11000));
        assert_eq!(error_code(&write_error(11000)), Some(11000));
        assert_eq!(classify(&write_error(11000)), Class::Refused);
        assert_eq!(error_code(&write_concern_error(64, &[])), Some(64));
        assert_eq!(classify(&write_concern_error(64, &[])), Class::Transient);
        // Labels decide even for codes dlock does not know.
        let labelled = write_concern_error(4242, &["RetryableWriteError"]);
        assert!(labelled.contains_label("RetryableWriteError"));
        assert_eq!(classify(&labelled), Class::Transient);
        assert_eq!(classify(&write_concern_error(4242, &[])), Class::Refused);

        let shutdown = mongodb::error::Error::from(ErrorKind::Shutdown);
        assert!(matches!(map_err(shutdown), Error::Unavailable { .. }));
        let garbled = mongodb::error::Error::from(ErrorKind::MissingResumeToken);
        assert!(matches!(map_err(garbled), Error::Protocol { .. }));
        let bad_bson = mongodb::bson::from_document::<String>(doc! {}).unwrap_err();
        let garbled = mongodb::error::Error::from(bad_bson);
        assert!(matches!(map_err(garbled), Error::Protocol { .. }));
    }
}
