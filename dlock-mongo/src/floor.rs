//! The floor of a MongoDB lock for `dlock bench` ([`dlock_core::floor`]):
//! an `insert` of the lock's document and its `delete`, in the lock
//! collection, on a client of its own. MongoDB has no lock of its own.

use async_trait::async_trait;
use dlock_core::floor::{FencedWrite, Floor};
use dlock_core::url::StoreUrl;
use dlock_core::{Error, FencingToken, LockName};
use mongodb::Collection;
use mongodb::bson::{Document, doc};

use crate::store::map_err;
use crate::{MongoBackend, MongoFence};

/// [`Floor`] of `mongodb://` and `mongodb+srv://` URLs: a backend of its
/// own, whose lock collection it writes to.
#[derive(Debug)]
pub struct MongoFloor {
    backend: MongoBackend,
}

impl MongoFloor {
    /// Opens the floor of `url` (read as [`MongoBackend::connect`] reads it).
    ///
    /// # Cancel safety
    /// As [`MongoBackend::connect`].
    pub async fn connect(url: &StoreUrl) -> Result<Self, Error> {
        Ok(Self {
            backend: MongoBackend::connect(url).await?,
        })
    }
}

#[async_trait]
impl Floor for MongoFloor {
    fn operations(&self) -> &'static str {
        "insertOne + deleteOne"
    }

    async fn cycle(&self, key: &LockName) -> Result<(), Error> {
        let locks = &self.backend.inner.clients.current().locks;
        // A space, which no lock name contains, keeps the floor's document
        // apart from every real lock's.
        let id = doc! { "_id": format!("dlock floor {key}") };
        locks.insert_one(&id).await.map_err(map_err)?;
        locks.delete_one(id).await.map_err(map_err)?;
        Ok(())
    }

    fn fenced_write(&self) -> Option<&dyn FencedWrite> {
        Some(self)
    }
}

impl MongoFloor {
    /// The collection of the fenced-write measure (`<locks>_floor`, next to
    /// the lock collection) and the `_id` of `key`'s document in it.
    fn fenced_doc(&self, key: &LockName) -> (Collection<Document>, Document) {
        let conn = self.backend.inner.clients.current();
        let locks = &conn.locks;
        let floor = conn
            .client
            .database(&locks.namespace().db)
            .collection(&format!("{}_floor", locks.name()));
        (floor, doc! { "_id": key.as_str() })
    }
}

#[async_trait]
impl FencedWrite for MongoFloor {
    fn operations(&self) -> &'static str {
        "updateOne, against MongoFence::update_one (one updateOne)"
    }

    async fn prepare(&self, key: &LockName) -> Result<(), Error> {
        let (floor, id) = self.fenced_doc(key);
        // Born fenced with no token yet, as MongoFence::insert_one would.
        let mut document = id;
        document.insert("fence", 0_i64);
        document.insert("v", 0_i64);
        floor.insert_one(document).await.map_err(map_err)?;
        Ok(())
    }

    async fn plain(&self, key: &LockName, value: u64) -> Result<(), Error> {
        let (floor, id) = self.fenced_doc(key);
        let v = i64::try_from(value).unwrap_or(i64::MAX);
        floor
            .update_one(id, doc! { "$set": { "v": v } })
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn fenced(&self, key: &LockName, token: FencingToken, value: u64) -> Result<(), Error> {
        let (floor, id) = self.fenced_doc(key);
        let v = i64::try_from(value).unwrap_or(i64::MAX);
        let done = MongoFence::new()
            .update_one(&floor, id, doc! { "$set": { "v": v } }, token)
            .await
            .map_err(|e| Error::protocol("mongodb", format!("floor: {e}")))?;
        if done.matched_count == 0 {
            return Err(Error::protocol("mongodb", "floor: the document is gone"));
        }
        Ok(())
    }

    async fn remove(&self, key: &LockName) -> Result<(), Error> {
        let (floor, id) = self.fenced_doc(key);
        floor.delete_one(id).await.map_err(map_err)?;
        Ok(())
    }
}
