//! The crate's invariant, checked on its manifest: it depends on the
//! contract and the engine, never on the server (the `retryd` package at
//! the workspace's root) or the budget stores, and it brings no TLS stack
//! of its own (tonic's rustls is the one).

#[test]
fn the_client_never_depends_on_the_server_the_stores_or_another_tls_stack() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .expect("the manifest");
    for line in manifest.lines().map(str::trim) {
        let name = line.split([' ', '=']).next().unwrap_or_default();
        assert_ne!(name, "retryd", "the server: {line}");
        assert_ne!(name, "retryd-budget", "the stores: {line}");
        assert!(
            !line.contains("path = \"../..\""),
            "the root package: {line}"
        );
        for tls in [
            "native-tls",
            "openssl",
            "aws-lc-rs",
            "rustls-tls",
            "default-tls",
        ] {
            assert!(!line.contains(tls), "a second TLS stack: {line}");
        }
    }
    assert!(manifest.contains("retryd-engine = { path = \"../retryd-engine\""));
}
