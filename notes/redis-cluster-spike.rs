use redis::cluster::ClusterClientBuilder;
use std::time::Duration;

#[tokio::main]
async fn main() -> redis::RedisResult<()> {
    let nodes: Vec<String> = (16401..=16406).map(|p| format!("redis://127.0.0.1:{p}/?protocol=3")).collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let client = ClusterClientBuilder::new(nodes.clone())
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(tx)
        .build()?;
    let mut sub = client.get_async_connection().await?;
    let mut cmd = ClusterClientBuilder::new(nodes).use_protocol(redis::ProtocolVersion::RESP3).build()?.get_async_connection().await?;
    // A script on keys of one slot, routed by its keys.
    let script = redis::Script::new("redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCR', KEYS[2])");
    for name in ["a", "b", "c", "zzz"] {
        let n: i64 = script.key(format!("dlock:{{{name}}}")).key(format!("dlock:{{{name}}}:t")).arg("v").invoke_async(&mut cmd).await?;
        println!("script on {{{name}}}: {n}");
    }
    // Keys of two slots in one script: refused.
    let r: redis::RedisResult<i64> = script.key("dlock:{a}").key("dlock:{b}:t").arg("v").invoke_async(&mut cmd).await;
    println!("cross-slot: {:?}", r.err().map(|e| e.to_string()));
    // Sharded pub/sub.
    sub.ssubscribe("dlock:{a}:c").await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let n: i64 = redis::cmd("SPUBLISH").arg("dlock:{a}:c").arg("released").query_async(&mut cmd).await?;
    println!("spublish reached {n}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        println!("push: {:?} {:?}", msg.kind, msg.data);
        if msg.kind == redis::PushKind::SMessage { break; }
    }
    Ok(())
}
