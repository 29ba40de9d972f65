//! The connection a node's requests go over: one server, or (next) a Redis
//! Cluster, whose client routes each request by its keys' slot. Scripts and
//! commands are sent the same way on both (`invoke_async`, `query_async`).

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// A connection requests can be sent on (cheap to clone: clones share it).
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server.
    Single(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
        }
    }
}
