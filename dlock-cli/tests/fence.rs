//! `dlock fence` end to end, with the lock in SQLite and the data in each
//! store the command writes to (SQLite, PostgreSQL, MariaDB, Redis, etcd;
//! the servers of `scripts/services`): a shell job under `dlock run` writes
//! with its grant's token; a write with an older token exits 76 and changes
//! nothing.
#![cfg(feature = "sqlite")]

use std::process::Command;

use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_dlock");

/// One store's writes in `dlock fence`'s terms.
struct Data {
    url: String,
    /// The write that records the token of `$DLOCK_TOKEN` (expanded by the
    /// job's shell), and the stale write `STALE` stands for.
    record: Vec<String>,
    /// Keeps SQLite's folder.
    _dir: Option<TempDir>,
}

/// A lock name of its own for each run.
fn unique(tag: &str) -> String {
    format!("fence-test/{tag}-{:08x}", rand::random::<u32>())
}

/// The test URL in `var`, or `None` (said on stderr: the test passes
/// without running).
#[allow(dead_code)]
fn server(var: &str) -> Option<String> {
    let url = std::env::var(var).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("{var} is not set: skipped");
    }
    url
}

/// `dlock` with `args`: its exit status and stderr.
fn dlock(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("DLOCK_URL")
        .env_remove("DLOCK_TOKEN")
        .env_remove("DLOCK_NAME")
        .output()
        .expect("spawn dlock");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Two jobs under `dlock run` record their tokens through `dlock fence`
/// (the token and resource from the environment `run` gives them); then a
/// write with the first job's token is refused with 76. Returns the two
/// tokens.
fn two_jobs_then_a_stale_write(data: &Data, tag: &str) -> (u64, u64) {
    let locks = tempfile::tempdir().unwrap();
    let locks = format!("sqlite://{}", locks.path().join("locks.db").display());
    let name = unique(tag);
    let mut tokens = Vec::new();
    for _ in 0..2 {
        // The job prints its token, then writes it.
        let mut script = String::from("echo \"$DLOCK_TOKEN\" && \"$0\" fence --url \"$1\" --");
        for word in &data.record {
            script.push_str(&format!(" \"{}\"", word.replace('"', "\\\"")));
        }
        let (code, out, err) = dlock(&[
            "run", "--url", &locks, &name, "--", "sh", "-c", &script, BIN, &data.url,
        ]);
        assert_eq!(code, Some(0), "{tag}: {out} {err}");
        // (the first line: a Redis write prints its reply after it)
        tokens.push(
            out.lines()
                .next()
                .unwrap_or_default()
                .parse::<u64>()
                .unwrap(),
        );
    }
    let (first, second) = (tokens[0], tokens[1]);
    assert!(second > first, "{tag}: {tokens:?}");
    // The first holder, paused past its lease, writes with its old token.
    let stale: Vec<String> = data
        .record
        .iter()
        .map(|w| w.replace("$DLOCK_TOKEN", "0"))
        .collect();
    let first_token = first.to_string();
    let mut args = vec![
        "fence",
        "--url",
        &data.url,
        "--resource",
        &name,
        "--token",
        &first_token,
        "--",
    ];
    args.extend(stale.iter().map(String::as_str));
    let (code, _, err) = dlock(&args);
    assert_eq!(code, Some(76), "{tag}: {err}");
    assert!(
        err.contains(&format!("stale fencing token {first}")) && err.contains("moved on"),
        "{tag}: {err}"
    );
    (first, second)
}

/// Runs `sql` on the database `url` names; the first column of its rows.
#[allow(dead_code)]
fn query(url: &str, sql: &str) -> Vec<i64> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut conn = dlocks::sql::connect_data(url).await.unwrap();
        dlocks::sql::sqlx::query_scalar(sql)
            .fetch_all(&mut conn)
            .await
            .unwrap()
    })
}

/// SQL: the jobs insert their tokens into a table of the test's own; a
/// write that fails after the check is rolled back with it (the token is
/// not recorded); a statement that would end the fence's transaction is
/// refused before anything runs.
#[allow(dead_code)]
fn sql(url: String, dir: Option<TempDir>, tag: &str) {
    let table = format!("fence_cli_{:08x}", rand::random::<u32>());
    // (DDL outside dlock fence: on MySQL it would commit the fence's
    // transaction, and dlock fence refuses it)
    query(&url, &format!("CREATE TABLE {table} (v BIGINT NOT NULL)"));
    let data = Data {
        url: url.clone(),
        record: vec![format!("INSERT INTO {table} (v) VALUES ($DLOCK_TOKEN)")],
        _dir: dir,
    };
    let (first, second) = two_jobs_then_a_stale_write(&data, tag);
    let rows = query(&url, &format!("SELECT v FROM {table} ORDER BY v"));
    assert_eq!(rows, [first as i64, second as i64], "{tag}");

    let resource = unique("rollback");
    let fenced = |token: u64, statements: &[&str]| {
        let token = token.to_string();
        let mut args = vec![
            "fence",
            "--url",
            &url,
            "--resource",
            &resource,
            "--token",
            &token,
            "--",
        ];
        args.extend(statements);
        dlock(&args)
    };
    let insert = format!("INSERT INTO {table} (v) VALUES (1000)");
    let (code, _, err) = fenced(9, &[&insert, "INSERT INTO no_such_table_here VALUES (1)"]);
    assert_eq!(code, Some(70), "{tag}: {err}");
    // Neither the insert nor the fence's 9 stayed: 8 is still current.
    let (code, _, err) = fenced(8, &["SELECT 1"]);
    assert_eq!(code, Some(0), "{tag}: {err}");
    let (code, _, err) = fenced(8, &[&insert, "COMMIT", &insert]);
    assert_eq!(code, Some(2), "{tag}: {err}");
    assert!(err.contains("would end the transaction"), "{tag}: {err}");
    let rows = query(&url, &format!("SELECT v FROM {table} WHERE v = 1000"));
    assert!(rows.is_empty(), "{tag}: {rows:?}");
    query(&url, &format!("DROP TABLE {table}"));
}

#[test]
fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("data.db").display());
    sql(url, Some(dir), "sqlite");
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    if let Some(url) = server("DLOCK_TEST_POSTGRES_URL") {
        sql(url, None, "postgres");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    if let Some(url) = server("DLOCK_TEST_MYSQL_URL") {
        sql(url, None, "mysql");
    }
}

/// Redis: the jobs push their tokens onto a list, read back through the
/// fence with the current token (its reply is printed).
#[cfg(feature = "redis")]
#[test]
fn redis() {
    let Some(url) = server("DLOCK_TEST_REDIS_URL") else {
        return;
    };
    let key = unique("redis-list");
    let data = Data {
        url: url.clone(),
        record: vec!["RPUSH".into(), key.clone(), "$DLOCK_TOKEN".into()],
        _dir: None,
    };
    let (first, second) = two_jobs_then_a_stale_write(&data, "redis");
    // Read back through a fence of its own (any token passes a new one);
    // the reply is printed, a line per element.
    let reader = unique("redis-reader");
    let fenced = |words: &[&str]| {
        let mut args = vec![
            "fence",
            "--url",
            &url,
            "--resource",
            &reader,
            "--token",
            "1",
            "--",
        ];
        args.extend(words);
        dlock(&args)
    };
    let (code, out, err) = fenced(&["LRANGE", &key, "0", "-1"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, format!("{first}\n{second}\n"));
    // (cleanup without the fence: dlock fence refuses to touch a fence key)
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        use dlocks::redis::redis;
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let fences = [format!("dlock:fence:{reader}")];
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .arg(&fences)
            .query_async(&mut conn)
            .await
            .unwrap();
    });
    let (code, _, err) = fenced(&["SET", &format!("dlock:fence:{reader}"), "1"]);
    assert_eq!(code, Some(2), "a write of the fence key itself: {err}");
}

/// etcd: each job puts its token under a key of its own; the stale write's
/// key never appears.
#[cfg(feature = "etcd")]
#[test]
fn etcd() {
    let Some(url) = server("DLOCK_TEST_ETCD_URL") else {
        return;
    };
    let prefix = unique("etcd-keys");
    let data = Data {
        url: url.clone(),
        record: vec![
            "put".into(),
            format!("{prefix}/$DLOCK_TOKEN"),
            "$DLOCK_TOKEN".into(),
        ],
        _dir: None,
    };
    let (first, second) = two_jobs_then_a_stale_write(&data, "etcd");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let keys: Vec<String> = rt.block_on(async {
        let backend = dlocks::etcd::EtcdBackend::connect(url.as_str())
            .await
            .unwrap();
        let mut client = backend.data_client().await.unwrap();
        let options = dlocks::etcd::etcd_client::GetOptions::new().with_prefix();
        let got = client
            .get(format!("{prefix}/"), Some(options.clone()))
            .await
            .unwrap();
        client
            .delete(
                format!("{prefix}/"),
                Some(dlocks::etcd::etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
            .unwrap();
        got.kvs()
            .iter()
            .map(|kv| kv.key_str().unwrap().to_owned())
            .collect()
    });
    let mut expected = vec![format!("{prefix}/{first}"), format!("{prefix}/{second}")];
    expected.sort();
    assert_eq!(keys, expected);
}

#[test]
fn bad_input_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("data.db").display());
    for (args, says) in [
        (
            vec!["fence", "--url", &url, "--token", "3", "--", "SELECT 1"],
            "--resource",
        ),
        (
            vec!["fence", "--url", &url, "--resource", "r", "--", "SELECT 1"],
            "--token",
        ),
        (
            vec![
                "fence",
                "--url",
                &url,
                "--resource",
                "r",
                "--token",
                "0",
                "--",
                "SELECT 1",
            ],
            "0 is not in 1..",
        ),
        (
            vec![
                "fence",
                "--url",
                "memory://",
                "--resource",
                "r",
                "--token",
                "3",
                "--",
                "x",
            ],
            "not to memory://",
        ),
        (
            vec!["fence", "--resource", "r", "--token", "3", "--", "SELECT 1"],
            "needs --url",
        ),
        (
            vec![
                "fence",
                "--url",
                &url,
                "--resource",
                "r",
                "--token",
                "x1",
                "--",
                "SELECT 1",
            ],
            "--token",
        ),
        (
            vec![
                "fence",
                "--url",
                &url,
                "--resource",
                "r",
                "--token",
                "3",
                "--fence",
                "bad name",
                "--",
                "SELECT 1",
            ],
            "bad name",
        ),
    ] {
        let (code, _, err) = dlock(&args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
