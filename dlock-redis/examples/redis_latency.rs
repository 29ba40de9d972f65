//! Uncontended acquire+release through dlock next to the raw pair it is
//! built from — `SET key owner NX PX ttl` and a compare-and-`DEL` script —
//! on the same client library, interleaved cycle by cycle; then, in the same
//! run, 8 clients on one name: handoffs/s, release→next-grant latency and
//! per-client acquisition counts (fairness).
//!
//! ```sh
//! cargo run --release -p dlock-redis --example redis_latency -- 2000 10 \
//!     redis://127.0.0.1:16379 'redlock://127.0.0.1:16380,127.0.0.1:16381,127.0.0.1:16382?max_ttl=30s'
//! ```

#[path = "../../support/hot_lock.rs"]
mod hot_lock;

use std::time::{Duration, Instant};

use hot_lock::{BoxErr, hot_lock, percentiles, releaser, us};

use dlock_core::{Backend, SessionOptions};
use dlock_redis::RedisBackend;

const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(2000);
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let urls: Vec<String> = args.collect();
    println!(
        "| backend | cycles | dlock acquire+release p50 | p99 | raw SET NX PX + release script p50 | p99 | ratio p50 |"
    );
    println!("|---|---|---|---|---|---|---|");
    for url in &urls {
        let backend = RedisBackend::connect(url).await?;
        backend.wait_ready(Duration::from_secs(60)).await?;
        let session = backend
            .session(SessionOptions::new().ttl(Duration::from_secs(10)))
            .await?;
        let lock = session.lock("bench/uncontended")?;
        // The raw pair on the first node, with the same client library.
        let first = url.replace("redlock://", "redis://");
        let first = first
            .split(',')
            .next()
            .unwrap_or(&first)
            .split('?')
            .next()
            .unwrap_or_default();
        let client = redis::Client::open(first)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let release = redis::Script::new(RAW_RELEASE);
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for i in 0..cycles + 100 {
            let start = Instant::now();
            lock.acquire().await?.release().await?;
            let d = start.elapsed();
            let start = Instant::now();
            let _: Option<String> = redis::cmd("SET")
                .arg("bench:raw")
                .arg("me")
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .query_async(&mut conn)
                .await?;
            let _: i64 = release
                .key("bench:raw")
                .arg("me")
                .invoke_async(&mut conn)
                .await?;
            let r = start.elapsed();
            if i >= 100 {
                ours.push(d);
                raw.push(r);
            }
        }
        let (o50, o99) = percentiles(&mut ours);
        let (r50, r99) = percentiles(&mut raw);
        let shown = dlock_core::url::redact(url);
        println!(
            "| {shown} | {cycles} | {} | {} | {} | {} | {:.2}× |",
            us(o50),
            us(o99),
            us(r50),
            us(r99),
            o50.as_secs_f64() / r50.as_secs_f64()
        );
        session.close().await?;
    }
    println!();
    println!(
        "| 8 clients, one name, {seconds} s | handoffs/s | release→grant p50 | p99 | per-client acquisitions |"
    );
    println!("|---|---|---|---|---|");
    for url in &urls {
        let mut sessions = Vec::new();
        for _ in 0..8 {
            let backend = RedisBackend::connect(url).await?;
            sessions.push(
                backend
                    .session(SessionOptions::new().ttl(Duration::from_secs(10)))
                    .await?,
            );
        }
        let clients = sessions
            .into_iter()
            .map(|s| {
                move || {
                    let s = s.clone();
                    async move {
                        let g = s.lock("bench/hot")?.acquire().await?;
                        Ok::<_, BoxErr>(releaser(
                            async move { g.release().await.map_err(Into::into) },
                        ))
                    }
                }
            })
            .collect();
        let report = hot_lock(Duration::from_secs(seconds), clients).await;
        println!("| {} | {report} |", dlock_core::url::redact(url));
    }
    Ok(())
}
