//! Fuzz target `retry_after`: see `retryd_fuzz::checks::retry_after` for the input format
//! and the invariants it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| retryd_fuzz::checks::retry_after(data));
