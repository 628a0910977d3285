//! cargo fuzz run forwarded_for: see `tollgate_fuzz::forwarded_for` (fuzz/src/lib.rs) and docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::forwarded_for(data);
});
