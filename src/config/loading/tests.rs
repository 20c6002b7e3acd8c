//! Loading: the layering of the file and `RETRYD__` variables, and the
//! errors of both, which name the key and never print a secret.

use std::collections::HashMap;

use crate::budget::redis::{RedisUrl, redact_url};
use crate::config::tests::{config, error_of};
use crate::config::{Config, Settings, StoreConfig, Urls};

use super::redact_urls_in;

#[test]
fn environment_overrides_the_file() {
    let environment = HashMap::from([
        ("RETRYD__STORE__KIND".to_string(), "redis".to_string()),
        (
            "RETRYD__STORE__URL".to_string(),
            "redis://127.0.0.1:6390".to_string(),
        ),
        (
            "RETRYD__DEFAULTS__MAX_ATTEMPTS".to_string(),
            "5".to_string(),
        ),
        (
            "RETRYD__SERVER__LISTEN".to_string(),
            "127.0.0.1:7000".to_string(),
        ),
    ]);
    let settings =
        Settings::from_sources("[defaults]\nmax_attempts = 2\n", Some(environment)).unwrap();
    let config = Config::try_from(settings).unwrap();
    assert_eq!(config.policies.defaults().engine.max_attempts, 5);
    assert_eq!(config.listen.port(), 7000);
    match config.store {
        StoreConfig::Redis(redis) => assert_eq!(redis.urls, ["redis://127.0.0.1:6390"]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bracketed_keys_are_refused_not_expanded() {
    // The config crate would read this as an index and try to allocate.
    let message = error_of("\"x[200000000000000000]\" = 1");
    assert!(message.starts_with("x[200000000000000000]:"), "{message}");
    let message = error_of("[upstreams.\"a[1]\"]\nmax_attempts = 2");
    assert!(message.starts_with("upstreams.a[1]:"), "{message}");
    let environment = HashMap::from([("RETRYD__X[9]".to_string(), "1".to_string())]);
    let error = Settings::from_sources("", Some(environment)).unwrap_err();
    assert!(error.to_string().starts_with("RETRYD__X[9]:"), "{error}");
}

const PASSWORD: &str = "hunter2-secret-9f3a";

#[test]
fn redis_urls_print_without_their_credentials() {
    let cases = [
        (
            "redis://:hunter2-secret-9f3a@cache:6379/0",
            "redis://***@cache:6379/0",
        ),
        (
            "redis://ops:hunter2-secret-9f3a@cache:6379",
            "redis://***@cache:6379",
        ),
        // A password written without its `:` is in the user name.
        ("redis://hunter2-secret-9f3a@cache", "redis://***@cache"),
        // Raw `@`, `/`, `?` in a password: still all userinfo.
        (
            "redis://:hunter2/secret?9f3a@x@cache:6379",
            "redis://***@cache:6379",
        ),
        // A password where the host should be.
        ("redis://:hunter2-secret-9f3a", "redis://:***"),
        (
            "redis://cache:6379/0?password=hunter2-secret-9f3a",
            "redis://cache:6379/0?***",
        ),
        (
            "redis://u:hunter2-secret-9f3a@[::1]:6379/2",
            "redis://***@[::1]:6379/2",
        ),
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("hunter2-secret-9f3a", "***"),
    ];
    for (raw, shown) in cases {
        let url = RedisUrl::from(raw);
        assert_eq!(url.to_string(), shown, "{raw}");
        assert_eq!(format!("{url:?}"), format!("RedisUrl({shown:?})"));
        assert_eq!(url.expose_credentials(), raw);
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    // Nothing that holds one prints it either.
    let toml = format!("[store]\nkind = \"redis\"\nurl = \"redis://:{PASSWORD}@cache:6379\"\n");
    let settings = Settings::from_toml(&toml).unwrap();
    assert!(!format!("{settings:?}").contains(PASSWORD));
    let config = Config::try_from(settings).unwrap();
    assert!(!format!("{config:?}").contains(PASSWORD));
    let many = Urls::Many(vec![format!("redis://:{PASSWORD}@a:7000")]);
    assert_eq!(format!("{many:?}"), "Many([\"redis://***@a:7000\"])");
}

#[test]
fn configuration_errors_name_the_key_without_the_password() {
    let url_line = |url: &str| format!("[store]\nkind = \"redis\"\nurl = {url}\n");
    let cases = [
        (
            url_line(&format!("\"http://:{PASSWORD}@cache:6379\"")),
            "store.url: \"http://***@cache:6379\" is not a redis:// or rediss:// URL",
        ),
        (
            url_line(&format!("\"rediss://:{PASSWORD}@cache:x6380\"")),
            "store.url: \"rediss://***@cache:***\": the port is not a number",
        ),
        (
            url_line(&format!("[\"redis://a:7000\", \"redis://:{PASSWORD}\"]")),
            "store.url: \"redis://:***\" names no host",
        ),
        (
            url_line(&format!("\"redis://:{PASSWORD}@cache:x6379\"")),
            "store.url: \"redis://***@cache:***\": the port is not a number",
        ),
        (
            url_line(&format!("\"redis://:{PASSWORD}@cache:6379")),
            "store.url: TOML syntax error at line 3, column ",
        ),
        (
            format!("[store] # comment\nkind = \"redis\"\npassword = '{PASSWORD}\n"),
            "store.password: TOML syntax error at line 3, column ",
        ),
        (
            format!("[store]\nurl = [\n  \"redis://:{PASSWORD}@a:1\n]\n"),
            "store: TOML syntax error at line 3, column ",
        ),
        (
            format!("{PASSWORD}\n"),
            "TOML syntax error at line 1, column 20: ",
        ),
        (
            format!("[server]\nallow_unauthenticated = \"redis://u:{PASSWORD}@cache\"\n"),
            "cannot load configuration: invalid type: string \"redis://***@cache\"",
        ),
    ];
    for (toml, expected) in &cases {
        let error = config(toml).expect_err("must be refused");
        let message = error.to_string();
        assert!(message.starts_with(expected), "{toml:?} gave {message:?}");
        assert!(!message.contains(PASSWORD), "{message}");
        // No source to print the unredacted text again.
        assert!(std::error::Error::source(&error).is_none(), "{message}");
    }

    let environment = |url: String| {
        HashMap::from([
            ("RETRYD__STORE__KIND".to_string(), "redis".to_string()),
            ("RETRYD__STORE__URL".to_string(), url),
        ])
    };
    // rediss:// is accepted now (TLS to Redis); a bad one is refused
    // like any URL.
    let settings = Settings::from_sources(
        "",
        Some(environment(format!("rediss://:{PASSWORD}@cache:6380"))),
    )
    .unwrap();
    assert!(Config::try_from(settings).is_ok());
    for url in [
        format!("ftp://:{PASSWORD}@cache:6380"),
        format!("http://:{PASSWORD}@cache:6379"),
    ] {
        let settings = Settings::from_sources("", Some(environment(url))).unwrap();
        let message = Config::try_from(settings).unwrap_err().to_string();
        assert!(message.starts_with("store.url: \""), "{message}");
        assert!(message.contains("cache:63"), "{message}");
        assert!(!message.contains(PASSWORD), "{message}");
    }
    let wrong_type = HashMap::from([(
        "RETRYD__SERVER__ALLOW_UNAUTHENTICATED".to_string(),
        format!("redis://:{PASSWORD}@cache:6379"),
    )]);
    let message = Settings::from_sources("", Some(wrong_type))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("server.allow_unauthenticated"),
        "{message}"
    );
    assert!(!message.contains(PASSWORD), "{message}");
}

#[test]
fn urls_in_free_text_are_redacted() {
    let cases = [
        (
            "expected a boolean, not string \"redis://u:p\\\"w@h:1\" in `x`",
            "expected a boolean, not string \"redis://***@h:1\" in `x`",
        ),
        ("at redis://:pw@h:1 then", "at redis://***@h:1 then"),
        // Unquoted, a URL runs to whitespace, so punctuation glued to it
        // is hidden with its port: on the safe side.
        ("at redis://:pw@h:1, then", "at redis://***@h:*** then"),
        (
            "two: redis://:a@h:1 https://u:b@web/x",
            "two: redis://***@h:1 https://***@web/x",
        ),
        ("no url here", "no url here"),
        ("é://u:p@h and ://", "é://***@h and ://"),
    ];
    for (text, redacted) in cases {
        assert_eq!(redact_urls_in(text), redacted);
    }
}

proptest::proptest! {
    #[test]
    fn any_password_is_hidden(
        password in "\\PC*",
        host in "[a-z0-9.-]{1,20}",
    ) {
        let url = format!("redis://user:{password}@{host}:6379/0");
        proptest::prop_assert_eq!(redact_url(&url), format!("redis://***@{host}:6379/0"));
        // Quoted by serde in a message, escapes and all.
        let message = format!("invalid type: string {url:?}, expected a boolean");
        proptest::prop_assert_eq!(
            redact_urls_in(&message),
            format!("invalid type: string \"redis://***@{host}:6379/0\", expected a boolean")
        );
    }

    #[test]
    fn syntax_errors_never_quote_the_file(
        head in "[a-z\\[\\]=\" \\n]{0,40}",
        password in "[!-~]{12,24}",
    ) {
        let toml = format!("{head}\nurl = \"redis://:{password}@cache:6379\n");
        if let Err(error) = Settings::from_toml(&toml) {
            let message = error.to_string();
            proptest::prop_assert!(!message.contains(&password), "{}", message);
        }
    }

    #[test]
    fn redaction_never_panics(text in "\\PC*") {
        let _ = redact_urls_in(&text);
        let _ = redact_url(&text);
        let _ = Settings::from_toml(&text);
    }
}

#[test]
fn unknown_keys_are_refused_by_name() {
    let message = error_of("[defaults]\nmax_atempts = 3");
    assert!(message.contains("max_atempts"), "{message}");
    let message = error_of("[serverr]\nlisten = \"127.0.0.1:1\"");
    assert!(message.contains("serverr"), "{message}");
}

#[test]
fn a_url_written_as_a_name_is_redacted() {
    // A Redis URL set on the wrong variable, or pasted into `mode`.
    let url = format!("redis://:{PASSWORD}@cache:6379");
    let expected =
        "store.mode: unknown variant \"redis://***@cache:6379\", expected \"exact\" or \"leased\"";
    let from_file = error_of(&format!("[store]\nmode = {url:?}\n"));
    let environment = HashMap::from([("RETRYD__STORE__MODE".to_string(), url)]);
    let from_environment = Settings::from_sources("", Some(environment))
        .unwrap_err()
        .to_string();
    for message in [from_file, from_environment] {
        assert_eq!(message, expected);
        assert!(!message.contains(PASSWORD), "{message}");
    }
}
