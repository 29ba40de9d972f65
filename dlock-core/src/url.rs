//! URL helpers shared by adapters: password redaction.

/// Replaces the password in `scheme://user:password@host...` with `***`.
///
/// Works on any string, including malformed URLs and multi-host URLs such as
/// `redlock://u:p@h1:1,h2:2`, so it is safe to call on user input before it
/// is validated.
///
/// ```
/// use dlock_core::url::redact;
/// assert_eq!(redact("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
/// assert_eq!(redact("redis://:s3cret@h"), "redis://:***@h");
/// assert_eq!(redact("sqlite://dlock.db"), "sqlite://dlock.db");
/// ```
pub fn redact(url: &str) -> String {
    // After `scheme://`, or after `scheme:` for malformed input like
    // `postgres:user:pass@host`.
    let Some(start) = url
        .find("://")
        .map(|i| i + 3)
        .or_else(|| url.find(':').map(|i| i + 1))
    else {
        return url.to_owned();
    };
    let rest = &url[start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    match userinfo.find(':') {
        Some(colon) => format!("{}{}:***{}", &url[..start], &userinfo[..colon], &rest[at..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redacts_only_the_password() {
        assert_eq!(redact("mysql://u:p@h/db?x=@"), "mysql://u:***@h/db?x=@");
        assert_eq!(
            redact("etcd://u:p:q@h1:1,h2:2/pre"),
            "etcd://u:***@h1:1,h2:2/pre"
        );
        assert_eq!(redact("redis://user@h"), "redis://user@h");
        assert_eq!(redact("no scheme"), "no scheme");
        assert_eq!(redact("x://"), "x://");
        assert_eq!(redact("postgres:u:p@h"), "postgres:u:***@h");
        assert_eq!(redact("h:1"), "h:1");
    }
}
