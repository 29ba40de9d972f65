//! `dlock torture`: fenced acquisitions on one hot lock under a nemesis
//! (DESIGN.md §5, "soak"; issue 11 item 5).
//!
//! For every backend and fault profile: `--clients` clients, each in a
//! simulated process of its own (its own runtime, which the client-pause
//! profile stops as a whole) and behind a link of its own (a TCP proxy per
//! store node; the memory backend's in-process link), acquire one lock over
//! and over, write a fenced register while they believe they hold it, and
//! release. A nemesis task meanwhile cycles the profile's faults over the
//! clients (the current holder half of the time) or the servers. Every
//! operation goes into one history on one monotonic clock, which is audited
//! afterwards: overlapping holds (S1, a hold ends at its release, its lost
//! signal or its local deadline, whichever is first), tokens out of grant
//! order or reused (S2), stale writes the register refused (fencing at work),
//! lost signals, and how long the lock stayed unavailable after a holder lost
//! it.

mod nemesis;
mod report;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dlock_conformance::checker::{Audit, Event, FencedRegister, History, Op, Phase};
use dlock_conformance::process::Process;
use dlock_conformance::servers::{MemoryServers, Servers, ServicesCommand};
use dlock_conformance::wire::{Link, MemoryLink, ProxyLink};
use dlock_core::memory::MemoryBackend;
use dlock_core::url::StoreUrl;
use dlocks::{Error, LockGuard, LockName, LostReason, Session, SessionOptions};
use tokio::time::{Instant, sleep, timeout};

pub(crate) use self::nemesis::Profile;
use self::report::{Row, Table};
use crate::cli::TortureArgs;
use crate::exit::{AUTH, FAILURE, Failure, USAGE};

/// How long a client keeps trying to open its first session while the
/// deployment is unavailable (a ZooKeeper ensemble re-electing after the
/// previous profile's restart takes seconds on a loaded machine).
const OPEN_BOUND: Duration = Duration::from_secs(60);

/// Runs `dlock torture`; returns the exit status (70 if a check failed that
/// the profile does not excuse by design).
pub(crate) async fn torture(urls: &[String], args: TortureArgs) -> Result<u8, Failure> {
    let urls = urls.to_vec();
    tokio::spawn(async move { soak(&urls, args).await })
        .await
        .map_err(|e| Failure::new(FAILURE, format!("the torture task failed: {e}")))?
}

async fn soak(urls: &[String], args: TortureArgs) -> Result<u8, Failure> {
    if !args.servers.is_empty() && args.servers.len() != urls.len() {
        return Err(Failure::usage(format!(
            "--servers is given {} times for {} --url: give it once per --url (`-` for none)",
            args.servers.len(),
            urls.len()
        )));
    }
    let profiles = Profile::parse_list(&args.profiles).map_err(Failure::usage)?;
    let mut table = Table::new(
        args.clone(),
        crate::bench::command_line(std::env::args_os()),
    );
    for (i, url) in urls.iter().enumerate() {
        let deployment = Deployment::new(url, args.servers.get(i), &args.services_command)?;
        for &profile in &profiles {
            let shown = dlock_core::url::redact(url);
            let row = match profile.applies(&deployment) {
                Err(why) => Row::skipped(&shown, profile, why),
                Ok(()) => {
                    if !args.quiet {
                        eprintln!("dlock torture: {shown}: {} ...", profile.name());
                    }
                    match run_profile(&deployment, profile, &args, i).await {
                        Ok(row) => row,
                        // (the deployment stayed unavailable: the next
                        // profile may still run, and the report says which)
                        Err(e) if !matches!(e.code, USAGE | AUTH) => {
                            Row::not_started(&shown, profile, deployment.through_links(e.message))
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            if !args.quiet {
                eprintln!("{}", row.summary());
            }
            if row.verdict(args.acquisitions).is_err() {
                // (to tell a stalled store from a stalled client: the servers'
                // state and logs, and this process's open files)
                if let Some(said) = describe_servers(&deployment).await {
                    eprintln!("  {}: the servers now:\n{said}", profile.name());
                }
                if let Some(open) = open_files() {
                    eprintln!("  {}: this process has {open}", profile.name());
                }
            }
            table.push(row);
        }
    }
    table.write(&args.out).map_err(|e| {
        Failure::new(
            FAILURE,
            format!("cannot write to {}: {e}", args.out.display()),
        )
    })?;
    if args.json {
        println!("{}", table.json());
    } else {
        print!("{}", table.markdown());
    }
    Ok(if table.failed() { FAILURE } else { 0 })
}

/// This process's open files and their limit, where `/proc` tells.
fn open_files() -> Option<String> {
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count();
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let limit = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .to_owned();
    Some(format!("{open} open files (soft limit {limit})"))
}

/// What the supervisor says of the deployment's servers, if it can.
async fn describe_servers(deployment: &Deployment) -> Option<String> {
    deployment.servers()?.describe().await
}

/// One store deployment under test: how to reach it through links, and how
/// to control its servers.
pub(crate) struct Deployment {
    url: String,
    /// The named in-process instance, for `memory://`.
    memory: Option<MemoryBackend>,
    endpoints: Vec<String>,
    servers: Option<Arc<dyn Servers>>,
}

impl Deployment {
    fn new(url: &str, servers: Option<&String>, command: &str) -> Result<Self, Failure> {
        let memory = if url.starts_with("memory://") {
            Some(MemoryBackend::connect(url)?)
        } else {
            None
        };
        let endpoints = if memory.is_some() || url.starts_with("sqlite:") {
            Vec::new()
        } else {
            let url = StoreUrl::parse(url)?;
            url.hosts().iter().map(ToString::to_string).collect()
        };
        let servers: Option<Arc<dyn Servers>> = match (&memory, servers.map(String::as_str)) {
            (Some(m), _) => Some(Arc::new(MemoryServers(m.clone()))),
            (None, None | Some("-")) => None,
            (None, Some(names)) => {
                let (names, group) = names
                    .split_once('@')
                    .map_or((names, None), |(n, g)| (n, Some(g)));
                let mut control = ServicesCommand::new(command, names.split(','));
                if let Some(group) = group {
                    control = control.group(group);
                }
                Some(Arc::new(control))
            }
        };
        if servers
            .as_ref()
            .is_some_and(|s| s.nodes() != endpoints.len())
            && memory.is_none()
        {
            return Err(Failure::new(
                USAGE,
                format!(
                    "--servers names {} server(s) for a URL with {} host(s)",
                    servers.as_ref().map_or(0, |s| s.nodes()),
                    endpoints.len()
                ),
            ));
        }
        Ok(Self {
            url: url.to_owned(),
            memory,
            endpoints,
            servers,
        })
    }

    /// `message` about a client's store, saying which store the address in
    /// it stands for (a client reaches it through a fault proxy of its own).
    fn through_links(&self, message: String) -> String {
        if self.endpoints.is_empty() {
            message
        } else {
            format!(
                "{message} (a fault proxy of this run, in front of {})",
                self.endpoints.join(",")
            )
        }
    }

    /// Whether clients can be put behind links.
    pub(crate) fn has_links(&self) -> bool {
        self.memory.is_some() || !self.endpoints.is_empty()
    }

    pub(crate) fn servers(&self) -> Option<&Arc<dyn Servers>> {
        self.servers.as_ref()
    }

    pub(crate) fn is_memory(&self) -> bool {
        self.memory.is_some()
    }

    /// Whether the URL's hosts are seeds of a sharded store (a Redis
    /// Cluster), not a quorum.
    pub(crate) fn is_sharded(&self) -> bool {
        self.url
            .split_once("://")
            .is_some_and(|(s, _)| s.ends_with("+cluster"))
    }

    /// A new link for one client.
    async fn link(&self) -> Result<Arc<dyn Link>, Failure> {
        if self.memory.is_some() {
            return Ok(Arc::new(MemoryLink(dlock_core::memory::Link::new())));
        }
        ProxyLink::start(&self.endpoints)
            .await
            .map(|l| Arc::new(l) as Arc<dyn Link>)
            .map_err(|e| Failure::new(FAILURE, format!("cannot start a fault proxy: {e}")))
    }
}

/// What the clients of one profile share.
pub(crate) struct Shared {
    pub(crate) history: History,
    pub(crate) register: FencedRegister,
    pub(crate) acquisitions: AtomicU64,
    /// Acquisitions to reach.
    pub(crate) target: u64,
    pub(crate) errors: AtomicU64,
    pub(crate) sessions_replaced: AtomicU64,
    pub(crate) stop: AtomicBool,
    /// The client holding the lock now, as far as the clients know.
    pub(crate) holder: AtomicU64,
    pub(crate) first_error: std::sync::Mutex<Option<String>>,
    /// The first server command (pause, resume, kill, start) that failed.
    pub(crate) first_server_error: std::sync::Mutex<Option<String>>,
}

/// One simulated client process and its link.
pub(crate) struct Client {
    pub(crate) process: Process,
    pub(crate) link: Arc<dyn Link>,
}

async fn run_profile(
    deployment: &Deployment,
    profile: Profile,
    args: &TortureArgs,
    index: usize,
) -> Result<Row, Failure> {
    let name = LockName::new(format!(
        "dlock-torture/{:08x}/{index}/{}",
        rand::random::<u32>(),
        profile.name()
    ))?;
    let shared = Arc::new(Shared {
        history: History::new(),
        register: FencedRegister::new(),
        acquisitions: AtomicU64::new(0),
        target: args.acquisitions,
        errors: AtomicU64::new(0),
        sessions_replaced: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        holder: AtomicU64::new(u64::MAX),
        first_error: std::sync::Mutex::new(None),
        first_server_error: std::sync::Mutex::new(None),
    });
    let mut clients = Vec::new();
    let mut tasks = Vec::new();
    for c in 0..args.clients as usize {
        let process = Process::start()
            .map_err(|e| Failure::new(FAILURE, format!("cannot start a client process: {e}")))?;
        let link = deployment.link().await?;
        let reopen = ReOpen {
            url: deployment.url.clone(),
            memory: deployment.memory.clone(),
            link: link.clone(),
            ttl: args.ttl,
        };
        let session = reopen.first(&process, OPEN_BOUND.min(args.max_time))?;
        let plan = Plan {
            name: name.clone(),
            ttl: args.ttl,
            long_every: args.long_holds,
        };
        let task = process.spawn(client_loop(c, session, reopen, plan, shared.clone()));
        tasks.push(task);
        clients.push(Client { process, link });
    }
    let started = Instant::now();
    let nemesis = nemesis::Nemesis::new(profile, deployment, &clients, shared.clone(), args.ttl);
    let faults = nemesis.run(args.max_time, args.min_faults).await;
    let servers_left_down = nemesis.restore().await.err();
    shared.stop.store(true, Ordering::SeqCst);
    for client in &clients {
        client.link.heal();
        client.process.resume();
    }
    for task in tasks {
        let _ = timeout(args.ttl * 10 + Duration::from_secs(10), task).await;
    }
    let elapsed = started.elapsed();
    drop(clients);
    let intervals = shared.history.intervals();
    let audit = Audit::of(&intervals);
    let unavailable = unavailability(&shared.history.events());
    Ok(Row {
        backend: dlock_core::url::redact(&deployment.url),
        profile,
        skipped: None,
        acquisitions: shared.acquisitions.load(Ordering::Relaxed),
        seconds: elapsed.as_secs_f64(),
        stale_writes_refused: shared.register.rejections() as u64,
        writes_accepted: shared.register.accepted() as u64,
        audit,
        lost_signals: intervals_lost(&shared.history.events()),
        errors: shared.errors.load(Ordering::Relaxed),
        sessions_replaced: shared.sessions_replaced.load(Ordering::Relaxed),
        faults,
        max_unavailable: unavailable.iter().copied().max().unwrap_or_default(),
        p50_unavailable: median(unavailable),
        first_error: shared.first_error.lock().unwrap().clone(),
        first_server_error: shared.first_server_error.lock().unwrap().clone(),
        servers_left_down,
        not_started: None,
    })
}

/// `url` with its hosts replaced by their proxies `via` (in host order). A
/// Redis Cluster client connects to the nodes the cluster announces, not to
/// the URL's hosts: its `address_map` sends each through its proxy.
fn proxied(url: &str, via: &[std::net::SocketAddr]) -> Result<StoreUrl, Error> {
    let url = StoreUrl::parse(url)?;
    let mut out = url.with_hosts(via)?;
    if url.scheme().ends_with("+cluster") {
        let map = dlock_conformance::wire::proxy_map(url.hosts(), via);
        out = out.with_option("address_map", &map)?;
    }
    Ok(out)
}

/// What every client of a profile does.
struct Plan {
    name: LockName,
    ttl: Duration,
    /// One hold in this many is long (0: none).
    long_every: u32,
}

/// How to open a replacement session for a client whose session ended.
struct ReOpen {
    url: String,
    memory: Option<MemoryBackend>,
    link: Arc<dyn Link>,
    ttl: Duration,
}

impl ReOpen {
    async fn open(&self) -> Result<Session, Error> {
        let options = SessionOptions::new().ttl(self.ttl).label("dlock-torture");
        let backend: Arc<dyn dlocks::Backend> = match (
            &self.memory,
            self.link.as_any().downcast_ref::<MemoryLink>(),
        ) {
            (Some(m), Some(l)) => Arc::new(m.with_link(l.0.clone())),
            _ => match self.link.addrs() {
                Some(addrs) if !addrs.is_empty() => {
                    dlocks::connect(proxied(&self.url, &addrs)?.expose()).await?
                }
                _ => dlocks::connect(&self.url).await?,
            },
        };
        backend.session(options).await
    }

    /// A client's first session, opened inside `process`.
    ///
    /// The previous profile may have left the deployment recovering (an
    /// ensemble electing a leader after a restart), so an open that may
    /// succeed later is retried for up to `bound` ([`OPEN_BOUND`], or the
    /// profile's time limit if shorter); a configuration
    /// error is not.
    fn first(&self, process: &Process, bound: Duration) -> Result<Session, Failure> {
        process.enter(async {
            let deadline = Instant::now() + bound;
            let mut backoff = Duration::from_millis(50);
            loop {
                match self.open().await {
                    Err(e) if e.is_retryable() && Instant::now() + backoff < deadline => {
                        sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    result => return Ok::<_, Failure>(result?),
                }
            }
        })
    }
}

/// One client: acquire, write the register while holding (checking
/// `is_held()` before each write, as a careful application does), release;
/// over and over until the profile has its acquisitions.
async fn client_loop(
    c: usize,
    mut session: Session,
    reopen: ReOpen,
    plan: Plan,
    shared: Arc<Shared>,
) {
    let Plan {
        name,
        ttl,
        long_every,
    } = plan;
    let mut backoff = Duration::from_millis(10);
    while !shared.stop.load(Ordering::Relaxed) {
        let lock = match session.lock(&name) {
            Ok(lock) => lock,
            Err(e) => return note_error(&shared, &e),
        };
        shared.history.record(c, Op::Acquire, Phase::Invoke, None);
        match lock.acquire_timeout(ttl * 6).await {
            Ok(guard) => {
                backoff = Duration::from_millis(10);
                shared
                    .history
                    .record(c, Op::Acquire, Phase::Ok, Some(guard.token()));
                let granted = Instant::now();
                shared.acquisitions.fetch_add(1, Ordering::Relaxed);
                shared.holder.store(c as u64, Ordering::Relaxed);
                hold(c, guard, granted, &shared, ttl, long_every).await;
            }
            Err(Error::Timeout { .. }) => {
                shared.history.record(c, Op::Acquire, Phase::Fail, None);
            }
            Err(Error::SessionLost { .. }) => {
                shared.history.record(c, Op::Acquire, Phase::Fail, None);
                match reopen.open().await {
                    Ok(s) => {
                        session = s;
                        shared.sessions_replaced.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        note_error(&shared, &e);
                        sleep(backoff).await;
                        backoff = (backoff * 2).min(ttl);
                    }
                }
            }
            Err(e) => {
                shared.history.record(c, Op::Acquire, Phase::Fail, None);
                note_error(&shared, &e);
                sleep(backoff).await;
                backoff = (backoff * 2).min(ttl);
            }
        }
    }
}

/// Holds and writes the register, checking `is_held()` before each write as
/// a careful application does, then releases. Most holds write once; one in
/// `long_every` lasts TTL/4 .. TTL and writes every TTL/10, so that faults
/// hit holders that renew. A hold that ended early is recorded as lost at
/// its local deadline (or when the loss was known, if earlier), but never
/// before `granted`, when the grant was recorded: a grant whose validity ran
/// out before this task saw it (a late reply, a starved task) is an empty
/// hold, and a loss recorded before its grant would leave the grant's
/// interval open in the history, overlapping every later hold.
async fn hold(
    c: usize,
    guard: LockGuard,
    granted: Instant,
    shared: &Shared,
    ttl: Duration,
    long_every: u32,
) {
    let token = guard.token();
    let long = long_every > 0 && rand::random_ratio(1, long_every);
    let until = Instant::now()
        + if long {
            nemesis::between(ttl / 4, ttl)
        } else {
            Duration::ZERO
        };
    loop {
        if !guard.is_held() {
            break;
        }
        // Decided to write; a pause here makes the write stale.
        tokio::task::yield_now().await;
        shared.register.write(c, token);
        if Instant::now() >= until {
            break;
        }
        sleep(ttl / 10).await;
    }
    let lost = match guard.lost_reason() {
        Some(reason) => reason != LostReason::Released,
        None => !guard.is_held(),
    };
    if lost {
        shared.history.push(Event {
            client: c,
            op: Op::Lost,
            phase: Phase::Ok,
            token: Some(token),
            at: guard.deadline().min(Instant::now()).max(granted),
        });
    } else {
        shared.history.record(c, Op::Release, Phase::Invoke, None);
    }
    let _ = timeout(ttl * 2, guard.release()).await;
}

fn note_error(shared: &Shared, e: &Error) {
    shared.errors.fetch_add(1, Ordering::Relaxed);
    let mut first = shared.first_error.lock().unwrap();
    if first.is_none() {
        *first = Some(e.to_string());
    }
}

/// Holds that ended by loss rather than release.
fn intervals_lost(events: &[Event]) -> u64 {
    events
        .iter()
        .filter(|e| e.op == Op::Lost && e.phase == Phase::Ok)
        .count() as u64
}

/// For every loss: the time until the next grant to anyone.
fn unavailability(events: &[Event]) -> Vec<Duration> {
    let grants: Vec<Instant> = events
        .iter()
        .filter(|e| e.op == Op::Acquire && e.phase == Phase::Ok)
        .map(|e| e.at)
        .collect();
    events
        .iter()
        .filter(|e| e.op == Op::Lost && e.phase == Phase::Ok)
        .filter_map(|lost| {
            let next = grants.partition_point(|g| *g <= lost.at);
            grants.get(next).map(|g| *g - lost.at)
        })
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}
