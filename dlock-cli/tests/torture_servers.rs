//! CI's short soak: `dlock torture` against every real server `scripts/services`
//! runs, a few hundred fenced acquisitions per fault profile, all backends at
//! once (each on its own servers, so one's restarts never touch another's),
//! then MongoDB and Redlock (see [`RUN_LAST`]). NATS runs with the others.
//! The long run with ≥ 10,000 acquisitions per profile is in FAULTS.md.
//!
//! A backend whose `DLOCK_TEST_<NAME>_URL` is unset prints a SKIPPED line
//! (scripts/test lists them); one whose run finds a violation the profile
//! does not excuse by design fails the test with its report.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use serde_json::Value;

/// Fenced acquisitions per backend and fault profile.
const ACQUISITIONS: &str = "200";

/// Run after the others, beside each other: the Mongo-wire server
/// (PostgreSQL under a gateway) is the heaviest here, and CI's soak twice
/// saw one of its early profiles stall for the whole time limit while eight
/// other backends ran beside it on two cores (never reproduced here; a stall
/// now fails its row after `MAX_TIME` with what the servers said). Redlock
/// did the same twice here on a slow evening (2026-11-28: 166 and 197 of
/// 200 acquisitions of its first profile in 4 min, against 200 in 7.5 s
/// alone, and also beside four busy CPU loops): ten backends' clients and
/// proxies and some twenty servers on two cores answer its 8 sessions × 5
/// nodes later than the 125 ms one node may take at a 1 s TTL, and every
/// connection that missed it was replaced (~2,700 connects in 3 min, each
/// an INFO more), which kept the take rounds missing it.
const RUN_LAST: &[&str] = &["mongo", "redlock"];

/// The longest one profile may take.
const MAX_TIME: &str = "4m";

/// (name for messages, URL variable, `--servers` names, extra URL options).
const BACKENDS: &[(&str, &str, &str, &str)] = &[
    ("postgres", "DLOCK_TEST_POSTGRES_URL", "postgres", ""),
    ("mysql", "DLOCK_TEST_MYSQL_URL", "mysql", ""),
    ("redis", "DLOCK_TEST_REDIS_URL", "redis", ""),
    (
        "redlock",
        "DLOCK_TEST_REDLOCK_URL",
        "redis-r1,redis-r2,redis-r3,redis-r4,redis-r5",
        // A restarted node waits max_ttl before it grants again.
        "max_ttl=3s",
    ),
    (
        "redis-cluster",
        "DLOCK_TEST_REDIS_CLUSTER3_URL",
        "redis-c1,redis-c2,redis-c3,redis-c4,redis-c5,redis-c6",
        "",
    ),
    ("etcd", "DLOCK_TEST_ETCD_URL", "etcd", ""),
    (
        "etcd-cluster",
        "DLOCK_TEST_ETCD_CLUSTER_URL",
        "etcd-c1,etcd-c2,etcd-c3@etcd-cluster",
        "",
    ),
    ("zk", "DLOCK_TEST_ZK_URL", "zk", ""),
    (
        "zk-ensemble",
        "DLOCK_TEST_ZK_ENSEMBLE_URL",
        "zk-e1,zk-e2,zk-e3@zk-ensemble",
        "",
    ),
    ("mongo", "DLOCK_TEST_MONGO_URL", "mongo", ""),
    // (TTL 1 s sessions on the suite's bucket of max_age 5 s)
    ("nats", "DLOCK_TEST_NATS_URL", "nats", ""),
];

fn with_options(url: &str, extra: &str) -> String {
    if extra.is_empty() {
        url.to_owned()
    } else if url.contains('?') {
        format!("{url}&{extra}")
    } else {
        format!("{url}?{extra}")
    }
}

fn spawn(url: &str, servers: &str, out: &Path) -> Child {
    let services = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/services");
    Command::new(env!("CARGO_BIN_EXE_dlock"))
        .args(["torture", "--url", url, "--servers", servers])
        .args(["--acquisitions", ACQUISITIONS, "--json"])
        // A profile whose clients stall fails after this, not the default
        // 20 minutes (a healthy profile here takes seconds).
        .args(["--max-time", MAX_TIME])
        .arg("--services-command")
        .arg(&services)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start dlock torture")
}

/// Every row of one backend's report: ran (or says why not), and clean.
fn check(name: &str, report: &Value, failures: &mut Vec<String>) {
    let Some(rows) = report["rows"].as_array() else {
        failures.push(format!("{name}: no rows in {report}"));
        return;
    };
    for row in rows {
        let profile = row["profile"].as_str().unwrap_or("?");
        if let Some(why) = row["skipped"].as_str() {
            eprintln!("{name}/{profile}: not run ({why})");
            continue;
        }
        let mut bad = Vec::new();
        // "ok", or why the profile's overlaps are by design.
        if row["verdict"]
            .as_str()
            .is_none_or(|v| v.starts_with("FAILED"))
        {
            bad.push(format!("verdict {}", row["verdict"]));
        }
        for field in ["tokens_out_of_order", "tokens_reused"] {
            if row[field] != 0 {
                bad.push(format!("{field} = {}", row[field]));
            }
        }
        if profile != "none" && row["faults"].as_u64().unwrap_or(0) == 0 {
            bad.push("no fault injected".to_owned());
        }
        if row["acquisitions"].as_u64().unwrap_or(0) < ACQUISITIONS.parse::<u64>().unwrap() {
            bad.push(format!("only {} acquisitions", row["acquisitions"]));
        }
        eprintln!(
            "{name}/{profile}: {} acquisitions, {} faults, {} overlaps, verdict {}, {:.1} s",
            row["acquisitions"],
            row["faults"],
            row["overlaps"],
            row["verdict"],
            row["seconds"].as_f64().unwrap_or(f64::NAN)
        );
        if let Some(e) = row["first_server_error"].as_str() {
            eprintln!("{name}/{profile}: a server command failed: {e}");
        }
        if !bad.is_empty() {
            failures.push(format!("{name}/{profile}: {}: {row}", bad.join(", ")));
        }
    }
}

#[test]
fn every_profile_on_every_server() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for last in [false, true] {
        let mut runs: Vec<(&str, Child, PathBuf)> = Vec::new();
        for &(name, var, servers, extra) in
            BACKENDS.iter().filter(|b| RUN_LAST.contains(&b.0) == last)
        {
            let Ok(url) = std::env::var(var) else {
                println!(
                    "SKIPPED torture::{name}: {var} is not set (scripts/services env sets it)"
                );
                continue;
            };
            let out = dir.path().join(name);
            runs.push((name, spawn(&with_options(&url, extra), servers, &out), out));
        }
        let (started, names) = (Instant::now(), runs.iter().map(|r| r.0).collect::<Vec<_>>());
        collect(runs, &mut failures);
        eprintln!("== {} in {:.0?}", names.join(", "), started.elapsed());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Waits for each run and checks its report.
fn collect(runs: Vec<(&str, Child, PathBuf)>, failures: &mut Vec<String>) {
    for (name, child, out) in runs {
        let output = child.wait_with_output().expect("wait for dlock torture");
        // (its progress: one line per profile, so a failure shows which one)
        let stderr = String::from_utf8_lossy(&output.stderr);
        let before = failures.len();
        match serde_json::from_slice::<Value>(&output.stdout) {
            Ok(report) => {
                check(name, &report, failures);
                if output.status.code() != Some(0) {
                    failures.push(format!("{name}: exit {:?}", output.status.code()));
                }
                assert!(out.join("torture.md").exists(), "{name}: no torture.md");
            }
            Err(e) => failures.push(format!(
                "{name}: exit {:?}, no JSON report ({e})",
                output.status.code()
            )),
        }
        if failures.len() > before {
            // (with what scripts/services says of the servers of a failed profile)
            eprintln!("== {name}: dlock torture's progress\n{stderr}");
        }
    }
}
