//! dlock on etcd next to what it is built from, in one run:
//! uncontended acquire+release vs the raw txn-put + delete pair, and 8
//! clients on one name: dlock vs etcd's own lock service (`Lock`/`Unlock`
//! RPCs through etcd-client), handoffs/s and release→next-grant latency.
//!
//! ```sh
//! cargo run --release -p dlock-etcd --example etcd_latency -- 1000 10 etcd://127.0.0.1:12379
//! ```

#[path = "../../support/hot_lock.rs"]
mod hot_lock;

use std::time::{Duration, Instant};

use dlock_core::{Backend, SessionOptions};
use dlock_etcd::EtcdBackend;
use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use hot_lock::{BoxErr, hot_lock, percentiles, releaser, us};

const CLIENTS: usize = 8;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let seconds: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(10);
    let url = args
        .next()
        .unwrap_or_else(|| "etcd://127.0.0.1:12379".into());
    let endpoint = url
        .trim_start_matches("etcd://")
        .split(['/', ','])
        .next()
        .unwrap_or_default()
        .to_owned();
    let duration = Duration::from_secs(seconds);

    // Uncontended, interleaved cycle by cycle.
    let backend = EtcdBackend::connect(&url).await?;
    let session = backend
        .session(SessionOptions::new().ttl(Duration::from_secs(10)))
        .await?;
    let lock = session.lock("bench/uncontended")?;
    let mut raw_client = Client::connect([endpoint.as_str()], None).await?;
    let lease = raw_client.lease_grant(10, None).await?.id();
    let (mut ours, mut raw) = (Vec::new(), Vec::new());
    for i in 0..cycles + 100 {
        let start = Instant::now();
        lock.acquire().await?.release().await?;
        let d = start.elapsed();
        let start = Instant::now();
        let key = "bench/raw/key";
        let txn = Txn::new()
            .when(vec![Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then(vec![TxnOp::put(
                key,
                "me",
                Some(PutOptions::new().with_lease(lease)),
            )]);
        raw_client.txn(txn).await?;
        raw_client.delete(key, None).await?;
        let r = start.elapsed();
        if i >= 100 {
            ours.push(d);
            raw.push(r);
        }
    }
    let (o50, o99) = percentiles(&mut ours);
    let (r50, r99) = percentiles(&mut raw);
    println!("| etcd {endpoint} | cycles | p50 | p99 |");
    println!("|---|---|---|---|");
    println!(
        "| dlock acquire+release | {cycles} | {} | {} |",
        us(o50),
        us(o99)
    );
    println!(
        "| raw txn(put if absent) + delete | {cycles} | {} | {} |",
        us(r50),
        us(r99)
    );
    println!(
        "| ratio p50 | | {:.2}× | |",
        o50.as_secs_f64() / r50.as_secs_f64()
    );
    session.close().await?;

    // 8 clients on one name, dlock then etcd's lock service, same run.
    println!();
    println!(
        "| {CLIENTS} clients, one name, {seconds} s | handoffs/s | release→grant p50 | p99 | per-client acquisitions |"
    );
    println!("|---|---|---|---|---|");
    let mut sessions = Vec::new();
    for _ in 0..CLIENTS {
        let b = EtcdBackend::connect(&url).await?;
        sessions.push(
            b.session(SessionOptions::new().ttl(Duration::from_secs(10)))
                .await?,
        );
    }
    let report = hot_lock(
        duration,
        sessions
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
            .collect(),
    )
    .await;
    println!("| dlock | {report} |");
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let mut c = Client::connect([endpoint.as_str()], None).await?;
        let lease = c.lease_grant(10, None).await?.id();
        let (mut keeper, _stream) = c.lease_keep_alive(lease).await?;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(3)).await;
                if keeper.keep_alive().await.is_err() {
                    return;
                }
            }
        });
        clients.push((c, lease));
    }
    let report = hot_lock(
        duration,
        clients
            .into_iter()
            .map(|(c, lease)| {
                move || {
                    let mut c = c.clone();
                    async move {
                        let key = c
                            .lock("bench/native", Some(LockOptions::new().with_lease(lease)))
                            .await?
                            .key()
                            .to_vec();
                        Ok::<_, BoxErr>(releaser(async move {
                            c.unlock(key).await.map(|_| ()).map_err(Into::into)
                        }))
                    }
                }
            })
            .collect(),
    )
    .await;
    println!("| etcd lock service (etcd-client lock/unlock) | {report} |");
    Ok(())
}
