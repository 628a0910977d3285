//! The source's own shape, checked: module layering as `src/lib.rs` documents it, no import
//! cycles (counting inline `crate::` paths), and the size of files and functions.

mod layering;

mod source;
