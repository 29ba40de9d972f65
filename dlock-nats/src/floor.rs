//! The floor of a NATS lock for `dlock bench` ([`dlock_core::floor`]): the
//! requests a dlock take and release send, a KV write only if the key has
//! no message and a purge marker written only on that revision (the
//! marker's purge and the release announcement follow in the background),
//! on a connection of its own. NATS has no lock of its own (KV is the one).

use async_trait::async_trait;
use bytes::Bytes;
use dlock_core::floor::{FencedWrite, Floor};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};

use std::time::Duration;

use crate::conn::open_bucket;
use crate::store::Free;
use crate::value::key_prefix;
use crate::{NatsBackend, NatsFence, RACES, SCHEME};

/// [`Floor`] of `nats://` URLs: a backend of its own, in whose bucket it
/// writes keys no lock uses, and the bucket `<bucket>_fence` (no
/// `max_age`, as [`NatsFence`] needs) for the fenced writes.
pub struct NatsFloor {
    backend: NatsBackend,
    js: async_nats::jetstream::Context,
    data: async_nats::jetstream::kv::Store,
}

impl std::fmt::Debug for NatsFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsFloor")
            .field("backend", &self.backend)
            .field("data", &self.data.name)
            .finish()
    }
}

impl NatsFloor {
    /// Opens the floor of `url` (read as [`NatsBackend::connect`] reads it).
    ///
    /// # Cancel safety
    /// As [`NatsBackend::connect`].
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        let backend = NatsBackend::connect(url).await?;
        let client = backend.inner.conn().client.clone();
        let bucket = &backend.inner.bucket;
        let name = format!("{}_fence", &bucket[..bucket.len().min(58)]);
        let data = open_bucket(&client, &name, Some(Duration::ZERO)).await?;
        let js = async_nats::jetstream::new(client);
        Ok(Self { backend, js, data })
    }
}

#[async_trait]
impl Floor for NatsFloor {
    fn operations(&self) -> &'static str {
        "KV update on revision 0 + purge marker on that revision (its purge and the release announcement in the background)"
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let inner = &self.backend.inner;
        let key = key_for('f', key);
        let value = Bytes::from_static(b"floor");
        // As a lock's take (the last cycle's marker may not be purged yet).
        let mut written = None;
        for _ in 0..RACES {
            match inner.write_if_free(&key, value.clone(), None).await? {
                Free::Written(revision) => {
                    written = Some(revision);
                    break;
                }
                Free::Raced => {}
                Free::Held => {
                    return Err(Error::protocol(
                        SCHEME,
                        format!("the floor's key {key} holds a value it did not write"),
                    ));
                }
            }
        }
        let revision = written.ok_or_else(|| {
            Error::unavailable(SCHEME, format!("the floor's key {key} kept changing"))
        })?;
        if inner.remove_exact(&key, revision, true).await? {
            Ok(())
        } else {
            Err(Error::protocol(
                SCHEME,
                format!("the floor's message {revision} was gone before its removal"),
            ))
        }
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

/// The key of `name` for `kind` (`f`: the floor's take; `w`: its data),
/// apart from every lock's (`l`).
fn key_for(kind: char, name: &LockName) -> String {
    format!("{kind}{}", &key_prefix(name.as_str())[1..])
}

#[async_trait]
impl FencedWrite for NatsFloor {
    fn operations(&self) -> &'static str {
        "KV put, against NatsFence::put (direct get + conditional publish)"
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        let put = self.data.put(key_for('w', key), value.to_string().into());
        self.backend.inner.bounded(put).await.map(drop)
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        let fence = NatsFence::new(key_for('w', key));
        let put = fence.put(&self.js, &self.data, token, value.to_string().into());
        self.backend
            .inner
            .call(put)
            .await?
            .map_err(|e| Error::protocol(SCHEME, format!("floor: {e}")))
            .map(drop)
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        // (the messages themselves, not a purge marker, which a later
        // fenced write of the same key would refuse)
        let subject = format!("{}{}", self.data.prefix, key_for('w', key));
        let purge = self.data.stream.purge().filter(subject);
        self.backend
            .inner
            .bounded(purge.into_future())
            .await
            .map(drop)
    }
}
