//! The configuration's validation, section by section: every bad value is
//! refused naming its key, and what is accepted means what the
//! configuration contract says. Loading and redaction are tested beside
//! `loading.rs`.

use std::collections::HashMap;

use crate::budget::BucketConfig;
use crate::engine::{GrpcCode, Policy};

use super::{Config, InvalidConfig, Settings, StoreConfig, TlsConfig};

#[test]
fn tls_debug_leaves_the_private_key_out() {
    let tls = TlsConfig {
        cert_pem: b"-----BEGIN CERTIFICATE-----".to_vec(),
        key_pem: b"-----BEGIN PRIVATE KEY-----\nsecret-key-bytes".to_vec(),
        client_ca_pem: None,
        client_auth_optional: false,
    };
    let printed = format!("{tls:?}");
    assert!(!printed.contains("secret-key-bytes"), "{printed}");
    assert!(printed.contains("<redacted>"), "{printed}");
}

pub(super) fn config(toml: &str) -> Result<Config, InvalidConfig> {
    Config::try_from(Settings::from_toml(toml)?)
}

pub(super) fn error_of(toml: &str) -> String {
    config(toml).expect_err("must be refused").to_string()
}

#[test]
fn no_file_gives_the_documented_defaults() {
    let config = config("").unwrap();
    assert_eq!(config.listen, "127.0.0.1:50051".parse().unwrap());
    assert_eq!(config.metrics_listen, "127.0.0.1:9464".parse().unwrap());
    assert_eq!(config.store, StoreConfig::Memory);
    assert_eq!(config.policies.defaults().engine, Policy::default());
    assert_eq!(config.policies.defaults().bucket, BucketConfig::default());
}

#[test]
fn what_no_file_says_is_the_default_impl() {
    // One source per default: serde reads each section's `Default`, and
    // the store's fallback is the budget's.
    assert_eq!(Settings::from_toml("").unwrap(), Settings::default());
    assert_eq!(
        Config::try_from(Settings::default())
            .unwrap()
            .policies
            .defaults()
            .bucket
            .on_unavailable,
        BucketConfig::default().on_unavailable
    );
    // A section that is there but says nothing is its defaults too.
    let empty_sections = "[server]\n[store]\n[telemetry]\n[limits]\n[auth]\n[defaults]\n";
    assert_eq!(
        Settings::from_toml(empty_sections).unwrap(),
        Settings::default()
    );
}

#[test]
fn the_design_example_parses() {
    let config = config(
        r#"
        [server]
        listen = "127.0.0.1:50051"
        metrics_listen = "127.0.0.1:9464"
        [store]
        kind = "memory"
        [defaults]
        max_attempts = 3
        min_attempt_budget = "50ms"
        max_retry_after = "60s"
        transient_500 = false
        budget = { capacity = 100.0, initial = 100.0, ratio = 0.1, min_per_second = 1.0 }
        backoff = { base = "50ms", max = "5s", jitter = "full" }
        [upstreams."payments-api"]
        max_attempts = 2
        budget = { capacity = 20.0 }
        "#,
    )
    .unwrap();
    let payments = config.policies.get("payments-api");
    assert_eq!(payments.engine.max_attempts, 2);
    assert_eq!(payments.bucket.capacity, 20.0);
    assert_eq!(
        payments.bucket.initial, 20.0,
        "initial shrinks with capacity"
    );
    assert_eq!(payments.bucket.ratio, 0.1, "inherited from defaults");
    assert_eq!(config.policies.get("other").engine.max_attempts, 3);
}

#[test]
fn upstream_names_keep_their_case_and_dots() {
    let config = config("[upstreams.\"Payments.API\"]\nmax_attempts = 2\n").unwrap();
    assert_eq!(config.policies.get("Payments.API").engine.max_attempts, 2);
    assert_eq!(config.policies.get("payments.api").engine.max_attempts, 3);
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        ("[server]\nlisten = \"nowhere\"", "server.listen"),
        ("[store]\nkind = \"etcd\"", "store.kind"),
        ("[store]\nkind = \"redis\"", "store.url"),
        ("[store]\nkind = \"redis\"\nurl = \"http://x\"", "store.url"),
        (
            "[store]\nkind = \"redis\"\nurl = [\"rediss://x:6380\", \"redis://y:6379\"]",
            "store.url",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmode = \"fast\"",
            "store.mode",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nlease_tokens = 20.0\nmax_lease_tokens = 10.0",
            "store.max_lease_tokens",
        ),
        (
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\nmax_lease_tokens = inf",
            "store.max_lease_tokens",
        ),
        ("[telemetry]\nlog_format = \"xml\"", "telemetry.log_format"),
        (
            "[telemetry]\nsampling_ratio = 2.0",
            "telemetry.sampling_ratio",
        ),
        ("[defaults]\nmax_attempts = 0", "defaults.max_attempts"),
        (
            "[defaults]\nmin_attempt_budget = \"5 parsecs\"",
            "defaults.min_attempt_budget",
        ),
        (
            "[defaults]\nbudget = { capacity = -1.0 }",
            "defaults.budget.capacity",
        ),
        (
            "[defaults]\nbudget = { initial = 500.0 }",
            "defaults.budget.initial",
        ),
        (
            "[defaults]\nbackoff = { jitter = \"equal\" }",
            "defaults.backoff.jitter",
        ),
        (
            "[defaults]\nbackoff = { base = \"10s\", max = \"1s\" }",
            "defaults.backoff.base",
        ),
        (
            "[upstreams.pay]\npermanent_failures = [\"gremlins\"]",
            "upstreams.\"pay\".permanent_failures",
        ),
        (
            "[upstreams.pay]\non_unavailable = \"panic\"",
            "upstreams.\"pay\".on_unavailable",
        ),
        ("[limits]\nmax_upstreams = 0", "limits.max_upstreams"),
        (
            "[limits]\nmax_upstreams_per_principal = 5",
            "limits.max_upstreams_per_principal",
        ),
        (
            "[limits]\nevict_idle_after = \"10ms\"",
            "limits.evict_idle_after",
        ),
        ("[server]\nlisten = \"0.0.0.0:50051\"", "server.listen"),
        (
            "[server]\nrequest_timeout = \"soon\"",
            "server.request_timeout",
        ),
        (
            "[server]\nmax_message_bytes = 10",
            "server.max_message_bytes",
        ),
        (
            "[server.tls]\ncert_file = \"/nonexistent.pem\"\nkey_file = \"/nonexistent.pem\"",
            "server.tls.cert_file",
        ),
        (
            "[[auth.principals]]\nname = \"a\"",
            "auth.principals[0].api_keys_sha256",
        ),
        (
            "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"abc\"]",
            "auth.principals[0].api_keys_sha256",
        ),
        (
            "[[auth.principals]]\nname = \"a\"\nidentities = [\"x\"]\n[[auth.principals]]\nname = \"a\"\nidentities = [\"y\"]",
            "auth.principals[1].name",
        ),
    ];
    for (toml, key) in cases {
        let message = error_of(toml);
        assert!(
            message.starts_with(key),
            "{toml:?} gave {message:?}, expected key {key}"
        );
    }
}

#[test]
fn leases_grow_to_a_thousand_tokens_unless_told() {
    let redis = |toml: &str| match config(toml).unwrap().store {
        StoreConfig::Redis(redis) => redis,
        other => panic!("{other:?}"),
    };
    let base = "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1\"\n";
    let defaults = redis(base);
    assert_eq!(
        (defaults.lease_tokens, defaults.max_lease_tokens),
        (5.0, 1000.0)
    );
    // A fixed lease size: as many tokens at most as at least.
    let fixed = redis(&format!(
        "{base}lease_tokens = 7.0\nmax_lease_tokens = 7.0\n"
    ));
    assert_eq!(fixed.max_lease_tokens, 7.0);
}

#[test]
fn public_listen_needs_auth_or_insistence() {
    let insisted =
        config("[server]\nlisten = \"0.0.0.0:50051\"\nallow_unauthenticated = true\n").unwrap();
    assert!(!insisted.auth.is_enabled());
    let key = "0".repeat(64);
    let with_auth = config(&format!(
        "[server]\nlisten = \"0.0.0.0:50051\"\n[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{key}\"]\nupstreams = [\"*\"]\n"
    ))
    .unwrap();
    assert!(with_auth.auth.is_enabled());
}

#[test]
fn one_key_hash_in_two_cases_is_one_key() {
    // Hex digits decode the same in either case (and with surrounding
    // space), so these are one key: two principals holding it would
    // have the later one silently win.
    let lower = format!("ab12{}", "0".repeat(60));
    let principals = |a: &str, b: &str| {
        format!(
            "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{a}\"]\nupstreams = [\"*\"]\n[[auth.principals]]\nname = \"b\"\napi_keys_sha256 = [\"{b}\"]\nupstreams = [\"*\"]\n"
        )
    };
    for other in [
        lower.clone(),
        lower.to_ascii_uppercase(),
        format!("AB12{}", "0".repeat(60)),
        format!(" {lower} "),
    ] {
        let message = error_of(&principals(&lower, &other));
        assert!(
            message.starts_with("auth.principals[1].api_keys_sha256[0]:")
                && message.contains("auth.principals[0]"),
            "{other:?} gave {message:?}"
        );
    }
    // Twice in one principal, in two cases: the same refusal.
    let message = error_of(&format!(
        "[[auth.principals]]\nname = \"a\"\napi_keys_sha256 = [\"{lower}\", \"{}\"]\n",
        lower.to_ascii_uppercase()
    ));
    assert!(
        message.starts_with("auth.principals[0].api_keys_sha256[1]:"),
        "{message}"
    );
}

#[test]
fn one_dns_identity_in_two_cases_is_one_identity() {
    // RFC 6125: DNS names compare case-insensitively, so a certificate
    // for `ops.example.com` is one for `OPS.Example.com`. URIs (SPIFFE
    // IDs) keep a case-sensitive path, so they stay distinct.
    let principals = |a: &str, b: &str| {
        format!(
            "[[auth.principals]]\nname = \"a\"\nidentities = [\"{a}\"]\nupstreams = [\"*\"]\n[[auth.principals]]\nname = \"b\"\nidentities = [\"{b}\"]\nupstreams = [\"*\"]\n"
        )
    };
    let message = error_of(&principals("ops.example.com", "OPS.Example.com"));
    assert!(
        message.starts_with("auth.principals[1].identities[0]:")
            && message.contains("auth.principals[0]"),
        "{message}"
    );
    let distinct = config(&principals(
        "spiffe://example.org/ns/ops",
        "spiffe://example.org/ns/OPS",
    ))
    .unwrap();
    assert!(distinct.auth.is_enabled());
}

#[test]
fn required_client_auth_needs_a_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pem = dir.path().join("any.pem");
    std::fs::write(
        &pem,
        "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let pem = pem.display();
    let tls =
        |extra: &str| format!("[server.tls]\ncert_file = \"{pem}\"\nkey_file = \"{pem}\"\n{extra}");
    // "required" with no CA to require a certificate from: refused.
    let message = error_of(&tls("client_auth = \"required\"\n"));
    assert!(
        message.starts_with("server.tls.client_ca_file:") && message.contains("client_auth"),
        "{message}"
    );
    // TLS without mTLS (client_auth unset) stays allowed; with a CA,
    // an unset client_auth means "required".
    let plain = config(&tls("")).unwrap().tls.unwrap();
    assert!(plain.client_ca_pem.is_none());
    for (extra, optional) in [
        ("", false),
        ("client_auth = \"required\"\n", false),
        ("client_auth = \"optional\"\n", true),
    ] {
        let mtls = config(&tls(&format!("client_ca_file = \"{pem}\"\n{extra}")))
            .unwrap()
            .tls
            .unwrap();
        assert!(mtls.client_ca_pem.is_some());
        assert_eq!(mtls.client_auth_optional, optional, "{extra:?}");
    }
}

/// `section.key = value` written in the file, then set by a `RETRYD__`
/// variable over a file without it (`other_lines`, in the same section,
/// are in both): the same refusal either way.
fn refusals_of(section: &str, key: &str, value: &str, other_lines: &str) -> [InvalidConfig; 2] {
    let file = format!("[{section}]\n{other_lines}{key} = {value:?}\n");
    let from_file = config(&file).expect_err("the file's value must be refused");
    let variable = format!(
        "RETRYD__{}__{}",
        section.replace('.', "__").to_ascii_uppercase(),
        key.to_ascii_uppercase()
    );
    let environment = HashMap::from([(variable, value.to_owned())]);
    let from_environment =
        Settings::from_sources(&format!("[{section}]\n{other_lines}"), Some(environment))
            .and_then(Config::try_from)
            .expect_err("the variable's value must be refused");
    [from_file, from_environment]
}

#[test]
fn a_misspelt_name_is_refused_with_the_names_accepted() {
    // Refused as the file is read, before the certificate files are.
    let tls = "cert_file = \"/nonexistent.pem\"\nkey_file = \"/nonexistent.pem\"\n";
    let cases = [
        (
            "store",
            "kind",
            "etcd",
            "",
            "store.kind: unknown variant \"etcd\", expected \"memory\" or \"redis\"",
        ),
        (
            "store",
            "mode",
            "fast",
            "",
            "store.mode: unknown variant \"fast\", expected \"exact\" or \"leased\"",
        ),
        (
            "store",
            "on_unavailable",
            "panic",
            "",
            "store.on_unavailable: unknown variant \"panic\", expected \"local\" or \"deny\"",
        ),
        (
            "defaults",
            "on_unavailable",
            "Deny",
            "",
            "defaults.on_unavailable: unknown variant \"Deny\", expected \"local\" or \"deny\"",
        ),
        (
            "upstreams.pay",
            "on_unavailable",
            "panic",
            "",
            "upstreams.\"pay\".on_unavailable: unknown variant \"panic\", expected \"local\" or \"deny\"",
        ),
        (
            "upstreams.pay",
            "inside_enclosing_retry",
            "never",
            "",
            "upstreams.\"pay\".inside_enclosing_retry: unknown variant \"never\", expected \"deny\" or \"allow\"",
        ),
        (
            "defaults.backoff",
            "jitter",
            "equal",
            "",
            "defaults.backoff.jitter: unknown variant \"equal\", expected \"full\" or \"decorrelated\"",
        ),
        (
            "upstreams.pay.backoff",
            "jitter",
            "equal",
            "",
            "upstreams.\"pay\".backoff.jitter: unknown variant \"equal\", expected \"full\" or \"decorrelated\"",
        ),
        (
            "telemetry",
            "log_format",
            "xml",
            "",
            "telemetry.log_format: unknown variant \"xml\", expected \"text\" or \"json\"",
        ),
        (
            "server.tls",
            "client_auth",
            "requird",
            tls,
            "server.tls.client_auth: unknown variant \"requird\", expected \"required\" or \"optional\"",
        ),
    ];
    for (section, key, value, other_lines, expected) in cases {
        for error in refusals_of(section, key, value, other_lines) {
            assert_eq!(error.to_string(), expected);
            assert!(
                matches!(&error, InvalidConfig::Value { key, .. } if expected.starts_with(&format!("{key}: "))),
                "{error:?}"
            );
        }
    }
}

#[test]
fn a_misspelt_failure_kind_is_refused_with_every_kind() {
    let every_kind = "expected one of \"dns\", \"connect\", \"pool_timeout\", \"pre_request_tls\", \"profile_rejection\", \"http2_refused_stream\", \"goaway_unprocessed\", \"partial_write\", \"response_header_timeout\", \"connection_reset\", \"decode_reset\", \"interrupted_stream\", \"generic_io\", \"tls_certificate_invalid\", \"request_encoding\"";
    let cases = [
        (
            "[defaults]\npermanent_failures = [\"connect\", \"gremlins\"]\n",
            "defaults.permanent_failures[1]",
        ),
        // An upstream name with dots is quoted, as in every other message.
        (
            "[upstreams.\"pay.v2\"]\npermanent_failures = [\"Connect\"]\n",
            "upstreams.\"pay.v2\".permanent_failures[0]",
        ),
    ];
    for (toml, key) in cases {
        let message = error_of(toml);
        let name = if key.ends_with("[0]") {
            "Connect"
        } else {
            "gremlins"
        };
        assert_eq!(
            message,
            format!("{key}: unknown variant {name:?}, {every_kind}")
        );
    }
}

#[test]
fn grpc_retryable_codes_are_named_and_validated() {
    let every_code = "expected one of \"cancelled\", \"unknown\", \"invalid_argument\", \"deadline_exceeded\", \"not_found\", \"already_exists\", \"permission_denied\", \"resource_exhausted\", \"failed_precondition\", \"aborted\", \"out_of_range\", \"unimplemented\", \"internal\", \"unavailable\", \"data_loss\", \"unauthenticated\"";
    assert_eq!(
        error_of("[upstreams.stock]\ngrpc_retryable_codes = [\"unavailable\", \"UNAVAILABLE\"]\n"),
        format!(
            "upstreams.stock.grpc_retryable_codes[1]: unknown variant \"UNAVAILABLE\", {every_code}"
        )
    );
    let parsed = config(
        "[defaults]\ngrpc_retryable_codes = [\"unavailable\"]\n\
         [upstreams.stock]\ngrpc_retryable_codes = [\"unavailable\", \"internal\"]\n",
    )
    .unwrap();
    let stock = parsed.policies.get("stock");
    assert!(stock.engine.grpc_retryable.contains(GrpcCode::Internal));
    assert!(
        !stock
            .engine
            .grpc_retryable
            .contains(GrpcCode::DeadlineExceeded)
    );
    let other = parsed.policies.get("other");
    assert_eq!(
        other.engine.grpc_retryable.iter().collect::<Vec<_>>(),
        [GrpcCode::Unavailable]
    );
    // Unset: the default list.
    assert_eq!(
        config("").unwrap().policies.get("x").engine.grpc_retryable,
        crate::engine::GrpcCodes::DEFAULT
    );
}

#[test]
fn report_id_limits_are_validated() {
    let parsed = config("").unwrap();
    assert_eq!(
        parsed.report_ids.window,
        std::time::Duration::from_secs(600)
    );
    assert_eq!(parsed.report_ids.max_ids, 100_000);
    assert!(
        error_of("[limits]\nreport_id_window = \"500ms\"\n")
            .starts_with("limits.report_id_window: ")
    );
    assert!(
        error_of("[limits]\nreport_id_window = \"soon\"\n")
            .starts_with("limits.report_id_window: ")
    );
    assert!(error_of("[limits]\nmax_report_ids = 0\n").starts_with("limits.max_report_ids: "));
    let parsed = config("[limits]\nreport_id_window = \"1h\"\nmax_report_ids = 7\n").unwrap();
    assert_eq!(
        parsed.report_ids.window,
        std::time::Duration::from_secs(3600)
    );
    assert_eq!(parsed.report_ids.max_ids, 7);
}

/// A garbage OTLP CA is refused at validation, naming its key: before any
/// port is bound, and by `check-config` (it used to be parsed only when the
/// exporter was built, after both ports were bound).
#[test]
fn a_garbage_otlp_ca_file_is_refused_naming_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("ca.pem");
    std::fs::write(&garbage, "not a certificate at all\n").unwrap();
    let broken = dir.path().join("broken.pem");
    std::fs::write(
        &broken,
        "-----BEGIN CERTIFICATE-----\nbm90IGRlcg==\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    for path in [&garbage, &broken] {
        let error = error_of(&format!(
            "[telemetry]\notlp_endpoint = \"https://127.0.0.1:4317\"\notlp_ca_file = {:?}\n",
            path.display().to_string()
        ));
        assert!(error.starts_with("telemetry.otlp_ca_file"), "{error}");
    }
}

/// `permanent_failures` (and `grpc_retryable_codes`) from the environment:
/// one string, comma-separated, for `[defaults]` and for an upstream; a
/// misspelt name is refused with the names accepted, as from the file.
#[test]
fn permanent_failures_are_comma_separated_in_the_environment() {
    use crate::engine::FailureKind;
    let from = |variables: &[(&str, &str)]| {
        let environment = variables
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect::<HashMap<_, _>>();
        Settings::from_sources("[upstreams.pay]\nmax_attempts = 2\n", Some(environment))
            .and_then(Config::try_from)
    };
    let config = from(&[
        (
            "RETRYD__DEFAULTS__PERMANENT_FAILURES",
            "connect, connection_reset",
        ),
        ("RETRYD__UPSTREAMS__PAY__PERMANENT_FAILURES", "dns"),
        (
            "RETRYD__DEFAULTS__GRPC_RETRYABLE_CODES",
            "unavailable,aborted",
        ),
    ])
    .unwrap();
    assert_eq!(
        config.policies.defaults().engine.permanent_failures,
        [FailureKind::Connect, FailureKind::ConnectionReset]
    );
    assert_eq!(
        config.policies.get("pay").engine.permanent_failures,
        [FailureKind::Dns]
    );
    let from_file =
        self::config("[defaults]\ngrpc_retryable_codes = [\"unavailable\", \"aborted\"]\n")
            .unwrap();
    assert_eq!(
        config.policies.defaults().engine.grpc_retryable,
        from_file.policies.defaults().engine.grpc_retryable
    );
    // An empty string is the empty list.
    let config = from(&[("RETRYD__DEFAULTS__PERMANENT_FAILURES", "")]).unwrap();
    assert!(
        config
            .policies
            .defaults()
            .engine
            .permanent_failures
            .is_empty()
    );
    let message = from(&[("RETRYD__DEFAULTS__PERMANENT_FAILURES", "connect,gremlins")])
        .unwrap_err()
        .to_string();
    assert!(message.contains("defaults.permanent_failures"), "{message}");
    assert!(message.contains("\"gremlins\""), "{message}");
    // The file's lists read as before.
    let config = self::config("[defaults]\npermanent_failures = [\"dns\"]\n").unwrap();
    assert_eq!(
        config.policies.defaults().engine.permanent_failures,
        [FailureKind::Dns]
    );
}

#[test]
fn inside_enclosing_retry_is_denied_unless_an_upstream_allows_it() {
    use crate::engine::EnclosingRetry;
    let config = Config::try_from(
        Settings::from_toml("[upstreams.fanout]\ninside_enclosing_retry = \"allow\"\n").unwrap(),
    )
    .unwrap();
    assert_eq!(
        config.policies.defaults().engine.inside_enclosing_retry,
        EnclosingRetry::Deny
    );
    assert_eq!(
        config.policies.get("fanout").engine.inside_enclosing_retry,
        EnclosingRetry::Allow
    );
}

#[test]
fn the_adaptive_budget_is_on_unless_a_section_turns_it_off() {
    let off = config(
        "[defaults]\nadaptive = false\n[upstreams.pay]\nadaptive = true\n[upstreams.ledger]\nmax_attempts = 2\n",
    )
    .unwrap();
    assert!(!off.policies.defaults().adaptive);
    assert!(off.policies.get("pay").adaptive);
    // An upstream that does not say inherits `[defaults]`.
    assert!(!off.policies.get("ledger").adaptive);
    let defaults = config("").unwrap();
    assert!(defaults.policies.defaults().adaptive);
    assert!(
        error_of("[upstreams.pay]\ncandidate = { adaptive = false }")
            .starts_with("upstreams.\"pay\".candidate.adaptive"),
        "{}",
        error_of("[upstreams.pay]\ncandidate = { adaptive = false }")
    );
}

#[test]
fn the_pushback_stop_and_ramp_windows_default_to_5s_and_are_bounded() {
    use std::time::Duration;
    let defaults = config("").unwrap();
    assert_eq!(
        defaults.policies.defaults().pushback_stop_window,
        Duration::from_secs(5)
    );
    assert_eq!(
        defaults.policies.defaults().ramp_window,
        Duration::from_secs(5)
    );
    let set = config(
        "[defaults]\nramp_window = \"0s\"\n[upstreams.pay]\npushback_stop_window = \"2s\"\nramp_window = \"10s\"\n",
    )
    .unwrap();
    assert_eq!(
        set.policies.get("pay").pushback_stop_window,
        Duration::from_secs(2)
    );
    assert_eq!(set.policies.get("pay").ramp_window, Duration::from_secs(10));
    assert_eq!(set.policies.get("other").ramp_window, Duration::ZERO);
    for (toml, key) in [
        ("[defaults]\nramp_window = \"2h\"", "defaults.ramp_window"),
        (
            "[defaults]\npushback_stop_window = \"soon\"",
            "defaults.pushback_stop_window",
        ),
        (
            "[upstreams.pay]\ncandidate = { ramp_window = \"1s\" }",
            "upstreams.\"pay\".candidate.ramp_window",
        ),
    ] {
        let error = error_of(toml);
        assert!(error.starts_with(key), "{error}");
    }
}
