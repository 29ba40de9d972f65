//! URL parsing for `redis://`, `rediss://` and `redlock://h1:p1,h2:p2,...`.
//!
//! Every option dlock reads is listed in the [crate docs](crate#url-options);
//! an unknown one is refused (a typo such as `max_tll=5s` must not be
//! silently ignored).

use std::path::PathBuf;
use std::time::Duration;

use dlock_core::Error;
use dlock_core::url::redact;

/// The key prefix used unless `dlock_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "dlock";

/// The default `max_ttl` (Redlock, and Redis with `restart_guard=true`).
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(60);

/// One node's driver URL (it may carry a password: never shown) and its
/// redacted form for errors and logs.
#[derive(Clone)]
pub(crate) struct NodeUrl {
    pub(crate) url: String,
    pub(crate) shown: String,
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
    pub(crate) nodes: Vec<NodeUrl>,
    pub(crate) redlock: bool,
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
    pub(crate) shown: String,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &self.shown)
            .field("prefix", &self.prefix)
            .field("restart_guard", &self.restart_guard)
            .finish()
    }
}

impl RedisOptions {
    pub(crate) fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::invalid_url(url, reason);
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected redis://, rediss:// or redlock://"))?;
        if !matches!(scheme, "redis" | "rediss" | "redlock") {
            return Err(bad("expected redis://, rediss:// or redlock://"));
        }
        let redlock = scheme == "redlock";
        // `#insecure` is the driver's spelling of "do not verify the
        // server's certificate"; `tls_insecure=true` is ours.
        let (rest, fragment) = rest.split_once('#').unwrap_or((rest, ""));
        let mut insecure = match fragment {
            "" => false,
            "insecure" => true,
            _ => return Err(bad("the only URL fragment understood is #insecure")),
        };
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut prefix = DEFAULT_PREFIX.to_owned();
        let mut max_ttl = None;
        let mut restart_guard = None;
        let mut allow_eviction = false;
        let mut tls = scheme == "rediss";
        let mut tls_files = TlsFiles::default();
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let flag = || parse_bool(v).ok_or_else(|| bad(&format!("{k} must be true or false")));
            let path = || {
                percent_decode(v)
                    .filter(|p| !p.is_empty())
                    .map(PathBuf::from)
                    .ok_or_else(|| bad(&format!("{k} must be a file path")))
            };
            match k {
                "dlock_prefix" => prefix = v.to_owned(),
                "max_ttl" => {
                    let ttl = parse_duration(v)
                        .filter(|d| !d.is_zero())
                        .ok_or_else(|| bad("max_ttl must look like 30s, 1500ms or 2m"))?;
                    max_ttl = Some(ttl);
                }
                "restart_guard" => restart_guard = Some(flag()?),
                "allow_eviction" => allow_eviction = flag()?,
                "tls" => tls = flag()?,
                "tls_insecure" => insecure = flag()?,
                "tls_ca" => tls_files.ca = Some(path()?),
                "tls_cert" => tls_files.cert = Some(path()?),
                "tls_key" => tls_files.key = Some(path()?),
                // Understood by the driver: RESP2 or RESP3.
                "protocol" => kept.push(pair),
                _ => {
                    return Err(bad(&format!(
                        "unknown option {k:?} (see the dlock-redis docs for the options)"
                    )));
                }
            }
        }
        if scheme == "rediss" && !tls {
            return Err(bad("rediss:// always uses TLS; drop tls=false"));
        }
        let restart_guard = match (redlock, restart_guard) {
            (true, Some(false)) => {
                return Err(bad(
                    "Redlock always guards restarted nodes; restart_guard=false is not allowed",
                ));
            }
            (true, _) => true,
            (false, guard) => guard.unwrap_or(false),
        };
        if max_ttl.is_some() && !restart_guard {
            return Err(bad(
                "max_ttl applies to Redlock and to Redis with restart_guard=true",
            ));
        }
        if !tls && (insecure || !tls_files.is_empty()) {
            return Err(bad(
                "tls_* options need TLS: use rediss:// (or tls=true for redlock://)",
            ));
        }
        if tls_files.cert.is_some() != tls_files.key.is_some() {
            return Err(bad("tls_cert and tls_key go together"));
        }
        let prefix_ok = !prefix.is_empty()
            && prefix.len() <= 32
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !prefix_ok {
            return Err(bad("dlock_prefix must be 1-32 of [A-Za-z0-9-_.]"));
        }
        let query = if kept.is_empty() {
            String::new()
        } else {
            format!("?{}", kept.join("&"))
        };
        let fragment = if insecure { "#insecure" } else { "" };
        let (userinfo, hosts_path) = match base.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), base),
        };
        let (hosts, path) = hosts_path
            .split_once('/')
            .map_or((hosts_path, ""), |(h, p)| (h, p));
        if hosts.is_empty() {
            return Err(bad("no host"));
        }
        let path = if path.is_empty() {
            String::new()
        } else {
            format!("/{path}")
        };
        let node_scheme = if tls { "rediss" } else { "redis" };
        let list: Vec<&str> = hosts.split(',').collect();
        if redlock {
            if list.len() < 3 || list.iter().any(|h| h.is_empty()) {
                return Err(bad(
                    "Redlock needs at least 3 hosts: redlock://h1:p1,h2:p2,h3:p3",
                ));
            }
            let mut sorted = list.clone();
            sorted.sort();
            sorted.dedup();
            if sorted.len() != list.len() {
                return Err(bad("a Redlock host is listed twice"));
            }
        } else if list.len() > 1 {
            return Err(bad(
                "several hosts: use redlock://h1:p1,h2:p2,h3:p3 for Redlock",
            ));
        }
        let nodes: Vec<NodeUrl> = list
            .iter()
            .map(|h| NodeUrl {
                url: format!("{node_scheme}://{userinfo}{h}{path}{query}{fragment}"),
                shown: format!("{node_scheme}://{h}"),
            })
            .collect();
        for node in &nodes {
            redis::Client::open(node.url.as_str()).map_err(|e| {
                // The driver's reason names no secret (user, password).
                bad(&format!(
                    "not a valid Redis URL ({})",
                    e.detail().unwrap_or("bad syntax")
                ))
            })?;
        }
        Ok(Self {
            redlock,
            nodes,
            prefix,
            restart_guard,
            max_ttl: max_ttl.unwrap_or(DEFAULT_MAX_TTL),
            allow_eviction,
            tls,
            tls_files: (!tls_files.is_empty()).then_some(tls_files),
            shown: redact(url),
        })
    }
}

/// `true`/`false` (also `1`/`0`, `yes`/`no`).
fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "true" | "yes" => Some(true),
        "0" | "false" | "no" => Some(false),
        _ => None,
    }
}

/// `%XX` decoding of a query value (paths may contain `/`, `&`, spaces).
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `30s`, `1500ms`, `2m`.
fn parse_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))?;
    let n: u64 = num.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => Some(Duration::from_secs(n.checked_mul(60)?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(o: &RedisOptions) -> Vec<&str> {
        o.nodes.iter().map(|n| n.url.as_str()).collect()
    }

    #[test]
    fn parses_single_and_redlock() {
        let o = RedisOptions::from_url("redis://u:pw@127.0.0.1:6379/2?dlock_prefix=app").unwrap();
        assert_eq!(urls(&o), ["redis://u:pw@127.0.0.1:6379/2"]);
        assert_eq!((o.prefix.as_str(), o.redlock), ("app", false));
        assert!(!o.restart_guard);
        assert_eq!(o.shown, "redis://u:***@127.0.0.1:6379/2?dlock_prefix=app");
        assert_eq!(o.nodes[0].shown, "redis://127.0.0.1:6379");
        let o = RedisOptions::from_url("redlock://:pw@a:1,b:2,c:3?tls=1&max_ttl=5s").unwrap();
        assert_eq!(
            urls(&o),
            ["rediss://:pw@a:1", "rediss://:pw@b:2", "rediss://:pw@c:3"]
        );
        assert_eq!(o.max_ttl, Duration::from_secs(5));
        assert!(o.redlock && o.restart_guard);
    }

    #[test]
    fn parses_guard_tls_and_eviction_options() {
        let o = RedisOptions::from_url("redis://h:1?restart_guard=true&max_ttl=10s").unwrap();
        assert!(o.restart_guard);
        assert_eq!(o.max_ttl, Duration::from_secs(10));
        let o = RedisOptions::from_url(
            "rediss://u:p@h:1/0?tls_ca=%2Fetc%2Fca%20x.pem&tls_cert=/c.pem&tls_key=/k.pem&allow_eviction=yes",
        )
        .unwrap();
        let files = o.tls_files.clone().unwrap();
        assert_eq!(files.ca.unwrap(), PathBuf::from("/etc/ca x.pem"));
        assert_eq!(files.cert.unwrap(), PathBuf::from("/c.pem"));
        assert!(o.allow_eviction);
        assert_eq!(urls(&o), ["rediss://u:p@h:1/0"]);
        let o = RedisOptions::from_url("rediss://h:1#insecure").unwrap();
        assert_eq!(urls(&o), ["rediss://h:1#insecure"]);
        let o = RedisOptions::from_url("rediss://h:1?tls_insecure=true&protocol=resp3").unwrap();
        assert_eq!(urls(&o), ["rediss://h:1?protocol=resp3#insecure"]);
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for url in [
            "redis://u:hunter2@a:1,b:2",
            "redlock://u:hunter2@a:1,b:2",
            "redlock://u:hunter2@a:1,a:1,b:2",
            "redis://u:hunter2@h?dlock_prefix=a{b}",
            "redlock://a:1,b:2,c:3?max_ttl=forever",
            "redlock://u:hunter2@a:1,b:2,c:3?max_ttl=0s",
            "redlock://u:hunter2@a:1,b:2,c:3?restart_guard=false",
            "redis://u:hunter2@h?max_ttl=5s",
            "redis://u:hunter2@h?max_tll=5s",
            "redis://u:hunter2@h?tls_ca=/ca.pem",
            "redis://u:hunter2@h#insecure",
            "rediss://u:hunter2@h?tls_cert=/c.pem",
            "rediss://u:hunter2@h?tls=false",
            "rediss://u:hunter2@h#other",
            "redis://u:hunter2@h?restart_guard=maybe",
            "redis://u:hunter2@h/notadb",
            "redis://",
            "memcached://h",
            "redis:h",
        ] {
            let e = RedisOptions::from_url(url).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
            assert!(!e.to_string().contains("hunter2"), "{e}");
        }
    }
}
