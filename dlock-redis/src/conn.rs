//! The connection a node's requests go over: one server, or a Redis
//! Cluster, whose client routes each request by its keys' slot. Scripts and
//! commands are sent the same way on both (`invoke_async`, `query_async`).

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value};

/// A connection requests can be sent on (cheap to clone: clones share it).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server.
    Single(MultiplexedConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl Conn {
    /// Sends `cmd` to the server at `address` (`host:port`, a cluster
    /// master); on one server, to that server whatever the address.
    pub(crate) async fn on_server<T: FromRedisValue>(
        &mut self,
        address: Option<&str>,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        match (self, address.and_then(|a| a.rsplit_once(':'))) {
            (Conn::Cluster(c), Some((host, port))) => {
                let port = port.parse().map_err(|_| {
                    redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "a cluster node address without a port",
                        address.unwrap_or_default().to_owned(),
                    ))
                })?;
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.trim_matches(['[', ']']).to_owned(),
                    port,
                });
                let value = c.route_command(cmd.clone(), routing).await?;
                Ok(T::from_redis_value(value)?)
            }
            (conn, _) => cmd.query_async(conn).await,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}
