//! cargo fuzz run request_head: see `tollgate_fuzz::request_head` (fuzz/src/lib.rs) and
//! docs/fuzzing.md.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tollgate_fuzz::request_head(data);
});
