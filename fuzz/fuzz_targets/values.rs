//! cargo fuzz run values: see `tollgate_fuzz::values` (fuzz/src/lib.rs) and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::values(data);
});
