//! The command line: clap types, duration parsing and the help texts.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, Parser, Subcommand};

use crate::exit::Failure;

/// The exit statuses, shown by `dlock --help` and `dlock run --help`.
pub(crate) const EXIT_STATUS: &str = "\
Exit status:
  0       success; `status`: the lock is held
  1       `status`: the lock is free (never an error)
  2       usage error: bad flag, duration, lock name or URL, backend not compiled in
  69      the backend is unreachable, or the session ended (after `run` has
          retried within --wait)
  70      other errors (a reply dlock cannot use, a refused request)
  75      `run`: the lock was not acquired (busy with --no-wait, or --wait ran out);
          change it with --conflict-exit-code
  76      `run`: the lock was lost while the command ran (the command was stopped;
          with --leader, dlock campaigns again instead);
          `fence`: the write was refused, a newer token was recorded
  77      the store refused the credentials
  126     `run`: the command is not executable
  127     `run`: the command was not found
  128+N   `run`: the command was killed by signal N, or dlock got signal N while
          waiting for the lock
  other   `run`: the command's own exit status

The backend URL comes from --url, else $DLOCK_URL, else sqlite://dlock.db.
Log filter: $DLOCK_LOG (tracing syntax, default `warn`).";

const ABOUT: &str =
    "Distributed locks with fencing tokens: run a command under a lock, inspect and break locks";

const RUN_ABOUT: &str = "\
Runs COMMAND while holding the lock NAME, like flock(1) across machines.

dlock opens a session on the backend (kept alive in the background with the
given --ttl), acquires NAME and runs COMMAND with DLOCK_TOKEN (the fencing
token of this grant: pass it to the resource you protect) and DLOCK_NAME in its
environment. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to dlock are forwarded to
COMMAND. When COMMAND exits, dlock releases the lock and exits with COMMAND's
status.

If the lock is lost while COMMAND runs (the store expired it, or an admin ran
`dlock release --force`), dlock says so on stderr, sends COMMAND SIGTERM, then
SIGKILL after --grace, and exits with 76.

With --leader, NAME is an election and COMMAND runs only while this dlock
leads it: dlock campaigns (waiting as long as it takes), runs COMMAND in a
process group of its own with DLOCK_TOKEN set to the term (larger with every
new leader), and if the leadership is lost, stops that group as above (and
kills what is left of it once COMMAND is gone), waits out the rest of one
TTL if the term was that short, and campaigns again, starting COMMAND anew
when it leads again (a standby: run the same line on several machines). A
deposed leader's COMMAND may still run for up to --grace while the next
leader's runs: fence its writes with DLOCK_TOKEN. dlock exits when COMMAND
exits on its own while leading (COMMAND's status), on a signal (128+N, or
COMMAND's status if it was running), or on an error (69, 70, 77, 126,
127); --why is what observers see as the leader's value (`dlock status
NAME`). COMMAND cannot read the terminal (its own process group).";

const BENCH_ABOUT: &str = "\
Measures every backend given with --url (repeat it) in one run, with the
same workloads, and writes a Markdown table, a JSON file and an SVG chart.

Each backend gets --clients clients, each with its own connection and
session (TTL --ttl). Phases, run phase by phase across the backends:
  1. baseline: --cycles raw round trips (PING, SELECT 1) -> p50/p99;
  2. uncontended acquire+release of one free lock, and the store's raw
     floor (the fewest requests a take + release needs on the same driver:
     SET NX PX + compare-and-DEL, an upsert + DELETE, ...), alternating
     with the pings cycle by cycle (and across backends) so noise hits all;
     the ratio column is dlock over the floor;
  3. hot lock: all clients acquire, write a fenced register and release
     one lock for --duration: handoffs/s (grants to a different client
     than the last), release->next-grant latency, per-client counts and
     Jain's fairness index; the same clients on the store's own lock where
     it has one (pg_advisory_lock, GET_LOCK, etcd's lock service, the
     ZooKeeper lock recipe), in a second table, in turns with dlock's
     (A B B A A B B A after an uncounted warm-up turn of each, each side
     --duration in all, counted within each turn) so drift hits both;
  4. independent locks: each client on its own lock for --duration:
     acquisitions/s;
  5. safety: the register's refusals and the history check (overlapping
     holds, grant order) over phase 3;
  6. many holds: one session holds --holds locks; one renewal round of
     all of them against a round of one, and memory per held lock;
  7. fenced writes: a plain write of the data against the same write
     through the store's fenced writer;
  8. primitives: all clients take and give back permits of a semaphore
     of half as many permits for --duration (grants/s, the most held at
     once), then --failovers planned leader failovers (resign -> the
     waiting candidate's grant).
Lock names are under a fresh bench/<random>/ prefix. The table goes to
stdout (the JSON with --json); DIR/bench.md, DIR/bench.json and
DIR/bench.svg are written. Exits 70 if the safety check fails (or a
semaphore held more permits than it has).";

/// `dlock`: run a command under a distributed lock, or inspect and break locks.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, about = ABOUT, after_help = EXIT_STATUS)]
pub(crate) struct Cli {
    /// The backend URL (sqlite://PATH, postgres://USER:PASS@HOST/DB, mysql://..., redis://,
    /// rediss://, redlock://, redis+cluster://, etcd://, etcds://, zk://, mongodb://, nats://,
    /// memory://); `bench` takes it several times.
    #[arg(
        long,
        global = true,
        value_name = "URL",
        env = "DLOCK_URL",
        hide_env_values = true,
        default_value = dlocks::DEFAULT_URL,
        action = ArgAction::Append
    )]
    pub(crate) url: Vec<String>,

    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run a command while holding a lock.
    #[command(long_about = RUN_ABOUT, after_help = EXIT_STATUS)]
    Run(RunArgs),
    /// Show who holds a lock (exit 0 if held, 1 if free).
    Status(StatusArgs),
    /// List the held locks, optionally under a name prefix.
    List(ListArgs),
    /// Break a lock whoever holds it (admin); needs --force.
    Release(ReleaseArgs),
    /// Write protected data only if a fencing token is current (the check
    /// in the store that keeps the data).
    #[command(long_about = FENCE_ABOUT, after_help = EXIT_STATUS)]
    Fence(FenceArgs),
    /// Benchmark backends: latency, hot-lock handoffs, throughput, safety.
    #[command(long_about = BENCH_ABOUT, after_help = EXIT_STATUS)]
    Bench(BenchArgs),
    /// Soak backends with fenced acquisitions under injected faults.
    #[command(long_about = TORTURE_ABOUT, after_help = EXIT_STATUS)]
    Torture(TortureArgs),
}

/// `dlock run`.
#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The lock name, e.g. `reports/nightly`.
    pub(crate) name: String,

    /// How long the store keeps the lock after the last renewal: a crashed
    /// dlock's lock is free after this. Renewed every TTL/3.
    #[arg(long, value_name = "D", default_value = "30s", value_parser = parse_duration)]
    pub(crate) ttl: Duration,

    /// Wait at most this long for the lock (default: wait as long as it takes).
    #[arg(long, value_name = "D", value_parser = parse_duration, conflicts_with = "no_wait")]
    pub(crate) wait: Option<Duration>,

    /// Do not wait: if the lock is busy, exit at once (status 75).
    #[arg(long)]
    pub(crate) no_wait: bool,

    /// A reason recorded with the lock, shown by `status` and `list`.
    #[arg(long, value_name = "TEXT")]
    pub(crate) why: Option<String>,

    /// Give the lock back after D even if COMMAND still runs (a hung job):
    /// COMMAND is stopped as for a lost lock, and dlock exits 76.
    #[arg(long, value_name = "D", value_parser = parse_positive_duration)]
    pub(crate) hold_at_most: Option<Duration>,

    /// Lead the election NAME: run COMMAND while leading, stop it when the
    /// leadership is lost and campaign again (see above).
    #[arg(long, conflicts_with_all = ["no_wait", "wait"])]
    pub(crate) leader: bool,

    /// Keep the lock at least D after it was acquired: when COMMAND is done
    /// sooner, dlock waits (holding it) before releasing and exiting, so
    /// that the same scheduled job started a little later elsewhere finds
    /// it taken.
    #[arg(long, value_name = "D", value_parser = parse_positive_duration)]
    pub(crate) hold_at_least: Option<Duration>,

    /// After a lost lock, how long COMMAND has between SIGTERM and SIGKILL.
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_duration)]
    pub(crate) grace: Duration,

    /// The exit status when the lock is not acquired (like flock's -E).
    #[arg(long, value_name = "N", default_value_t = crate::exit::CONFLICT)]
    pub(crate) conflict_exit_code: u8,

    /// The command and its arguments (after `--`, or after NAME).
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

/// `dlock status`.
#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// The lock name.
    pub(crate) name: String,

    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `dlock list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    /// Only locks whose names start with this (e.g. `reports/`).
    #[arg(default_value = "")]
    pub(crate) prefix: String,

    /// Print a JSON array instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `dlock release`.
#[derive(Debug, Args)]
pub(crate) struct ReleaseArgs {
    /// The lock name.
    pub(crate) name: String,

    /// Required: free the lock whoever holds it. The holder's command is
    /// stopped when its dlock notices (within TTL/3); the next holder still
    /// gets a larger fencing token.
    #[arg(long)]
    pub(crate) force: bool,
}

const FENCE_ABOUT: &str = "\
Writes data in the store --url names only if TOKEN is at least the highest
token recorded for RESOURCE, and records it: the check and the write are one
atomic step in that store, so a former holder paused past its lease cannot
write after the next holder did. Under `dlock run`, TOKEN and RESOURCE
default to DLOCK_TOKEN and DLOCK_NAME (the lock's name):

  dlock run --url $LOCKS accounts/42 -- \\
    dlock fence --url postgres://app@db/bank -- 'UPDATE accounts SET balance = 90 WHERE id = 42'

WRITE, by store:
  postgres://, mysql://, sqlite://  SQL statements (one argument each), run in
      one transaction after the check on RESOURCE's row of the fence table
      (--fence TABLE, default dlock_fences, created if missing)
  redis://, rediss://  one Redis command (SET key value), run in one script
      after the check on the fence key (--fence KEY, default
      dlock:fence:RESOURCE); its reply is printed
  etcd://, etcds://  put KEY VALUE and del KEY (repeatable), in one
      transaction with the compare on the fence key (--fence KEY, default
      dlock/fence/RESOURCE)
A refused write changes nothing and exits 76: a newer holder wrote first,
the lock has moved on. Tokens are per lock name: guard one RESOURCE with one
lock, on one backend.";

/// `dlock fence`.
#[derive(Debug, Args)]
pub(crate) struct FenceArgs {
    /// What the write protects: the fence's key.
    #[arg(long, value_name = "RESOURCE", env = "DLOCK_NAME")]
    pub(crate) resource: String,

    /// The fencing token of the writer's grant.
    #[arg(long, value_name = "TOKEN", env = "DLOCK_TOKEN",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) token: u64,

    /// Where the store keeps the highest token per resource: the fence
    /// table (SQL) or key (Redis, etcd).
    #[arg(long, value_name = "NAME")]
    pub(crate) fence: Option<String>,

    /// The write, in the store's terms (see above).
    #[arg(required = true, trailing_var_arg = true, value_name = "WRITE")]
    pub(crate) write: Vec<String>,
}

/// `dlock bench`.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Clients per backend, each with its own connection and session.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(2..=256))]
    pub(crate) clients: u32,

    /// Latency samples per backend: this many pings and as many
    /// acquire+release cycles (after a short warm-up).
    #[arg(long, value_name = "N", default_value_t = 2000,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub(crate) cycles: u64,

    /// How long each contended phase (hot lock, independent locks) runs on
    /// each backend; the hot lock runs this long on each side where the
    /// store has a lock of its own (dlock's and the store's, in turns).
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_positive_duration)]
    pub(crate) duration: Duration,

    /// The TTL of the clients' sessions (Redlock: at most its max_ttl).
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_duration)]
    pub(crate) ttl: Duration,

    /// Locks one session holds in the last phase (renewal cost and memory
    /// per held lock); 0 skips it.
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub(crate) holds: u64,

    /// Planned leader failovers timed per backend in the primitives phase;
    /// 0 skips them.
    #[arg(long, value_name = "N", default_value_t = 50,
          value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub(crate) failovers: u64,

    /// Where bench.md, bench.json and bench.svg are written (created if missing).
    #[arg(long, value_name = "DIR", default_value = "target/bench")]
    pub(crate) out: PathBuf,

    /// Print the JSON report on stdout instead of the Markdown table.
    #[arg(long)]
    pub(crate) json: bool,

    /// No progress bars and no notes on stderr.
    #[arg(long)]
    pub(crate) quiet: bool,
}

const TORTURE_ABOUT: &str = "\
Runs fenced acquisitions on one hot lock under a nemesis, for every backend
given with --url (repeat it) and every fault profile, and audits the history.

--clients clients, each in a simulated process of its own behind a link of
its own (a TCP proxy per store node; in-process for memory://), acquire the
lock, write a fenced register while they believe they hold it, and release,
until --acquisitions are done. Meanwhile the nemesis cycles the profile's
faults, on the current holder half of the time:
  none                 no faults (the baseline)
  delays               one client's requests and replies delayed (to TTL/4)
  lost-replies         one client's replies lost; its requests take effect
  partitions           one client cut off, connections open (to 2 TTL)
  resets               one client's connections reset and refused
  dead-connections     one client's connections silently dead
  late-requests        one client's connections stall, then deliver late
  minority-partitions  a minority of the nodes cut off from one client
  client-pauses        one client's whole process stopped past the TTL
  server-pauses        one server stopped (SIGSTOP); needs --servers
  server-restarts      one server killed and restarted; needs --servers
  clock-jumps          the store's clock jumps past the TTL (memory://)
Reported per backend and profile: acquisitions, register violations (tokens
out of grant order or reused), overlapping holds (a hold ends at its release,
its lost signal or its local deadline), stale writes the register refused,
lost signals, and how long the lock stayed unavailable after a holder lost
it. DIR/torture.md and DIR/torture.json are written. Exits 70 if a check
fails that the profile does not excuse by design (overlaps under clock jumps,
or restarts of a store without persistence).";

/// `dlock torture`.
#[derive(Debug, Clone, Args)]
pub(crate) struct TortureArgs {
    /// Clients on the lock, each its own process, link and session.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(2..=64))]
    pub(crate) clients: u32,

    /// Acquisitions per backend and profile.
    #[arg(long, value_name = "N", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub(crate) acquisitions: u64,

    /// Faults each profile injects at least (it runs on past its
    /// acquisitions until then).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub(crate) min_faults: u64,

    /// The fault profiles: `all` or a comma-separated list.
    #[arg(long, value_name = "LIST", default_value = "all")]
    pub(crate) profiles: String,

    /// One hold in N lasts TTL/4 .. TTL (writing every TTL/10), so that
    /// faults hit holders that renew; the others write once and release.
    /// 0: no long holds.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub(crate) long_holds: u32,

    /// The clients' session TTL (faults are timed from it).
    #[arg(long, value_name = "D", default_value = "1s", value_parser = parse_positive_duration)]
    pub(crate) ttl: Duration,

    /// Give up a profile after this long (its row then fails); also bounds
    /// how long its clients try to open their first sessions (at most 60 s),
    /// after which the row fails naming why and the next profile runs.
    #[arg(long, value_name = "D", default_value = "20m", value_parser = parse_positive_duration)]
    pub(crate) max_time: Duration,

    /// The servers behind each --url, in the same order (repeat it; `-` for
    /// none): `NAME,NAME[@GROUP]` as --services-command knows them, for the
    /// server-pauses and server-restarts profiles.
    #[arg(long, value_name = "NAMES", action = ArgAction::Append)]
    pub(crate) servers: Vec<String>,

    /// The command that controls --servers (the scripts/services interface).
    #[arg(long, value_name = "CMD", default_value = "scripts/services")]
    pub(crate) services_command: String,

    /// Where torture.md and torture.json are written (created if missing).
    #[arg(long, value_name = "DIR", default_value = "target/torture")]
    pub(crate) out: PathBuf,

    /// Print the JSON report on stdout instead of the Markdown table.
    #[arg(long)]
    pub(crate) json: bool,

    /// No progress lines on stderr.
    #[arg(long)]
    pub(crate) quiet: bool,
}

/// The one URL of a command other than `bench`: `--url` given twice is a
/// usage error there.
pub(crate) fn single_url(urls: &[String]) -> Result<&str, Failure> {
    match urls {
        [url] => Ok(url),
        [] => Ok(dlocks::DEFAULT_URL),
        _ => Err(Failure::usage(
            "--url given more than once; only `dlock bench` and `dlock torture` take several",
        )),
    }
}

/// Parses a duration that must not be zero.
fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err("must be more than zero".to_owned()),
        d => Ok(d),
    }
}

/// Parses `30s`, `500ms`, `2m`, `1h 30m` (humantime syntax).
fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// Turns a clap error into one line: its first paragraph, with a pointer to
/// the right `--help` (`args` are the arguments after the program name).
pub(crate) fn one_line(error: &clap::Error, args: &[OsString]) -> String {
    let text = error.to_string();
    let first = text.split("\n\n").next().unwrap_or_default();
    let message = first
        .trim()
        .strip_prefix("error:")
        .unwrap_or(first)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    match subcommand(args) {
        Some(sub) => format!("{message}; see 'dlock {sub} --help'"),
        None => format!("{message}; see 'dlock --help'"),
    }
}

/// The subcommand named in `args`, if any (the first word that is not an
/// option or the value of `--url`).
fn subcommand(args: &[OsString]) -> Option<&'static str> {
    let mut words = args.iter().map(|a| a.to_str().unwrap_or(""));
    while let Some(word) = words.next() {
        match word {
            "--url" => {
                words.next();
            }
            w if w.starts_with('-') => {}
            w => {
                return ["run", "status", "list", "release", "bench"]
                    .into_iter()
                    .find(|s| *s == w);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("dlock").chain(args.iter().copied()))
    }

    fn line(args: &[&str]) -> String {
        let e = parse(args).unwrap_err();
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        one_line(&e, &args)
    }

    #[test]
    fn command_after_double_dash_or_name() {
        for args in [
            &["run", "demo", "--", "ls", "-l"][..],
            &["run", "demo", "ls", "-l"][..],
            &["run", "--ttl", "1s", "demo", "--", "ls", "-l"][..],
        ] {
            let Command::Run(run) = parse(args).unwrap().command else {
                panic!("not run")
            };
            assert_eq!(run.name, "demo");
            assert_eq!(run.command, ["ls", "-l"]);
        }
        let Command::Run(run) = parse(&["run", "demo", "--", "sh", "--wait", "1s"])
            .unwrap()
            .command
        else {
            panic!("not run")
        };
        assert_eq!(run.wait, None);
        assert_eq!(run.command, ["sh", "--wait", "1s"]);
    }

    #[test]
    fn errors_are_one_line() {
        let l = line(&["run", "demo", "--ttl", "5x", "--", "true"]);
        assert!(!l.contains('\n'), "{l}");
        assert!(
            l.contains("5x") && l.ends_with("see 'dlock run --help'"),
            "{l}"
        );
        let l = line(&["--url", "x", "run", "demo"]);
        assert!(
            l.contains("<COMMAND>") && l.ends_with("see 'dlock run --help'"),
            "{l}"
        );
        let l = line(&["run", "demo", "--wait", "1s", "--no-wait", "--", "true"]);
        assert!(l.contains("cannot be used with"), "{l}");
        let l = line(&["bogus"]);
        assert!(l.ends_with("see 'dlock --help'"), "{l}");
        let l = line(&["bench", "--clients", "1"]);
        assert!(l.ends_with("see 'dlock bench --help'"), "{l}");
        let l = line(&["bench", "--duration", "0s"]);
        assert!(l.contains("more than zero"), "{l}");
    }

    #[test]
    fn url_repeats_only_for_bench() {
        let cli = parse(&["bench", "--url", "memory://a", "--url", "memory://b"]).unwrap();
        assert_eq!(cli.url, ["memory://a", "memory://b"]);
        assert!(single_url(&cli.url).is_err());
        // As for any global flag, the values after the subcommand win.
        let cli = parse(&["--url", "memory://a", "bench", "--url", "memory://b"]).unwrap();
        assert_eq!(cli.url, ["memory://b"]);
        let cli = parse(&["--url", "memory://a", "bench"]).unwrap();
        assert_eq!(cli.url, ["memory://a"]);
        let cli = parse(&["status", "x", "--url", "memory://a"]).unwrap();
        assert_eq!(single_url(&cli.url).unwrap(), "memory://a");
    }
}
