//! The options of `redis://`, `rediss://`, `redlock://h1:p1,h2:p2,...` and
//! `redis+cluster://h1:p1,h2:p2,...` URLs, read from a [`StoreUrl`].
//!
//! Every option dlock reads is listed in the [crate docs](crate#url-options);
//! an unknown one is refused (a typo such as `max_tll=5s` must not be
//! silently ignored).

use std::path::PathBuf;
use std::time::Duration;

use dlock_core::Error;
use dlock_core::url::{HostPort, StoreUrl};

/// The key prefix used unless `dlock_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "dlock";

/// The default `max_ttl` (Redlock, and Redis with `restart_guard=true`).
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(60);

/// The port of a node the URL gives none for (the driver's default), to tell
/// `h` and `h:6379` apart from two nodes.
const DEFAULT_PORT: u16 = 6379;

/// The query options the driver understands, left in each node's URL.
const DRIVER_OPTIONS: &[&str] = &["protocol"];

/// One node's driver URL (it may carry a password: hand only its
/// [`StoreUrl::expose`] to the driver) and its password-free form for errors
/// and logs.
#[derive(Clone)]
pub(crate) struct NodeUrl {
    pub(crate) url: StoreUrl,
    pub(crate) shown: String,
    /// `host:port` as the URL gives it.
    pub(crate) host: String,
}

/// A server address, `(host, port)` (IPv6 hosts without brackets).
pub(crate) type Address = (String, u16);

/// Reads `host:port` (`[::1]:7000` for IPv6).
fn address(text: &str) -> Option<Address> {
    let (host, port) = text.trim().rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = port.parse().ok()?;
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// Reads `address_map`: `announced>reached` pairs, comma-separated.
fn address_map(url: &StoreUrl, text: &str) -> Result<Vec<(Address, Address)>, Error> {
    text.split(',')
        .map(|pair| {
            pair.split_once('>')
                .and_then(|(from, to)| Some((address(from)?, address(to)?)))
                .ok_or_else(|| {
                    url.invalid(format!(
                        "address_map: {pair:?} is not ANNOUNCED_HOST:PORT>REACHED_HOST:PORT"
                    ))
                })
        })
        .collect()
}

/// PEM files for TLS (`tls_ca`, `tls_cert`, `tls_key`).
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsFiles {
    pub(crate) ca: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }
}

/// A parsed Redis or Redlock URL.
#[derive(Clone)]
pub(crate) struct RedisOptions {
    /// One driver URL per configured node (one for plain Redis).
    /// (For a Redis Cluster: its seed nodes, one driver client in all.)
    pub(crate) nodes: Vec<NodeUrl>,
    pub(crate) redlock: bool,
    /// A Redis Cluster (`redis+cluster://`, `rediss+cluster://`).
    pub(crate) cluster: bool,
    /// Redis Cluster: where to reach the nodes the cluster announces at
    /// other addresses (NAT, containers, proxies): `(announced, reached)`.
    pub(crate) address_map: Vec<(Address, Address)>,
    pub(crate) prefix: String,
    /// Whether a node refuses grants (and vouches for no renewal) for
    /// `max_ttl` after dlock first sees a new server process on it: always
    /// for Redlock, opt-in for plain Redis.
    pub(crate) restart_guard: bool,
    /// The largest TTL any client may use while the guard is on; a node
    /// guards for this long after a restart.
    pub(crate) max_ttl: Duration,
    /// Accept a server whose `maxmemory-policy` may evict held locks.
    pub(crate) allow_eviction: bool,
    /// Whether the nodes are reached over TLS.
    pub(crate) tls: bool,
    /// PEM files for TLS, if any.
    pub(crate) tls_files: Option<TlsFiles>,
    /// The URL as given (its `Display` and `Debug` hide the password).
    pub(crate) url: StoreUrl,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .field("restart_guard", &self.restart_guard)
            .finish()
    }
}

impl RedisOptions {
    pub(crate) fn from_url(url: &StoreUrl) -> Result<Self, Error> {
        let scheme = url.scheme();
        if !crate::SCHEMES.contains(&scheme) || !url.has_authority() {
            return Err(url.invalid(
                "expected redis://, rediss://, redlock://, redis+cluster:// or rediss+cluster://",
            ));
        }
        let redlock = scheme == "redlock";
        let cluster = scheme.ends_with("+cluster");
        // `#insecure` is the driver's spelling of "do not verify the
        // server's certificate"; `tls_insecure=true` is ours.
        let insecure_fragment = match url.fragment() {
            None | Some("") => false,
            Some("insecure") => true,
            Some(_) => return Err(url.invalid("the only URL fragment understood is #insecure")),
        };

        let mut options = url.options();
        let prefix = options
            .string("dlock_prefix")?
            .unwrap_or_else(|| DEFAULT_PREFIX.to_owned());
        let max_ttl = options.duration("max_ttl")?;
        let restart_guard = options.flag("restart_guard")?;
        let allow_eviction = options.flag("allow_eviction")?.unwrap_or(false);
        let address_map = match options.string("address_map")? {
            Some(_) if !cluster => {
                return Err(url.invalid("address_map applies to redis+cluster:// only"));
            }
            Some(text) => self::address_map(url, &text)?,
            None => Vec::new(),
        };
        let tls_option = options.flag("tls")?;
        let insecure = options.flag("tls_insecure")?.unwrap_or(insecure_fragment);
        let tls_files = TlsFiles {
            ca: options.path("tls_ca")?,
            cert: options.path("tls_cert")?,
            key: options.path("tls_key")?,
        };
        for key in DRIVER_OPTIONS {
            options.pass(key);
        }
        options.finish()?;

        // Bounded both ways: a max_ttl that wraps when sent to the script as
        // milliseconds (`18446744073709551s616ms`) would switch the restart
        // guard off while sessions of any length were allowed (S1).
        if max_ttl.is_some_and(|d| d < crate::MIN_TTL || d > dlock_core::MAX_TTL) {
            return Err(url.invalid(format!(
                "max_ttl must be from {:?} to {:?}, such as 30s, 1500ms or 2m",
                crate::MIN_TTL,
                dlock_core::MAX_TTL
            )));
        }
        let tls_scheme = scheme.starts_with("rediss");
        if tls_scheme && tls_option == Some(false) {
            return Err(url.invalid(format!("{scheme}:// always uses TLS; drop tls=false")));
        }
        if cluster && tls_option.is_some() {
            return Err(url.invalid("tls= is for redlock://: use rediss+cluster:// for TLS"));
        }
        let tls = tls_option.unwrap_or(tls_scheme);
        let restart_guard = match (redlock, restart_guard) {
            (true, Some(false)) => {
                return Err(url.invalid(
                    "Redlock always guards restarted nodes; restart_guard=false is not allowed",
                ));
            }
            (true, _) => true,
            (false, guard) => guard.unwrap_or(false),
        };
        if max_ttl.is_some() && !restart_guard {
            return Err(
                url.invalid("max_ttl applies to Redlock and to Redis with restart_guard=true")
            );
        }
        if !tls && (insecure || !tls_files.is_empty()) {
            return Err(url.invalid(
                "tls_* options need TLS: use rediss:// or rediss+cluster:// (or tls=true for \
                 redlock://)",
            ));
        }
        if tls_files.cert.is_some() != tls_files.key.is_some() {
            return Err(url.invalid("tls_cert and tls_key go together"));
        }
        let prefix_ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !prefix_ok {
            return Err(url.invalid("dlock_prefix must be 1-32 of [A-Za-z0-9-_.]"));
        }

        let hosts = url.hosts();
        if hosts.is_empty() {
            return Err(url.invalid("no host"));
        }
        if redlock {
            if hosts.len() < 3 {
                return Err(
                    url.invalid("Redlock needs at least 3 hosts: redlock://h1:p1,h2:p2,h3:p3")
                );
            }
            let mut distinct: Vec<String> = hosts.iter().map(node_key).collect();
            distinct.sort();
            distinct.dedup();
            if distinct.len() != hosts.len() {
                return Err(url.invalid("a Redlock host is listed twice"));
            }
        } else if cluster {
            // Redis Cluster serves only database 0.
            if !matches!(url.path().trim_start_matches('/'), "" | "0") {
                return Err(url.invalid("a Redis Cluster has only database 0: drop the /DB path"));
            }
        } else if hosts.len() > 1 {
            return Err(url.invalid(
                "several hosts: use redlock://h1:p1,h2:p2,h3:p3 for Redlock, or \
                 redis+cluster://h1:p1,h2:p2 for a Redis Cluster",
            ));
        }

        // Each node's driver URL: the same credentials, database and driver
        // options, without dlock's own options.
        let node_scheme = if tls { "rediss" } else { "redis" };
        let base = url
            .with_query_filtered(|key| DRIVER_OPTIONS.contains(&key))?
            .with_scheme(node_scheme)?
            .with_fragment(insecure.then_some("insecure"))?;
        let mut nodes = Vec::with_capacity(hosts.len());
        for host in hosts {
            let node = base.with_hosts(std::slice::from_ref(host))?;
            redis::Client::open(node.expose()).map_err(|e| {
                // The driver's reason names no secret (user, password).
                url.invalid(format!(
                    "not a valid Redis URL ({})",
                    e.detail().unwrap_or("bad syntax")
                ))
            })?;
            nodes.push(NodeUrl {
                url: node,
                shown: format!("{node_scheme}://{host}"),
                host: host.to_string(),
            });
        }
        Ok(Self {
            redlock,
            cluster,
            address_map,
            nodes,
            prefix,
            restart_guard,
            max_ttl: max_ttl.unwrap_or(DEFAULT_MAX_TTL),
            allow_eviction,
            tls,
            tls_files: (!tls_files.is_empty()).then_some(tls_files),
            url: url.clone(),
        })
    }
}

/// What makes two Redlock hosts the same node: the host (names compare
/// without case) and the port, the default one when none is given.
fn node_key(host: &HostPort) -> String {
    host.with_default_port(DEFAULT_PORT).to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<RedisOptions, Error> {
        RedisOptions::from_url(&StoreUrl::parse(url)?)
    }

    fn urls(o: &RedisOptions) -> Vec<&str> {
        o.nodes.iter().map(|n| n.url.expose()).collect()
    }

    #[test]
    fn parses_single_and_redlock() {
        let o = parse("redis://u:pw@127.0.0.1:6379/2?dlock_prefix=app").unwrap();
        assert_eq!(urls(&o), ["redis://u:pw@127.0.0.1:6379/2"]);
        assert_eq!((o.prefix.as_str(), o.redlock), ("app", false));
        assert!(!o.restart_guard);
        assert_eq!(
            o.url.to_string(),
            "redis://u:***@127.0.0.1:6379/2?dlock_prefix=app"
        );
        assert!(!format!("{o:?}").contains("pw"), "{o:?}");
        assert_eq!(o.nodes[0].shown, "redis://127.0.0.1:6379");
        let o = parse("redlock://:pw@a:1,b:2,c:3?tls=1&max_ttl=5s").unwrap();
        assert_eq!(
            urls(&o),
            ["rediss://:pw@a:1", "rediss://:pw@b:2", "rediss://:pw@c:3"]
        );
        assert_eq!(o.nodes[2].shown, "rediss://c:3");
        assert_eq!(o.max_ttl, Duration::from_secs(5));
        assert!(o.redlock && o.restart_guard);
        let o = parse("redlock://a,b,[::1]:7?max_ttl=1m30s").unwrap();
        assert_eq!(urls(&o), ["redis://a", "redis://b", "redis://[::1]:7"]);
        assert_eq!(o.max_ttl, Duration::from_secs(90));
        assert_eq!(parse("redlock://a,b,c").unwrap().max_ttl, DEFAULT_MAX_TTL);
    }

    #[test]
    fn parses_redis_cluster() {
        let o = parse(
            "redis+cluster://u:pw@a:1,b:2?address_map=a:1%3E10.0.0.1:7001,[::1]:2>[fd00::1]:7002",
        )
        .unwrap();
        assert!(o.cluster && !o.redlock && !o.restart_guard && !o.tls);
        assert_eq!(urls(&o), ["redis://u:pw@a:1", "redis://u:pw@b:2"]);
        assert_eq!(o.nodes[1].host, "b:2");
        assert_eq!(
            o.address_map,
            [
                (("a".into(), 1), ("10.0.0.1".into(), 7001)),
                (("::1".into(), 2), ("fd00::1".into(), 7002)),
            ]
        );
        let o = parse("rediss+cluster://h:1/0?restart_guard=true&max_ttl=5s&tls_insecure=true")
            .unwrap();
        assert!(o.cluster && o.tls && o.restart_guard);
        assert_eq!(urls(&o), ["rediss://h:1/0#insecure"]);
        assert_eq!(o.max_ttl, Duration::from_secs(5));
    }

    #[test]
    fn parses_guard_tls_and_eviction_options() {
        let o = parse("redis://h:1?restart_guard=true&max_ttl=10s").unwrap();
        assert!(o.restart_guard);
        assert_eq!(o.max_ttl, Duration::from_secs(10));
        assert_eq!(urls(&o), ["redis://h:1"]);
        let o = parse(
            "rediss://u:p@h:1/0?tls_ca=%2Fetc%2Fca%20x.pem&tls_cert=/c.pem&tls_key=/k.pem&allow_eviction=yes",
        )
        .unwrap();
        let files = o.tls_files.clone().unwrap();
        assert_eq!(files.ca.unwrap(), PathBuf::from("/etc/ca x.pem"));
        assert_eq!(files.cert.unwrap(), PathBuf::from("/c.pem"));
        assert!(o.allow_eviction && o.tls);
        assert_eq!(urls(&o), ["rediss://u:p@h:1/0"]);
        let o = parse("rediss://h:1#insecure").unwrap();
        assert_eq!(urls(&o), ["rediss://h:1#insecure"]);
        let o = parse("rediss://h:1?tls_insecure=true&protocol=resp3").unwrap();
        assert_eq!(urls(&o), ["rediss://h:1?protocol=resp3#insecure"]);
        let o = parse("redis://h:1?tls=true&protocol=resp3&dlock_prefix=x").unwrap();
        assert_eq!(urls(&o), ["rediss://h:1?protocol=resp3"]);
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for (url, why) in [
            ("redis://u:hunter2@a:1,b:2", "use redlock://"),
            ("redlock://u:hunter2@a:1,b:2", "at least 3 hosts"),
            ("redlock://u:hunter2@a:1,a:1,b:2", "listed twice"),
            ("redlock://u:hunter2@a,A:6379,b:2", "listed twice"),
            ("redlock://u:hunter2@a:1,,b:2", "empty host"),
            ("redis://u:hunter2@h?dlock_prefix=a{b}", "dlock_prefix"),
            ("redis://u:hunter2@h?dlock_prefix=", "dlock_prefix"),
            ("redlock://a:1,b:2,c:3?max_ttl=forever", "max_ttl"),
            ("redlock://u:hunter2@a:1,b:2,c:3?max_ttl=5", "max_ttl"),
            ("redlock://u:hunter2@a:1,b:2,c:3?max_ttl=0s", "max_ttl"),
            (
                "redlock://a:1,b:2,c:3?max_ttl=18446744073709551s616ms",
                "max_ttl must be from",
            ),
            (
                "redis://h?restart_guard=true&max_ttl=500us",
                "max_ttl must be from",
            ),
            (
                "redlock://u:hunter2@a:1,b:2,c:3?restart_guard=false",
                "always guards",
            ),
            ("redis://u:hunter2@h?max_ttl=5s", "restart_guard=true"),
            (
                "redis://u:hunter2@h?max_tll=5s",
                "unknown option \"max_tll\"",
            ),
            ("redis://u:hunter2@h?max_ttl=5s&max_ttl=6s", "twice"),
            ("redis://u:hunter2@h?tls_ca=/ca.pem", "need TLS"),
            ("redis://u:hunter2@h#insecure", "need TLS"),
            ("rediss://u:hunter2@h?tls_cert=/c.pem", "go together"),
            ("rediss://u:hunter2@h?tls_ca=", "file path"),
            ("rediss://u:hunter2@h?tls=false", "drop tls=false"),
            ("rediss://u:hunter2@h#other", "#insecure"),
            ("redis://u:hunter2@h?restart_guard=maybe", "true or false"),
            ("redis://u:hunter2@h/notadb", "not a valid Redis URL"),
            ("redis://", "no host"),
            ("redis://u:hunter2@", "no host"),
            ("memcached://h", "expected redis://"),
            ("redis+cluster://u:hunter2@h:1/2", "only database 0"),
            (
                "redis+cluster://u:hunter2@h:1?tls=true",
                "rediss+cluster://",
            ),
            ("rediss+cluster://u:hunter2@h:1?tls=false", "drop tls=false"),
            (
                "redis://u:hunter2@h:1?address_map=a:1>b:2",
                "redis+cluster:// only",
            ),
            (
                "redis+cluster://u:hunter2@h:1?address_map=a:1",
                "ANNOUNCED_HOST:PORT",
            ),
            (
                "redis+cluster://u:hunter2@h:1?address_map=a:1>b",
                "ANNOUNCED_HOST:PORT",
            ),
            (
                "redis+cluster://u:hunter2@h:1?max_ttl=5s",
                "restart_guard=true",
            ),
            ("redis:h", "expected redis://"),
        ] {
            dlock_conformance::unit::assert_refused(url, parse(url), why);
        }
    }
}
