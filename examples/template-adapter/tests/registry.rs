//! The new scheme through the facade, as an application uses it:
//! `dlocks::register` once, then `dlocks::connect` like any built-in URL.

use dlock_core::SessionOptions;
use dlock_core::url::StoreUrl;
use dlock_template_adapter::TenantAdapter;

/// The conformance suite's URL for another tenant.
fn url(tenant: &str) -> String {
    let url = std::env::var("DLOCK_TEST_TENANT_REDIS_URL")
        .unwrap_or_else(|_| "tenant+redis://127.0.0.1:16379".into());
    let url = StoreUrl::parse(&url).and_then(|u| u.with_option("tenant", tenant));
    url.unwrap().expose().to_owned()
}

#[tokio::test]
async fn dlocks_connects_the_new_scheme_and_tenants_do_not_share_locks() {
    if dlock_conformance::skip_requested("tenant-redis", "registry") {
        return;
    }
    dlocks::register(TenantAdapter).unwrap();
    let acme = dlocks::connect(&url("acme")).await.unwrap();
    let globex = dlocks::connect(&url("globex")).await.unwrap();
    assert_eq!(acme.scheme(), "tenant+redis");

    let a = acme.session(SessionOptions::new()).await.unwrap();
    let g = globex.session(SessionOptions::new()).await.unwrap();
    let held = a.lock("registry-test/x").unwrap().acquire().await.unwrap();
    let other = g.lock("registry-test/x").unwrap().try_acquire().await;
    let other = other
        .unwrap()
        .expect("another tenant's lock of the same name is free");
    assert!(
        acme.inspect(held.name())
            .await
            .unwrap()
            .is_some_and(|i| i.token == held.token())
    );
    other.release().await.unwrap();
    held.release().await.unwrap();
    a.close().await.unwrap();
    g.close().await.unwrap();
}

/// This crate's `dlocks` has no built-in backend (`default-features = false`),
/// as an application that brings its own adapter may build it: every built-in
/// scheme is then a typed error naming the feature that compiles it in, and an
/// unknown scheme an invalid URL, neither showing the password. (CI's only
/// run of the facade with no backend compiled in: `scripts/test` says why.)
#[tokio::test]
async fn built_in_schemes_left_out_are_typed_errors_naming_their_feature() {
    for &(schemes, feature, compiled) in dlocks::KNOWN_SCHEMES {
        assert!(
            !compiled,
            "`{feature}` is compiled in: dlocks has default features here"
        );
        for scheme in schemes {
            let url = format!("{scheme}://user:secret@127.0.0.1:1/x");
            let e = dlocks::connect(&url).await.unwrap_err();
            assert!(
                matches!(&e, dlocks::Error::FeatureDisabled { feature: f, .. } if *f == feature),
                "{scheme}: {e:?}"
            );
            let message = e.to_string();
            assert!(
                message.contains(&format!("enable the `{feature}` feature")),
                "{message}"
            );
            assert!(!message.contains("secret"), "{message}");
        }
    }
    let e = dlocks::connect("gopher://user:secret@h").await.unwrap_err();
    assert!(matches!(e, dlocks::Error::InvalidUrl { .. }), "{e:?}");
    assert!(!e.to_string().contains("secret"), "{e}");
}
