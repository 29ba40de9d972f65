//! [`MongoFence`]: a lock's fencing token checked where the protected data
//! lives, when that is a MongoDB document.

use dlock_core::{FenceError, FencingToken, StaleToken};
use mongodb::Collection;
use mongodb::bson::{Bson, Document, doc};
use mongodb::results::UpdateResult;

/// Fenced updates of MongoDB documents: the token is kept in a field of the
/// protected document itself (default `fence`), and an update goes through
/// only if that field holds no newer token, in the update's own filter,
/// atomically on the server; it also records the token. An older token is
/// [`FenceError::Stale`] and writes nothing. Equal tokens are accepted, so a
/// holder may write many times.
///
/// Tokens are stored as 64-bit integers. Tokens are per lock name: guard one
/// document with one lock name on one backend.
///
/// ```no_run
/// # async fn demo(accounts: mongodb::Collection<mongodb::bson::Document>, guard: dlock_core::LockGuard) -> Result<(), dlock_core::FenceError> {
/// use dlock_mongo::MongoFence;
/// use mongodb::bson::doc;
///
/// let fence = MongoFence::new();
/// fence
///     .update_one(&accounts, doc! { "_id": 42 }, doc! { "$inc": { "balance": -10 } }, guard.token())
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MongoFence {
    field: String,
}

impl Default for MongoFence {
    fn default() -> Self {
        Self::new()
    }
}

impl MongoFence {
    /// The fence in the field `fence`.
    pub fn new() -> Self {
        Self::in_field("fence")
    }

    /// The fence in the field `field` of the protected documents.
    pub fn in_field(field: impl Into<String>) -> Self {
        Self {
            field: field.into(),
        }
    }

    /// `filter`, narrowed to documents whose fence holds no newer token than
    /// `token` (a missing field counts as none).
    pub fn filter(&self, filter: Document, token: FencingToken) -> Result<Document, FenceError> {
        let t = self.value(&filter, token)?;
        Ok(doc! { "$and": [filter, { self.field.as_str(): { "$not": { "$gt": t } } }] })
    }

    /// `update` (operators such as `$set`, `$inc`), with the token recorded
    /// in the fence field.
    pub fn update(
        &self,
        mut update: Document,
        token: FencingToken,
    ) -> Result<Document, FenceError> {
        let t = self.value(&update, token)?;
        let mut set = match update.remove("$set") {
            Some(Bson::Document(set)) => set,
            _ => Document::new(),
        };
        set.insert(self.field.as_str(), t);
        update.insert("$set", set);
        Ok(update)
    }

    /// Updates the document `filter` matches with `update` if `token` is
    /// current: the update's result (no match: no such document);
    /// [`FenceError::Stale`] if the document holds a newer token.
    pub async fn update_one(
        &self,
        collection: &Collection<Document>,
        filter: Document,
        update: Document,
        token: FencingToken,
    ) -> Result<UpdateResult, FenceError> {
        let shown = format!("{filter}");
        let result = collection
            .update_one(
                self.filter(filter.clone(), token)?,
                self.update(update, token)?,
            )
            .await
            .map_err(|e| store_error(&shown, e))?;
        if result.matched_count > 0 {
            return Ok(result);
        }
        // Nothing matched: a newer token, or no such document.
        let found = collection
            .find_one(filter)
            .await
            .map_err(|e| store_error(&shown, e))?;
        match found.as_ref().and_then(|d| d.get(self.field.as_str())) {
            Some(Bson::Int64(h)) if *h > token.get() as i64 => Err(FenceError::Stale {
                resource: shown,
                stale: StaleToken {
                    token,
                    highest: FencingToken::new(*h as u64),
                },
            }),
            _ => Ok(result),
        }
    }

    fn value(&self, context: &Document, token: FencingToken) -> Result<i64, FenceError> {
        i64::try_from(token.get()).map_err(|_| FenceError::TokenTooLarge {
            resource: format!("{context}"),
            token,
        })
    }
}

fn store_error(resource: &str, e: mongodb::error::Error) -> FenceError {
    FenceError::Store {
        resource: resource.to_owned(),
        source: Box::new(e),
    }
}
