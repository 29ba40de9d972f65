//! `dlock torture` end to end on the in-process memory backend: every
//! profile that applies runs to its acquisitions with no violation, the
//! report says why the others did not run, and the files are written.

use std::process::Command;

use serde_json::Value;

#[test]
fn every_profile_on_memory() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dlock"))
        .args([
            "torture",
            "--url",
            "memory://torture-test",
            "--acquisitions",
            "300",
        ])
        .args([
            "--ttl",
            "200ms",
            "--clients",
            "4",
            "--long-holds",
            "20",
            "--json",
            "--quiet",
        ])
        .arg("--out")
        .arg(out_dir.path())
        .output()
        .expect("run dlock torture");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 12, "{report:#}");
    for row in rows {
        let profile = row["profile"].as_str().unwrap();
        if profile == "minority-partitions" {
            assert!(row["skipped"].is_string(), "{row:#}");
            continue;
        }
        assert!(row["skipped"].is_null(), "{row:#}");
        assert!(row["acquisitions"].as_u64().unwrap() >= 300, "{row:#}");
        assert_eq!(row["tokens_out_of_order"], 0, "{row:#}");
        assert_eq!(row["tokens_reused"], 0, "{row:#}");
        if profile != "clock-jumps" && profile != "server-restarts" {
            assert_eq!(row["overlaps"], 0, "{row:#}");
        }
        if profile != "none" {
            assert!(row["faults"].as_u64().unwrap() > 0, "{row:#}");
        }
    }
    assert!(out_dir.path().join("torture.md").exists());
    assert!(out_dir.path().join("torture.json").exists());
}

/// A store that never answers: every profile gets a failed row saying why
/// its clients could not start (the run goes on to the next profile and
/// still writes its report), within the profile's time limit, and the
/// password stays out of it.
#[cfg(feature = "redis")]
#[test]
fn unreachable_store_fails_each_profile_in_the_report() {
    let out_dir = tempfile::tempdir().unwrap();
    // (port 1: nothing listens there)
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_dlock"))
        .args(["torture", "--url", "redis://:s3cret@127.0.0.1:1"])
        .args(["--profiles", "none,delays", "--max-time", "1s", "--json"])
        .arg("--out")
        .arg(out_dir.path())
        .output()
        .expect("run dlock torture");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(70), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert!(
        !stdout.contains("s3cret") && !stderr.contains("s3cret"),
        "{stdout}{stderr}"
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{report:#}");
    for row in rows {
        let why = row["not_started"]
            .as_str()
            .unwrap_or_else(|| panic!("{row:#}"));
        assert!(why.contains("127.0.0.1"), "{row:#}");
        assert!(
            row["verdict"].as_str().unwrap().starts_with("FAILED"),
            "{row:#}"
        );
    }
    assert!(stderr.contains("delays: could not start"), "{stderr}");
    assert!(out_dir.path().join("torture.md").exists());
}
