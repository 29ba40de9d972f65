//! Lock names as KV keys, and the value a held key carries.

use bytes::Bytes;
use dlock_core::{Error, FencingToken, LockName};

use crate::SCHEME;

/// A lock name as a KV key: its bytes in hex (keys allow only `[-/_=.a-zA-Z0-9]`).
pub(crate) fn key_of(name: &LockName) -> String {
    key_prefix(name.as_str())
}

/// The start of the keys of every name that starts with `prefix`.
pub(crate) fn key_prefix(prefix: &str) -> String {
    let mut key = String::from("l.");
    for b in prefix.bytes() {
        key.push_str(&format!("{b:02x}"));
    }
    key
}

pub(crate) fn name_of(key: &str) -> Option<LockName> {
    let hex = key.strip_prefix("l.")?;
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    LockName::new(String::from_utf8(bytes?).ok()?).ok()
}

/// A held key's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value {
    pub(crate) owner: String,
    pub(crate) token: Option<FencingToken>,
    pub(crate) session: String,
    pub(crate) why: String,
}

impl Value {
    pub(crate) fn encode(&self) -> Bytes {
        let token = self.token.map(|t| t.get().to_string()).unwrap_or_default();
        Bytes::from(format!(
            "{}\n{token}\n{}\n{}",
            self.owner, self.session, self.why
        ))
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes)
            .map_err(|_| Error::protocol(SCHEME, "a lock value is not UTF-8"))?;
        let mut parts = text.splitn(4, '\n');
        let (Some(owner), Some(token), Some(session), why) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Error::protocol(SCHEME, "a lock value has too few fields"));
        };
        let token = match token {
            "" => None,
            t => Some(FencingToken::new(t.parse().map_err(|_| {
                Error::protocol(SCHEME, format!("lock value token {t:?} is no number"))
            })?)),
        };
        Ok(Self {
            owner: owner.to_owned(),
            token,
            session: session.to_owned(),
            why: why.unwrap_or_default().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn keys_round_trip() {
        for name in ["a", "reports/nightly", "x.y-z_1"] {
            let n = LockName::new(name).unwrap();
            assert_eq!(name_of(&key_of(&n)), Some(n));
        }
    }

    #[test]
    pub(crate) fn values_round_trip() {
        let v = Value {
            owner: "s#1".into(),
            token: Some(FencingToken::new(7)),
            session: "s".into(),
            why: "a\nb".into(),
        };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
        let v = Value { token: None, ..v };
        assert_eq!(Value::decode(&v.encode()).unwrap(), v);
    }
}
