//! URL reading: dlock's own query options, name validation, the driver's URL.

use std::fmt;

use dlock_core::Error;
use dlock_core::url::StoreUrl;
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
/// Any other `dlock_…` option is an [`Error::InvalidUrl`]. Everything else
/// (credentials, `authSource`, `tls`, `replicaSet`, `readPreference`,
/// timeouts, ...) is the driver's, passed through and checked by it.
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
    /// The URL handed to the driver: dlock's options taken out (with the
    /// password: only `expose` it to the driver).
    url: StoreUrl,
    database: String,
    locks: String,
    sessions: String,
    mongos: MongosPolicy,
}

/// The prefix of dlock's own query options; the driver has none that starts
/// so.
const OWN_PREFIX: &str = "dlock_";

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
    /// Reads `mongodb://` and `mongodb+srv://` URLs, taking out `dlock_db`,
    /// `dlock_locks`, `dlock_sessions` and `dlock_mongos`, and checks the
    /// rest with the driver's parser (no DNS look-up yet: `mongodb+srv`
    /// records are resolved by
    /// [`MongoBackend::connect`](crate::MongoBackend::connect)).
    ///
    /// Every other query option is the driver's and is left in the URL
    /// handed to it: its parser knows its options (some forty, with
    /// case-insensitive names, repeatable `readPreferenceTags`, and new ones
    /// in new driver versions) and refuses the ones it does not, so dlock
    /// passes them through rather than keeping a copy of that list that
    /// would drift. Only an unknown option named `dlock_…` is refused here:
    /// no driver reads those, and a misspelt `dlock_lokcs` must not put the
    /// locks in the default collection.
    ///
    /// Anything wrong is [`Error::InvalidUrl`], without the password.
    pub fn from_url<U>(url: U) -> Result<Self, Error>
    where
        U: TryInto<StoreUrl, Error = Error>,
    {
        let url = url.try_into()?;
        if !matches!(url.scheme(), "mongodb" | "mongodb+srv") || !url.has_authority() {
            return Err(url.invalid("expected mongodb:// or mongodb+srv://"));
        }
        if url.hosts().is_empty() {
            return Err(url.invalid("no host"));
        }
        if url.fragment().is_some() {
            return Err(url.invalid("a #fragment means nothing to MongoDB"));
        }
        let mut options = url.options();
        let database = options.string("dlock_db")?;
        let locks = options.string("dlock_locks")?;
        let sessions = options.string("dlock_sessions")?;
        let mongos = match options.string("dlock_mongos")?.as_deref() {
            None | Some("refuse") => MongosPolicy::Refuse,
            Some("allow") => MongosPolicy::Allow,
            Some(other) => {
                return Err(
                    url.invalid(format!("dlock_mongos={other:?}: expected refuse or allow"))
                );
            }
        };
        for key in options.unread() {
            if !key.starts_with(OWN_PREFIX) {
                options.pass(key);
            }
        }
        options.finish()?;
        let database = database.unwrap_or_else(|| DEFAULT_DATABASE.to_owned());
        let locks = locks.unwrap_or_else(|| DEFAULT_LOCKS.to_owned());
        let sessions = sessions.unwrap_or_else(|| DEFAULT_SESSIONS.to_owned());
        check_database(&database).map_err(|r| url.invalid(r))?;
        check_collection(&locks).map_err(|r| url.invalid(r))?;
        check_collection(&sessions).map_err(|r| url.invalid(r))?;
        if locks == sessions {
            return Err(url.invalid("dlock_locks and dlock_sessions must differ"));
        }
        let url = url.with_query_filtered(|key| !key.starts_with(OWN_PREFIX))?;
        let options = Self {
            url,
            database,
            locks,
            sessions,
            mongos,
        };
        // The driver's own checks (hosts, ports, option values), offline.
        ConnectionString::parse(options.driver_url())
            .map_err(|e| options.driver_refused("not a valid MongoDB URL", &e))?;
        Ok(options)
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
        self.url.expose()
    }

    /// An [`Error::InvalidUrl`] for a URL the driver refused: `what`, then
    /// the driver's reason with the password taken out, in case it quotes
    /// it.
    pub(crate) fn driver_refused(&self, what: &str, e: &mongodb::error::Error) -> Error {
        let mut reason = format!("{what}: {}", e.kind);
        if let Some(password) = self.url.password().filter(|p| !p.is_empty()) {
            reason = reason.replace(password, "***");
        }
        self.url.invalid(reason)
    }
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
        fmt::Display::fmt(&self.url, f)
    }
}

impl fmt::Debug for MongoOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MongoOptions")
            .field("url", &self.url)
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
            "mongodb://u:hunter2@h/?dlock_db=a&dlock_db=b",
            "mongodb://u:hunter2@h/#frag",
            "mongodb://u:hunter2@h/?replicaSett=rs0",
        ] {
            dlock_conformance::unit::assert_refused(url, MongoOptions::from_url(url), "");
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
    fn driver_messages_lose_the_password() {
        let o = MongoOptions::from_url("mongodb://u:hun%2Fter2@h/").unwrap();
        let e = mongodb::error::Error::from(std::io::Error::other("bad password hun/ter2!"));
        let e = o.driver_refused("refused", &e);
        assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
        assert!(
            e.to_string()
                .ends_with("refused: I/O error: bad password ***!"),
            "{e}"
        );
        let o = MongoOptions::from_url("mongodb://h/").unwrap();
        let e = mongodb::error::Error::from(std::io::Error::other("x"));
        assert!(
            o.driver_refused("y", &e)
                .to_string()
                .ends_with("y: I/O error: x")
        );
    }

    /// The driver's options pass through as written, repeated ones too; an
    /// unknown `dlock_` option is refused by name, an unknown driver option
    /// by the driver.
    #[test]
    fn driver_options_pass_through() {
        let url = "mongodb://u:p%40ss@[::1]:27017,h2/admin?readPreference=secondaryPreferred\
                   &readPreferenceTags=dc:ny&dlock_db=ops&readPreferenceTags=&W=majority";
        let o = MongoOptions::from_url(url).unwrap();
        assert_eq!(o.database(), "ops");
        assert_eq!(
            o.driver_url(),
            "mongodb://u:p%40ss@[::1]:27017,h2/admin?readPreference=secondaryPreferred\
             &readPreferenceTags=dc:ny&readPreferenceTags=&W=majority"
        );
        let e = MongoOptions::from_url("mongodb://u:hunter2@h/?dlock_lokcs=x&w=1").unwrap_err();
        assert!(
            e.to_string().contains("unknown option \"dlock_lokcs\""),
            "{e}"
        );
        let e = MongoOptions::from_url("mongodb://u:hunter2@h/?replicaSett=rs0").unwrap_err();
        assert!(e.to_string().contains("replicasett"), "{e}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let e = MongoOptions::from_url("mongodb://h/?dlock_db=a&dlock_db=b").unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
    }
}
