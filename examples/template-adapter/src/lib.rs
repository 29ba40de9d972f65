//! A template dlock adapter, built from `docs/writing-an-adapter.md` of the
//! dlock repository: `tenant+redis://` opens dlock-redis's backend with one
//! key space per tenant.
//!
//! `tenant+redis://[user:password@]host:port[/db]?tenant=NAME[&options]`
//!
//! | option | meaning |
//! |---|---|
//! | `tenant=NAME` (required) | 1–24 of `a-z`, `0-9`, `-`: the tenant's locks are the Redis keys under `dlock-NAME:`, so two tenants on one Redis never see each other's locks |
//! | `restart_guard`, `max_ttl`, `allow_eviction`, `protocol` | passed to dlock-redis (see its crate docs) |
//!
//! Any other option is refused, `dlock_prefix` included (the tenant sets it).
//!
//! Everything a lock does (take, renew, release, wake-up, fencing tokens) is
//! dlock-redis's: [`TenantBackend`] forwards every [`Backend`](dlock_core::Backend) primitive to
//! a [`RedisBackend`] and changes only the scheme and how the URL is read.
//! The sessions it opens are dlock-redis's own
//! [`RawSession`](dlock_core::backend::RawSession)s, unwrapped.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! use dlock_core::{Backend, SessionOptions};
//!
//! dlock_core::registry().register(dlock_template_adapter::TenantAdapter)?;
//! let backend = dlock_core::registry()
//!     .connect("tenant+redis://127.0.0.1:6379?tenant=acme")
//!     .await?;
//! let session = backend.session(SessionOptions::new()).await?;
//! let guard = session.lock("invoices/run")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

use dlock_core::Error;
use dlock_core::url::StoreUrl;
use dlock_redis::RedisBackend;

/// The URL scheme of this adapter.
pub const SCHEME: &str = "tenant+redis";

/// The dlock-redis options a `tenant+redis://` URL may carry, passed on.
const REDIS_OPTIONS: &[&str] = &["restart_guard", "max_ttl", "allow_eviction", "protocol"];

/// The adapter: registered in a [`dlock_core::Registry`] (or with
/// `dlocks::register`), it opens `tenant+redis://` URLs.
#[derive(Debug, Clone, Copy, Default)]
pub struct TenantAdapter;

dlock_core::impl_adapter!(TenantAdapter, name: "tenant", schemes: &[SCHEME], connect: TenantBackend::connect);

/// A tenant's view of one Redis: dlock-redis's backend under its own scheme.
#[derive(Debug, Clone)]
pub struct TenantBackend {
    inner: RedisBackend,
    tenant: String,
}

impl TenantBackend {
    /// Connects to the Redis a `tenant+redis://` URL names.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`RedisBackend::connect`].
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        let (redis_url, tenant) = redis_url(url)?;
        let inner = RedisBackend::connect(&redis_url).await?;
        Ok(Self { inner, tenant })
    }

    /// The tenant this backend's locks belong to.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Store objects left under the lock-name prefix `prefix` that will never
    /// expire: zero unless something leaked (the conformance suite's leak
    /// checks).
    pub async fn leftovers(&self, prefix: &str) -> Result<usize, Error> {
        self.inner.leftovers(prefix).await
    }
}

/// Reads a `tenant+redis://` URL: the `redis://` URL that does the work
/// (the tenant as its key prefix) and the tenant.
pub fn redis_url(url: &StoreUrl) -> Result<(StoreUrl, String), Error> {
    if url.scheme() != SCHEME {
        return Err(url.invalid(format!("expected {SCHEME}://")));
    }
    let mut options = url.options();
    let tenant = options.string("tenant")?;
    for key in REDIS_OPTIONS {
        options.pass(key);
    }
    options.finish()?; // refuses every option not read or passed above
    let tenant = tenant.ok_or_else(|| url.invalid("tenant=NAME is required"))?;
    let valid = (1..=24).contains(&tenant.len())
        && tenant
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(url.invalid(format!(
            "tenant must be 1-24 of a-z, 0-9 and -, not {tenant:?}"
        )));
    }
    let redis = url
        .with_scheme("redis")?
        .with_query_filtered(|key| key != "tenant")?
        .with_option("dlock_prefix", &format!("dlock-{tenant}"))?;
    Ok((redis, tenant))
}

// Every primitive is dlock-redis's; only the scheme is this adapter's.
dlock_core::forward_backend! {
    impl Backend for TenantBackend => inner;
    forward: min_ttl, max_ttl, capabilities, wait_ready, open, inspect, list, validate,
        force_release, ping;

    fn scheme(&self) -> &'static str {
        SCHEME
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(url: &str) -> Result<(String, String), Error> {
        let (redis, tenant) = redis_url(&StoreUrl::parse(url)?)?;
        Ok((redis.expose().to_owned(), tenant))
    }

    #[test]
    fn the_tenant_becomes_the_key_prefix() {
        let (redis, tenant) = read("tenant+redis://u:pw@h:1/2?tenant=acme&max_ttl=2s").unwrap();
        assert_eq!(
            redis,
            "redis://u:pw@h:1/2?max_ttl=2s&dlock_prefix=dlock-acme"
        );
        assert_eq!(tenant, "acme");
    }

    #[test]
    fn unknown_and_bad_options_are_refused_without_the_password() {
        for (url, why) in [
            ("tenant+redis://:s3cret@h:1", "tenant=NAME is required"),
            ("tenant+redis://:s3cret@h:1?tenant=Acme", "tenant must be"),
            (
                "tenant+redis://:s3cret@h:1?tenant=a&tenat=b",
                "unknown option \"tenat\"",
            ),
            (
                "tenant+redis://:s3cret@h:1?tenant=a&dlock_prefix=x",
                "unknown option",
            ),
            ("redis://:s3cret@h:1?tenant=a", "expected tenant+redis://"),
        ] {
            let e = read(url).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e:?}");
            assert!(e.to_string().contains(why), "{url}: {e}");
            assert!(!format!("{e} {e:?}").contains("s3cret"), "{url}: {e}");
        }
    }
}
