//! `dlock run`: hold a lock while a command runs.
//!
//! Order of events: validate the name, catch signals, connect, open a session,
//! acquire (interruptible by a signal), spawn the command with `DLOCK_TOKEN`
//! and `DLOCK_NAME`, then wait for whichever comes first: the command's exit
//! (release, close, exit with its status) or the lock's loss (SIGTERM, SIGKILL
//! after the grace period, exit 76). Signals are forwarded to the command
//! meanwhile. With `--leader` the name is an election: the command runs in
//! a process group of its own, a loss stops that group (SIGKILL to what is
//! left once the command is gone) and dlock campaigns again (each
//! [`Run::hold`] is one term) instead of exiting 76.

use std::ffi::OsStr;
use std::future::Future;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use dlocks::{Backend, Error, Lock, LockGuard, LockName, Session, SessionOptions};
use nix::errno::Errno;
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::cli::RunArgs;
use crate::exit::{FAILURE, Failure, LOST, NOT_EXECUTABLE, NOT_FOUND, SIGNAL_BASE};
use crate::signals::{self, Signals};

/// The longest dlock waits for the release and for closing the session once
/// the command is over; the store frees the lock within one TTL regardless.
const FINISH_TIMEOUT: Duration = Duration::from_secs(5);

/// How `dlock run` ended, before it is turned into an exit status.
enum Outcome {
    /// The command exited on its own (or after a forwarded signal).
    Exited(ExitStatus),
    /// The lock was lost and the command was stopped; a signal dlock got
    /// meanwhile (forwarded to the command).
    Stopped { signalled: Option<Signal> },
}

/// Runs `dlock run`; returns the exit status.
pub(crate) async fn run(url: &str, args: RunArgs) -> Result<u8, Failure> {
    let name = LockName::new(&args.name)?;
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(Failure::usage("no command given"));
    };
    let mut signals = Signals::install()
        .map_err(|e| Failure::new(FAILURE, format!("cannot catch signals: {e}")))?;

    // Once, or with --leader until COMMAND ends on its own: each pass is
    // one term. The backend is kept across terms (drivers reconnect).
    let mut backend = None;
    loop {
        let began = Instant::now();
        let run = Run {
            url,
            name: &name,
            args: &args,
            program,
            program_args,
        };
        match run.hold(&mut backend, &mut signals).await? {
            Held::Done(code) => return Ok(code),
            Held::Lost if args.leader => {
                // A term lost at once (a TTL too short for the store, or
                // repeated forced releases) must not become a tight loop.
                let pause = args.ttl.saturating_sub(began.elapsed());
                eprintln!("dlock: campaigning to lead {name} again");
                if let Err(sig) = unless_signalled(&mut signals, sleep(pause)).await {
                    return Err(interrupted(sig, &format!("waiting to lead {name} again")));
                }
            }
            Held::Lost => return Ok(LOST),
        }
    }
}

/// How one hold of `dlock run` ended.
enum Held {
    /// Exit with this status.
    Done(u8),
    /// The lock was lost and COMMAND stopped.
    Lost,
}

/// What one hold of `dlock run` needs.
struct Run<'a> {
    url: &'a str,
    name: &'a LockName,
    args: &'a RunArgs,
    program: &'a OsStr,
    program_args: &'a [std::ffi::OsString],
}

impl Run<'_> {
    /// Waits for the lock, runs COMMAND under it and supervises it.
    async fn hold(
        &self,
        backend: &mut Option<Arc<dyn Backend>>,
        signals: &mut Signals,
    ) -> Result<Held, Failure> {
        let (url, name, args) = (self.url, self.name, self.args);
        let (session, guard) =
            match unless_signalled(signals, wait_for_lock(url, name, args, backend)).await {
                Ok(Ok(Some(held))) => held,
                Ok(Ok(None)) => {
                    let message = match args.wait {
                        Some(wait) if !args.no_wait => format!(
                            "lock {name} is still busy after {}",
                            humantime::format_duration(wait)
                        ),
                        _ => format!("lock {name} is busy"),
                    };
                    return Err(Failure::new(args.conflict_exit_code, message));
                }
                Ok(Err(e)) => return Err(e),
                Err(sig) => return Err(interrupted(sig, &format!("waiting for lock {name}"))),
            };
        let granted = Instant::now();
        tracing::debug!(lock = %name, token = %guard.token(), "acquired; starting the command");
        if args.leader {
            eprintln!("dlock: leading {name} in term {}", guard.token());
        }

        let mut command = Command::new(self.program);
        command
            .args(self.program_args)
            .env("DLOCK_TOKEN", guard.token().get().to_string())
            .env("DLOCK_NAME", name.as_str());
        if args.leader {
            // Its own process group, so that stopping a deposed leader's
            // command stops what it started too (`sh -c 'a; b'`).
            command.process_group(0);
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                finish(guard, &session, name).await;
                return Err(spawn_failure(self.program, &e));
            }
        };
        let group = args.leader.then(|| child.id()).flatten();

        let outcome = supervise(&mut child, &guard, signals, name, args.grace, group).await;
        if let Some(pgid) = group {
            // Whatever of the command outlived it (a child that ignored
            // SIGTERM, a daemon it left) must not act for this term any more.
            signals::send(pgid, Signal::SIGKILL, true);
        }
        match outcome {
            Ok(Outcome::Exited(status)) => {
                let code = status_code(status);
                if let Some(minimum) = args.hold_at_least {
                    // Held until then (renewed), unless lost or told to stop.
                    let until = sleep_until(granted + minimum);
                    tokio::select! {
                        () = until => {}
                        _ = guard.lost() => {}
                        _ = signals.recv() => {}
                    }
                }
                Ok(match finish(guard, &session, name).await {
                    // With --leader a lost term is stood down from, whoever
                    // noticed first.
                    Some(_) if args.leader => Held::Lost,
                    Some(lost) => {
                        eprintln!(
                            "dlock: lock {name} was lost before the command finished ({lost})"
                        );
                        Held::Done(LOST)
                    }
                    None => Held::Done(code),
                })
            }
            Ok(Outcome::Stopped { signalled }) => {
                finish(guard, &session, name).await;
                match signalled {
                    // Told to stop while stopping the command: stop, not
                    // campaign again.
                    Some(sig) if args.leader => Ok(Held::Done(signal_code(sig))),
                    _ => Ok(Held::Lost),
                }
            }
            Err(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                finish(guard, &session, name).await;
                Err(Failure::new(
                    FAILURE,
                    format!("waiting for the command failed: {e}"),
                ))
            }
        }
    }
}

/// Connects, opens a session and acquires as the flags say, riding out
/// network trouble within the wait budget: an unreachable store is retried
/// with backoff, and a session that ends while waiting (its lease expired
/// during a partition) is replaced by a new one. `None` when the lock is busy
/// (`--no-wait`) or `--wait` ran out; an error only when the budget is spent
/// on an unreachable store, or the error is permanent. `--no-wait` tries once.
async fn wait_for_lock(
    url: &str,
    name: &LockName,
    args: &RunArgs,
    backend: &mut Option<Arc<dyn Backend>>,
) -> Result<Option<(Session, LockGuard)>, Failure> {
    // None: try once; Some(None): no end; Some(Some(d)): until d (a wait
    // too long to count has no end).
    let deadline = (!args.no_wait).then(|| args.wait.and_then(|w| Instant::now().checked_add(w)));
    let mut backoff = Duration::from_millis(100);
    loop {
        let left = deadline.map(|d| d.map(|d| d.saturating_duration_since(Instant::now())));
        // Connecting and opening a session spend the same budget.
        let budget = match left {
            Some(Some(left)) => left,
            _ => Duration::MAX,
        };
        // Set when the store cannot grant within the budget (final, not retried).
        let mut not_ready = false;
        let attempt = async {
            let b = match backend.as_ref() {
                Some(b) => Arc::clone(b),
                None => {
                    let b = timeout(crate::CONNECT_TIMEOUT.min(budget), dlocks::connect(url))
                        .await
                        .map_err(|_| Error::unavailable("dlock", "no answer while connecting"))??;
                    let may_wait = if left.is_none() {
                        Duration::ZERO
                    } else {
                        budget
                    };
                    if let Err((e, last)) = ready(&*b, args.ttl, may_wait, args.no_wait, &|note| {
                        eprintln!("{note}")
                    })
                    .await
                    {
                        not_ready = last;
                        return Err(e);
                    }
                    *backend = Some(Arc::clone(&b));
                    b
                }
            };
            // (what is left of the budget after a wait for readiness)
            let budget = match deadline {
                Some(Some(d)) => d.saturating_duration_since(Instant::now()),
                _ => budget,
            };
            let options = SessionOptions::new().ttl(args.ttl).label("dlock");
            let session = timeout(budget, b.session(options))
                .await
                .map_err(|_| Error::unavailable("dlock", "no answer while opening a session"))??;
            let mut lock = session.lock(name)?;
            if let Some(why) = &args.why {
                lock = lock.why(why.as_str());
            }
            if let Some(limit) = args.hold_at_most {
                lock = lock.hold_at_most(limit);
            }
            let left = deadline.map(|d| d.map(|d| d.saturating_duration_since(Instant::now())));
            let result = acquire(&lock, left).await;
            Ok::<_, Error>((session, result))
        };
        let error = match attempt.await {
            Ok((session, Ok(Some(guard)))) => return Ok(Some((session, guard))),
            Ok((session, Ok(None))) => {
                close(&session).await;
                return Ok(None);
            }
            Ok((session, Err(e))) => {
                close(&session).await;
                e
            }
            Err(e) => e,
        };
        let transient =
            !not_ready && matches!(error, Error::Unavailable { .. } | Error::SessionLost { .. });
        let left = match deadline {
            None => Duration::ZERO,
            Some(None) => Duration::MAX,
            Some(Some(d)) => d.saturating_duration_since(Instant::now()),
        };
        if !transient || left.is_zero() {
            // The budget went on an unreachable store: say so (69), not "busy".
            return Err(error.into());
        }
        // The backend stays: drivers reconnect on their own.
        eprintln!("dlock: {error}; still waiting for lock {name}");
        sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Waits out a store that cannot grant yet (a Redis restart guard after
/// dlock first sees its nodes), saying so through `say`; an error naming the
/// wait if it is longer than `may_wait`. A `ttl` the backend cannot honour
/// is refused first (not after the wait). The flag with an error: whether
/// it is final (the TTL, a wait longer than the budget) rather than a
/// failure to ask, which the caller retries within its budget.
pub(crate) async fn ready(
    backend: &dyn Backend,
    ttl: Duration,
    may_wait: Duration,
    no_wait: bool,
    say: &(dyn Fn(&str) + Sync),
) -> Result<(), (Error, bool)> {
    if ttl > backend.max_ttl() {
        let refused = Error::InvalidTtl {
            ttl,
            min: backend.min_ttl(),
            max: backend.max_ttl(),
        };
        return Err((refused, true));
    }
    let wait = backend.ready_in().await.map_err(|e| (e, false))?;
    if wait.is_zero() {
        return Ok(());
    }
    let why = format!(
        "its nodes refuse grants for {} more: the restart guard (a node dlock has not seen \
         since its start grants only after max_ttl = {}; a smaller ?max_ttl= shortens it)",
        humantime::format_duration(round_up(wait)),
        humantime::format_duration(backend.max_ttl()),
    );
    if wait > may_wait {
        let flag = if no_wait { "--no-wait" } else { "--wait" };
        let refused = Error::unavailable(backend.scheme(), format!("{why}; not waiting ({flag})"));
        return Err((refused, true));
    }
    say(&format!("dlock: {}: waiting: {why}", backend.scheme()));
    backend
        .wait_ready(wait + Duration::from_secs(1))
        .await
        .map_err(|e| (e, false))
}

/// `d` rounded up to whole seconds (for messages).
fn round_up(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

/// One acquire: `left` is `None` for `--no-wait`, `Some(None)` to wait
/// forever, `Some(Some(d))` to wait at most `d`. `None` when busy or timed out.
async fn acquire(lock: &Lock, left: Option<Option<Duration>>) -> Result<Option<LockGuard>, Error> {
    let result = match left {
        None => lock.try_acquire().await,
        Some(Some(wait)) => lock.acquire_timeout(wait).await.map(Some),
        Some(None) => lock.acquire().await.map(Some),
    };
    match result {
        // The store failing is not the lock being busy.
        Err(Error::Timeout {
            cause: Some(cause), ..
        }) => Err(*cause),
        Err(Error::Timeout { .. }) => Ok(None),
        other => other,
    }
}

/// Waits for the command while holding the lock: forwards signals (to its
/// process group `group`, under `--leader`), and stops the command if the
/// lock is lost.
async fn supervise(
    child: &mut Child,
    guard: &LockGuard,
    signals: &mut Signals,
    name: &LockName,
    grace: Duration,
    group: Option<u32>,
) -> io::Result<Outcome> {
    let lost = guard.lost();
    tokio::pin!(lost);
    let reason = loop {
        tokio::select! {
            biased;
            sig = signals.recv() => forward(child, sig, group),
            status = child.wait() => return Ok(Outcome::Exited(status?)),
            reason = &mut lost => break reason,
        }
    };
    eprintln!("dlock: lock {name} lost ({reason}); stopping the command");
    forward(child, Signal::SIGTERM, group);
    let kill_at = sleep(grace);
    tokio::pin!(kill_at);
    let (mut killed, mut signalled) = (false, None);
    loop {
        tokio::select! {
            biased;
            sig = signals.recv() => {
                signalled = Some(sig);
                forward(child, sig, group);
            }
            status = child.wait() => {
                let status = status?;
                tracing::debug!(%status, "the command stopped after the loss");
                return Ok(Outcome::Stopped { signalled });
            }
            () = &mut kill_at, if !killed => {
                eprintln!(
                    "dlock: the command is still running {} after SIGTERM; killing it",
                    humantime::format_duration(grace)
                );
                match group {
                    Some(pgid) => signals::send(pgid, Signal::SIGKILL, true),
                    None => child.start_kill()?,
                }
                killed = true;
            }
        }
    }
}

/// Sends `sig` to the command (to its process group `group`, if it has its
/// own) if it has not been reaped yet.
fn forward(child: &Child, sig: Signal, group: Option<u32>) {
    if let Some(pid) = child.id() {
        tracing::debug!(pid, signal = %sig, "forwarding a signal to the command");
        signals::send(group.unwrap_or(pid), sig, group.is_some());
    }
}

/// Releases the lock and closes the session, each bounded by
/// [`FINISH_TIMEOUT`]. Returns the reason if the hold had been lost before
/// the release (also when the store says it no longer had it); other release
/// problems (backend unreachable) are reported as warnings.
async fn finish(
    guard: LockGuard,
    session: &Session,
    name: &LockName,
) -> Option<dlocks::LostReason> {
    let lost = match timeout(FINISH_TIMEOUT, guard.release()).await {
        Ok(Ok(())) => None,
        Ok(Err(Error::Lost { reason, .. })) => Some(reason),
        // The store had given the lock up (force-released or expired there)
        // before the lost signal reached us: a loss all the same.
        Ok(Err(Error::NotHeld { .. })) => Some(dlocks::LostReason::Revoked),
        Ok(Err(e)) => {
            eprintln!("dlock: warning: releasing lock {name}: {e}");
            None
        }
        Err(_) => {
            eprintln!(
                "dlock: warning: releasing lock {name} timed out; the store frees it within the TTL"
            );
            None
        }
    };
    close(session).await;
    lost
}

/// Closes the session, bounded by [`FINISH_TIMEOUT`]; errors are only logged.
async fn close(session: &Session) {
    match timeout(FINISH_TIMEOUT, session.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing the session failed"),
        Err(_) => tracing::debug!("closing the session timed out"),
    }
}

/// Runs `fut` unless one of the caught signals arrives first.
async fn unless_signalled<T>(
    signals: &mut Signals,
    fut: impl Future<Output = T>,
) -> Result<T, Signal> {
    tokio::select! {
        biased;
        sig = signals.recv() => Err(sig),
        out = fut => Ok(out),
    }
}

/// dlock got `sig` before the command started: exit 128 + signal number.
fn interrupted(sig: Signal, doing: &str) -> Failure {
    Failure::new(
        signal_code(sig),
        format!("got {sig} while {doing}; giving up"),
    )
}

/// 128 + the signal's number, as shells report a death by signal.
fn signal_code(sig: Signal) -> u8 {
    u8::try_from(sig as i32).map_or(FAILURE, |n| SIGNAL_BASE.saturating_add(n))
}

/// The exit status for a command's [`ExitStatus`]: its code, or 128 + signal
/// number if a signal killed it (as shells report it).
fn status_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code).unwrap_or(FAILURE);
    }
    match status.signal() {
        Some(sig) => u8::try_from(sig).map_or(FAILURE, |n| SIGNAL_BASE.saturating_add(n)),
        None => FAILURE,
    }
}

/// The failure for a command that could not be started: 127 if not found,
/// 126 if not executable, 1 otherwise.
fn spawn_failure(program: &OsStr, e: &io::Error) -> Failure {
    let shown = program.to_string_lossy();
    match e.kind() {
        io::ErrorKind::NotFound => Failure::new(NOT_FOUND, format!("{shown}: command not found")),
        io::ErrorKind::PermissionDenied => {
            Failure::new(NOT_EXECUTABLE, format!("{shown}: permission denied"))
        }
        _ if e.raw_os_error() == Some(Errno::ENOEXEC as i32) => {
            Failure::new(NOT_EXECUTABLE, format!("{shown}: not an executable format"))
        }
        _ => Failure::new(FAILURE, format!("cannot run {shown}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_like_a_shell() {
        assert_eq!(status_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(status_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137); // SIGKILL
        assert_eq!(status_code(ExitStatus::from_raw(15)), 143); // SIGTERM
    }

    #[test]
    fn spawn_errors() {
        let not_found = io::Error::from(io::ErrorKind::NotFound);
        assert_eq!(spawn_failure(OsStr::new("x"), &not_found).code, NOT_FOUND);
        let denied = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(spawn_failure(OsStr::new("x"), &denied).code, NOT_EXECUTABLE);
        let noexec = io::Error::from_raw_os_error(Errno::ENOEXEC as i32);
        assert_eq!(spawn_failure(OsStr::new("x"), &noexec).code, NOT_EXECUTABLE);
    }
}
