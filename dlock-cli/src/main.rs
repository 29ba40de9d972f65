//! `dlock`: run a command under a distributed lock, inspect and break locks.
//!
//! ```text
//! dlock run NAME [--url URL] [--ttl D] [--wait D | --no-wait] [--why TEXT]
//!                [--grace D] [--hold-at-most D] [--conflict-exit-code N] -- CMD ARGS...
//! dlock status NAME [--url URL] [--json]
//! dlock list [PREFIX] [--url URL] [--json]
//! dlock release --force NAME [--url URL]
//! dlock fence [--url URL] [--resource R] [--token N] [--fence NAME] -- WRITE...
//! dlock bench [--url URL]... [--clients N] [--cycles N] [--duration D]
//!             [--ttl D] [--out DIR] [--json] [--quiet]
//! ```
//!
//! `run` opens a session (TTL 30 s by default, renewed every TTL/3), acquires
//! NAME (waiting forever, at most `--wait D`, or not at all with `--no-wait`)
//! and runs CMD with `DLOCK_TOKEN` (the fencing token) and `DLOCK_NAME` in its
//! environment. SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to CMD. If
//! the lock is lost meanwhile, CMD gets SIGTERM, then SIGKILL after `--grace`
//! (10 s). When CMD exits, the lock is released.
//!
//! `bench` runs the same workloads on every backend given (`--url` repeated)
//! and writes a Markdown table, a JSON report and an SVG chart to `--out`
//! (`target/bench`); see `dlock bench --help`. It exits 1 if the safety check
//! over its hot-lock phase fails.
//!
//! The URL comes from `--url`, else `DLOCK_URL`, else [`dlocks::DEFAULT_URL`].
//! Durations are humantime's: `500ms`, `30s`, `2m`. Logs go to stderr,
//! filtered by `DLOCK_LOG` (tracing-subscriber syntax, default `warn`).
//! Errors are one line, `dlock: <message>`, on stderr.
//!
//! # Exit status
//!
//! | status | meaning |
//! |---|---|
//! | CMD's status | `run`: CMD exited on its own; if a signal killed it, 128 + the signal number |
//! | 0 | `status`: the lock is held; `list`, `release --force`: success |
//! | 1 | `status`: the lock is free (an answer: no error exits 1) |
//! | 2 | usage errors: bad flags, durations, lock names or URLs; a backend not compiled in |
//! | 69 | the backend is unreachable, or the session ended; `run --wait` first retries within its budget (reconnecting, opening a new session) |
//! | 70 | other errors: a reply dlock cannot use, a request the store refused |
//! | 77 | the store refused the credentials |
//! | 75 | `run`: the lock was not acquired (busy with `--no-wait`, or `--wait` ran out); `--conflict-exit-code N` changes it, like flock(1)'s `-E` |
//! | 76 | `run`: the lock was lost while CMD ran (CMD was stopped); `fence`: the write was refused (a newer token was recorded) |
//! | 126 | `run`: CMD is not executable |
//! | 127 | `run`: CMD was not found |
//! | 128 + N | `run`: dlock got signal N while connecting or waiting for the lock |
//!
//! As with flock(1) and timeout(1), a CMD that itself exits with 75 or 76 is
//! indistinguishable from dlock's own statuses.

mod admin;
mod bench;
mod cli;
mod exit;
mod fence;
mod run;
mod signals;
mod torture;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use dlocks::{Backend, Error};
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command};

/// The system allocator, counting: `dlock bench` reads the live heap bytes
/// (client memory per held lock). A relaxed atomic add per allocation.
#[global_allocator]
static ALLOCATOR: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Live heap bytes of this process now.
///
/// `bytes_reallocated` is not added: stats_alloc already counts a realloc's
/// growth in `bytes_allocated` (and its shrinking in `bytes_deallocated`), so
/// adding the net delta again counted every buffer grown by realloc and freed
/// later as live (MongoDB's BSON buffers showed 26 KiB per held lock that way,
/// against a heaptrack peak of 6 MB for the whole run of 2,000 holds).
pub(crate) fn heap_bytes() -> i64 {
    let s = ALLOCATOR.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}
use crate::exit::{Failure, UNAVAILABLE};

/// The longest connecting to the backend may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The default log filter: warnings, except the core's "lock lost" line, which
/// `run` reports itself, sqlx's "slow statement" notes, which a paused or
/// busy dlock would print for every query in flight, and the Redis Cluster
/// client's reports of the reconnects and slot-map refreshes dlock asks for
/// (a failover shows in dlock's own warnings).
const DEFAULT_LOG: &str =
    "warn,dlock_core::session=error,sqlx::query=error,redis::cluster_handling=off";

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let parsed = Cli::command()
        .try_get_matches_from(&args)
        .and_then(|m| Ok((Cli::from_arg_matches(&m)?, url_given(&m))));
    let (cli, url_given) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => match e.kind() {
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                let _ = e.print();
                return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(exit::USAGE));
            }
            _ => {
                eprintln!(
                    "dlock: {}",
                    cli::one_line(&e, args.get(1..).unwrap_or_default())
                );
                return ExitCode::from(exit::USAGE);
            }
        },
    };
    // Under injected faults, renewal and connection warnings are the point.
    init_logging(if matches!(cli.command, Command::Torture(_)) {
        "error,redis::cluster_handling=off"
    } else {
        DEFAULT_LOG
    });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("dlock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    let code = match runtime.block_on(dispatch(cli, url_given)) {
        Ok(code) => code,
        Err(failure) => {
            eprintln!("dlock: {failure}");
            failure.code
        }
    };
    // The drivers' clean-ups spawned as the backends were dropped (MongoDB
    // ends its server sessions) get a moment to finish: stopping the runtime
    // under them made the MongoDB driver panic in a task once (its pool's
    // worker was gone first).
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        let metrics = tokio::runtime::Handle::current().metrics();
        while metrics.num_alive_tasks() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    ExitCode::from(code)
}

/// Whether `--url` was given on the command line (not from `DLOCK_URL` or
/// the default), at the top or after the subcommand.
fn url_given(matches: &clap::ArgMatches) -> bool {
    let here = matches.value_source("url") == Some(ValueSource::CommandLine);
    here || matches.subcommand().is_some_and(|(_, sub)| url_given(sub))
}

/// Runs the subcommand; returns the exit status.
async fn dispatch(cli: Cli, url_given: bool) -> Result<u8, Failure> {
    let urls = &cli.url;
    match cli.command {
        // The data's store, never the locks' by default (DLOCK_URL).
        Command::Fence(_) if !url_given => Err(Failure::usage(
            "dlock fence needs --url: the store that keeps the data (DLOCK_URL names the locks' store)",
        )),
        Command::Run(args) => run::run(cli::single_url(urls)?, args).await,
        Command::Status(args) => admin::status(cli::single_url(urls)?, args).await,
        Command::List(args) => admin::list(cli::single_url(urls)?, args).await,
        Command::Release(args) => admin::release(cli::single_url(urls)?, args).await,
        Command::Fence(args) => fence::fence(cli::single_url(urls)?, args).await,
        Command::Bench(args) => bench::bench(urls, args).await,
        Command::Torture(args) => torture::torture(urls, args).await,
    }
}

/// Opens the backend `url` names, within [`CONNECT_TIMEOUT`]. An unreachable
/// backend's message names the URL (without its password).
pub(crate) async fn connect(url: &str) -> Result<Arc<dyn Backend>, Failure> {
    let shown = || dlock_core::url::redact(url);
    match tokio::time::timeout(CONNECT_TIMEOUT, dlocks::connect(url)).await {
        Ok(Ok(backend)) => Ok(backend),
        Ok(Err(e @ Error::Unavailable { .. })) => {
            Err(Failure::new(UNAVAILABLE, format!("{e} (URL {})", shown())))
        }
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(Failure::new(
            UNAVAILABLE,
            format!(
                "no answer from {} within {}",
                shown(),
                humantime::format_duration(CONNECT_TIMEOUT)
            ),
        )),
    }
}

/// Logs to stderr, filtered by `DLOCK_LOG` (default `default`).
fn init_logging(default: &str) {
    let filter = match std::env::var("DLOCK_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("dlock: ignoring DLOCK_LOG={spec:?}: {e}");
            EnvFilter::new(default)
        }),
        _ => EnvFilter::new(default),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
