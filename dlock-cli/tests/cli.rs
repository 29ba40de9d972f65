//! End-to-end tests of the `dlock` binary: each case runs on SQLite (a
//! temporary file) and, with the `postgres` feature, on the PostgreSQL server
//! from `scripts/services` (`DLOCK_TEST_POSTGRES_URL`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_dlock");

/// Slack for process start-up and scheduling on a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

/// Where the locks live for one test.
struct Store {
    url: String,
    /// Keeps an SQLite file's directory alive.
    _dir: Option<TempDir>,
}

impl Store {
    fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("dlock.db").display());
        Self {
            url,
            _dir: Some(dir),
        }
    }

    #[cfg(feature = "postgres")]
    fn postgres() -> Self {
        let url = std::env::var("DLOCK_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://dlock:dlock@127.0.0.1:15432/dlock".to_owned());
        Self { url, _dir: None }
    }

    /// `dlock` with this store's URL in `DLOCK_URL`.
    fn dlock(&self) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.env("DLOCK_URL", &self.url)
            .env_remove("DLOCK_LOG")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `dlock ARGS` to completion.
    fn run(&self, args: &[&str]) -> Ran {
        Ran::of(self.dlock().args(args))
    }
}

/// A finished `dlock`.
#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Ran {
    fn of(cmd: &mut Command) -> Self {
        let start = Instant::now();
        let out = cmd.output().expect("spawn dlock");
        Self::from_output(out, start.elapsed())
    }

    fn from_output(out: Output, took: Duration) -> Self {
        Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            took,
        }
    }

    /// Asserts a clean error: `code`, one `dlock: ` line on stderr, no panic.
    fn assert_error(&self, code: i32) -> &Self {
        assert_eq!(self.code, Some(code), "{self:#?}");
        let lines: Vec<_> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{self:#?}");
        assert!(lines[0].starts_with("dlock: "), "{self:#?}");
        assert!(!self.stderr.contains("panicked"), "{self:#?}");
        self
    }
}

/// A lock name no other test (or earlier run) uses.
fn unique(tag: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "cli-test/{tag}-{}-{nanos:09}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Writes the token to `$READY` (atomically), then becomes `sleep 30`.
const HOLD: &str =
    r#"echo "$DLOCK_TOKEN" > "$READY.tmp" && mv "$READY.tmp" "$READY" && exec sleep 30"#;

/// A `dlock run` in the background whose command has started.
struct Running {
    child: Option<Child>,
    /// The command's `DLOCK_TOKEN`.
    token: u64,
}

impl Running {
    /// Starts `dlock run ARGS -- sh -c SCRIPT` (with `$READY` set) and waits
    /// until the script has written its token to `$READY`.
    fn start(store: &Store, dir: &Path, args: &[&str], script: &str) -> Self {
        let (mut child, ready) = Self::spawn(store, dir, args, script);
        let deadline = Instant::now() + Duration::from_secs(15);
        let token = loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                break text.trim().parse().expect("token");
            }
            if child.try_wait().unwrap().is_some() {
                let out = child.wait_with_output().unwrap();
                panic!("dlock run exited early: {out:?}");
            }
            assert!(Instant::now() < deadline, "the command did not start");
            thread::sleep(Duration::from_millis(10));
        };
        Self {
            child: Some(child),
            token,
        }
    }

    /// Starts `dlock run ARGS -- sh -c SCRIPT` without waiting for its
    /// command (a standby that does not hold the lock yet).
    fn start_standing_by(store: &Store, dir: &Path, args: &[&str], script: &str) -> Self {
        let (child, _) = Self::spawn(store, dir, args, script);
        // (long enough to be in line before the leader loses the lock)
        thread::sleep(Duration::from_millis(300));
        Self {
            child: Some(child),
            token: 0,
        }
    }

    /// `dlock run ARGS -- sh -c SCRIPT` with `$READY` set to a new path in
    /// `dir`: the child and that path.
    fn spawn(store: &Store, dir: &Path, args: &[&str], script: &str) -> (Child, PathBuf) {
        let ready = dir.join(format!("ready-{}", unique("r").replace('/', "_")));
        let child = store
            .dlock()
            .arg("run")
            .args(args)
            .args(["--", "sh", "-c", script])
            .env("READY", &ready)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (child, ready)
    }

    /// Whether dlock is still running.
    fn is_running(&mut self) -> bool {
        self.child.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().unwrap().id() as i32)
    }

    fn signal(&self, sig: Signal) {
        kill(self.pid(), sig).unwrap();
    }

    /// Waits for dlock to exit; `took` counts from now.
    /// Waits (at most 60 s, then kills it and fails) for dlock to exit;
    /// `took` counts from now.
    fn wait(mut self) -> Ran {
        let start = Instant::now();
        let mut child = self.child.take().unwrap();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("dlock did not exit: {:?}", child.wait_with_output());
            }
            thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        Ran::from_output(out, start.elapsed())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = Pid::from_raw(child.id() as i32);
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGTERM); // forwarded to the command
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------- the cases

/// 1. Two concurrent `dlock run` loops on one name never overlap, and tokens
///    strictly increase in the order the holds happened.
fn runs_never_overlap(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let name = unique("overlap");
    let script = r#"echo "start $DLOCK_TOKEN $(date +%s%N)" >> "$LOG"; sleep 0.1; echo "end $DLOCK_TOKEN $(date +%s%N)" >> "$LOG""#;
    thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..3 {
                    let ran = Ran::of(
                        store
                            .dlock()
                            .args(["run", &name, "--ttl", "5s", "--", "sh", "-c", script])
                            .env("LOG", &log),
                    );
                    assert_eq!(ran.code, Some(0), "{ran:#?}");
                }
            });
        }
    });
    let text = std::fs::read_to_string(&log).unwrap();
    let events: Vec<(String, u64, u128)> = text
        .lines()
        .map(|l| {
            let f: Vec<_> = l.split_whitespace().collect();
            (
                f[0].to_owned(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(events.len(), 12, "{text}");
    let mut last: Option<(u64, u128)> = None; // token and end time of the previous hold
    for pair in events.chunks(2) {
        let [(start, token, t0), (end, token2, t1)] = pair else {
            unreachable!()
        };
        assert_eq!(
            (start.as_str(), end.as_str()),
            ("start", "end"),
            "overlap:\n{text}"
        );
        assert_eq!(token, token2, "{text}");
        assert!(t0 <= t1, "{text}");
        if let Some((prev_token, prev_end)) = last {
            assert!(*token > prev_token, "tokens must increase:\n{text}");
            assert!(*t0 >= prev_end, "overlap:\n{text}");
        }
        last = Some((*token, *t1));
    }
}

/// 2. A busy lock: `--no-wait` exits 75 at once (or `--conflict-exit-code`),
///    `--wait 300ms` exits 75 after at least 300 ms; SIGTERM to dlock is
///    forwarded to the command (exit 143) and the lock is free afterwards.
fn busy_lock_statuses(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("busy");
    let holder = Running::start(store, dir.path(), &[&name], HOLD);

    let ran = store.run(&["run", &name, "--no-wait", "--", "true"]);
    ran.assert_error(75);
    assert!(ran.stderr.contains("busy"), "{ran:#?}");
    assert!(ran.took < SLACK, "{ran:#?}");

    let ran = store.run(&[
        "run",
        &name,
        "--no-wait",
        "--conflict-exit-code",
        "9",
        "--",
        "true",
    ]);
    ran.assert_error(9);

    let ran = store.run(&["run", &name, "--wait", "300ms", "--", "true"]);
    ran.assert_error(75);
    assert!(ran.took >= Duration::from_millis(300), "{ran:#?}");
    assert!(ran.took < Duration::from_millis(300) + SLACK, "{ran:#?}");

    holder.signal(Signal::SIGTERM);
    let ran = holder.wait();
    assert_eq!(ran.code, Some(128 + 15), "{ran:#?}");
    assert_eq!(ran.stderr, "", "{ran:#?}");

    let ran = store.run(&["run", &name, "--no-wait", "--", "true"]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
}

/// 3. `DLOCK_TOKEN` strictly increases over consecutive runs; `DLOCK_NAME` is
///    the name. (The URL comes from `--url` here, not `DLOCK_URL`.)
fn tokens_increase(store: &Store) {
    let name = unique("tokens");
    let mut last = 0;
    for _ in 0..3 {
        let ran = Ran::of(
            Command::new(BIN)
                .env_remove("DLOCK_URL")
                .args(["run", "--url", &store.url, &name, "--"])
                .args(["sh", "-c", r#"echo "$DLOCK_NAME $DLOCK_TOKEN""#]),
        );
        assert_eq!(ran.code, Some(0), "{ran:#?}");
        let (got_name, token) = ran.stdout.trim().split_once(' ').unwrap();
        assert_eq!(got_name, name);
        let token: u64 = token.parse().unwrap();
        assert!(token > last, "{token} after {last}");
        last = token;
    }
}

/// 4. `release --force` from another process: the command gets SIGTERM
///    within one renewal period (TTL/3) plus slack, dlock exits 76, and the
///    next holder gets a larger token.
fn force_release_stops_command(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let trapped = dir.path().join("trapped");
    let name = unique("force");
    let script = format!(
        r#"trap 'echo TERM > "{}"; kill $! 2>/dev/null; exit 143' TERM
        sleep 30 >/dev/null 2>&1 &
        echo "$DLOCK_TOKEN" > "$READY.tmp"; mv "$READY.tmp" "$READY"
        wait"#,
        trapped.display()
    );
    let holder = Running::start(
        store,
        dir.path(),
        &["--ttl", "2s", "--grace", "1s", &name],
        &script,
    );

    let ran = store.run(&["release", "--force", &name]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    assert!(ran.stdout.contains("released"), "{ran:#?}");
    assert!(
        ran.stdout.contains(&format!("token {}", holder.token)),
        "{ran:#?}"
    );

    let token = holder.token;
    let ran = holder.wait();
    ran.assert_error(76);
    assert!(
        ran.stderr.contains(&format!("lock {name} lost")),
        "{ran:#?}"
    );
    assert!(ran.took < Duration::from_secs(2) / 3 + SLACK, "{ran:#?}");
    assert_eq!(std::fs::read_to_string(&trapped).unwrap().trim(), "TERM");

    let ran = store.run(&["release", "--force", &name]);
    assert!(ran.stdout.contains("was not held"), "{ran:#?}");
    assert_next_token_above(store, &name, token);
}

/// `--hold-at-most`: a command still running at the limit is stopped as for
/// a lost lock (76), and the lock is free again for the next run.
fn hold_at_most_stops_a_hung_command(store: &Store) {
    let name = unique("hold-at-most");
    let ran = store.run(&[
        "run",
        "--hold-at-most",
        "1s",
        "--grace",
        "1s",
        &name,
        "--",
        "sleep",
        "30",
    ]);
    ran.assert_error(76);
    assert!(ran.stderr.contains("hold_at_most"), "{ran:#?}");
    assert!(
        ran.took >= Duration::from_secs(1) && ran.took < Duration::from_secs(1) + SLACK * 2,
        "{ran:#?}"
    );
    let ran = store.run(&["run", "--no-wait", &name, "--", "true"]);
    assert_eq!(
        ran.code,
        Some(0),
        "the lock stayed held after its limit: {ran:#?}"
    );
}

/// `--leader`: a leader whose leadership is lost (force-released) stops its
/// command's whole process group (a background child of the command too)
/// and campaigns again instead of exiting; the other dlock leads the next
/// term with a larger `DLOCK_TOKEN`. When that leader is stopped by a
/// signal, the first one leads again (a third term): a deposed leader does
/// come back. Each exits with its command's status on SIGTERM.
fn leader_campaigns_again(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let (terms, kids) = (dir.path().join("terms"), dir.path().join("kids"));
    let name = unique("leader");
    // The term and the leading dlock's pid, then a background child of the
    // command (it must not outlive the term), then ready.
    let script = format!(
        r#"echo "$DLOCK_TOKEN $PPID" >> "{}"; sleep 1000 & echo $! >> "{}"
        echo "$DLOCK_TOKEN" > "$READY.tmp" && mv "$READY.tmp" "$READY"; wait"#,
        terms.display(),
        kids.display()
    );
    let args = ["--leader", "--ttl", "2s", "--grace", "1s", &name];
    let first = Running::start(store, dir.path(), &args, &script);
    let second = Running::start_standing_by(store, dir.path(), &args, &script);
    let read_terms = || -> Vec<(u64, i32)> {
        std::fs::read_to_string(&terms)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (term, pid) = l.trim().split_once(' ').unwrap();
                (term.parse().unwrap(), pid.parse().unwrap())
            })
            .collect()
    };
    let terms_now = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(15);
        while read_terms().len() < n {
            assert!(Instant::now() < deadline, "no term {n}: {:?}", read_terms());
            thread::sleep(Duration::from_millis(20));
        }
        read_terms()
    };
    assert_eq!(read_terms(), [(first.token, first.pid().as_raw())]);
    let ran = store.run(&["release", "--force", &name]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    let seen = terms_now(2);
    assert!(seen[1].0 > seen[0].0, "terms {seen:?}");
    assert_eq!(seen[1].1, second.pid().as_raw(), "terms {seen:?}");
    // The old leader notices the loss at its next renewal (TTL/3), stops
    // its command's group and stands by; nobody starts a third term.
    thread::sleep(Duration::from_secs(2) / 3 + SLACK);
    assert_eq!(
        read_terms().len(),
        2,
        "a third term began: {:?}",
        read_terms()
    );
    let first_kid = std::fs::read_to_string(&kids).unwrap();
    let first_kid: i32 = first_kid.lines().next().unwrap().parse().unwrap();
    // Gone within the grace period once the loss is noticed (polled: on a
    // loaded machine the renewal that notices may come late).
    let gone_by = Instant::now() + Duration::from_secs(2) + Duration::from_secs(1) + SLACK * 4;
    while kill(Pid::from_raw(first_kid), None).is_ok() {
        assert!(
            Instant::now() < gone_by,
            "the deposed leader's background child {first_kid} still runs"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let (mut first, second) = (first, second);
    assert!(
        first.is_running(),
        "a dlock --leader exited after its term was lost"
    );
    second.signal(Signal::SIGTERM);
    let ran = second.wait();
    assert_eq!(ran.code, Some(143), "{ran:#?}");
    let seen = terms_now(3);
    assert!(seen[2].0 > seen[1].0, "terms {seen:?}");
    assert_eq!(seen[2].1, first.pid().as_raw(), "terms {seen:?}");
    first.signal(Signal::SIGTERM);
    let ran = first.wait();
    assert_eq!(ran.code, Some(143), "{ran:#?}");
    assert!(!ran.stderr.contains("panicked"), "{ran:#?}");
}

/// `--hold-at-least`: a command done at once leaves the lock held (dlock
/// waits) until the minimum, then dlock exits with the command's status
/// and the lock is free.
fn hold_at_least_keeps_the_lock(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("hold-at-least");
    let started = Instant::now();
    let script = r#"echo "$DLOCK_TOKEN" > "$READY.tmp" && mv "$READY.tmp" "$READY"; exit 3"#;
    let holder = Running::start(
        store,
        dir.path(),
        &["--hold-at-least", "2s", "--ttl", "1s", &name],
        script,
    );
    let ran = store.run(&["run", "--no-wait", &name, "--", "true"]);
    ran.assert_error(75);
    let ran = holder.wait();
    assert_eq!(ran.code, Some(3), "{ran:#?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(2) + SLACK * 2,
        "dlock held the lock for {took:?}: {ran:#?}"
    );
    let ran = store.run(&["run", "--no-wait", &name, "--", "true"]);
    assert_eq!(ran.code, Some(0), "the lock stayed held: {ran:#?}");
}

/// The next `dlock run` of `name` gets a token larger than `token`.
fn assert_next_token_above(store: &Store, name: &str, token: u64) {
    let ran = store.run(&["run", name, "--", "sh", "-c", "echo $DLOCK_TOKEN"]);
    assert!(
        ran.stdout.trim().parse::<u64>().unwrap() > token,
        "{ran:#?}"
    );
}

/// 4b. A command that ignores SIGTERM is killed after `--grace`.
fn lost_lock_kills_stubborn_command(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("stubborn");
    let script = format!("trap '' TERM; {HOLD}");
    let holder = Running::start(
        store,
        dir.path(),
        &["--ttl", "1s", "--grace", "700ms", &name],
        &script,
    );
    let token = holder.token;
    assert_eq!(store.run(&["release", "--force", &name]).code, Some(0));
    let ran = holder.wait();
    assert_eq!(ran.code, Some(76), "{ran:#?}");
    assert!(ran.stderr.contains("lost"), "{ran:#?}");
    assert!(ran.stderr.contains("killing it"), "{ran:#?}");
    assert!(ran.took >= Duration::from_millis(700), "{ran:#?}");
    assert!(
        ran.took < Duration::from_secs(1) / 3 + Duration::from_millis(700) + SLACK,
        "{ran:#?}"
    );
    assert_next_token_above(store, &name, token);
}

/// 4c. A holder paused past its TTL loses the lock to another process (with
///     a larger token) and, once resumed, stops its command and exits 76.
fn paused_holder_loses_lock(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("paused");
    let holder = Running::start(store, dir.path(), &["--ttl", "1s", &name], HOLD);
    holder.signal(Signal::SIGSTOP);
    let (taken, resume) = std::sync::mpsc::channel::<()>();
    let ran = thread::scope(|s| {
        // Resume once the lock was taken over, or after 2 s at the latest: an
        // SQLite holder stopped in the middle of a renewal keeps the database
        // file locked until it runs again.
        let pid = holder.pid();
        s.spawn(move || {
            let _ = resume.recv_timeout(Duration::from_secs(2));
            kill(pid, Signal::SIGCONT).unwrap();
        });
        let ran = store.run(&[
            "run",
            &name,
            "--wait",
            "5s",
            "--",
            "sh",
            "-c",
            "echo $DLOCK_TOKEN",
        ]);
        let _ = taken.send(());
        ran
    });
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    assert!(
        ran.stdout.trim().parse::<u64>().unwrap() > holder.token,
        "{ran:#?}"
    );
    let ran = holder.wait();
    ran.assert_error(76);
    assert!(ran.stderr.contains("lost"), "{ran:#?}");
    assert!(ran.took < SLACK, "{ran:#?}");
}

/// 5. Exit statuses: the command's, 128 + signal, 127 not found, 126 not
///    executable; the lock is released every time.
fn exit_statuses(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let name = unique("status");
    let ran = store.run(&["run", &name, "--", "sh", "-c", "exit 7"]);
    assert_eq!(ran.code, Some(7), "{ran:#?}");
    assert_eq!(ran.stderr, "");
    let ran = store.run(&["run", &name, "--", "sh", "-c", "kill -KILL $$"]);
    assert_eq!(ran.code, Some(128 + 9), "{ran:#?}");
    let ran = store.run(&["run", &name, "--", "dlock-test-no-such-command"]);
    ran.assert_error(127);
    assert!(ran.stderr.contains("not found"), "{ran:#?}");
    let plain = dir.path().join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\ntrue\n").unwrap();
    let ran = store.run(&["run", &name, "--", plain.to_str().unwrap()]);
    ran.assert_error(126);
    let ran = store.run(&["status", &name]);
    assert_eq!(ran.code, Some(1), "{ran:#?}");
    assert_eq!(ran.stdout, format!("{name} is free\n"));
}

/// 6. Bad input exits 2 with one line on stderr, without secrets or panics.
fn bad_input(store: &Store) {
    let name = unique("bad");
    let cases: &[&[&str]] = &[
        &["run", &name, "--ttl", "5x", "--", "true"],
        &["run", &name, "--wait", "soon", "--", "true"],
        &["run", &name, "--grace", "-1s", "--", "true"],
        &["run", &name, "--ttl", "0s", "--", "true"],
        &["run", &name, "--wait", "1s", "--no-wait", "--", "true"],
        &["run", &name, "--conflict-exit-code", "300", "--", "true"],
        &["run", &name],
        &["run", &name, "--url", "gopher://u:hunter2@h", "--", "true"],
        &[
            "run",
            &name,
            "--url",
            // Exit 2 either way: compiled out (FeatureDisabled), or compiled
            // in and refused (two hosts in a plain redis:// URL).
            "redis://u:hunter2@h:1,h:2",
            "--",
            "true",
        ],
        &["run", &name, "--url", "sqlite:relative.db", "--", "true"],
        &["run", "bad name", "--", "true"],
        &["run", "/leading-slash", "--", "true"],
        &["status", "a//b"],
        &["release", "--force", "a b"],
        &["release", &name],
        &["list", "bad prefix"],
        &["frobnicate"],
    ];
    for args in cases {
        let ran = store.run(args);
        ran.assert_error(2);
        assert!(!ran.stderr.contains("hunter2"), "{args:?}: {ran:#?}");
    }
}

/// 7. `status` and `list`, human and `--json`, while a lock is held and after.
fn status_and_list(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("{}/", unique("list"));
    let name = format!("{prefix}job");
    let holder = Running::start(store, dir.path(), &["--why", "cli test", &name], HOLD);
    let token = holder.token.to_string();

    let ran = store.run(&["status", &name]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    for want in [
        format!("name:        {name}"),
        format!("token:       {token}"),
        "why:         cli test".to_owned(),
        "holder:".to_owned(),
        "acquired-at:".to_owned(),
        "expires-at:".to_owned(),
    ] {
        assert!(ran.stdout.contains(&want), "{want:?} in {ran:#?}");
    }

    let ran = store.run(&["status", &name, "--json"]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    let v: Value = serde_json::from_str(&ran.stdout).unwrap();
    assert_eq!(v["name"], name.as_str());
    assert_eq!(v["held"], true);
    assert_eq!(v["token"], holder.token);
    assert_eq!(v["why"], "cli test");
    assert!(v["holder"].as_str().unwrap().ends_with(":dlock"), "{v}");
    assert!(v["expires_at"].as_str().unwrap().ends_with('Z'), "{v}");

    let ran = store.run(&["list", &prefix]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    let lines: Vec<_> = ran.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{ran:#?}");
    let header: Vec<_> = lines[0].split_whitespace().collect();
    assert_eq!(header, ["NAME", "TOKEN", "HOLDER", "EXPIRES", "WHY"]);
    let row: Vec<_> = lines[1].split_whitespace().collect();
    assert_eq!(row[0], name);
    assert_eq!(row[1], token);
    assert!(lines[1].ends_with("cli test"), "{ran:#?}");

    let ran = store.run(&["list", &prefix, "--json"]);
    let v: Value = serde_json::from_str(&ran.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["name"], name.as_str());
    assert_eq!(v[0]["token"], holder.token);

    holder.signal(Signal::SIGINT);
    assert_eq!(holder.wait().code, Some(128 + 2));

    let ran = store.run(&["status", &name]);
    assert_eq!(ran.code, Some(1), "{ran:#?}");
    assert_eq!(ran.stdout, format!("{name} is free\n"));
    let ran = store.run(&["status", &name, "--json"]);
    assert_eq!(ran.code, Some(1), "{ran:#?}");
    let v: Value = serde_json::from_str(&ran.stdout).unwrap();
    assert_eq!(v["held"], false);
    assert_eq!(v["token"], Value::Null);
    let ran = store.run(&["list", &prefix, "--json"]);
    assert_eq!(ran.stdout.trim(), "[]", "{ran:#?}");
    let ran = store.run(&["list", &prefix]);
    assert_eq!(ran.stdout, "no locks held\n", "{ran:#?}");
}

/// Each case once per store.
macro_rules! on_every_store {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(#[test] fn $case() { super::$case(&super::Store::sqlite()) })*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(#[test] fn $case() { super::$case(&super::Store::postgres()) })*
        }
    };
}

on_every_store!(
    runs_never_overlap,
    busy_lock_statuses,
    tokens_increase,
    force_release_stops_command,
    leader_campaigns_again,
    hold_at_most_stops_a_hung_command,
    hold_at_least_keeps_the_lock,
    lost_lock_kills_stubborn_command,
    paused_holder_loses_lock,
    exit_statuses,
    bad_input,
    status_and_list,
);

// ------------------------------------------------------- store-independent

#[test]
fn help_documents_exit_statuses() {
    for args in [&["--help"][..], &["run", "--help"][..]] {
        let ran = Ran::of(Command::new(BIN).args(args));
        assert_eq!(ran.code, Some(0), "{ran:#?}");
        for want in [
            "75",
            "76",
            "69",
            "126",
            "127",
            "128+N",
            "--conflict-exit-code",
        ] {
            assert!(
                ran.stdout.contains(want),
                "{want} in {args:?}: {}",
                ran.stdout
            );
        }
    }
}

#[test]
fn password_in_dlock_url_is_not_shown_in_help() {
    let ran = Ran::of(
        Command::new(BIN)
            .env("DLOCK_URL", "postgres://u:hunter2@h/db")
            .args(["run", "--help"]),
    );
    assert!(!ran.stdout.contains("hunter2"), "{}", ran.stdout);
}

#[cfg(feature = "postgres")]
#[test]
fn unreachable_backend_exits_69() {
    let ran = Ran::of(Command::new(BIN).args([
        "status",
        "x",
        "--url",
        "postgres://dlock:hunter2@127.0.0.1:1/dlock",
    ]));
    ran.assert_error(69);
    assert!(!ran.stderr.contains("hunter2"), "{ran:#?}");
    assert!(ran.stderr.contains("dlock:***@127.0.0.1:1"), "{ran:#?}");
}

#[test]
fn sqlite_file_in_a_missing_directory_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/missing/x.db", dir.path().display());
    for args in [&["status", "x"][..], &["run", "x", "--", "true"][..]] {
        let ran = Ran::of(Command::new(BIN).args(["--url", &url]).args(args));
        // Never 1: that is `status`'s answer "free".
        ran.assert_error(2);
        assert!(
            ran.stderr.contains("missing does not exist"),
            "{args:?}: {ran:#?}"
        );
    }
}

/// A closed port is named as such, in one line, at once: no driver dump, no
/// wait for a time-out.
#[cfg(any(feature = "etcd", feature = "zk", feature = "mongo", feature = "nats"))]
#[test]
fn closed_ports_are_named_at_once() {
    let urls: &[&str] = &[
        #[cfg(feature = "etcd")]
        "etcd://127.0.0.1:1",
        #[cfg(feature = "zk")]
        "zk://127.0.0.1:1",
        #[cfg(feature = "mongo")]
        "mongodb://127.0.0.1:1/",
        #[cfg(feature = "nats")]
        "nats://127.0.0.1:1",
    ];
    for url in urls {
        let ran = Ran::of(Command::new(BIN).args(["status", "x", "--url", url]));
        ran.assert_error(69);
        assert!(ran.stderr.contains("cannot connect"), "{url}: {ran:#?}");
        for dump in ["tonic::", "Topology", "Kind:", "labels:", "Os {"] {
            assert!(!ran.stderr.contains(dump), "{url}: {dump} in {ran:#?}");
        }
        // (a bound, not a speed target: the driver's own time-outs are 10 s
        // for ZooKeeper and 30 s for MongoDB when left alone)
        assert!(ran.took < Duration::from_secs(8), "{url}: {ran:#?}");
    }
}

/// Issue 18 (first run): Redlock's restart guard is named, not taken for a
/// busy lock: `--wait` shorter than the guard fails at once (69) saying so,
/// a longer one prints the wait and then runs the command, and a TTL above
/// `max_ttl` is refused (2) before any wait. Red before: "lock … is still
/// busy after 1s" (75), and the TTL error only after the wait.
#[cfg(feature = "redis")]
#[test]
fn redlock_names_its_restart_guard() {
    let Ok(url) = std::env::var("DLOCK_TEST_REDLOCK_URL") else {
        println!("SKIPPED redlock_names_its_restart_guard: DLOCK_TEST_REDLOCK_URL is not set");
        return;
    };
    // A prefix of its own: the guard's clock starts on first sight.
    let url = format!(
        "{url}?dlock_prefix=cli{:08x}&max_ttl=3s",
        rand::random::<u32>()
    );
    let name = unique("guard");
    let dlock = |args: &[&str]| Ran::of(Command::new(BIN).args(["--url", &url]).args(args));

    let ran = dlock(&["run", &name, "--ttl", "1s", "--wait", "1s", "--", "true"]);
    ran.assert_error(69);
    assert!(ran.stderr.contains("restart guard"), "{ran:#?}");
    assert!(ran.took < Duration::from_secs(3), "{ran:#?}");

    let ran = dlock(&["run", &name, "--ttl", "10s", "--", "true"]);
    ran.assert_error(2);
    assert!(ran.stderr.contains("max_ttl"), "{ran:#?}");

    let ran = dlock(&[
        "run", &name, "--ttl", "1s", "--wait", "10s", "--", "echo", "ran",
    ]);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    assert_eq!(ran.stdout, "ran\n", "{ran:#?}");
    assert!(ran.stderr.contains("waiting"), "{ran:#?}");
}

/// Issue 18 (first run): `status` and `list` tell when an etcd or ZooKeeper
/// hold frees; both printed `-`. etcd tells the lease's expiry; ZooKeeper
/// tells no client when it last heard from another's session, so dlock
/// shows the holder's session timeout (recorded in the lock node). Red
/// before: no `expires` line for ZooKeeper.
#[cfg(all(feature = "etcd", feature = "zk"))]
#[test]
fn status_tells_when_etcd_and_zookeeper_holds_free() {
    for (var, want_status, want_json, want_list) in [
        ("DLOCK_TEST_ETCD_URL", "expires-at:", "expires_at", "Z"),
        (
            "DLOCK_TEST_ZK_URL",
            "expires:     30s after the holder's session falls silent",
            "session_timeout_ms",
            "silent+30s",
        ),
    ] {
        let Ok(url) = std::env::var(var) else {
            println!("SKIPPED status_tells_when_etcd_and_zookeeper_holds_free: {var} is not set");
            continue;
        };
        let store = Store { url, _dir: None };
        let dir = tempfile::tempdir().unwrap();
        let prefix = format!("{}/", unique("expiry"));
        let name = format!("{prefix}job");
        let holder = Running::start(&store, dir.path(), &["--ttl", "30s", &name], HOLD);

        let ran = store.run(&["status", &name]);
        assert_eq!(ran.code, Some(0), "{var}: {ran:#?}");
        assert!(ran.stdout.contains(want_status), "{var}: {ran:#?}");
        let ran = store.run(&["status", &name, "--json"]);
        let v: Value = serde_json::from_str(&ran.stdout).unwrap();
        assert!(!v[want_json].is_null(), "{var}: {v}");
        if var == "DLOCK_TEST_ZK_URL" {
            assert_eq!(v["session_timeout_ms"], 30_000, "{v}");
            assert_eq!(v["expires_at"], Value::Null, "{v}");
        }
        let ran = store.run(&["list", &prefix]);
        let row: Vec<_> = ran
            .stdout
            .lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .collect();
        assert!(row[3].ends_with(want_list), "{var}: {ran:#?}");

        holder.signal(Signal::SIGINT);
        assert_eq!(holder.wait().code, Some(128 + 2));
    }
}
