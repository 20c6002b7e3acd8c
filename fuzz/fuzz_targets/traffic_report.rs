//! Fuzz target `traffic_report`: see `retryd_fuzz::checks::traffic_report` for the input format
//! and the invariants it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| retryd_fuzz::checks::traffic_report(data));
