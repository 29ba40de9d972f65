//! The in-memory "server": lock table, sessions, queues, expiry by its own
//! clock, per-waiter notifications. All operations are atomic under one mutex,
//! as a store's single-key transactions are.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::clock::{ServerClock, ServerTime};
use crate::backend::primitives::{Busy, Hold, Take};
use crate::{Error, FencingToken, LockInfo, LockName};

/// How a grant's life is bounded (the two models of
/// [`ExpiryModel`](crate::backend::ExpiryModel)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leases {
    /// Each hold and each queue entry has its own expiry, set by the take and
    /// extended by renewals (Redis, SQL, MongoDB).
    PerHold,
    /// Holds and queue entries live as long as their session's lease, which
    /// only renewals extend (etcd, ZooKeeper).
    Session,
}

#[derive(Debug)]
struct SessionRec {
    ttl: Duration,
    expires_at: ServerTime,
}

#[derive(Debug)]
struct Holder {
    ticket: u64,
    session: Arc<str>,
    token: u64,
    why: Option<String>,
    acquired_at: ServerTime,
    /// `None`: lives with the session's lease.
    expires_at: Option<ServerTime>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    session: Arc<str>,
    notify: Arc<Notify>,
    /// `None`: lives with the session's lease; otherwise refreshed by each
    /// take of its attempt, so an entry whose abandon never arrived expires.
    expires_at: Option<ServerTime>,
}

#[derive(Debug, Default)]
struct Entry {
    holder: Option<Holder>,
    /// Waiting attempts in arrival order; fair locks grant in this order,
    /// unfair ones only wake from it.
    queue: VecDeque<Waiter>,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.holder.is_none() && self.queue.is_empty()
    }
}

#[derive(Debug, Default)]
struct State {
    /// One counter for all names: strictly increasing per name too, and no
    /// per-name state outlives its lock (etcd revisions and ZooKeeper zxids
    /// work the same way).
    last_token: u64,
    next_ticket: u64,
    sessions: HashMap<Arc<str>, SessionRec>,
    locks: BTreeMap<LockName, Entry>,
    /// Tickets whose claim or hold ended while a take of it may still be
    /// in flight (abandoned, released or force-released), with their
    /// session: such a take arriving later (sent before, overtaken on
    /// another connection) is refused, or it would grant a hold nobody
    /// owns, which on session leases lives as long as its session (etcd's
    /// tombstones do the same). Forgotten with the session.
    abandoned: HashMap<u64, Arc<str>>,
}

/// One in-memory lock service, shared by every backend handle that names it.
#[derive(Debug)]
pub(crate) struct Server {
    state: Mutex<State>,
    pub(crate) clock: ServerClock,
    /// Paused (SIGSTOP: requests wait) or down (killed: requests fail).
    run: watch::Sender<Run>,
}

/// Whether the server process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Run {
    Running,
    Paused,
    Down,
}

pub(crate) const BACKEND: &str = "memory";

/// What a take needs to know about its attempt.
pub(crate) struct TakeArgs<'a> {
    pub(crate) name: &'a LockName,
    pub(crate) session: &'a Arc<str>,
    pub(crate) ticket: u64,
    pub(crate) why: Option<&'a str>,
    pub(crate) notify: &'a Arc<Notify>,
    pub(crate) fair: bool,
    pub(crate) leases: Leases,
}

impl Server {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State::default()),
            clock: ServerClock::new(),
            run: watch::Sender::new(Run::Running),
        }
    }

    fn now(&self) -> ServerTime {
        self.clock.now()
    }

    /// Pauses or resumes request processing (a SIGSTOP'd server: requests
    /// queue, its clock runs on), or takes the server down.
    pub(crate) fn set_run(&self, run: Run) {
        self.run.send_replace(run);
    }

    /// Waits while the server is paused; fails while it is down (a refused
    /// connection).
    pub(crate) async fn admit(&self) -> Result<(), Error> {
        let mut rx = self.run.subscribe();
        let run = *rx
            .wait_for(|run| *run != Run::Paused)
            .await
            .map_err(|_| refused())?;
        match run {
            Run::Down => Err(refused()),
            _ => Ok(()),
        }
    }

    pub(crate) fn open_session(&self, id: &str, ttl: Duration) -> Arc<str> {
        let id: Arc<str> = id.into();
        let mut st = self.state.lock().unwrap();
        let expires_at = self.now() + ttl;
        st.sessions
            .insert(id.clone(), SessionRec { ttl, expires_at });
        id
    }

    pub(crate) fn new_ticket(&self) -> u64 {
        let mut st = self.state.lock().unwrap();
        st.next_ticket += 1;
        st.next_ticket
    }

    /// Takes `name` for the attempt if free (or expired) and, for fair locks,
    /// first in line; otherwise queues it (once) and reports how long until
    /// the holder or the first waiter ahead expires.
    pub(crate) fn try_take(&self, args: TakeArgs<'_>) -> Result<Take, Error> {
        let TakeArgs {
            name,
            session,
            ticket,
            why,
            notify,
            fair,
            leases,
        } = args;
        let mut guard = self.state.lock().unwrap();
        let now = self.now();
        let st = &mut *guard;
        if st.abandoned.contains_key(&ticket) {
            return Err(Error::protocol(
                BACKEND,
                format!("a take of {name} arrived after its claim was abandoned"),
            ));
        }
        let rec = live_session_mut(&mut st.sessions, session, now)?;
        let ttl = rec.ttl;
        // Per-hold: a take proves the session alive as of now, and holds die
        // with their session record, so it must last at least as long as the
        // grant (adapter rule 5: store expiry ≥ TTL from send). Session
        // leases: only renewals extend the lease.
        let expires_at = match leases {
            Leases::PerHold => {
                rec.expires_at = rec.expires_at.max(now + ttl);
                Some(now + ttl)
            }
            Leases::Session => None,
        };
        let entry = st.locks.entry(name.clone()).or_default();
        purge(entry, &st.sessions, now, name);
        if let Some(h) = &mut entry.holder
            && h.ticket == ticket
        {
            // A retry after a lost reply: the core counts validity from now.
            h.expires_at = h.expires_at.max(expires_at);
            return Ok(Take::Granted(hold_of(name, h)));
        }
        let position = entry.queue.iter().position(|w| w.ticket == ticket);
        let first_in_line = match position {
            Some(p) => p == 0 || !fair,
            None => entry.queue.is_empty() || !fair,
        };
        if entry.holder.is_none() && first_in_line {
            if let Some(p) = position {
                entry.queue.remove(p);
            }
            st.last_token += 1;
            let holder = Holder {
                ticket,
                session: session.clone(),
                token: st.last_token,
                why: why.map(str::to_owned),
                acquired_at: now,
                expires_at,
            };
            let hold = hold_of(name, &holder);
            entry.holder = Some(holder);
            return Ok(Take::Granted(hold));
        }
        match position {
            Some(p) => entry.queue[p].expires_at = expires_at,
            None => entry.queue.push_back(Waiter {
                ticket,
                session: session.clone(),
                notify: notify.clone(),
                expires_at,
            }),
        }
        // Wake when the holder, or (fair) a waiter ahead of us, would expire.
        let sessions = &st.sessions;
        let expiry = |s: &Arc<str>, own: Option<ServerTime>| {
            own.or_else(|| sessions.get(s).map(|r| r.expires_at))
        };
        let holder = entry
            .holder
            .iter()
            .filter_map(|h| expiry(&h.session, h.expires_at));
        let ahead = entry
            .queue
            .iter()
            .take_while(|w| fair && w.ticket != ticket)
            .filter_map(|w| expiry(&w.session, w.expires_at));
        let next_expiry = holder.chain(ahead).min();
        Ok(Take::Busy(Busy {
            retry_after: next_expiry.and_then(|t| self.clock.until(t)),
        }))
    }

    /// Removes `ticket`'s queue entry and its hold, if any; with `doubtful`
    /// (a take of it may still be in flight) refuses its takes from now on.
    pub(crate) fn abandon(&self, name: &LockName, session: &Arc<str>, ticket: u64, doubtful: bool) {
        let mut st = self.state.lock().unwrap();
        if doubtful && st.sessions.contains_key(session) {
            st.abandoned.insert(ticket, session.clone());
        }
        if let Some(entry) = st.locks.get_mut(name) {
            entry.queue.retain(|w| w.ticket != ticket);
            if entry.holder.as_ref().is_some_and(|h| h.ticket == ticket) {
                entry.holder = None;
            }
            wake_next(entry);
            if entry.is_empty() {
                st.locks.remove(name);
            }
        }
    }

    /// Frees `hold` if `session` holds it with `ticket`; with `doubtful` (a
    /// take of its claim may still be in flight: a retried take's first
    /// try) refuses that ticket's takes from now on, or the late take would
    /// grant the lock again to nobody.
    pub(crate) fn release(
        &self,
        session: &Arc<str>,
        hold: &Hold,
        ticket: u64,
        doubtful: bool,
    ) -> Result<(), Error> {
        let mut guard = self.state.lock().unwrap();
        let now = self.now();
        let st = &mut *guard;
        if doubtful && st.sessions.contains_key(session) {
            st.abandoned.insert(ticket, session.clone());
        }
        let Some(entry) = st.locks.get_mut(&hold.name) else {
            return Err(not_held(&hold.name));
        };
        purge(entry, &st.sessions, now, &hold.name);
        let ours = entry.holder.as_ref().is_some_and(|h| {
            h.ticket == ticket && &h.session == session && h.token == hold.token.get()
        });
        let result = if ours {
            entry.holder = None;
            wake_next(entry);
            Ok(())
        } else {
            Err(not_held(&hold.name))
        };
        if entry.is_empty() {
            st.locks.remove(&hold.name);
        }
        result
    }

    pub(crate) fn renew(
        &self,
        session: &Arc<str>,
        holds: &[(Hold, u64)],
    ) -> Result<Vec<bool>, Error> {
        let mut guard = self.state.lock().unwrap();
        let now = self.now();
        let st = &mut *guard;
        let rec = live_session_mut(&mut st.sessions, session, now)?;
        // Never shorten what a concurrent take set.
        rec.expires_at = rec.expires_at.max(now + rec.ttl);
        let until = now + rec.ttl;
        let mut out = Vec::with_capacity(holds.len());
        for (hold, ticket) in holds {
            let ok = match st.locks.get_mut(&hold.name).and_then(|e| e.holder.as_mut()) {
                Some(h)
                    if h.ticket == *ticket
                        && &h.session == session
                        && h.token == hold.token.get()
                        && h.expires_at.is_none_or(|e| e > now) =>
                {
                    if let Some(e) = &mut h.expires_at {
                        *e = (*e).max(until);
                    }
                    true
                }
                _ => false,
            };
            out.push(ok);
        }
        Ok(out)
    }

    /// Ends a session: frees its holds and queue entries.
    pub(crate) fn close_session(&self, session: &Arc<str>) {
        let mut guard = self.state.lock().unwrap();
        let st = &mut *guard;
        st.sessions.remove(session);
        st.abandoned.retain(|_, s| s != session);
        st.locks.retain(|_, entry| {
            entry.queue.retain(|w| &w.session != session);
            if entry.holder.as_ref().is_some_and(|h| &h.session == session) {
                entry.holder = None;
            }
            wake_next(entry);
            !entry.is_empty()
        });
    }

    pub(crate) fn inspect(&self, name: &LockName) -> Option<LockInfo> {
        let mut guard = self.state.lock().unwrap();
        let now = self.now();
        let st = &mut *guard;
        let entry = st.locks.get_mut(name)?;
        purge(entry, &st.sessions, now, name);
        self.info(name, entry, &st.sessions)
    }

    fn info(
        &self,
        name: &LockName,
        entry: &Entry,
        sessions: &HashMap<Arc<str>, SessionRec>,
    ) -> Option<LockInfo> {
        let h = entry.holder.as_ref()?;
        let mut info = LockInfo::new(name.clone(), &*h.session, FencingToken::new(h.token));
        info.why = h.why.clone();
        info.acquired_at = Some(self.clock.wall(h.acquired_at));
        let expires = h
            .expires_at
            .or_else(|| sessions.get(&h.session).map(|s| s.expires_at));
        info.expires_at = expires.map(|e| self.clock.wall(e));
        info.waiters = Some(entry.queue.len());
        Some(info)
    }

    /// The state, locked, with what is due expired.
    fn swept(&self) -> std::sync::MutexGuard<'_, State> {
        let mut st = self.state.lock().unwrap();
        sweep(&mut st, self.now());
        st
    }

    pub(crate) fn list(&self, prefix: &str) -> Vec<LockInfo> {
        let st = self.swept();
        st.locks
            .iter()
            .filter(|(name, _)| name.as_str().starts_with(prefix))
            .filter_map(|(name, entry)| self.info(name, entry, &st.sessions))
            .collect()
    }

    pub(crate) fn validate(&self, name: &LockName, token: FencingToken) -> bool {
        let st = self.state.lock().unwrap();
        let now = self.now();
        st.locks
            .get(name)
            .and_then(|e| e.holder.as_ref())
            .is_some_and(|h| {
                h.token == token.get()
                    && h.expires_at.is_none_or(|e| e > now)
                    && st
                        .sessions
                        .get(&h.session)
                        .is_some_and(|s| s.expires_at > now)
            })
    }

    pub(crate) fn force_release(&self, name: &LockName) -> bool {
        let mut guard = self.state.lock().unwrap();
        let now = self.now();
        let st = &mut *guard;
        let Some(entry) = st.locks.get_mut(name) else {
            return false;
        };
        purge(entry, &st.sessions, now, name);
        let held = entry.holder.take();
        if let Some(h) = &held {
            tracing::info!(lock = %name, holder = %h.session, token = h.token, "force-released");
            // The holder's client cannot be asked whether a take of it is
            // still in flight; force releases are rare: refuse it.
            st.abandoned.insert(h.ticket, h.session.clone());
        }
        wake_next(entry);
        if entry.is_empty() {
            st.locks.remove(name);
        }
        held.is_some()
    }

    /// Store objects (lock entries and queue entries) under `prefix`, after
    /// expiring what is due: the conformance suite's leak check.
    pub(crate) fn objects(&self, prefix: &str) -> usize {
        let st = self.swept();
        st.locks
            .iter()
            .filter(|(name, _)| name.as_str().starts_with(prefix))
            .map(|(_, e)| usize::from(e.holder.is_some()) + e.queue.len())
            .sum()
    }

    /// Loses every lock, session and queue; keeps the token counter only if
    /// `durable` (a restart from durable storage, or from nothing).
    pub(crate) fn restart(&self, durable: bool) {
        let mut st = self.state.lock().unwrap();
        st.sessions.clear();
        st.abandoned.clear();
        for entry in st.locks.values() {
            for w in &entry.queue {
                w.notify.notify_one();
            }
        }
        st.locks.clear();
        if !durable {
            st.last_token = 0;
        }
    }
}

fn live_session_mut<'a>(
    sessions: &'a mut HashMap<Arc<str>, SessionRec>,
    id: &Arc<str>,
    now: ServerTime,
) -> Result<&'a mut SessionRec, Error> {
    match sessions.get_mut(id) {
        Some(rec) if rec.expires_at > now => Ok(rec),
        _ => Err(Error::session_lost(
            id.to_string(),
            "it expired on the server, or was closed",
        )),
    }
}

/// Drops an expired holder and expired or dead waiters (server time only,
/// S6); wakes the new first waiter if that changed anything.
fn purge(
    entry: &mut Entry,
    sessions: &HashMap<Arc<str>, SessionRec>,
    now: ServerTime,
    name: &LockName,
) {
    let alive = |s: &Arc<str>, own: Option<ServerTime>| {
        own.is_none_or(|e| e > now) && sessions.get(s).is_some_and(|r| r.expires_at > now)
    };
    let mut changed = false;
    if let Some(h) = &entry.holder
        && !alive(&h.session, h.expires_at)
    {
        tracing::info!(lock = %name, holder = %h.session, token = h.token, "holder expired");
        entry.holder = None;
        changed = true;
    }
    let before = entry.queue.len();
    entry.queue.retain(|w| alive(&w.session, w.expires_at));
    changed |= entry.queue.len() != before;
    if changed {
        wake_next(entry);
    }
}

/// Expires everything that is due, and forgets dead sessions.
fn sweep(st: &mut State, now: ServerTime) {
    let State {
        sessions,
        locks,
        abandoned,
        ..
    } = st;
    locks.retain(|name, entry| {
        purge(entry, sessions, now, name);
        !entry.is_empty()
    });
    sessions.retain(|_, s| s.expires_at > now);
    abandoned.retain(|_, session| sessions.contains_key(session));
}

/// Wakes the first waiter (only it: no herd, invariant L6) if the lock is free.
fn wake_next(entry: &Entry) {
    if entry.holder.is_none()
        && let Some(first) = entry.queue.front()
    {
        first.notify.notify_one();
    }
}

fn hold_of(name: &LockName, h: &Holder) -> Hold {
    Hold {
        name: name.clone(),
        token: FencingToken::new(h.token),
        key: format!("{}#{}", h.session, h.ticket),
    }
}

fn refused() -> Error {
    Error::unavailable(BACKEND, "connection refused (the server is down)")
}

fn not_held(name: &LockName) -> Error {
    Error::NotHeld {
        name: name.to_string(),
    }
}
