use std::net::SocketAddr;
use std::time::Duration;

use super::*;

fn url(text: &str) -> StoreUrl {
    StoreUrl::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn reason(text: &str) -> String {
    match StoreUrl::parse(text) {
        Ok(u) => panic!("{text} parsed: {u:?}"),
        Err(Error::InvalidUrl { reason, url }) => {
            assert!(!url.contains("s3cret"), "{url}");
            reason
        }
        Err(e) => panic!("{text}: {e:?}"),
    }
}

#[test]
fn parts_of_a_multi_host_url() {
    let u = url("ETCD://app:p%40ss@h1:2379,[::1]:2380,h3/jobs/x?a=1&b=two+words#frag");
    assert_eq!(u.scheme(), "etcd");
    assert_eq!(u.username(), "app");
    assert_eq!(u.password(), Some("p@ss"));
    let hosts: Vec<String> = u.hosts().iter().map(ToString::to_string).collect();
    assert_eq!(hosts, ["h1:2379", "[::1]:2380", "h3"]);
    assert_eq!(u.hosts()[2].with_default_port(2379), "h3:2379");
    assert_eq!(u.path(), "/jobs/x");
    assert_eq!(u.path_decoded().unwrap(), "jobs/x");
    let pairs: Vec<(&str, &str)> = u.query_pairs().collect();
    assert_eq!(pairs, [("a", "1"), ("b", "two words")]);
    assert_eq!(u.fragment(), Some("frag"));
}

#[test]
fn forms_without_hosts() {
    let u = url("memory://");
    assert!(u.has_authority() && u.hosts().is_empty());
    let u = url("sqlite:///tmp/x.db?mode=rwc");
    assert_eq!((u.hosts().len(), u.path()), (0, "/tmp/x.db"));
    let u = url("sqlite::memory:");
    assert!(!u.has_authority());
    assert_eq!(u.path(), ":memory:");
    let u = url("mongodb://%2Ftmp%2Fmongodb-27017.sock/?x=1");
    assert_eq!(u.hosts()[0].host, "%2Ftmp%2Fmongodb-27017.sock");
    assert!(reason("mongodb://%41bc").contains("Unix socket"));
    let u = url("sqlite://dlock.db");
    assert_eq!(u.hosts()[0].host, "dlock.db");
}

#[test]
fn secrets_are_never_shown() {
    let u = url("redis://:s3cret@h:6379/0?password=s3cret");
    for shown in [u.to_string(), format!("{u:?}"), u.redacted()] {
        assert!(!shown.contains("s3cret"), "{shown}");
    }
    assert!(u.expose().contains("s3cret"));
    let e = u.options().finish().unwrap_err();
    assert!(!e.to_string().contains("s3cret"), "{e}");
    assert!(!format!("{e:?}").contains("s3cret"), "{e:?}");
}

#[test]
fn malformed_urls_say_what_is_wrong() {
    assert!(reason("no-scheme").contains("no scheme"));
    assert!(reason("1x://h").contains("not a URL scheme"));
    assert!(reason("redis://:s3cret@h:port").contains("not a number"));
    assert!(reason("redis://:s3cret@h:70000").contains("not a number"));
    assert!(reason("etcd://:s3cret@h1:1,,h2:2").contains("empty host"));
    assert!(reason("etcd://:s3cret@[::1:1").contains("closing ]"));
    assert!(reason("etcd://:s3cret@[nope]:1").contains("not an IPv6"));
    assert!(reason("redis://:s3%zzcret@h").contains("password"));
    assert!(reason("redis://:s3cret@h?x=%").contains("\"x\""));
    assert!(reason("redis://:s3cret@h?=1").contains("without a name"));
    assert!(reason("redis://:s3cret@h x").contains("percent-encode"));
    assert!(reason("redis://:s3cret@h<i>").contains("host 1 of the URL: not a host name"));
    assert!(!reason("redis://u:s3cret").contains("s3cret"));
    assert!(!reason("redis://:s3cret").contains("s3cret"));
}

#[test]
fn a_password_with_unencoded_delimiters_is_never_quoted() {
    for text in [
        "etcd://u:hunter2/x@a:1",
        "etcd://u:hun/ter2@a:1,b:2/pre",
        "redis://:hunter2?x@h",
        "redis://:hunter2#x@h",
        "redis://:p@hunter2/w@h",
    ] {
        let e = StoreUrl::parse(text).unwrap_err();
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains("hunter2"), "{text}: {shown}");
        assert!(shown.contains("percent-encode"), "{text}: {shown}");
    }
    // Encoded, the same password is fine.
    assert_eq!(
        url("etcd://u:hunter2%2Fx@a:1").password(),
        Some("hunter2/x")
    );
}

#[test]
fn typed_options() {
    let u = url("x://h?t=1500ms&f=yes&n=7&p=%2Ftmp%2Fca.pem&d=driver&bad=soon");
    let mut o = u.options();
    assert_eq!(o.duration("t").unwrap(), Some(Duration::from_millis(1500)));
    assert_eq!(o.flag("f").unwrap(), Some(true));
    assert_eq!(o.parse::<u32>("n", "a whole number").unwrap(), Some(7));
    assert_eq!(o.path("p").unwrap().unwrap().to_str(), Some("/tmp/ca.pem"));
    assert_eq!(o.string("missing").unwrap(), None);
    o.pass("d");
    assert_eq!(o.unread(), ["bad"]);
    let e = o.duration("bad").unwrap_err();
    assert!(e.to_string().contains("bad must be a duration"), "{e}");
    o.finish().unwrap();
}

#[test]
fn repeated_and_unknown_options_are_refused() {
    let u = url("x://h?a=1&a=2");
    let e = u.options().string("a").unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let u = url("x://h?max_tll=5s");
    let mut o = u.options();
    o.duration("max_ttl").unwrap();
    let e = o.finish().unwrap_err().to_string();
    assert!(
        e.contains("unknown option \"max_tll\" (known: max_ttl)"),
        "{e}"
    );
    let e = url("x://h?a=1").options().finish().unwrap_err().to_string();
    assert!(e.contains("x:// takes no options"), "{e}");
}

#[test]
fn rebuilt_urls_keep_everything_else() {
    let u = url("etcd://u:p%2F@h1:1,h2:2/pre?a=1&keep=x%20y#f");
    let proxies: Vec<SocketAddr> = vec!["127.0.0.1:9".parse().unwrap()];
    let v = u.with_hosts(&proxies).unwrap();
    assert_eq!(v.expose(), "etcd://u:p%2F@127.0.0.1:9/pre?a=1&keep=x%20y#f");
    let v = u.with_query_filtered(|k| k == "keep").unwrap();
    assert_eq!(v.expose(), "etcd://u:p%2F@h1:1,h2:2/pre?keep=x%20y#f");
    let v = v
        .with_query_filtered(|_| false)
        .unwrap()
        .with_fragment(None)
        .unwrap()
        .with_scheme("etcds")
        .unwrap();
    assert_eq!(v.expose(), "etcds://u:p%2F@h1:1,h2:2/pre");
    let v = u
        .with_option("a", "x&y")
        .unwrap()
        .with_option("new", "1")
        .unwrap();
    assert_eq!(
        v.expose(),
        "etcd://u:p%2F@h1:1,h2:2/pre?keep=x%20y&a=x%26y&new=1#f"
    );
    let one = u.with_hosts(&u.hosts()[1..]).unwrap();
    assert_eq!(one.hosts().len(), 1);
    assert!(url("sqlite::memory:").with_hosts(&proxies).is_err());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
    assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
    assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
    for bad in ["", "5", "s", "-1s", "soon", "5 parsecs"] {
        assert_eq!(parse_duration(bad), None, "{bad}");
    }
}
