//! Uncontended acquire+release latency per SQL dialect, next to the raw
//! `INSERT … ON CONFLICT` + `DELETE` round trips measured in the same run,
//! interleaved cycle by cycle so machine noise hits both alike.
//!
//! ```sh
//! cargo run --release -p dlock-sql --all-features --example sql_latency -- 2000 \
//!     sqlite:///tmp/bench.db postgres://dlock:dlock@127.0.0.1:15432/dlock \
//!     mysql://dlock:dlock@127.0.0.1:13306/dlock
//! ```

use std::time::{Duration, Instant};

use dlock_core::{Backend, SessionOptions};
use dlock_sql::SqlBackend;
use sqlx::Executor;
use sqlx::any::AnyPoolOptions;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2000);
    let urls: Vec<String> = args.collect();
    sqlx::any::install_default_drivers();
    println!(
        "| dialect | cycles | dlock acquire+release p50 | p99 | raw upsert+delete p50 | p99 | ratio p50 |"
    );
    println!("|---|---|---|---|---|---|---|");
    for url in urls {
        let backend = SqlBackend::connect(&url).await?;
        let session = backend.session(SessionOptions::new()).await?;
        let lock = session.lock("bench/uncontended")?;
        let scheme = backend.scheme();
        let raw_url = if scheme == "sqlite" {
            format!("{url}?mode=rwc")
        } else {
            url.clone()
        };
        let pool = AnyPoolOptions::new()
            .max_connections(4)
            .connect(&raw_url)
            .await?;
        pool.execute("CREATE TABLE IF NOT EXISTS dlock_raw_bench (name VARCHAR(200) PRIMARY KEY, v BIGINT NOT NULL)")
            .await?;
        let (upsert, delete) = match scheme {
            "mysql" => (
                "INSERT INTO dlock_raw_bench (name, v) VALUES (?, 1) ON DUPLICATE KEY UPDATE v = v + 1",
                "DELETE FROM dlock_raw_bench WHERE name = ?",
            ),
            "postgres" => (
                "INSERT INTO dlock_raw_bench (name, v) VALUES ($1, 1) ON CONFLICT (name) DO UPDATE SET v = dlock_raw_bench.v + 1",
                "DELETE FROM dlock_raw_bench WHERE name = $1",
            ),
            _ => (
                "INSERT INTO dlock_raw_bench (name, v) VALUES (?1, 1) ON CONFLICT (name) DO UPDATE SET v = dlock_raw_bench.v + 1",
                "DELETE FROM dlock_raw_bench WHERE name = ?1",
            ),
        };
        let (mut ours, mut raw) = (Vec::with_capacity(cycles), Vec::with_capacity(cycles));
        for i in 0..cycles + 100 {
            let start = Instant::now();
            lock.acquire().await?.release().await?;
            let d = start.elapsed();
            let start = Instant::now();
            sqlx::query(upsert).bind("raw").execute(&pool).await?;
            sqlx::query(delete).bind("raw").execute(&pool).await?;
            let r = start.elapsed();
            if i >= 100 {
                // the first 100 warm up connections and statement caches
                ours.push(d);
                raw.push(r);
            }
        }
        let (o50, o99) = percentiles(&mut ours);
        let (r50, r99) = percentiles(&mut raw);
        println!(
            "| {scheme} | {cycles} | {} | {} | {} | {} | {:.2}× |",
            us(o50),
            us(o99),
            us(r50),
            us(r99),
            o50.as_secs_f64() / r50.as_secs_f64()
        );
        session.close().await?;
    }
    Ok(())
}

fn percentiles(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    (v[v.len() / 2], v[(v.len() * 99) / 100])
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}
