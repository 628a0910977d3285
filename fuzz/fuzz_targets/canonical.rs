//! cargo fuzz run canonical: see `tollgate_fuzz::canonical` (fuzz/src/lib.rs) and
//! docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::canonical(data);
});
