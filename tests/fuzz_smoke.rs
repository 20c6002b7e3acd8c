//! The fuzz targets' checks on stable Rust, in every `cargo test`: a few
//! thousand seeded pseudo-random inputs per target, mutations of the
//! committed seeds, and every committed seed and regression input under
//! `fuzz/`. The checks themselves live in `fuzz/src/checks/`, included by
//! path so that retryd never depends on the fuzz crate; the coverage-guided
//! runs are `scripts/fuzz` (see `fuzz/README.md`).
//!
//! Every run draws the same inputs (a fixed ChaCha seed), so a failure here
//! reproduces, and proptest shrinks it to a small input before reporting.

#[path = "../fuzz/src/checks/mod.rs"]
pub mod checks;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::io::Write;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// Runs `check` on `cases` values of `strategy`, drawn from a fixed seed.
fn fuzz<S>(cases: u32, strategy: S, check: impl Fn(S::Value))
where
    S: Strategy,
    S::Value: Debug,
{
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    if let Err(error) = runner.run(&strategy, |value| {
        check(value);
        Ok(())
    }) {
        panic!("{error}");
    }
}

fn bytes(max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max_len)
}

#[test]
fn decide_on_random_bytes() {
    // An environment, a mode byte (odd: structured, the deep path; even: a
    // protobuf) and the request's bytes. Mostly the structured mode, which
    // gets past validation far more often than random protobuf does.
    let mode = prop_oneof![4 => any::<u8>().prop_map(|m| m | 1), 1 => any::<u8>()];
    let input = (any::<[u8; 6]>(), mode, bytes(200));
    let reached = RefCell::new(BTreeSet::new());
    fuzz(4000, input, |(environment, mode, rest)| {
        let mut data = environment.to_vec();
        data.push(mode);
        data.extend(rest);
        if let Some(decision) = checks::decide(&data) {
            let verdict = decision.verdict.as_str();
            reached
                .borrow_mut()
                .insert((decision.rule.number(), verdict));
        }
    });
    // The inputs are only worth what they reach: every rule of the decision
    // order, each verdict at rule 9, and hedges (rule 10) both granted and
    // denied.
    let reached = reached.into_inner();
    for rule in 1..=9 {
        assert!(
            reached.iter().any(|(number, _)| *number == rule),
            "no input reached rule {rule}: {reached:?}"
        );
    }
    for verdict in ["retry", "deny", "ambiguous"] {
        assert!(
            reached.contains(&(9, verdict)),
            "no {verdict} at rule 9: {reached:?}"
        );
    }
    for verdict in ["retry", "deny"] {
        assert!(
            reached.contains(&(10, verdict)),
            "no hedge {verdict} (rule 10): {reached:?}"
        );
    }
}

#[test]
fn traffic_report_on_random_bytes() {
    fuzz(1000, bytes(300), |data| checks::traffic_report(&data));
}

#[test]
fn retry_after_on_random_text() {
    let text = prop_oneof![
        any::<String>(),
        "[0-9 \t]{0,30}",
        "[+-]?[0-9]{1,25}(\\.[0-9])?",
        "(Sun|Mon|Fri|Sunday), [0-9]{1,2}[ -](Jan|Nov|Dec)[ -][0-9]{2,4} [0-9]{2}:[0-9]{2}:[0-9]{2} (GMT|UTC)",
        "(Sun|Thu) (Nov|Feb) [ 0-9][0-9] [0-9]{2}:[0-9]{2}:[0-9]{2} [0-9]{4}",
    ];
    fuzz(2000, text, |raw| checks::check_retry_after(&raw));
    fuzz(
        1000,
        0..checks::HTTP_DATE_END,
        checks::check_http_date_round_trip,
    );
}

/// A value as a configuration file might hold one, right or wrong.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "\"50ms\"",
            "\"5s\"",
            "\"24h\"",
            "\"25h\"",
            "\"0s\"",
            "\"5 parsecs\"",
            "\"\"",
            "\"memory\"",
            "\"redis\"",
            "\"redis://127.0.0.1:6379\"",
            "[\"redis://a:1\", \"rediss://b:2\"]",
            "[]",
            "\"http://127.0.0.1:4317\"",
            "\"127.0.0.1:0\"",
            "\"[::1]:50051\"",
            "\"full\"",
            "\"decorrelated\"",
            "\"local\"",
            "\"deny\"",
            "\"exact\"",
            "\"leased\"",
            "\"json\"",
            "[\"connect\", \"dns\"]",
            "[\"gremlins\"]",
            "true",
            "nan",
            "inf",
            "-inf",
            "{ capacity = 20.0 }",
            "{ capacity = 0.5 }",
            "{ initial = 500.0 }",
            "{ base = \"10s\", max = \"1s\" }",
            "{ jitter = \"equal\" }",
        ])
        .prop_map(str::to_owned),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|x| format!("{x:?}")),
        "\"[ -~]{0,12}\"",
    ]
}

fn toml_line() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "listen",
        "metrics_listen",
        "shutdown_grace",
        "kind",
        "url",
        "mode",
        "on_unavailable",
        "timeout",
        "lease_tokens",
        "lease_ttl",
        "key_prefix",
        "otlp_endpoint",
        "sampling_ratio",
        "log_format",
        "log_level",
        "max_upstreams",
        "max_attempts",
        "min_attempt_budget",
        "max_retry_after",
        "transient_500",
        "permanent_failures",
        "budget",
        "backoff",
        "budget.capacity",
        "backoff.base",
        "max_atempts",
    ]);
    let section = prop_oneof![
        prop::sample::select(vec![
            "server",
            "store",
            "telemetry",
            "limits",
            "defaults",
            "upstreams",
            "serverr",
        ])
        .prop_map(str::to_owned),
        "[ -~]{0,8}".prop_map(|name| format!("upstreams.{name:?}")),
    ];
    prop_oneof![
        section.prop_map(|section| format!("[{section}]")),
        (key, toml_value()).prop_map(|(key, value)| format!("{key} = {value}")),
        "[ -~]{0,20}",
    ]
}

#[test]
fn config_on_generated_toml() {
    let lines = prop::collection::vec(toml_line(), 0..12).prop_map(|lines| lines.join("\n"));
    fuzz(1500, lines, |toml| checks::check_config(&toml));
    fuzz(300, any::<String>(), |toml| checks::check_config(&toml));
}

#[test]
fn trace_context_on_random_text() {
    let traceparent = prop_oneof![
        any::<String>(),
        "[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]{0,8})?",
        "[ \t]?00-[0-9a-f0]{32}-[0-9a-f0]{16}-0[01][ \t]?",
        "[0-9a-fA-F+]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-fA-F]{2}",
    ];
    let tracestate = prop::option::of(prop_oneof!["[a-z]{1,8}=[a-z0-9]{1,8}", "[ -~]{500,520}",]);
    fuzz(
        2000,
        (traceparent, tracestate),
        |(traceparent, tracestate)| {
            checks::check_trace_context(&traceparent, tracestate.as_deref())
        },
    );
}

/// One small random edit of a seed: overwrite, insert or delete a byte.
#[derive(Clone, Debug)]
enum Edit {
    Overwrite(prop::sample::Index, u8),
    Insert(prop::sample::Index, u8),
    Delete(prop::sample::Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Edit::Overwrite(at, b)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, b)| Edit::Insert(at, b)),
        any::<prop::sample::Index>().prop_map(Edit::Delete),
    ]
}

fn apply(seed: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut data = seed.to_vec();
    for edit in edits {
        match edit {
            Edit::Overwrite(at, byte) if !data.is_empty() => {
                let at = at.index(data.len());
                data[at] = *byte;
            }
            Edit::Insert(at, byte) => {
                let at = at.index(data.len() + 1);
                data.insert(at, *byte);
            }
            Edit::Delete(at) if !data.is_empty() => {
                data.remove(at.index(data.len()));
            }
            _ => {}
        }
    }
    data
}

#[test]
fn mutated_seeds() {
    // The seeds reach deep into each parser; a few random edits of them
    // explore nearby, as a fuzzer's first mutations would.
    for seed in checks::seeds() {
        let edits = prop::collection::vec(edit(), 1..4);
        fuzz(100, edits, |edits| {
            checks::run(seed.target, &apply(&seed.bytes, &edits));
        });
    }
}

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .map(|entry| entry.expect("a readable directory entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn committed_inputs_pass() {
    // The seeds, and every input a fuzzer crashed on (kept in
    // fuzz/regressions/ so that it stays fixed). All run before the test
    // fails, so that it names each input that fails.
    let mut failing = Vec::new();
    let mut n_inputs = 0;
    for target in checks::TARGETS {
        for kind in ["seeds", "regressions"] {
            for path in files_in(&fuzz_dir().join(kind).join(target)) {
                let data = std::fs::read(&path).expect("a readable input");
                if kind == "regressions" {
                    // Straight to stderr, past the harness's capture: should
                    // an input abort the process (a failed allocation does),
                    // this is the last line it printed.
                    let _ = writeln!(std::io::stderr(), "fuzz_smoke: {}", path.display());
                }
                let outcome = std::panic::catch_unwind(|| checks::run(target, &data));
                if outcome.is_err() {
                    failing.push(path.display().to_string());
                }
                n_inputs += 1;
            }
        }
    }
    assert!(
        failing.is_empty(),
        "inputs failing their checks: {failing:#?}"
    );
    assert!(n_inputs >= checks::seeds().len(), "seeds missing");
}

#[test]
fn committed_seeds_match_the_generator() {
    // fuzz/seeds/ is written from `checks::seeds()`: set
    // RETRYD_BLESS_FUZZ_SEEDS=1 to rewrite it after changing them.
    let bless = std::env::var_os("RETRYD_BLESS_FUZZ_SEEDS").is_some();
    let seeds_dir = fuzz_dir().join("seeds");
    let seeds = checks::seeds();
    if bless {
        for target in checks::TARGETS {
            let dir = seeds_dir.join(target);
            for stale in files_in(&dir) {
                std::fs::remove_file(stale).expect("removable");
            }
            std::fs::create_dir_all(&dir).expect("creatable");
        }
        for seed in &seeds {
            let path = seeds_dir.join(seed.target).join(&seed.name);
            std::fs::write(path, &seed.bytes).expect("writable");
        }
    }
    let mut n_files = 0;
    for target in checks::TARGETS {
        n_files += files_in(&seeds_dir.join(target)).len();
    }
    assert_eq!(n_files, seeds.len(), "fuzz/seeds/ has files seeds() lacks");
    for seed in &seeds {
        let path = seeds_dir.join(seed.target).join(&seed.name);
        let committed = std::fs::read(&path).unwrap_or_default();
        assert!(
            committed == seed.bytes,
            "{} differs from checks::seeds(); rerun with RETRYD_BLESS_FUZZ_SEEDS=1",
            path.display()
        );
    }
}
