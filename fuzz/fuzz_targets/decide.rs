//! Fuzz target `decide`: see `retryd_fuzz::checks::decide` for the input format
//! and the invariants it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    retryd_fuzz::checks::decide(data);
});
