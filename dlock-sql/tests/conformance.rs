//! The conformance suite on PostgreSQL, MariaDB/MySQL and SQLite (a
//! temporary file: no wire, so no wire faults, and no servers to kill), in a
//! table of its own. What the cases expect is what the backend declares for
//! each URL (`SqlOptions::capabilities`).

use dlock_conformance::{AdapterHarness, conformance_tests};
use dlock_sql::{SqlAdapter, SqlBackend};

fn sql(store: &str, url: &str) -> AdapterHarness {
    AdapterHarness::new(store, SqlAdapter)
        .default_url(url)
        .url_option("dlock_table", "dlock_test_locks")
        .leftovers(|u, p| async move { SqlBackend::connect(&u).await?.held_rows(&p).await })
        .bad_urls([
            "postgres://",
            "postgres://dlock:secret@127.0.0.1:15432/dlock?dlock_table=no-dashes",
            "mysql://dlock:secret@127.0.0.1:13306/dlock?dlock_pool=0",
            "postgres://dlock:secret@127.0.0.1:15432/dlock?dlock_tabel=misspelt",
            "sqlite://:memory:",
            "sqlite::memory:",
            "sqlite:relative.db",
            "oracle://x",
        ])
}

/// The SQLite suite's database, in cargo's directory for integration tests'
/// files (`target/tmp`), not the system's temporary directory.
fn sqlite_file() -> String {
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dlock-conformance-{}.db", std::process::id()));
    format!("sqlite://{}", file.display())
}

conformance_tests!(mod postgres, sql("postgres", "postgres://dlock:dlock@127.0.0.1:15432/dlock")
    .services(["postgres"]));
conformance_tests!(mod mysql, sql("mysql", "mysql://dlock:dlock@127.0.0.1:13306/dlock")
    .services(["mysql"]));
conformance_tests!(mod sqlite, sql("sqlite", &sqlite_file()));
