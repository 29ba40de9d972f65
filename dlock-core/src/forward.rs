//! [`forward_backend!`](crate::forward_backend): a [`Backend`](crate::Backend)
//! that wraps another and forwards most of its methods to it, written once.

/// Implements [`Backend`](crate::Backend) for a wrapper type: each method
/// named after `forward:` calls the same method of the field named after
/// `=>`; the methods written after the list are the wrapper's own (and
/// methods in neither keep the trait's default). `wait_ready` forwards
/// `ready_in` too.
///
/// ```
/// use std::sync::Arc;
/// use dlock_core::backend::RawSession;
/// use dlock_core::memory::MemoryBackend;
/// use dlock_core::{Error, SessionId, SessionOptions};
///
/// /// A memory backend that counts the sessions it opens.
/// #[derive(Debug)]
/// struct Counting {
///     inner: MemoryBackend,
///     opened: std::sync::atomic::AtomicUsize,
/// }
///
/// dlock_core::forward_backend! {
///     impl Backend for Counting => inner;
///     forward: scheme, min_ttl, max_ttl, capabilities, wait_ready, inspect, list, validate,
///         force_release, ping;
///
///     async fn open(
///         &self,
///         id: SessionId,
///         options: &SessionOptions,
///     ) -> Result<Arc<dyn RawSession>, Error> {
///         self.opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         self.inner.open(id, options).await
///     }
/// }
/// ```
#[macro_export]
macro_rules! forward_backend {
    (
        impl Backend for $ty:ty => $inner:ident;
        forward: $($method:ident),+ $(,)?;
        $($own:tt)*
    ) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($method)+] [$($own)*]);
    };
    (@munch ($ty:ty, $inner:ident) [] [$($done:tt)*]) => {
        #[$crate::__async_trait]
        impl $crate::Backend for $ty {
            $($done)*
        }
    };
    (@munch ($ty:ty, $inner:ident) [scheme $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            fn scheme(&self) -> &'static str {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.scheme()
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [min_ttl $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            fn min_ttl(&self) -> ::std::time::Duration {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.min_ttl()
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [max_ttl $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            fn max_ttl(&self) -> ::std::time::Duration {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.max_ttl()
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [capabilities $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            fn capabilities(&self) -> $crate::Capabilities {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.capabilities()
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [wait_ready $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn wait_ready(
                &self,
                limit: ::std::time::Duration,
            ) -> ::std::result::Result<(), $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.wait_ready(limit).await
            }
            // (the two go together: a wrapper that forwards the wait also
            // tells how long it would be)
            async fn ready_in(
                &self,
            ) -> ::std::result::Result<::std::time::Duration, $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.ready_in().await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [open $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn open(
                &self,
                id: $crate::SessionId,
                options: &$crate::SessionOptions,
            ) -> ::std::result::Result<
                ::std::sync::Arc<dyn $crate::backend::RawSession>,
                $crate::Error,
            > {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.open(id, options).await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [inspect $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn inspect(
                &self,
                name: &$crate::LockName,
            ) -> ::std::result::Result<::std::option::Option<$crate::LockInfo>, $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.inspect(name).await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [list $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn list(
                &self,
                prefix: &str,
            ) -> ::std::result::Result<::std::vec::Vec<$crate::LockInfo>, $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.list(prefix).await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [validate $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn validate(
                &self,
                name: &$crate::LockName,
                token: $crate::FencingToken,
            ) -> ::std::result::Result<bool, $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.validate(name, token).await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [force_release $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn force_release(
                &self,
                name: &$crate::LockName,
            ) -> ::std::result::Result<bool, $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.force_release(name).await
            }
        ]);
    };
    (@munch ($ty:ty, $inner:ident) [ping $($rest:ident)*] [$($done:tt)*]) => {
        $crate::forward_backend!(@munch ($ty, $inner) [$($rest)*] [$($done)*
            async fn ping(&self) -> ::std::result::Result<(), $crate::Error> {
                #[allow(unused_imports)] // (unused where the call resolves without it)
                use $crate::Backend as _;
                self.$inner.ping().await
            }
        ]);
    };
}
