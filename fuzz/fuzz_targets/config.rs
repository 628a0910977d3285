//! cargo fuzz run config: see `tollgate_fuzz::config` (fuzz/src/lib.rs) and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::config(data);
});
