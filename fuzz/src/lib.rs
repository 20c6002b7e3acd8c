//! retryd's fuzz targets share their checks with `tests/fuzz_smoke.rs`,
//! which includes `checks/mod.rs` by path so that retryd never depends on this
//! crate. See `fuzz/README.md`.

pub mod checks;
