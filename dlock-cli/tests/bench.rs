//! End-to-end tests of `dlock bench`: the real binary with tiny settings on
//! `memory://`, a temporary SQLite file and, with each backend's feature,
//! the server from `scripts/services` whose `DLOCK_TEST_*_URL` is set (a
//! test whose variable is unset passes without running).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_dlock");

/// The tiny workload every run here uses.
const TINY: &[&str] = &[
    "--cycles",
    "50",
    "--duration",
    "300ms",
    "--clients",
    "3",
    "--holds",
    "40",
    "--failovers",
    "4",
];

/// A finished `dlock bench`.
#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `dlock bench ARGS` with no `DLOCK_URL` from the environment.
fn bench(args: &[&str]) -> Ran {
    let out = Command::new(BIN)
        .arg("bench")
        .args(args)
        .env_remove("DLOCK_URL")
        .env_remove("DLOCK_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("spawn dlock");
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the tiny workload on `urls` with `--json`, checks the exit status,
/// the files and the sanity of every backend's numbers; returns the JSON.
fn run_tiny(urls: &[&str]) -> Value {
    let out = TempDir::new().unwrap();
    let dir = out.path().join("results");
    let mut args: Vec<&str> = TINY.to_vec();
    for url in urls {
        args.extend(["--url", url]);
    }
    let dir_text = dir.to_str().unwrap();
    args.extend(["--out", dir_text, "--json", "--quiet"]);
    let start = Instant::now();
    let ran = bench(&args);
    let took = start.elapsed();
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    // --quiet: nothing but an adapter's warnings (MongoDB's through mongos).
    assert!(
        ran.stderr.lines().all(|l| l.contains(" WARN ")),
        "--quiet: {ran:#?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "took {took:?} for {} backend(s)",
        urls.len()
    );

    let json: Value = serde_json::from_str(&ran.stdout).expect("stdout is the JSON report");
    let on_disk: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("bench.json")).unwrap()).unwrap();
    assert_eq!(json, on_disk);
    assert_eq!(json["settings"]["clients"], 3);
    assert_eq!(json["settings"]["cycles"], 50);
    assert!(
        json["command"]
            .as_str()
            .unwrap()
            .starts_with("dlock bench ")
    );
    let backends = json["backends"].as_array().unwrap();
    assert_eq!(backends.len(), urls.len(), "{json:#}");
    for b in backends {
        check_backend(b);
    }
    check_files(&dir, backends);
    json
}

/// The numbers of one backend make sense.
fn check_backend(b: &Value) {
    let name = b["backend"].as_str().unwrap();
    let num = |v: &Value| v.as_f64().unwrap_or_else(|| panic!("{name}: {v} in {b:#}"));
    assert_eq!(b["baseline"]["samples"], 50, "{b:#}");
    assert_eq!(b["acquire_release"]["samples"], 50, "{b:#}");
    assert!(num(&b["baseline"]["p50_us"]) > 0.0, "{b:#}");
    assert!(
        num(&b["acquire_release"]["p99_us"]) >= num(&b["acquire_release"]["p50_us"]),
        "{b:#}"
    );
    assert!(num(&b["acquire_release_x_baseline"]) > 0.0, "{b:#}");
    if b["floor"].is_null() {
        assert!(b["acquire_release_x_floor"].is_null(), "{b:#}");
    } else {
        let floor = &b["floor"]["latency"];
        assert_eq!(floor["samples"], 50, "{b:#}");
        assert!(num(&floor["p50_us"]) > 0.0, "{b:#}");
        assert!(num(&floor["p99_us"]) >= num(&floor["p50_us"]), "{b:#}");
        assert!(!b["floor"]["operations"].as_str().unwrap().is_empty());
        let ratio = num(&b["acquire_release_x_floor"]);
        let expected = num(&b["acquire_release"]["p50_us"]) / num(&floor["p50_us"]);
        assert!((ratio - expected).abs() < 1e-6 && ratio > 0.0, "{b:#}");
    }

    let hot = &b["hot_lock"];
    check_contended(b, hot);
    assert!(num(&hot["take_attempts_per_grant"]) >= 1.0, "{b:#}");
    if !b["native_lock"].is_null() {
        let native = &b["native_lock"];
        assert!(!native["lock"].as_str().unwrap().is_empty(), "{b:#}");
        check_contended(b, &native["hot_lock"]);
        assert!(
            native["hot_lock"]["take_attempts_per_grant"].is_null(),
            "{b:#}"
        );
        let ratio = num(&native["dlock_handoffs_x_native"]);
        let expected = num(&hot["handoffs_per_s"]) / num(&native["hot_lock"]["handoffs_per_s"]);
        assert!((ratio - expected).abs() < 1e-6 && ratio > 0.0, "{b:#}");
    }

    assert!(num(&b["independent"]["acquisitions"]) > 0.0, "{b:#}");
    assert_eq!(b["independent"]["errors"], 0, "{b:#}");

    let many = &b["many_holds"];
    assert_eq!(many["holds"], 40, "{b:#}");
    assert!(many["error"].is_null(), "{b:#}");
    assert_eq!(many["renew_one"]["samples"], 7, "{b:#}");
    assert_eq!(many["renew_all"]["samples"], 7, "{b:#}");
    let ratio = num(&many["renew_all_x_one"]);
    let expected = num(&many["renew_all"]["p50_us"]) / num(&many["renew_one"]["p50_us"]);
    assert!((ratio - expected).abs() < 1e-6 && ratio > 0.0, "{b:#}");
    // Each held lock costs the client some memory (guard, tenure, adapter).
    assert!(num(&many["heap_bytes_per_hold"]) > 0.0, "{b:#}");

    // Every store with a floor has a fenced writer: both writes measured,
    // the ratio theirs, and nothing failed (a refused fenced write fails).
    let fenced = &b["fenced_writes"];
    if b["floor"].is_null() {
        assert!(fenced.is_null(), "{b:#}");
    } else {
        assert!(fenced["error"].is_null(), "{b:#}");
        assert_eq!(fenced["plain"]["samples"], 50, "{b:#}");
        assert_eq!(fenced["fenced"]["samples"], 50, "{b:#}");
        let ratio = num(&fenced["fenced_x_plain"]);
        let expected = num(&fenced["fenced"]["p50_us"]) / num(&fenced["plain"]["p50_us"]);
        assert!((ratio - expected).abs() < 1e-6 && ratio > 0.0, "{b:#}");
        assert!(!fenced["operations"].as_str().unwrap().is_empty());
    }

    // Primitives: the semaphore (1 permit of 3 clients) granted permits
    // and never more than it has; 4 planned failovers timed.
    let primitives = &b["primitives"];
    assert!(primitives["error"].is_null(), "{b:#}");
    assert_eq!(primitives["permits"], 1, "{b:#}");
    assert!(num(&primitives["permit_grants_per_s"]) > 0.0, "{b:#}");
    assert_eq!(primitives["most_held"], 1, "{b:#}");
    assert_eq!(primitives["failover"]["samples"], 4, "{b:#}");
    assert!(num(&primitives["failover"]["p50_us"]) > 0.0, "{b:#}");

    let safety = &b["safety"];
    assert_eq!(safety["verdict"], "ok", "{b:#}");
    assert_eq!(safety["register_rejections"], 0, "{b:#}");
    // Every hold of dlock's counted turns wrote the register once and was
    // checked. The grants count those up to each turn's end: a grant that
    // lands just after it (at most one per client and turn, four turns where
    // the store has a lock of its own) is checked, not counted.
    assert_eq!(
        safety["register_accepted"], safety["holds_checked"],
        "{b:#}"
    );
    let (checked, grants) = (num(&safety["holds_checked"]), num(&hot["grants"]));
    assert!(grants <= checked && checked <= grants + 3.0 * 4.0, "{b:#}");
}

/// The figures of one contended phase (`hot`, dlock's or the native lock's)
/// of backend `b` make sense.
fn check_contended(b: &Value, hot: &Value) {
    let name = b["backend"].as_str().unwrap();
    let num = |v: &Value| v.as_f64().unwrap_or_else(|| panic!("{name}: {v} in {b:#}"));
    assert!(num(&hot["handoffs"]) > 0.0, "{b:#}");
    assert!(num(&hot["handoffs_per_s"]) > 0.0, "{b:#}");
    assert!(num(&hot["grants"]) >= num(&hot["handoffs"]), "{b:#}");
    assert!(num(&hot["release_to_grant"]["p50_us"]) > 0.0, "{b:#}");
    let per_client: Vec<f64> = hot["per_client"]
        .as_array()
        .unwrap()
        .iter()
        .map(num)
        .collect();
    assert_eq!(per_client.len(), 3, "{b:#}");
    assert_eq!(per_client.iter().sum::<f64>(), num(&hot["grants"]), "{b:#}");
    let jain = num(&hot["jain"]);
    assert!((1.0 / 3.0 - 1e-9..=1.0 + 1e-9).contains(&jain), "{b:#}");
    assert_eq!(hot["errors"], 0, "{b:#}");
}

/// `bench.md` has the command, the date and a row per backend; `bench.svg` is
/// an SVG with bars and the backends' names.
fn check_files(dir: &Path, backends: &[Value]) {
    let md = std::fs::read_to_string(dir.join("bench.md")).unwrap();
    assert!(md.contains("- command: `dlock bench "), "{md}");
    assert!(md.contains("- date: 20"), "{md}");
    assert!(md.contains("| backend | baseline p50 |"), "{md}");
    for b in backends.iter().filter(|b| !b["fenced_writes"].is_null()) {
        let (name, writes) = (
            b["backend"].as_str().unwrap(),
            b["fenced_writes"]["operations"].as_str().unwrap(),
        );
        assert!(md.contains(&format!("| {name} | {writes} | ")), "{md}");
    }
    let natives = backends.iter().filter(|b| !b["native_lock"].is_null());
    for b in natives {
        let (name, lock) = (
            b["backend"].as_str().unwrap(),
            b["native_lock"]["lock"].as_str().unwrap(),
        );
        assert!(md.contains(&format!("| {name} | dlock | ")), "{md}");
        assert!(md.contains(&format!("| {name} | {lock} | ")), "{md}");
    }
    let svg = std::fs::read_to_string(dir.join("bench.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.matches("<rect").count() >= 5 * backends.len(), "{svg}");
    for b in backends {
        let name = b["backend"].as_str().unwrap();
        assert!(md.contains(&format!("| {name} |")), "{md}");
        assert!(md.contains(" | ok |"), "{md}");
        let text = svg.replace('\n', "");
        assert!(text.contains(&format!(">{name}</text>")), "{name} in {svg}");
    }
}

#[test]
fn bench_memory() {
    let json = run_tiny(&["memory://"]);
    let b = &json["backends"][0];
    assert_eq!(b["backend"], "memory");
    assert!(b["floor"].is_null() && b["native_lock"].is_null(), "{b:#}");
}

#[test]
fn bench_sqlite_and_memory_in_one_run() {
    let dir = TempDir::new().unwrap();
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let json = run_tiny(&[&url, "memory://"]);
    assert_eq!(json["backends"][0]["backend"], "sqlite");
    assert_eq!(json["backends"][1]["backend"], "memory");
    check_floor(&json["backends"][0], None);
}

/// `b` has a floor, and the native lock `native` (or none).
fn check_floor(b: &Value, native: Option<&str>) {
    assert!(b["floor"]["latency"]["p50_us"].as_f64().is_some(), "{b:#}");
    match native {
        Some(lock) => assert_eq!(b["native_lock"]["lock"], lock, "{b:#}"),
        None => assert!(b["native_lock"].is_null(), "{b:#}"),
    }
}

/// The URL in `var`, or `None` (the test then passes without running).
#[allow(dead_code)]
fn server(var: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("{var} is not set: skipped");
    }
    url
}

/// Runs the tiny workload on the server in `var`, if set; checks its label,
/// its floor and its native lock (or none), and that no password shows.
#[allow(dead_code)]
fn bench_server(var: &str, label: &str, native: Option<&str>) {
    let Some(url) = server(var) else { return };
    let json = run_tiny(&[&url]);
    let b = &json["backends"][0];
    assert_eq!(b["backend"], label, "{b:#}");
    check_floor(b, native);
    if let Some(password) = dlock_core::url::StoreUrl::parse(&url).unwrap().password() {
        assert!(
            !json.to_string().contains(&format!(":{password}@")),
            "{json:#}"
        );
    }
}

#[cfg(feature = "postgres")]
#[test]
fn bench_postgres() {
    bench_server(
        "DLOCK_TEST_POSTGRES_URL",
        "postgres",
        Some("pg_advisory_lock"),
    );
}

#[cfg(feature = "mysql")]
#[test]
fn bench_mysql() {
    bench_server("DLOCK_TEST_MYSQL_URL", "mysql", Some("GET_LOCK"));
}

#[cfg(feature = "redis")]
#[test]
fn bench_redis() {
    bench_server("DLOCK_TEST_REDIS_URL", "redis", None);
}

#[cfg(feature = "redis")]
#[test]
fn bench_redlock() {
    let Some(url) = server("DLOCK_TEST_REDLOCK_URL") else {
        return;
    };
    // A prefix of its own, so the nodes' restart guard starts its clock now:
    // the bench must wait it out (2 s), say so once, then measure.
    let sep = if url.contains('?') { '&' } else { '?' };
    let tag = rand::random::<u32>();
    let loud = format!("{url}{sep}dlock_prefix=bench{tag:08x}&max_ttl=2s");
    let quiet = format!("{url}{sep}dlock_prefix=quiet{tag:08x}&max_ttl=2s");
    let out = TempDir::new().unwrap();
    let dir = out.path().to_str().unwrap();
    let run = |url: &str, quiet: bool| {
        let mut args = vec![
            "--cycles",
            "20",
            "--duration",
            "300ms",
            "--clients",
            "2",
            "--holds",
            "0",
            "--failovers",
            "0",
            "--ttl",
            "2s",
            "--json",
            "--url",
            url,
            "--out",
            dir,
        ];
        if quiet {
            args.push("--quiet");
        }
        let ran = bench(&args);
        assert_eq!(ran.code, Some(0), "{ran:#?}");
        ran
    };

    let ran = run(&loud, false);
    let waits = ran
        .stderr
        .lines()
        .filter(|l| l.starts_with("dlock: redlock: waiting: its nodes refuse grants"))
        .count();
    assert_eq!(waits, 1, "{ran:#?}");
    let json: Value = serde_json::from_str(&ran.stdout).expect("stdout is the JSON report");
    let b = &json["backends"][0];
    assert_eq!(b["backend"], "redlock", "{b:#}");
    check_floor(b, None);
    // The floor is the textbook Redlock on every node, not one node's lock.
    assert!(
        b["floor"]["operations"]
            .as_str()
            .is_some_and(|ops| ops.contains("every node")),
        "{b:#}"
    );

    // --quiet: the same wait, and no note.
    let ran = run(&quiet, true);
    assert!(!ran.stderr.contains("waiting"), "{ran:#?}");
}

#[cfg(feature = "etcd")]
#[test]
fn bench_etcd() {
    bench_server("DLOCK_TEST_ETCD_URL", "etcd", Some("etcd lock service"));
}

#[cfg(feature = "zk")]
#[test]
fn bench_zk() {
    bench_server(
        "DLOCK_TEST_ZK_URL",
        "zk",
        Some("zookeeper-client lock recipe"),
    );
}

#[cfg(feature = "mongo")]
#[test]
fn bench_mongo() {
    bench_server("DLOCK_TEST_MONGO_URL", "mongodb", None);
}

#[cfg(feature = "nats")]
#[test]
fn bench_nats() {
    // A bucket of its own whose max_age (the backend's max_ttl) allows the
    // bench's TTL of 10 s; the suite's keeps 5 s.
    let Some(url) = server("DLOCK_TEST_NATS_URL") else {
        return;
    };
    let url = dlock_core::url::StoreUrl::parse(&url).unwrap();
    let authority = url.hosts()[0].to_string();
    let json = run_tiny(&[&format!("nats://{authority}/dlock_bench?max_age=10s")]);
    let b = &json["backends"][0];
    assert_eq!(b["backend"], "nats", "{b:#}");
    check_floor(b, None);
}

#[test]
fn table_on_stdout_by_default() {
    let out = TempDir::new().unwrap();
    let dir = out.path().to_str().unwrap();
    let mut args = TINY.to_vec();
    args.extend(["--url", "memory://", "--url", "memory://", "--out", dir]);
    let ran = bench(&args);
    assert_eq!(ran.code, Some(0), "{ran:#?}");
    let lines: Vec<_> = ran.stdout.lines().collect();
    assert_eq!(
        lines.len(),
        14,
        "header, rule, two rows; a blank line, the many-holds table; a blank line, \
         the primitives table: {ran:#?}"
    );
    assert!(lines[2].starts_with("| memory |"), "{ran:#?}");
    assert!(lines[3].starts_with("| memory#2 |"), "{ran:#?}");
    assert!(lines[5].contains("locks held by one session"), "{ran:#?}");
    assert!(lines[7].starts_with("| memory | 40 |"), "{ran:#?}");
    assert!(lines[10].contains("semaphore permits"), "{ran:#?}");
    assert!(lines[12].starts_with("| memory | 1 / 3 |"), "{ran:#?}");
    // stderr is not a terminal here: no progress bars, only where the files went.
    assert_eq!(ran.stderr.lines().count(), 1, "{ran:#?}");
    assert!(ran.stderr.contains("bench.{md,json,svg}"), "{ran:#?}");
}

#[test]
fn bad_flags_exit_2_with_one_line() {
    for args in [
        &["--clients", "1"][..],
        &["--clients", "many"][..],
        &["--cycles", "0"][..],
        &["--duration", "0s"][..],
        &["--duration", "soon"][..],
        &["--ttl", "1ms", "--url", "memory://"][..],
        &["--url", "gopher://u:hunter2@h"][..],
        &["--frobnicate"][..],
    ] {
        let ran = bench(args);
        assert_eq!(ran.code, Some(2), "{args:?}: {ran:#?}");
        let lines: Vec<_> = ran.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {ran:#?}");
        assert!(lines[0].starts_with("dlock: "), "{args:?}: {ran:#?}");
        assert!(!ran.stderr.contains("hunter2"), "{args:?}: {ran:#?}");
        assert!(ran.stdout.is_empty(), "{args:?}: {ran:#?}");
    }
}

#[test]
fn other_commands_take_one_url() {
    let out = Command::new(BIN)
        .args(["status", "x", "--url", "memory://", "--url", "memory://"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("only `dlock bench` and `dlock torture` take several")
    );
}

#[cfg(feature = "postgres")]
#[test]
fn unreachable_backend_exits_69() {
    let out = TempDir::new().unwrap();
    let dir = out.path().join("results");
    let ran = bench(&[
        "--url",
        "memory://",
        "--url",
        "postgres://dlock:hunter2@127.0.0.1:1/dlock",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(ran.code, Some(69), "{ran:#?}");
    assert_eq!(ran.stderr.lines().count(), 1, "{ran:#?}");
    assert!(ran.stderr.contains("dlock:***@127.0.0.1:1"), "{ran:#?}");
    assert!(!ran.stderr.contains("hunter2"), "{ran:#?}");
    assert!(
        !dir.exists(),
        "nothing is written when a backend is unreachable"
    );
}
