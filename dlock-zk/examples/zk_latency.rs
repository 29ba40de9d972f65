//! dlock on ZooKeeper next to what it is built from, in one run:
//! uncontended acquire+release vs a raw ephemeral-sequential create + delete,
//! and 8 clients on one name: dlock vs zookeeper-client's own lock recipe
//! (`Client::lock`, Curator-compatible), handoffs/s and release→next-grant.
//!
//! ```sh
//! cargo run --release -p dlock-zk --example zk_latency -- 1000 10 zk://127.0.0.1:12181
//! ```

#[path = "../../support/hot_lock.rs"]
mod hot_lock;

use std::time::{Duration, Instant};

use dlock_core::{Backend, SessionOptions};
use dlock_zk::ZkBackend;
use hot_lock::{BoxErr, hot_lock, percentiles, releaser, us};
use zookeeper_client as zk;

const CLIENTS: usize = 8;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let url = args.next().unwrap_or_else(|| "zk://127.0.0.1:12181".into());
    let hosts = url
        .trim_start_matches("zk://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let duration = Duration::from_secs(seconds);
    let backend = ZkBackend::connect(&format!("{url}/dlock-bench")).await?;

    // Uncontended, interleaved cycle by cycle.
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(10)))
        .await?;
    let lock = session.lock("uncontended")?;
    let raw = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(&hosts)
        .await?;
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    raw.mkdir("/dlock-bench-raw", &persistent).await?;
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    raw.mkdir("/dlock-bench-native", &persistent).await?;
    let (mut ours, mut raws, mut recipe) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..cycles + 100 {
        let start = Instant::now();
        lock.acquire().await?.release().await?;
        let d = start.elapsed();
        let start = Instant::now();
        let (_, seq) = raw.create("/dlock-bench-raw/n-", b"", &ephemeral).await?;
        raw.delete(&format!("/dlock-bench-raw/n-{seq}"), None)
            .await?;
        let r = start.elapsed();
        let start = Instant::now();
        let prefix = zk::LockPrefix::new_curator("/dlock-bench-native", "uncontended-")?;
        let held = raw
            .lock(prefix, b"", zk::LockOptions::new(zk::Acls::anyone_all()))
            .await?;
        let path = held.lock_path().to_owned();
        std::mem::forget(held);
        raw.delete(&path, None).await?;
        let n = start.elapsed();
        if i >= 100 {
            ours.push(d);
            raws.push(r);
            recipe.push(n);
        }
    }
    let (o50, o99) = percentiles(&mut ours);
    let (r50, r99) = percentiles(&mut raws);
    let (n50, n99) = percentiles(&mut recipe);
    let ratio = |d: Duration| d.as_secs_f64() / r50.as_secs_f64();
    println!("| zk {hosts}, uncontended | cycles | p50 | p99 | ×raw p50 |");
    println!("|---|---|---|---|---|");
    println!(
        "| dlock acquire+release | {cycles} | {} | {} | {:.2}× |",
        us(o50),
        us(o99),
        ratio(o50)
    );
    println!(
        "| zookeeper-client recipe lock + delete | {cycles} | {} | {} | {:.2}× |",
        us(n50),
        us(n99),
        ratio(n50)
    );
    println!(
        "| raw create ephemeral-sequential + delete | {cycles} | {} | {} | 1.00× |",
        us(r50),
        us(r99)
    );
    session.close().await?;

    println!();
    println!(
        "| {CLIENTS} clients, one name, {seconds} s | handoffs/s | release→grant p50 | p99 | per-client acquisitions |"
    );
    println!("|---|---|---|---|---|");
    let mut sessions = Vec::new();
    for _ in 0..CLIENTS {
        let b = ZkBackend::connect(&format!("{url}/dlock-bench")).await?;
        sessions.push(
            b.session(SessionOptions::new().ttl(Duration::from_secs(10)))
                .await?,
        );
    }
    let clients = sessions
        .into_iter()
        .map(|s| {
            move || {
                let s = s.clone();
                async move {
                    let g = s.lock("hot")?.acquire().await?;
                    Ok::<_, BoxErr>(releaser(
                        async move { g.release().await.map_err(Into::into) },
                    ))
                }
            }
        })
        .collect();
    println!("| dlock | {} |", hot_lock(duration, clients).await);

    let mut natives = Vec::new();
    for _ in 0..CLIENTS {
        natives.push(
            zk::Client::connector()
                .with_session_timeout(Duration::from_secs(10))
                .connect(&hosts)
                .await?,
        );
    }
    let clients = natives
        .into_iter()
        .map(|c| {
            move || {
                let c = c.clone();
                async move {
                    let prefix = zk::LockPrefix::new_curator("/dlock-bench-native", "lock-")?;
                    let options = zk::LockOptions::new(zk::Acls::anyone_all());
                    let held = c.lock(prefix, b"", options).await?;
                    let path = held.lock_path().to_owned();
                    // Release explicitly (the guard would delete in the background).
                    std::mem::forget(held);
                    Ok::<_, BoxErr>(releaser(async move {
                        c.delete(&path, None).await.map_err(Into::into)
                    }))
                }
            }
        })
        .collect();
    println!(
        "| zookeeper-client lock recipe | {} |",
        hot_lock(duration, clients).await
    );
    Ok(())
}
