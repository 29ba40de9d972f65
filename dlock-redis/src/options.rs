//! URL parsing for `redis://`, `rediss://` and `redlock://h1:p1,h2:p2,...`.

use std::time::Duration;

use dlock_core::Error;
use dlock_core::url::redact;

/// The key prefix used unless `dlock_prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "dlock";

/// A parsed Redis or Redlock URL.
#[derive(Clone)]
pub(crate) struct RedisOptions {
    /// One driver URL per node (one for plain Redis).
    pub(crate) nodes: Vec<String>,
    pub(crate) redlock: bool,
    pub(crate) prefix: String,
    /// Redlock: the largest TTL any client may use; a node refuses grants for
    /// this long after it (re)starts, so a restart without persistence cannot
    /// re-grant a lock another node set still holds.
    pub(crate) max_ttl: Duration,
    pub(crate) shown: String,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &self.shown)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisOptions {
    pub(crate) fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::invalid_url(url, reason);
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected redis://, rediss:// or redlock://"))?;
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut prefix = DEFAULT_PREFIX.to_owned();
        let mut max_ttl = Duration::from_secs(60);
        let mut tls = scheme == "rediss";
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "dlock_prefix" => prefix = v.to_owned(),
                "max_ttl" if scheme == "redlock" => {
                    max_ttl = parse_duration(v)
                        .ok_or_else(|| bad("max_ttl must look like 30s or 1500ms"))?;
                }
                "tls" if scheme == "redlock" => tls = matches!(v, "1" | "true" | "yes"),
                _ => kept.push(pair),
            }
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
        let nodes: Vec<String> = match scheme {
            "redis" | "rediss" => {
                if hosts.contains(',') {
                    return Err(bad(
                        "several hosts: use redlock://h1:p1,h2:p2,h3:p3 for Redlock",
                    ));
                }
                vec![format!("{scheme}://{userinfo}{hosts}{path}{query}")]
            }
            "redlock" => {
                let node_scheme = if tls { "rediss" } else { "redis" };
                let list: Vec<_> = hosts.split(',').collect();
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
                list.iter()
                    .map(|h| format!("{node_scheme}://{userinfo}{h}{path}{query}"))
                    .collect()
            }
            _ => return Err(bad("expected redis://, rediss:// or redlock://")),
        };
        for node in &nodes {
            redis::Client::open(node.as_str()).map_err(|_| bad("not a valid Redis URL"))?;
        }
        Ok(Self {
            redlock: scheme == "redlock",
            nodes,
            prefix,
            max_ttl,
            shown: redact(url),
        })
    }
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
        "m" => Some(Duration::from_secs(n * 60)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_single_and_redlock() {
        let o = RedisOptions::from_url("redis://u:pw@127.0.0.1:6379/2?dlock_prefix=app").unwrap();
        assert_eq!(o.nodes, ["redis://u:pw@127.0.0.1:6379/2"]);
        assert_eq!((o.prefix.as_str(), o.redlock), ("app", false));
        assert_eq!(o.shown, "redis://u:***@127.0.0.1:6379/2?dlock_prefix=app");
        let o = RedisOptions::from_url("redlock://:pw@a:1,b:2,c:3?tls=1&max_ttl=5s").unwrap();
        assert_eq!(
            o.nodes,
            ["rediss://:pw@a:1", "rediss://:pw@b:2", "rediss://:pw@c:3"]
        );
        assert_eq!(o.max_ttl, Duration::from_secs(5));
        assert!(o.redlock);
    }

    #[test]
    fn refuses_bad_urls_without_the_password() {
        for url in [
            "redis://u:hunter2@a:1,b:2",
            "redlock://u:hunter2@a:1,b:2",
            "redlock://u:hunter2@a:1,a:1,b:2",
            "redis://u:hunter2@h?dlock_prefix=a{b}",
            "redlock://a:1,b:2,c:3?max_ttl=forever",
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
