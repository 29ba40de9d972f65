//! URL parsing: dlock's own query options, name validation, a redacted display.

use std::fmt;

use dlock_core::Error;
use dlock_core::url::redact;
use mongodb::options::ConnectionString;

/// The default database.
pub const DEFAULT_DATABASE: &str = "dlock";
/// The default lock collection (the seeds' `config.locks`).
pub const DEFAULT_LOCKS: &str = "locks";
/// The default session collection (the seeds' `config.lockpings`).
pub const DEFAULT_SESSIONS: &str = "sessions";

/// Where and how to keep locks in MongoDB.
///
/// Parsed from a `mongodb://` or `mongodb+srv://` URL. dlock's own options
/// ride in the query string and are removed before the driver sees it:
///
/// | option | default | meaning |
/// |---|---|---|
/// | `dlock_db` | `dlock` | the database |
/// | `dlock_locks` | `locks` | the lock collection |
/// | `dlock_sessions` | `sessions` | the session collection |
/// | `dlock_mongos` | `refuse` | `allow` lets dlock work through `mongos` routers (see [`MongosPolicy`]) |
///
/// Everything else (credentials, `authSource`, `tls`, `replicaSet`,
/// `readPreference`, timeouts, ...) is the driver's and is checked by it.
///
/// ```
/// use dlock_mongo::MongoOptions;
/// let o = MongoOptions::from_url(
///     "mongodb://app:secret@db1:27017,db2:27017/?replicaSet=rs0&dlock_db=ops&dlock_locks=mutex",
/// )?;
/// assert_eq!((o.database(), o.locks(), o.sessions()), ("ops", "mutex", "sessions"));
/// assert_eq!(o.to_string(), "mongodb://app:***@db1:27017,db2:27017/?replicaSet=rs0");
/// assert!(!format!("{o:?}").contains("secret"));
/// # Ok::<(), dlock_core::Error>(())
/// ```
#[derive(Clone)]
pub struct MongoOptions {
    /// The URL handed to the driver (with the password; never log it).
    url: String,
    database: String,
    locks: String,
    sessions: String,
    mongos: MongosPolicy,
}

/// What [`MongoBackend::connect`](crate::MongoBackend::connect) does when the
/// server is a `mongos` router (a sharded cluster), set with the URL option
/// `dlock_mongos`.
///
/// Through `mongos`, `$$NOW` — the only clock dlock's expiry is judged by —
/// is the clock of **the router that handled the request**, not of the shard
/// that stores the lock (the router computes it and sends it to the shards
/// with the request). Clients that reach the cluster through different
/// routers (or one client whose URL lists several, which the driver uses in
/// turn) compare an `expiresAt` written by one router's clock with another
/// router's `$$NOW`: a router whose clock is *ahead* of the writer's by more
/// than the session's drift margin frees a hold early, while its holder
/// still trusts it (S1). dlock cannot measure the routers' clocks, so it
/// refuses by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MongosPolicy {
    /// `dlock_mongos=refuse` (the default): connecting to a `mongos` is an
    /// [`Error::Config`].
    #[default]
    Refuse,
    /// `dlock_mongos=allow`: the operator vouches that every router any
    /// client of these locks uses keeps its clock within the drift margin of
    /// the others (NTP-synchronised hosts; the default drift margin is
    /// TTL/100 + 2 ms), or that all clients use one router. Each connect
    /// through `mongos` then logs a `warn` event saying so.
    Allow,
}

impl MongoOptions {
    /// Parses `mongodb://` and `mongodb+srv://` URLs, taking out `dlock_db`,
    /// `dlock_locks` and `dlock_sessions`, and checks the rest with the
    /// driver's parser (no DNS look-up yet: `mongodb+srv` records are resolved
    /// by [`MongoBackend::connect`](crate::MongoBackend::connect)).
    ///
    /// Anything wrong is [`Error::InvalidUrl`], without the password.
    pub fn from_url(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::invalid_url(url, scrub(reason, url));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected mongodb:// or mongodb+srv://"))?;
        if !matches!(scheme, "mongodb" | "mongodb+srv") {
            return Err(bad("expected mongodb:// or mongodb+srv://"));
        }
        let (base, query) = match rest.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (rest, None),
        };
        if base.is_empty() || base.starts_with('/') {
            return Err(bad("no host"));
        }
        let mut database = DEFAULT_DATABASE.to_owned();
        let mut locks = DEFAULT_LOCKS.to_owned();
        let mut sessions = DEFAULT_SESSIONS.to_owned();
        let mut mongos = MongosPolicy::default();
        let mut kept = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "dlock_db" => database = v.to_owned(),
                "dlock_locks" => locks = v.to_owned(),
                "dlock_sessions" => sessions = v.to_owned(),
                "dlock_mongos" => {
                    mongos = match v {
                        "refuse" => MongosPolicy::Refuse,
                        "allow" => MongosPolicy::Allow,
                        _ => {
                            return Err(bad(&format!(
                                "dlock_mongos={v:?}: expected refuse or allow"
                            )));
                        }
                    }
                }
                _ if k.starts_with("dlock_") => {
                    return Err(bad(&format!(
                        "unknown dlock option {k:?} (known: dlock_db, dlock_locks, \
                         dlock_sessions, dlock_mongos)"
                    )));
                }
                _ => kept.push(pair),
            }
        }
        check_database(&database).map_err(|r| bad(&r))?;
        check_collection(&locks).map_err(|r| bad(&r))?;
        check_collection(&sessions).map_err(|r| bad(&r))?;
        if locks == sessions {
            return Err(bad("dlock_locks and dlock_sessions must differ"));
        }
        let mut driver_url = format!("{scheme}://{base}");
        if query.is_some() && !kept.is_empty() {
            driver_url.push('?');
            driver_url.push_str(&kept.join("&"));
        }
        // The driver's own checks (hosts, ports, option values), offline.
        ConnectionString::parse(&driver_url)
            .map_err(|e| bad(&format!("not a valid MongoDB URL: {}", e.kind)))?;
        Ok(Self {
            url: driver_url,
            database,
            locks,
            sessions,
            mongos,
        })
    }

    /// The database holding both collections.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The lock collection.
    pub fn locks(&self) -> &str {
        &self.locks
    }

    /// The session collection.
    pub fn sessions(&self) -> &str {
        &self.sessions
    }

    /// What to do when the server is a `mongos` router.
    pub fn mongos(&self) -> MongosPolicy {
        self.mongos
    }

    /// Sets what to do when the server is a `mongos` router.
    pub fn with_mongos(mut self, policy: MongosPolicy) -> Self {
        self.mongos = policy;
        self
    }

    /// Sets the database (validated).
    pub fn with_database(mut self, database: &str) -> Result<Self, Error> {
        check_database(database).map_err(Error::Config)?;
        self.database = database.to_owned();
        Ok(self)
    }

    /// Sets the lock and session collections (validated, distinct).
    pub fn with_collections(mut self, locks: &str, sessions: &str) -> Result<Self, Error> {
        check_collection(locks).map_err(Error::Config)?;
        check_collection(sessions).map_err(Error::Config)?;
        if locks == sessions {
            return Err(Error::Config(
                "the lock and session collections must differ".into(),
            ));
        }
        self.locks = locks.to_owned();
        self.sessions = sessions.to_owned();
        Ok(self)
    }

    /// The URL handed to the driver (with the password; never log it).
    pub(crate) fn driver_url(&self) -> &str {
        &self.url
    }
}

/// Removes the URL's password from a driver message, in case one quotes it.
pub(crate) fn scrub(message: &str, url: &str) -> String {
    match password(url) {
        Some(p) if !p.is_empty() => message.replace(p, "***"),
        _ => message.to_owned(),
    }
}

/// The password part of `scheme://user:password@...`, as written.
fn password(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, p)| p)
}

/// MongoDB database names: 1-63 bytes; dlock allows `[A-Za-z0-9_-]`
/// (the server forbids `/\. "$*<>:|?` and NUL).
pub(crate) fn check_database(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "database name {name:?} must be 1-63 of [A-Za-z0-9_-]"
        ))
    }
}

/// Collection names: `[A-Za-z_][A-Za-z0-9_.-]{0,63}`, not `system.*`, no
/// empty dot segments (the server forbids `$`, NUL and the `system.` prefix).
pub(crate) fn check_collection(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && name.len() <= 64
        && !name.starts_with("system.")
        && !name.ends_with('.')
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "collection name {name:?} must match [A-Za-z_][A-Za-z0-9_.-]{{0,63}} \
             and not start with \"system.\""
        ))
    }
}

impl fmt::Display for MongoOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.url))
    }
}

impl fmt::Debug for MongoOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoOptions")
            .field("url", &self.to_string())
            .field("database", &self.database)
            .field("locks", &self.locks)
            .field("sessions", &self.sessions)
            .field("mongos", &self.mongos)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_stripping() {
        let o = MongoOptions::from_url("mongodb://127.0.0.1:17017/?replicaSet=rs0").unwrap();
        assert_eq!(
            (o.database(), o.locks(), o.sessions()),
            ("dlock", "locks", "sessions")
        );
        assert_eq!(o.driver_url(), "mongodb://127.0.0.1:17017/?replicaSet=rs0");

        let o = MongoOptions::from_url(
            "mongodb://u:p@h1:1,h2:2/admin?dlock_db=x&tls=true&dlock_sessions=pings&authSource=admin",
        )
        .unwrap();
        assert_eq!((o.database(), o.sessions()), ("x", "pings"));
        assert_eq!(
            o.driver_url(),
            "mongodb://u:p@h1:1,h2:2/admin?tls=true&authSource=admin"
        );

        let o = MongoOptions::from_url("mongodb://h/?dlock_mongos=allow&w=1").unwrap();
        assert_eq!(o.mongos(), MongosPolicy::Allow);
        assert_eq!(o.driver_url(), "mongodb://h/?w=1");
        let o = MongoOptions::from_url("mongodb://h/?dlock_mongos=refuse").unwrap();
        assert_eq!(o.mongos(), MongosPolicy::Refuse);
        assert_eq!(
            MongoOptions::from_url("mongodb://h/").unwrap().mongos(),
            MongosPolicy::Refuse
        );

        // Only dlock options: the query string goes away entirely.
        let o = MongoOptions::from_url("mongodb://h/?dlock_locks=l2").unwrap();
        assert_eq!(o.driver_url(), "mongodb://h/");
        assert_eq!(o.locks(), "l2");

        let o = MongoOptions::from_url("mongodb+srv://u:p@cluster0.example.net/").unwrap();
        assert_eq!(o.driver_url(), "mongodb+srv://u:p@cluster0.example.net/");
    }

    #[test]
    fn display_and_debug_hide_the_password() {
        let o = MongoOptions::from_url("mongodb://app:hunter2@h:27017/?dlock_db=d").unwrap();
        assert_eq!(o.to_string(), "mongodb://app:***@h:27017/");
        let debug = format!("{o:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("database: \"d\""), "{debug}");
    }

    #[test]
    fn refuses_bad_urls_without_leaking_passwords() {
        for url in [
            "mongodb://",
            "mongodb:///db",
            "mongodb://u:hunter2@",
            "mongodb:u:hunter2@h",
            "postgres://u:hunter2@h/db",
            "redis://u:hunter2@h",
            "nonsense",
            "mongodb://u:hunter2@h/?dlock_db=bad.name",
            "mongodb://u:hunter2@h/?dlock_db=",
            "mongodb://u:hunter2@h/?dlock_locks=system.locks",
            "mongodb://u:hunter2@h/?dlock_locks=1abc",
            "mongodb://u:hunter2@h/?dlock_locks=a$b",
            "mongodb://u:hunter2@h/?dlock_locks=same&dlock_sessions=same",
            "mongodb://u:hunter2@h/?dlock_table=x",
            "mongodb://u:hunter2@h/?dlock_mongos=yes",
            "mongodb://u:hunter2@h/?dlock_mongos=",
            "mongodb://u:hunter2@h:notaport/",
            "mongodb://u:hunter2@h/?serverSelectionTimeoutMS=soon",
            "mongodb+srv://u:hunter2@h:27017/",
            "mongodb+srv://u:hunter2@h1,h2/",
        ] {
            match MongoOptions::from_url(url) {
                Err(e @ Error::InvalidUrl { .. }) => {
                    assert!(!e.to_string().contains("hunter2"), "{url}: {e}");
                }
                other => panic!("{url}: expected InvalidUrl, got {other:?}"),
            }
        }
    }

    #[test]
    fn name_rules() {
        for ok in ["dlock", "a", "A_b-9", &"x".repeat(63)] {
            assert!(check_database(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a.b", "a b", "a/b", "a$", "é", &"x".repeat(64)] {
            assert!(check_database(bad).is_err(), "{bad:?}");
        }
        for ok in ["locks", "_x", "dlock.locks", "a-b_c9", &"x".repeat(64)] {
            assert!(check_collection(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1a",
            ".a",
            "a.",
            "a..b",
            "a$b",
            "a b",
            "system.locks",
            "a\0b",
            &"x".repeat(65),
        ] {
            assert!(check_collection(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn with_setters_validate() {
        let o = MongoOptions::from_url("mongodb://h/").unwrap();
        assert!(o.clone().with_database("a.b").is_err());
        assert!(o.clone().with_collections("x", "x").is_err());
        let o = o
            .with_database("d")
            .unwrap()
            .with_collections("l", "s")
            .unwrap();
        assert_eq!((o.database(), o.locks(), o.sessions()), ("d", "l", "s"));
    }

    #[test]
    fn scrub_removes_the_password() {
        assert_eq!(
            scrub("bad password hunter2!", "mongodb://u:hunter2@h/"),
            "bad password ***!"
        );
        assert_eq!(scrub("x", "mongodb://h/"), "x");
        assert_eq!(password("mongodb://u:p:q@h/x?y=@"), Some("p:q"));
        assert_eq!(password("mongodb://u@h"), None);
    }
}
