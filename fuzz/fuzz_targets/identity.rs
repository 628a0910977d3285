//! cargo fuzz run identity: see `tollgate_fuzz::identity` (fuzz/src/lib.rs) and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::identity(data);
});
