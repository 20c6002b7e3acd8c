//! `[store]` for Redis beyond its URLs: TLS files parsed at validation and
//! refused naming their key, passwords from the TOML, a file or a named
//! variable (never quoted), Sentinel, and TLS keys from `RETRYD__`
//! variables.

use std::collections::HashMap;

use crate::budget::redis::RedisConfig;

use super::super::tests::error_of;
use super::super::{Config, Settings, StoreConfig};

fn redis_of(toml: &str, environment: &[(&str, &str)]) -> RedisConfig {
    let environment = environment
        .iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect::<HashMap<_, _>>();
    let settings = Settings::from_sources(toml, Some(environment)).unwrap();
    match Config::try_from(settings).unwrap().store {
        StoreConfig::Redis(redis) => *redis,
        other => panic!("not Redis: {other:?}"),
    }
}

fn store(url: &str, extra: &str) -> String {
    format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\n{extra}")
}

/// A CA certificate and a key in PEM, made here.
fn pem_files(dir: &std::path::Path) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let certificate = rcgen::CertificateParams::new(vec!["localhost".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let cert_path = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert_path, certificate.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    (
        cert_path.display().to_string(),
        key_path.display().to_string(),
    )
}

#[test]
fn tls_files_are_parsed_at_validation_and_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pem_files(dir.path());
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let garbage = garbage.display().to_string();
    let tls = |body: &str| store("rediss://cache:6380", &format!("[store.tls]\n{body}\n"));

    let redis = redis_of(
        &tls(&format!(
            "ca_file = \"{cert}\"\ncert_file = \"{cert}\"\nkey_file = \"{key}\""
        )),
        &[],
    );
    assert!(redis.access.tls.ca_pem.is_some());
    assert!(redis.access.tls.client_pem.is_some());
    assert!(!format!("{redis:?}").contains("PRIVATE KEY"), "{redis:?}");

    for (body, key_named) in [
        (format!("ca_file = \"{garbage}\""), "store.tls.ca_file"),
        (
            "ca_file = \"/nonexistent.pem\"".to_owned(),
            "store.tls.ca_file",
        ),
        (format!("cert_file = \"{cert}\""), "store.tls.key_file"),
        (format!("key_file = \"{key}\""), "store.tls.cert_file"),
        (
            format!("cert_file = \"{garbage}\"\nkey_file = \"{key}\""),
            "store.tls.cert_file",
        ),
        (
            format!("cert_file = \"{cert}\"\nkey_file = \"{cert}\""),
            "store.tls.key_file",
        ),
    ] {
        let error = error_of(&tls(&body));
        assert!(error.contains(key_named), "{body}: {error}");
    }
    // TLS material without rediss://, and mixed schemes.
    let error = error_of(&store(
        "redis://cache:6379",
        "[store.tls]\ninsecure_skip_verify = true\n",
    ));
    assert!(
        error.contains("store.tls") && error.contains("rediss://"),
        "{error}"
    );
    let mixed = "[store]\nkind = \"redis\"\nurl = [\"redis://a:7000\", \"rediss://b:7000\"]\n";
    assert!(error_of(mixed).contains("store.url"));
}

#[test]
fn a_password_comes_from_one_place_and_is_never_quoted() {
    let secret = "pw-3b9d0c";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    let file = file.display().to_string();

    let from_file = redis_of(
        &store(
            "redis://cache:6379",
            &format!("username = \"retryd\"\npassword_file = \"{file}\"\n"),
        ),
        &[],
    );
    assert_eq!(
        from_file.access.password.unwrap().expose(),
        secret,
        "one newline dropped"
    );
    assert_eq!(from_file.access.username.as_deref(), Some("retryd"));
    let from_env = redis_of(
        &store(
            "redis://cache:6379",
            "password_env = \"MY_REDIS_PASSWORD\"\n",
        ),
        &[("MY_REDIS_PASSWORD", secret)],
    );
    assert_eq!(from_env.access.password.as_ref().unwrap().expose(), secret);
    assert!(!format!("{from_env:?}").contains(secret));
    let from_retryd_variable = redis_of(
        &store("redis://cache:6379", ""),
        &[("RETRYD__STORE__PASSWORD", secret)],
    );
    assert_eq!(
        from_retryd_variable.access.password.unwrap().expose(),
        secret
    );

    for (extra, key) in [
        (
            format!("password = \"{secret}\"\npassword_file = \"{file}\"\n"),
            "store.password",
        ),
        (
            "password_file = \"/nonexistent/password\"\n".to_owned(),
            "store.password_file",
        ),
        (
            "password_env = \"NO_SUCH_VARIABLE_HERE\"\n".to_owned(),
            "store.password_env",
        ),
        ("password = \"\"\n".to_owned(), "store.password"),
        ("username = \"\"\n".to_owned(), "store.username"),
    ] {
        let error = error_of(&store("redis://cache:6379", &extra));
        assert!(error.contains(key), "{extra}: {error}");
        assert!(!error.contains(secret), "{error}");
    }
}

#[test]
fn sentinel_and_tls_keys_work_from_retryd_variables_too() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, _) = pem_files(dir.path());
    let redis = redis_of(
        "",
        &[
            ("RETRYD__STORE__KIND", "redis"),
            ("RETRYD__STORE__URL", "rediss://sentinel-a:26379"),
            ("RETRYD__STORE__TLS__CA_FILE", &cert),
            ("RETRYD__STORE__SENTINEL__MASTER_NAME", "primary"),
        ],
    );
    assert_eq!(redis.access.sentinel.unwrap().master_name, "primary");
    assert!(redis.access.tls.ca_pem.is_some());
    let error = error_of(&store(
        "redis://sentinel-a:26379",
        "sentinel = { master_name = \" \" }\n",
    ));
    assert!(error.contains("store.sentinel.master_name"), "{error}");
}
