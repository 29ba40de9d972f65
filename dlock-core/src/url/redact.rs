//! URL helpers shared by adapters: password redaction (invariant S9).

use std::borrow::Cow;

/// Query parameters whose values are secrets in some driver's URL syntax
/// (compared without case): `password=` (sqlx, mongodb), `sslpassword=`
/// (libpq), `token=`, ...
const SECRET_PARAMS: &[&str] = &[
    "password",
    "pass",
    "passwd",
    "pwd",
    "sslpassword",
    "secret",
    "token",
    "auth",
    "authtoken",
    "access_key",
    "secret_key",
    "api_key",
    "apikey",
    // MongoDB: the client key's passphrase, and AWS credentials inside
    // `authMechanismProperties=AWS_SESSION_TOKEN:...` (masked whole).
    "tlscertificatekeyfilepassword",
    "authmechanismproperties",
];

const MASK: &str = "***";

/// Replaces the password of a URL (in its user info or in a password-like
/// query parameter) with `***`.
///
/// Well-formed URLs are redacted by a real URL parser; anything else (a
/// multi-host authority, a password with an unencoded `/`, `?`, `#` or `@`,
/// plain garbage) by a conservative rule: everything between the first `:`
/// after `scheme://` and the **last** `@` is treated as a password. It may
/// hide more than the password of a malformed URL, never less.
///
/// ```
/// use dlock_core::url::redact;
/// assert_eq!(redact("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact("redis://:s3cret@h"), "redis://:***@h");
/// assert_eq!(redact("redis://:pa/ss@h:6379/0"), "redis://:***@h:6379/0");
/// assert_eq!(redact("postgres://u@h/db?password=s3cret"), "postgres://u@h/db?password=***");
/// assert_eq!(redact("etcd://u:p@h1:1,h2:2/pre"), "etcd://u:***@h1:1,h2:2/pre");
/// assert_eq!(redact("sqlite://dlock.db"), "sqlite://dlock.db");
/// ```
pub fn redact(url: &str) -> String {
    if !looks_like_a_url(url) {
        return NOT_SHOWN.to_owned();
    }
    let url = redact_params(url);
    match ::url::Url::parse(&url) {
        Ok(parsed) if read_as_written(&url, &parsed) => redact_parsed(parsed),
        _ => redact_userinfo_loosely(&url).into_owned(),
    }
}

/// Whether the parser's user info is the one a reader sees: a password it
/// found appears verbatim before `@host`, or there is no `@` at all. (A
/// password holding an unencoded `/` or `?` parses "fine" as host, port and
/// path: `redis://u:12/x@h`.)
fn read_as_written(url: &str, parsed: &::url::Url) -> bool {
    match parsed.password() {
        Some(password) => {
            let host = parsed.host_str().unwrap_or("");
            // One `@` only: `redis://:p@x/w@h` may have the password `p@x/w`.
            !host.is_empty()
                && url.contains(&format!(":{password}@{host}"))
                && url.matches('@').count() == 1
        }
        None => !url.contains('@'),
    }
}

fn redact_parsed(mut parsed: ::url::Url) -> String {
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some(MASK));
    }
    parsed.to_string()
}

/// `scheme://user:<anything>@host...` → `scheme://user:***@host...`, taking
/// the last `@` so that a password holding `/ ? # @` is hidden whole.
fn redact_userinfo_loosely(url: &str) -> Cow<'_, str> {
    let Some(start) = url
        .find("://")
        .map(|i| i + 3)
        .or_else(|| url.find(':').map(|i| i + 1))
    else {
        return Cow::Borrowed(url);
    };
    let rest = &url[start..];
    let Some(at) = rest.rfind('@') else {
        return Cow::Borrowed(url);
    };
    let userinfo = &rest[..at];
    match userinfo.find(':') {
        Some(colon) => Cow::Owned(format!(
            "{}{}:{MASK}{}",
            &url[..start],
            &userinfo[..colon],
            &rest[at..]
        )),
        None => Cow::Borrowed(url),
    }
}

/// Masks the values of secret query parameters (`?password=…&x=1`),
/// wherever a `?` or `&` starts one: the first `?` may sit inside an
/// unencoded password. A secret value runs to the next `&` (as the query
/// parsers split it), so an unencoded `?` or `#` in it is hidden too.
fn redact_params(url: &str) -> String {
    let Some(first) = url.find(['?', '&']) else {
        return url.to_owned();
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..=first]);
    let mut rest = &url[first + 1..];
    loop {
        let pair_end = rest.find(['?', '&']).unwrap_or(rest.len());
        let pair = &rest[..pair_end];
        let end = match pair.split_once('=') {
            Some((key, _)) if is_secret(key) => {
                out.push_str(key);
                out.push('=');
                out.push_str(MASK);
                rest.find('&').unwrap_or(rest.len())
            }
            _ => {
                out.push_str(pair);
                pair_end
            }
        };
        if end == rest.len() {
            return out;
        }
        out.push_str(&rest[end..=end]);
        rest = &rest[end + 1..];
    }
}

/// Whether `text` reads as `scheme:` + something, the shape every store URL
/// has; anything else (`host=db password=...`, `Server=h;Pwd=...`,
/// `user:pw@host`) is not shown at all.
fn looks_like_a_url(text: &str) -> bool {
    if !text.contains([':', '@', '=', ';']) {
        return true; // nothing that could hold a secret
    }
    let Some((scheme, rest)) = text.split_once(':') else {
        return false;
    };
    super::is_scheme(scheme) && (rest.starts_with("//") || !rest.contains(['@', ';']))
}

/// What is shown of a text that is not a URL.
pub(crate) const NOT_SHOWN: &str = "(not shown: not a URL)";

fn is_secret(key: &str) -> bool {
    let decoded = ::url::form_urlencoded::parse(key.as_bytes())
        .next()
        .map(|(k, _)| k.into_owned())
        .unwrap_or_else(|| key.to_owned());
    SECRET_PARAMS
        .iter()
        .any(|s| decoded.eq_ignore_ascii_case(s))
}

#[cfg(test)]
mod tests {
    use super::{NOT_SHOWN, redact};

    /// From the review of the StoreUrl change: texts that are not URLs, or
    /// whose first `?` sits in the password, or whose secret holds a `;`.
    #[test]
    fn secrets_in_texts_that_are_not_urls() {
        for text in [
            "postgres//app:s3cret@db/x",
            "app:s3cret@db.internal:5432/x",
            "Server=h;Uid=u;Pwd=s3cret",
            "Server=h;Uid=u;Pwd=se:cret",
            "host=db user=app password=s3cret",
        ] {
            assert_eq!(redact(text), NOT_SHOWN, "{text}");
        }
        let shown = redact("postgres://u:pa?ss@h/db?sslpassword=s3cret");
        assert!(
            !shown.contains("s3cret") && !shown.contains("pa?ss"),
            "{shown}"
        );
        assert_eq!(
            redact("postgres://u@h/db?password=ab;cd&x=1"),
            "postgres://u@h/db?password=***&x=1"
        );
        assert_eq!(
            redact(
                "mongodb://h/?tlsCertificateKeyFilePassword=s3cret&authMechanismProperties=AWS_SESSION_TOKEN:s3cret"
            ),
            "mongodb://h/?tlsCertificateKeyFilePassword=***&authMechanismProperties=***"
        );
    }

    /// A password with every character that breaks naive parsing.
    const NASTY: &str = "p/@:?#%s";

    #[test]
    fn redacts_only_the_password() {
        // A second `@` makes the password ambiguous (`p@h/db?x=` could be
        // it): everything up to the last `@` is hidden.
        assert_eq!(redact("mysql://u:p@h/db?x=@"), "mysql://u:***@");
        assert_eq!(redact("redis://:p@hunter2/w@h"), "redis://:***@h");
        assert_eq!(
            redact("etcd://u:p:q@h1:1,h2:2/pre"),
            "etcd://u:***@h1:1,h2:2/pre"
        );
        assert_eq!(redact("redis://user@h"), "redis://user@h");
        assert_eq!(redact("no scheme"), "no scheme");
        assert_eq!(redact("x://"), "x://");
        assert_eq!(redact("postgres:u:p@h"), NOT_SHOWN);
        assert_eq!(redact("h:1"), "h:1");
        assert_eq!(
            redact("postgres://u@h/db?sslmode=require&PassWord=x&application_name=a"),
            "postgres://u@h/db?sslmode=require&PassWord=***&application_name=a"
        );
        // A secret runs to the next separator: an unencoded `#` in it is hidden.
        assert_eq!(
            redact("redis://h?password=x#frag"),
            "redis://h?password=***"
        );
    }

    #[test]
    fn no_scheme_leaks_a_nasty_password() {
        let encoded: String = ::url::form_urlencoded::byte_serialize(NASTY.as_bytes()).collect();
        for scheme in [
            "redis",
            "rediss",
            "redlock",
            "etcd",
            "etcds",
            "zk",
            "postgres",
            "postgresql",
            "mysql",
            "mariadb",
            "mongodb",
            "mongodb+srv",
            "sqlite",
            "memory",
            "nats",
        ] {
            for url in [
                format!("{scheme}://user:{NASTY}@127.0.0.1:1/db"),
                format!("{scheme}://user:{encoded}@127.0.0.1:1/db"),
                format!("{scheme}://:{NASTY}@h1:1,h2:2/pre"),
                format!("{scheme}://user:{NASTY}@h1:1,h2:2"),
                format!("{scheme}://h:1/db?password={encoded}&x=1"),
                format!("{scheme}://h:1/db?x=1&password={NASTY}"),
                format!("{scheme}:user:{NASTY}@h"),
            ] {
                let shown = redact(&url);
                for secret in [NASTY, &encoded, "p/@:", "?#%s", "%2F%40"] {
                    assert!(!shown.contains(secret), "{url:?} redacted to {shown:?}");
                }
                assert!(
                    shown.contains("***") || shown == NOT_SHOWN,
                    "{url:?} redacted to {shown:?}"
                );
            }
        }
    }
}
