//! The facade's built-in adapters and an application's own, in one process
//! (its own test binary: the process-wide registry is filled once).

use dlocks::Error;
use dlocks::memory::MemoryBackend;
use dlocks::url::StoreUrl;

/// An application's adapter for `sqlite://` (an in-process store here).
#[derive(Debug, Clone, Copy)]
struct Mine;

struct MineBackend;

impl MineBackend {
    async fn connect(url: &StoreUrl) -> Result<MemoryBackend, Error> {
        MemoryBackend::connect(&url.with_scheme("memory")?)
    }
}

dlocks::impl_adapter!(Mine, name: "mine", schemes: &["sqlite"], connect: MineBackend::connect);

/// An application's wrapper for `redis://` alone (say one with its own key
/// layout), not for its aliases.
#[derive(Debug, Clone, Copy)]
struct Wrapper;

dlocks::impl_adapter!(Wrapper, name: "wrapper", schemes: &["redis"], connect: MineBackend::connect);

/// An adapter registered before the facade fills the registry keeps its
/// scheme, and the built-in SQL adapter still gets its other schemes (it
/// used to lose all five to the one taken); `replace` then takes a scheme
/// back explicitly.
#[tokio::test]
async fn an_early_adapter_keeps_its_scheme_and_the_built_in_its_others() {
    dlock_core::registry().register(Mine).unwrap();
    dlock_core::registry().register(Wrapper).unwrap();
    let registry = dlocks::registry();
    assert_eq!(registry.adapter("sqlite").unwrap().name(), "mine");
    let backend = dlocks::connect("sqlite://x").await.unwrap();
    assert_eq!(backend.scheme(), "memory");
    #[cfg(feature = "postgres")]
    assert_eq!(registry.adapter("postgres").unwrap().name(), "sql");
    // redis:// is the wrapper's, and its aliases go to no adapter rather
    // than reach the same server as the built-in one with another layout
    // (red before: rediss:// and redlock:// were the built-in adapter's).
    assert_eq!(registry.adapter("redis").unwrap().name(), "wrapper");
    #[cfg(feature = "redis")]
    for alias in ["rediss://127.0.0.1:1", "redlock://127.0.0.1:1"] {
        let e = dlocks::connect(alias).await.unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{alias}: {e:?}");
        assert!(e.to_string().contains("wrapper adapter"), "{e}");
    }
    #[cfg(feature = "sqlite")]
    {
        assert_eq!(dlocks::replace(dlocks::sql::SqlAdapter).unwrap(), ["mine"]);
        assert_eq!(registry.adapter("sqlite").unwrap().name(), "sql");
    }
}
