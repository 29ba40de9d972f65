//! The floor of a MongoDB lock for `dlock bench` ([`dlock_core::floor`]):
//! an `insert` of the lock's document and its `delete`, in the lock
//! collection, on a client of its own. MongoDB has no lock of its own.

use async_trait::async_trait;
use dlock_core::floor::Floor;
use dlock_core::url::StoreUrl;
use dlock_core::{Error, LockName};
use mongodb::bson::doc;

use crate::MongoBackend;
use crate::store::map_err;

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
}
