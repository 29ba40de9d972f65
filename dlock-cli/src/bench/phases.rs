//! The workloads: connecting the clients, the latency phases (baseline,
//! uncontended acquire+release and the store's raw floor), the hot lock and
//! the store's own lock under the same contention, the independent locks,
//! and the safety verdict over the hot lock's history.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_conformance::checker::{Event, FencedRegister, History, Op, Phase};
use dlock_core::floor::{Floor, NativeGuard};
use dlock_core::url::StoreUrl;
use dlocks::{Backend, Error, FencingToken, Lock, LockGuard, LockName, Session, SessionOptions};
use indicatif::ProgressBar;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout};

use super::report::{FloorReport, HotLock, Independent, NativeReport, Safety};
use super::stats::{self, Latency};
use crate::exit::{FAILURE, Failure, UNAVAILABLE, code_for};

/// The longest one operation outside the contended phases may take.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the clients of a contended phase may run past its end before
/// the backend is declared stuck.
const OVERRUN: Duration = Duration::from_secs(30);

/// The pause after a failed operation in a contended phase, so that a broken
/// backend is not hammered in a tight loop.
const ERROR_PAUSE: Duration = Duration::from_millis(20);

/// How often a contended phase's progress bar moves.
const TICK: Duration = Duration::from_millis(100);

/// One benchmark client: its own connection to the store and its own session.
struct Client {
    /// The client's own connection (pool) to the store.
    backend: Arc<dyn Backend>,
    /// The client's own session on it.
    session: Session,
    /// The store's raw operations on a connection of their own, if its
    /// adapter has them.
    floor: Option<Arc<dyn Floor>>,
}

/// One backend under test, with its clients.
pub(crate) struct Target {
    /// Short label for tables (the scheme, made unique by the caller).
    pub(crate) label: String,
    /// The URL, password redacted.
    pub(crate) url: String,
    /// The name prefix of this backend's locks in this run.
    prefix: String,
    /// The clients; the first also runs the latency phases.
    clients: Vec<Client>,
}

impl Target {
    /// Opens `clients` connections to `url`, each with its own session of
    /// TTL `ttl`; lock names will start with `prefix`.
    pub(crate) async fn connect(
        url: &str,
        clients: usize,
        ttl: Duration,
        prefix: String,
        say: &(dyn Fn(&str) + Sync),
    ) -> Result<Self, Failure> {
        let shown = dlock_core::url::redact(url);
        let parsed = StoreUrl::parse(url)?;
        let mut opened = Vec::with_capacity(clients);
        for i in 0..clients {
            let backend = crate::connect(url).await?;
            if i == 0 {
                // Nodes just started grant nothing for up to max_ttl (Redis's
                // restart guard): waited out, saying so, rather than timed as
                // a cycle that never answers.
                let longest = backend.max_ttl();
                crate::run::ready(backend.as_ref(), ttl, longest, false, say)
                    .await
                    .map_err(|(e, _)| Failure::new(code_for(&e), format!("{shown}: {e}")))?;
            }
            let options = SessionOptions::new().ttl(ttl).label("dlock-bench");
            let session = within(&shown, "opening a session", backend.session(options)).await?;
            let floor = within(
                &shown,
                "opening the floor",
                dlocks::registry().floor(&parsed),
            )
            .await?;
            opened.push(Client {
                backend,
                session,
                floor,
            });
        }
        let label = opened
            .first()
            .map_or("?", |c| c.backend.scheme())
            .to_owned();
        Ok(Self {
            label,
            url: shown,
            prefix,
            clients: opened,
        })
    }

    /// Number of clients.
    pub(crate) fn clients(&self) -> usize {
        self.clients.len()
    }

    /// The lock `<prefix>/<suffix>`.
    fn name(&self, suffix: &str) -> Result<LockName, Failure> {
        Ok(LockName::new(format!("{}/{suffix}", self.prefix))?)
    }

    /// Client `i`'s session (`i` below [`clients`](Self::clients)).
    pub(crate) fn session(&self, i: usize) -> &Session {
        &self.clients[i].session
    }

    /// [`Target::name`], for the other phase modules.
    pub(crate) fn lock_name(&self, suffix: &str) -> Result<LockName, Failure> {
        self.name(suffix)
    }

    /// The first client's backend (its connection to the store).
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.clients[0].backend
    }

    /// The first client's floor, if the store's adapter has one.
    pub(crate) fn floor(&self) -> Option<&Arc<dyn Floor>> {
        self.clients.first().and_then(|c| c.floor.as_ref())
    }

    /// Take attempts and waits over all clients' sessions so far.
    fn counters(&self) -> (u64, u64) {
        self.clients.iter().fold((0, 0), |(takes, waits), c| {
            let s = c.session.stats();
            (takes + s.take_attempts, waits + s.waits)
        })
    }

    /// Closes every client's session (bounded; errors only logged).
    pub(crate) async fn close(&self) {
        for c in &self.clients {
            match timeout(OP_TIMEOUT, c.session.close()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(backend = %self.label, error = %e, "closing a session")
                }
                Err(_) => tracing::debug!(backend = %self.label, "closing a session timed out"),
            }
        }
    }
}

/// What the latency phases measured on one target: the baseline, dlock's
/// acquire+release and the floor's raw cycle (if the store has one).
pub(crate) struct Latencies {
    /// Phase 1: pings.
    pub(crate) baseline: Option<Latency>,
    /// Phase 2: dlock's acquire+release.
    pub(crate) acquire_release: Option<Latency>,
    /// Phase 2: the floor's raw take+release.
    pub(crate) floor: Option<FloorReport>,
}

/// Phases 1 and 2 on every target: `warmup + cycles` rounds; in each round,
/// every target in turn does one ping, one acquire+release of a free lock and
/// one raw floor cycle (the order rotates from round to round), so that
/// noise hits all of them alike. The bar counts rounds.
pub(crate) async fn latency(
    targets: &[Target],
    warmup: u64,
    cycles: u64,
    bar: &ProgressBar,
) -> Result<Vec<Latencies>, Failure> {
    let mut locks = Vec::with_capacity(targets.len());
    let mut floor_keys = Vec::with_capacity(targets.len());
    for t in targets {
        locks.push(first_client(t)?.session.lock(t.name("solo")?)?);
        floor_keys.push(t.name("floor")?);
    }
    let mut samples: Vec<[_; 3]> = targets
        .iter()
        .map(|_| [stats::histogram(), stats::histogram(), stats::histogram()])
        .collect();
    for round in 0..warmup + cycles {
        for (k, ((t, lock), floor_key)) in targets.iter().zip(&locks).zip(&floor_keys).enumerate() {
            let client = first_client(t)?;
            let mut took = [None; 3];
            for step in 0..3 {
                let op = (step + round as usize) % 3;
                took[op] = match (op, &client.floor) {
                    (0, _) => Some(timed(t, "ping", client.backend.ping()).await?),
                    (1, _) => Some(timed(t, "acquire+release", cycle(lock)).await?),
                    (_, Some(floor)) => {
                        Some(timed(t, "the floor's raw cycle", floor.cycle(floor_key)).await?)
                    }
                    (_, None) => None,
                };
            }
            if round >= warmup {
                for (h, d) in samples[k].iter_mut().zip(took) {
                    if let Some(d) = d {
                        stats::record(h, d);
                    }
                }
            }
        }
        bar.inc(1);
    }
    Ok(targets
        .iter()
        .zip(&samples)
        .map(|(t, [ping, take, raw])| Latencies {
            baseline: Latency::of(ping),
            acquire_release: Latency::of(take),
            floor: t
                .clients
                .first()
                .and_then(|c| c.floor.as_ref())
                .map(|f| FloorReport {
                    operations: f.operations().to_owned(),
                    latency: Latency::of(raw),
                }),
        })
        .collect())
}

/// One uncontended acquire+release.
async fn cycle(lock: &Lock) -> Result<(), Error> {
    lock.acquire_timeout(OP_TIMEOUT).await?.release().await
}

/// Which side of the hot-lock phase a turn is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// dlock's hot lock.
    Dlock,
    /// The store's own lock.
    Native,
}

/// The order of the hot-lock phase's turns where the store has a lock of
/// its own: A B B A A B B A, each turn a quarter of the phase's duration,
/// so that a drift over the phase (the machine's load, a server's JIT or
/// caches) falls on both sides alike. Run one after the other, the side
/// that went second gained ~10 % on ZooKeeper whichever it was
/// (2026-11-28). Both sides first run a short turn that is not counted, so
/// that neither meets a cold path in its first counted turn.
const ORDER: [Side; 8] = {
    use Side::{Dlock as A, Native as B};
    [A, B, B, A, A, B, B, A]
};

/// The uncounted warm-up turn of each side: at most this long.
const WARM_UP: Duration = Duration::from_millis(500);

/// What the hot-lock phase found: dlock's figures and safety verdict, and
/// the store's own lock's figures where it has one.
pub(crate) struct HotLockPhase {
    /// dlock's hot lock.
    pub(crate) dlock: HotLock,
    /// The safety verdict over dlock's turns (phase 5).
    pub(crate) safety: Safety,
    /// The store's own lock, if it has one.
    pub(crate) native: Option<NativeReport>,
}

/// Phase 3 and the safety verdict (phase 5): every client loops acquire →
/// fenced register write → release on one lock; where every client's floor
/// has a lock of the store's own, the same clients loop lock → release on
/// it, in turns with dlock's ([`ORDER`]). Each side runs for `duration` in
/// all, and only what happened within its turns counts (a native wait
/// cannot be cut short, so a client still waiting at the end of a turn
/// takes its grant first; that grant is not counted). The bar counts the
/// counted turns' milliseconds.
pub(crate) async fn hot_lock(
    t: &Target,
    duration: Duration,
    bar: &ProgressBar,
) -> Result<HotLockPhase, Failure> {
    let name = t.name("hot")?;
    let register = Arc::new(FencedRegister::new());
    let native = native_lock_of(t)?;
    let (order, length): (&[Side], _) = match native {
        Some(_) => (&ORDER, duration / 4),
        None => (&[Side::Dlock], duration),
    };
    bar.set_length(order.len() as u64 * millis(length));
    let contenders =
        |side: Side, register: &Arc<FencedRegister>| -> Result<Vec<Contender>, Failure> {
            Ok(match (side, &native) {
                (Side::Native, Some(store)) => store
                    .floors
                    .iter()
                    .map(|f| Contender::Native(f.clone(), store.name.clone()))
                    .collect(),
                _ => {
                    let mut locks = Vec::with_capacity(t.clients.len());
                    for c in &t.clients {
                        let lock = c.session.lock(name.clone())?;
                        locks.push(Contender::Dlock(lock, register.clone()));
                    }
                    locks
                }
            })
        };
    if native.is_some() {
        // With a register of its own: the safety verdict is the counted
        // turns'.
        let (warm_up, register) = (length.min(WARM_UP), Arc::new(FencedRegister::new()));
        let hidden = ProgressBar::hidden();
        for side in [Side::Native, Side::Dlock] {
            let contenders = contenders(side, &register)?;
            Tally::default()
                .run(t, contenders, warm_up, &hidden)
                .await?;
        }
    }
    let (takes_before, waits_before) = t.counters();
    let (mut dlock, mut theirs) = (Tally::default(), Tally::default());
    for &side in order {
        let tally = match side {
            Side::Dlock => &mut dlock,
            Side::Native => &mut theirs,
        };
        tally
            .run(t, contenders(side, &register)?, length, bar)
            .await?;
    }
    let (takes_after, waits_after) = t.counters();
    let mut hot = contention(t, &dlock);
    let per_grant = |n: u64| n as f64 / hot.grants.max(1) as f64;
    hot.take_attempts_per_grant = Some(per_grant(takes_after - takes_before));
    hot.waits_per_grant = Some(per_grant(waits_after - waits_before));
    Ok(HotLockPhase {
        dlock: hot,
        safety: dlock.safety(&register),
        native: native.map(|store| NativeReport {
            lock: store.lock,
            hot_lock: contention(t, &theirs),
            dlock_handoffs_x_native: None,
        }),
    })
}

/// The store's own lock under the same contention as dlock's hot lock.
struct NativeSide {
    /// Every client's floor, which takes it.
    floors: Vec<Arc<dyn Floor>>,
    /// Which lock, for the report (`"pg_advisory_lock"`).
    lock: String,
    /// The name it is taken under.
    name: LockName,
}

/// The store's own lock, if every client's floor has one.
fn native_lock_of(t: &Target) -> Result<Option<NativeSide>, Failure> {
    let floors: Option<Vec<Arc<dyn Floor>>> = t.clients.iter().map(|c| c.floor.clone()).collect();
    let Some(floors) = floors else {
        return Ok(None);
    };
    let Some(lock) = floors
        .first()
        .and_then(|f| f.native())
        .map(|n| n.name().to_owned())
    else {
        return Ok(None);
    };
    let name = t.name("native")?;
    Ok(Some(NativeSide { floors, lock, name }))
}

/// One side's turns of a contended phase, added up. What counts is what
/// happened within a turn: grants up to its end, handoffs between them (a
/// grant after the other side's turn is no handoff); the safety check
/// (phase 5) runs over every event of the turns together, and the fenced
/// register spans them all.
#[derive(Default)]
struct Tally {
    /// The turns' length.
    seconds: f64,
    /// Release→grant of every handoff.
    handoffs: Vec<Duration>,
    /// Grants per client, over all turns.
    grants: Vec<u64>,
    /// Per client, over all turns: the errors.
    outcomes: Vec<Outcome>,
    /// Every turn's events.
    history: History,
}

impl Tally {
    /// Runs one turn: `contenders` loop on their lock for `length`.
    async fn run(
        &mut self,
        t: &Target,
        contenders: Vec<Contender>,
        length: Duration,
        bar: &ProgressBar,
    ) -> Result<(), Failure> {
        let history = Arc::new(History::new());
        let start = Instant::now();
        let deadline = start + length;
        let mut tasks = JoinSet::new();
        for (i, contender) in contenders.into_iter().enumerate() {
            tasks.spawn(hot_client(i, contender, deadline, history.clone()));
        }
        let outcomes = join(t, tasks, start, deadline, bar).await?;
        self.add(&history, outcomes, length, deadline);
        Ok(())
    }

    /// Adds one turn's `history` and `outcomes`: `length` long, counted
    /// until `deadline`.
    fn add(
        &mut self,
        history: &History,
        outcomes: Vec<Outcome>,
        length: Duration,
        deadline: Instant,
    ) {
        self.seconds += length.as_secs_f64();
        let events = history.events();
        let counted: Vec<Event> = events
            .iter()
            .filter(|e| e.at <= deadline)
            .cloned()
            .collect();
        self.handoffs.extend(stats::handoffs(&counted));
        self.grants.resize(self.grants.len().max(outcomes.len()), 0);
        for e in &counted {
            if (e.op, e.phase) == (Op::Acquire, Phase::Ok)
                && let Some(n) = self.grants.get_mut(e.client)
            {
                *n += 1;
            }
        }
        for event in events {
            self.history.push(event);
        }
        if self.outcomes.is_empty() {
            self.outcomes = outcomes;
            return;
        }
        for (sum, o) in self.outcomes.iter_mut().zip(outcomes) {
            sum.errors += o.errors;
            if sum.first_error.is_none() {
                sum.first_error = o.first_error;
            }
        }
    }

    /// The safety verdict (phase 5): the register's refusals and the
    /// history check (overlapping holds, grant order, reused tokens) over
    /// every turn.
    fn safety(&self, register: &FencedRegister) -> Safety {
        let mut problems = Vec::new();
        if let Err(refused) = register.check() {
            problems.push(refused);
        }
        let holds_checked = match self.history.check() {
            Ok(summary) => summary.holds,
            Err(violation) => {
                problems.push(violation.to_string());
                self.history.intervals().len()
            }
        };
        Safety {
            verdict: if problems.is_empty() {
                "ok".to_owned()
            } else {
                problems.join("; ")
            },
            register_accepted: register.accepted(),
            register_rejections: register.rejections(),
            holds_checked,
        }
    }
}

/// The contended-phase figures of one side's turns.
fn contention(t: &Target, tally: &Tally) -> HotLock {
    let mut release_to_grant = stats::histogram();
    let handoffs = &tally.handoffs;
    for d in handoffs {
        stats::record(&mut release_to_grant, *d);
    }
    let seconds = tally.seconds;
    let per_client = tally.grants.clone();
    let grants: u64 = per_client.iter().sum();
    let (errors, first_error) = errors(&tally.outcomes);
    HotLock {
        clients: t.clients(),
        seconds,
        grants,
        grants_per_s: grants as f64 / seconds,
        handoffs: handoffs.len() as u64,
        handoffs_per_s: handoffs.len() as f64 / seconds,
        release_to_grant: Latency::of(&release_to_grant),
        min: per_client.iter().copied().min().unwrap_or(0),
        max: per_client.iter().copied().max().unwrap_or(0),
        jain: stats::jain(&per_client),
        per_client,
        take_attempts_per_grant: None,
        waits_per_grant: None,
        errors,
        first_error,
    }
}

/// How one client of a hot-lock phase takes the lock.
enum Contender {
    /// Through dlock, writing the fenced register while it holds.
    Dlock(Lock, Arc<FencedRegister>),
    /// Through the store's own lock on this floor, under this name.
    Native(Arc<dyn Floor>, LockName),
}

/// A lock one [`Contender`] holds.
enum Held {
    /// dlock's guard.
    Dlock(LockGuard),
    /// The store's own.
    Native(Box<dyn NativeGuard>),
}

impl Contender {
    /// Takes the lock, giving up at `deadline` where the lock allows it.
    async fn acquire(&self, deadline: Instant) -> Result<Held, Error> {
        match self {
            Self::Dlock(lock, _) => {
                let left = deadline.saturating_duration_since(Instant::now());
                lock.acquire_timeout(left).await.map(Held::Dlock)
            }
            Self::Native(floor, name) => match floor.native() {
                Some(native) => native.lock(name).await.map(Held::Native),
                None => Err(Error::Config(format!("{floor:?} has no native lock"))),
            },
        }
    }

    /// What the holder does while it holds `held` as client `i`; returns the
    /// fencing token, if the lock has one.
    fn hold(&self, i: usize, held: &Held) -> Option<FencingToken> {
        match (self, held) {
            (Self::Dlock(_, register), Held::Dlock(guard)) => {
                register.write(i, guard.token());
                Some(guard.token())
            }
            _ => None,
        }
    }
}

impl Held {
    /// Gives the lock back.
    async fn release(self) -> Result<(), Error> {
        match self {
            Self::Dlock(guard) => guard.release().await,
            Self::Native(guard) => guard.release().await,
        }
    }
}

/// One hot-lock client: `i` is its number in the history.
async fn hot_client(
    i: usize,
    contender: Contender,
    deadline: Instant,
    history: Arc<History>,
) -> Outcome {
    let mut out = Outcome::new(i);
    while Instant::now() < deadline {
        history.record(i, Op::Acquire, Phase::Invoke, None);
        match contender.acquire(deadline).await {
            Ok(held) => {
                let token = contender.hold(i, &held);
                history.record(i, Op::Acquire, Phase::Ok, token);
                out.done += 1;
                history.record(i, Op::Release, Phase::Invoke, None);
                if let Err(e) = held.release().await {
                    history.record(i, Op::Release, Phase::Fail, None);
                    out.failed(&e).await;
                }
            }
            // The turn's end; a take cut off by it reads as "the store was
            // not answering", so a timeout's cause says nothing here.
            Err(Error::Timeout { .. }) => {
                history.record(i, Op::Acquire, Phase::Fail, None);
                break;
            }
            Err(e) => {
                history.record(i, Op::Acquire, Phase::Unknown, None);
                out.failed(&e).await;
            }
        }
    }
    out
}

/// Phase 4: every client loops acquire+release on its own lock for
/// `duration`. The bar counts milliseconds.
pub(crate) async fn independent(
    t: &Target,
    duration: Duration,
    bar: &ProgressBar,
) -> Result<Independent, Failure> {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = JoinSet::new();
    for (i, c) in t.clients.iter().enumerate() {
        let lock = c.session.lock(t.name(&format!("free/{i}"))?)?;
        tasks.spawn(async move {
            let mut out = Outcome::new(i);
            while Instant::now() < deadline {
                match cycle(&lock).await {
                    Ok(()) => out.done += 1,
                    Err(e) => out.failed(&e).await,
                }
            }
            out
        });
    }
    let outcomes = join(t, tasks, start, deadline, bar).await?;
    let seconds = start.elapsed().as_secs_f64();
    let acquisitions = outcomes.iter().map(|o| o.done).sum();
    let (errors, first_error) = errors(&outcomes);
    Ok(Independent {
        clients: t.clients(),
        seconds,
        acquisitions,
        per_s: acquisitions as f64 / seconds,
        errors,
        first_error,
    })
}

/// What one client of a contended phase did.
struct Outcome {
    /// The client's number.
    client: usize,
    /// Successful acquisitions.
    done: u64,
    /// Failed operations.
    errors: u64,
    /// The first failure.
    first_error: Option<String>,
}

impl Outcome {
    /// Nothing done yet by client `client`.
    fn new(client: usize) -> Self {
        Self {
            client,
            done: 0,
            errors: 0,
            first_error: None,
        }
    }

    /// Counts `e` and pauses briefly.
    async fn failed(&mut self, e: &Error) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| e.to_string());
        sleep(ERROR_PAUSE).await;
    }
}

/// Total errors and the first one, over all clients.
fn errors(outcomes: &[Outcome]) -> (u64, Option<String>) {
    let total = outcomes.iter().map(|o| o.errors).sum();
    let first = outcomes.iter().find_map(|o| o.first_error.clone());
    (total, first)
}

/// Waits for a contended phase's clients while moving the bar; fails if they
/// are still busy [`OVERRUN`] after `deadline`. Outcomes in client order.
async fn join(
    t: &Target,
    mut tasks: JoinSet<Outcome>,
    start: Instant,
    deadline: Instant,
    bar: &ProgressBar,
) -> Result<Vec<Outcome>, Failure> {
    let mut outcomes = Vec::with_capacity(tasks.len());
    let mut tick = tokio::time::interval(TICK);
    let total = deadline.saturating_duration_since(start);
    // A phase of several turns moves one bar on from where it stands.
    let base = bar.position();
    loop {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                None => break,
                Some(Ok(outcome)) => outcomes.push(outcome),
                Some(Err(e)) => {
                    return Err(Failure::new(
                        FAILURE,
                        format!("{}: a benchmark client failed: {e}", t.label),
                    ));
                }
            },
            _ = tick.tick() => {
                bar.set_position(base + millis(start.elapsed().min(total)));
                if Instant::now() > deadline + OVERRUN {
                    tasks.abort_all();
                    return Err(Failure::new(
                        UNAVAILABLE,
                        format!(
                            "{} ({}): clients still busy {} after the phase ended; is the backend stuck?",
                            t.label,
                            t.url,
                            humantime::format_duration(OVERRUN)
                        ),
                    ));
                }
            }
        }
    }
    bar.set_position(base + millis(total));
    outcomes.sort_by_key(|o| o.client);
    Ok(outcomes)
}

/// A duration in whole milliseconds (for progress bars).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The first client of `t` (there is always one).
fn first_client(t: &Target) -> Result<&Client, Failure> {
    t.clients
        .first()
        .ok_or_else(|| Failure::new(FAILURE, format!("{}: no clients", t.label)))
}

/// Runs one operation of the latency phases within [`OP_TIMEOUT`]; returns
/// how long it took.
async fn timed(
    t: &Target,
    what: &str,
    op: impl Future<Output = Result<(), Error>>,
) -> Result<Duration, Failure> {
    let measured = async {
        let start = Instant::now();
        op.await?;
        Ok(start.elapsed())
    };
    within(&format!("{} ({})", t.label, t.url), what, measured).await
}

/// Runs `op` within [`OP_TIMEOUT`]; a failure names `who` and `what`.
async fn within<T>(
    who: &str,
    what: &str,
    op: impl Future<Output = Result<T, Error>>,
) -> Result<T, Failure> {
    match timeout(OP_TIMEOUT, op).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => {
            let code = match e {
                // Nobody else uses the run's names: a free lock that cannot be
                // had within the limit means the store is not answering.
                Error::Timeout { .. } => UNAVAILABLE,
                Error::Lost { .. } => FAILURE,
                _ => code_for(&e),
            };
            Err(Failure::new(code, format!("{who}: {what}: {e}")))
        }
        Err(_) => Err(Failure::new(
            UNAVAILABLE,
            format!(
                "{who}: {what}: no answer within {}",
                humantime::format_duration(OP_TIMEOUT)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Client `client` takes `token` at `at` and releases 1 ms later.
    fn hold(history: &History, client: usize, token: u64, at: Instant) {
        let event = |op, phase, token, at| Event {
            client,
            op,
            phase,
            token,
            at,
        };
        let token = Some(FencingToken::new(token));
        history.push(event(Op::Acquire, Phase::Invoke, None, at));
        history.push(event(Op::Acquire, Phase::Ok, token, at));
        let released = at + Duration::from_millis(1);
        history.push(event(Op::Release, Phase::Invoke, None, released));
    }

    fn outcomes() -> Vec<Outcome> {
        (0..2).map(Outcome::new).collect()
    }

    const TURN: Duration = Duration::from_millis(500);

    /// A tally of `turns`, each [`TURN`] long and counted to its end.
    fn tally_of(turns: &[&History]) -> Tally {
        let mut tally = Tally::default();
        for turn in turns {
            tally.add(
                turn,
                outcomes(),
                TURN,
                Instant::now() + Duration::from_secs(60),
            );
        }
        tally
    }

    #[test]
    fn turns_add_up_with_no_handoff_across_the_other_sides_turn() {
        let t0 = Instant::now();
        let (first, second) = (History::new(), History::new());
        hold(&first, 0, 1, t0);
        hold(&first, 1, 2, t0 + Duration::from_millis(2));
        // The other side's turn ran in between; then client 0 again.
        hold(&second, 0, 3, t0 + Duration::from_secs(1));
        let tally = tally_of(&[&first, &second]);
        assert_eq!(
            tally.handoffs,
            [Duration::from_millis(1)],
            "only the handoff within the first turn counts"
        );
        assert_eq!(tally.grants, [2, 1]);
        assert_eq!(tally.seconds, 1.0);
        let safety = tally.safety(&FencedRegister::new());
        assert!(safety.ok(), "{}", safety.verdict);
        assert_eq!(safety.holds_checked, 3);
    }

    #[test]
    fn a_grant_after_the_turns_end_does_not_count() {
        let t0 = Instant::now();
        let turn = History::new();
        hold(&turn, 0, 1, t0);
        // A native wait cannot be cut short: client 1's grant comes after
        // the end, as the turn drains.
        hold(&turn, 1, 2, t0 + Duration::from_millis(3));
        let mut tally = Tally::default();
        tally.add(&turn, outcomes(), TURN, t0 + Duration::from_millis(2));
        assert_eq!(tally.grants, [1, 0]);
        assert!(tally.handoffs.is_empty(), "{:?}", tally.handoffs);
        assert_eq!(
            tally.history.intervals().len(),
            2,
            "the safety check still sees every hold"
        );
    }

    #[test]
    fn each_side_gets_as_many_turns_at_the_same_mean_place() {
        let places = |side| {
            let at: Vec<usize> = (0..ORDER.len()).filter(|&k| ORDER[k] == side).collect();
            (at.len(), at.iter().sum::<usize>())
        };
        assert_eq!(places(Side::Dlock), places(Side::Native));
        assert_eq!(places(Side::Dlock).0, 4);
    }

    #[test]
    fn the_safety_check_spans_the_turns() {
        let t0 = Instant::now();
        let (first, second) = (History::new(), History::new());
        hold(&first, 0, 5, t0);
        // A later turn granted an older token: the grant order is broken.
        hold(&second, 1, 4, t0 + Duration::from_secs(1));
        let tally = tally_of(&[&first, &second]);
        let safety = tally.safety(&FencedRegister::new());
        assert!(!safety.ok(), "a token going back across turns passed");
    }
}
