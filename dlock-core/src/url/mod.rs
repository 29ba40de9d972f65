//! Store URLs: [`StoreUrl`], parsed once for every adapter, with typed query
//! [`Options`] and passwords never shown (invariant S9).
//!
//! A store URL is `scheme://[user[:password]@]host[:port][,host[:port]...][/path][?k=v&...][#fragment]`
//! or the opaque `scheme:rest` (`sqlite::memory:`). The authority may list
//! several hosts (`etcd://h1:2379,h2:2379/prefix`), which general URL parsers
//! refuse; everything else follows RFC 3986, using the `url` crate's host
//! rules and `application/x-www-form-urlencoded` query decoding.
//!
//! ```
//! use std::time::Duration;
//! use dlock_core::url::StoreUrl;
//!
//! let url: StoreUrl = "etcd://app:s%2Fcret@h1:2379,h2:2379/jobs?dial_timeout=2s".parse()?;
//! assert_eq!(url.scheme(), "etcd");
//! assert_eq!(url.hosts().len(), 2);
//! assert_eq!(url.password(), Some("s/cret"));
//! assert_eq!(url.to_string(), "etcd://app:***@h1:2379,h2:2379/jobs?dial_timeout=2s");
//!
//! let mut options = url.options();
//! assert_eq!(options.duration("dial_timeout")?, Some(Duration::from_secs(2)));
//! options.finish()?; // any option nobody asked for is an error
//! # Ok::<(), dlock_core::Error>(())
//! ```

mod options;
mod redact;

use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::str::FromStr;

pub use options::{Options, parse_duration};
pub use redact::redact;

use crate::Error;

/// One host of a URL's authority, as written (`[::1]` keeps its brackets),
/// with its port if one was given.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostPort {
    /// The host name or address, as written.
    pub host: String,
    /// The port, if the URL gave one.
    pub port: Option<u16>,
}

impl HostPort {
    /// `host:port`, with `default` when the URL gave no port.
    pub fn with_default_port(&self, default: u16) -> String {
        format!("{}:{}", self.host, self.port.unwrap_or(default))
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(port) => write!(f, "{}:{port}", self.host),
            None => f.write_str(&self.host),
        }
    }
}

impl From<SocketAddr> for HostPort {
    fn from(addr: SocketAddr) -> Self {
        let host = match addr {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        Self {
            host,
            port: Some(addr.port()),
        }
    }
}

/// One `key=value` pair of the query: decoded, and as written.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pair {
    key: String,
    value: String,
    raw: String,
}

/// A parsed store URL.
///
/// `Display` and `Debug` replace the password (in the user info or in a
/// password-like query option) with `***`; [`StoreUrl::expose`] gives the
/// text as written, for a driver.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreUrl {
    raw: String,
    scheme: String,
    /// `None` for an opaque URL (`scheme:rest`).
    authority: Option<Authority>,
    path: String,
    query: Option<String>,
    pairs: Vec<Pair>,
    fragment: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Authority {
    /// The user info as written, without the `@`.
    userinfo: Option<String>,
    username: String,
    password: Option<String>,
    hosts: Vec<HostPort>,
}

impl StoreUrl {
    /// Parses `text`; an error names what is wrong without the password.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let bad = |reason: String| Error::invalid_url(text, reason);
        if text.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(bad(
                "contains a space or control character; percent-encode it".into(),
            ));
        }
        let (scheme, rest) = text
            .split_once(':')
            .ok_or_else(|| bad("no scheme: expected SCHEME://...".into()))?;
        if !is_scheme(scheme) {
            return Err(bad(
                "the text before the first : is not a URL scheme (expected SCHEME://...)".into(),
            ));
        }
        let (rest, fragment) = match rest.split_once('#') {
            Some((r, f)) => (r, Some(f.to_owned())),
            None => (rest, None),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q.to_owned())),
            None => (rest, None),
        };
        let (authority, path) = match rest.strip_prefix("//") {
            // An `@` past the host means a user name or password with an
            // unencoded `/`, `?`, `#` or `@`: the parts would be misread and
            // a piece of the password could end up quoted in an error, so
            // nothing of it is quoted here (S9).
            Some(_)
                if text
                    .split_once("//")
                    .is_some_and(|(_, t)| after_authority(t).contains('@')) =>
            {
                return Err(Error::InvalidUrl {
                    url: format!("{}://***", scheme.to_ascii_lowercase()),
                    reason: "an @ after the host: percent-encode / ? # @ % in the user name, \
                             password and options (%2F %3F %23 %40 %25)"
                        .into(),
                });
            }
            Some(hier) => {
                let end = hier.find('/').unwrap_or(hier.len());
                // A malformed authority may be a password without its `@`
                // (`redis://u:s3cret`): none of it is shown.
                let authority =
                    parse_authority(&hier[..end]).map_err(|reason| Error::InvalidUrl {
                        url: format!("{}://***", scheme.to_ascii_lowercase()),
                        reason,
                    })?;
                (Some(authority), hier[end..].to_owned())
            }
            None => (None, rest.to_owned()),
        };
        let pairs = match &query {
            Some(q) => parse_query(q).map_err(bad)?,
            None => Vec::new(),
        };
        Ok(Self {
            raw: text.to_owned(),
            scheme: scheme.to_ascii_lowercase(),
            authority,
            path,
            query,
            pairs,
            fragment,
        })
    }

    /// The scheme, lower-cased (`redis`, `mongodb+srv`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The hosts of the authority, in order; empty for `scheme:///path`,
    /// `scheme://` and opaque URLs.
    pub fn hosts(&self) -> &[HostPort] {
        self.authority.as_ref().map_or(&[], |a| &a.hosts)
    }

    /// The user name, percent-decoded; empty if none.
    pub fn username(&self) -> &str {
        self.authority.as_ref().map_or("", |a| &a.username)
    }

    /// The password, percent-decoded. Never log it.
    pub fn password(&self) -> Option<&str> {
        self.authority.as_ref().and_then(|a| a.password.as_deref())
    }

    /// Whether the URL has the `scheme://` form (as opposed to `scheme:rest`).
    pub fn has_authority(&self) -> bool {
        self.authority.is_some()
    }

    /// The path as written (percent-encoded), with its leading `/`; for an
    /// opaque URL, everything between `scheme:` and `?`.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The path without its leading `/`, percent-decoded.
    pub fn path_decoded(&self) -> Result<String, Error> {
        let path = self.path.strip_prefix('/').unwrap_or(&self.path);
        decode(path).map_err(|why| self.invalid(format!("the path {why}")))
    }

    /// The fragment (after `#`), as written.
    pub fn fragment(&self) -> Option<&str> {
        self.fragment.as_deref()
    }

    /// The query options, decoded, in order (duplicates included).
    pub fn query_pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs
            .iter()
            .map(|p| (p.key.as_str(), p.value.as_str()))
    }

    /// A reader of the query options that refuses unknown ones at
    /// [`Options::finish`].
    pub fn options(&self) -> Options<'_> {
        Options::new(self)
    }

    /// The URL exactly as written, password included: only for handing to
    /// a driver, never for a message or log.
    pub fn expose(&self) -> &str {
        &self.raw
    }

    /// The URL with its password replaced by `***`: what `Display` shows.
    pub fn redacted(&self) -> String {
        redact(&self.raw)
    }

    /// An [`Error::InvalidUrl`] about this URL (shown without its password).
    pub fn invalid(&self, reason: impl Into<String>) -> Error {
        Error::invalid_url(&self.raw, reason)
    }

    /// The same URL with another scheme.
    pub fn with_scheme(&self, scheme: &str) -> Result<Self, Error> {
        self.rebuilt(Some(scheme), None, None, None)
    }

    /// The same URL with other hosts (for one node of a list, or a proxy in
    /// front of each).
    pub fn with_hosts<H: Into<HostPort> + Clone>(&self, hosts: &[H]) -> Result<Self, Error> {
        let hosts: Vec<HostPort> = hosts.iter().cloned().map(Into::into).collect();
        self.rebuilt(None, Some(&hosts), None, None)
    }

    /// The same URL keeping only the query options for which `keep` is true
    /// (for instance, those a driver understands).
    pub fn with_query_filtered(&self, keep: impl Fn(&str) -> bool) -> Result<Self, Error> {
        let kept: Vec<&str> = self
            .pairs
            .iter()
            .filter(|p| keep(&p.key))
            .map(|p| p.raw.as_str())
            .collect();
        let query = (!kept.is_empty()).then(|| kept.join("&"));
        self.rebuilt(None, None, Some(query), None)
    }

    /// The same URL with the query option `key` set to `value` (encoded),
    /// replacing every earlier `key`.
    pub fn with_option(&self, key: &str, value: &str) -> Result<Self, Error> {
        let encoded: String = ::url::form_urlencoded::Serializer::new(String::new())
            .append_pair(key, value)
            .finish();
        let mut kept: Vec<&str> = self
            .pairs
            .iter()
            .filter(|p| p.key != key)
            .map(|p| p.raw.as_str())
            .collect();
        kept.push(&encoded);
        self.rebuilt(None, None, Some(Some(kept.join("&"))), None)
    }

    /// The same URL with another fragment (`None` removes it).
    pub fn with_fragment(&self, fragment: Option<&str>) -> Result<Self, Error> {
        self.rebuilt(None, None, None, Some(fragment.map(str::to_owned)))
    }

    fn rebuilt(
        &self,
        scheme: Option<&str>,
        hosts: Option<&[HostPort]>,
        query: Option<Option<String>>,
        fragment: Option<Option<String>>,
    ) -> Result<Self, Error> {
        let mut text = scheme.unwrap_or(&self.scheme).to_owned();
        text.push(':');
        if let Some(a) = &self.authority {
            text.push_str("//");
            if let Some(userinfo) = &a.userinfo {
                text.push_str(userinfo);
                text.push('@');
            }
            let hosts = hosts.unwrap_or(&a.hosts);
            let list: Vec<String> = hosts.iter().map(HostPort::to_string).collect();
            text.push_str(&list.join(","));
        } else if hosts.is_some() {
            return Err(self.invalid("an opaque URL has no hosts to replace"));
        }
        text.push_str(&self.path);
        if let Some(q) = query.unwrap_or_else(|| self.query.clone()) {
            text.push('?');
            text.push_str(&q);
        }
        if let Some(f) = fragment.unwrap_or_else(|| self.fragment.clone()) {
            text.push('#');
            text.push_str(&f);
        }
        Self::parse(&text)
    }
}

impl FromStr for StoreUrl {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl TryFrom<&str> for StoreUrl {
    type Error = Error;

    fn try_from(s: &str) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl TryFrom<&String> for StoreUrl {
    type Error = Error;

    fn try_from(s: &String) -> Result<Self, Error> {
        Self::parse(s)
    }
}

impl TryFrom<String> for StoreUrl {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        Self::parse(&s)
    }
}

impl TryFrom<&StoreUrl> for StoreUrl {
    type Error = Error;

    fn try_from(url: &StoreUrl) -> Result<Self, Error> {
        Ok(url.clone())
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("StoreUrl").field(&self.redacted()).finish()
    }
}

/// Whether `text` is a URL scheme (RFC 3986: a letter, then letters,
/// digits, `+`, `-` or `.`).
fn is_scheme(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_alphabetic())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// What follows the authority of `scheme://` + `text`: from the first `/`,
/// `?` or `#` on.
fn after_authority(text: &str) -> &str {
    let end = text.find(['/', '?', '#']).unwrap_or(text.len());
    &text[end..]
}

fn parse_authority(text: &str) -> Result<Authority, String> {
    let (userinfo, hosts_text) = match text.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, text),
    };
    let (username, password) = match userinfo {
        Some(u) => {
            let (user, password) = match u.split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (u, None),
            };
            let password = password
                .map(decode)
                .transpose()
                .map_err(|why| format!("the password {why}"))?;
            (
                decode(user).map_err(|why| format!("the user name {why}"))?,
                password,
            )
        }
        None => (String::new(), None),
    };
    let hosts = if hosts_text.is_empty() {
        Vec::new()
    } else {
        hosts_text
            .split(',')
            .enumerate()
            .map(|(i, host)| {
                parse_host(host).map_err(|why| format!("host {} of the URL: {why}", i + 1))
            })
            .collect::<Result<_, _>>()?
    };
    Ok(Authority {
        userinfo: userinfo.map(str::to_owned),
        username,
        password,
        hosts,
    })
}

fn parse_host(text: &str) -> Result<HostPort, String> {
    if text.is_empty() {
        return Err("an empty host in the host list".into());
    }
    let (host, port) = if let Some(v6) = text.strip_prefix('[') {
        let (addr, after) = v6
            .split_once(']')
            .ok_or_else(|| "an IPv6 address needs its closing ]".to_owned())?;
        Ipv6Addr::from_str(addr).map_err(|_| "not an IPv6 address".to_owned())?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| "expected :PORT after ]".to_owned())?,
            ),
        };
        (&text[..addr.len() + 2], port)
    } else {
        match text.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        }
    };
    if host.is_empty() {
        return Err("no host name".into());
    }
    if host.contains('%') {
        // A percent-encoded Unix socket path (`%2Ftmp%2Fmongodb.sock`), as
        // libpq and MongoDB write it.
        let path = decode(host).map_err(|why| format!("its name {why}"))?;
        if !path.starts_with('/') {
            return Err("only a Unix socket path (%2F...) may be percent-encoded".into());
        }
    } else if !host.starts_with('[') {
        ::url::Host::parse(host).map_err(|e| format!("not a host name ({e})"))?;
    }
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .map_err(|_| "its port is not a number from 0 to 65535".to_owned())
        })
        .transpose()?;
    Ok(HostPort {
        host: host.to_owned(),
        port,
    })
}

fn parse_query(query: &str) -> Result<Vec<Pair>, String> {
    let mut pairs = Vec::new();
    for raw in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = raw.split_once('=').unwrap_or((raw, ""));
        let key = decode_form(k).map_err(|why| format!("an option name {why}"))?;
        let value = decode_form(v).map_err(|why| format!("the value of {key:?} {why}"))?;
        if key.is_empty() {
            return Err("an option without a name".into());
        }
        pairs.push(Pair {
            key,
            value,
            raw: raw.to_owned(),
        });
    }
    Ok(pairs)
}

/// Percent-decodes `text` into UTF-8 text.
fn decode(text: &str) -> Result<String, String> {
    check_escapes(text)?;
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| "is not UTF-8 once percent-decoded".to_owned())
}

/// Decodes a query component (`+` is a space).
fn decode_form(text: &str) -> Result<String, String> {
    decode(&text.replace('+', " "))
}

/// Refuses a `%` not followed by two hex digits (decoders keep it silently).
fn check_escapes(text: &str) -> Result<(), String> {
    let bytes = text.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'%'
            && !(i + 2 < bytes.len()
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit())
        {
            return Err("has a % that is not followed by two hex digits".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
