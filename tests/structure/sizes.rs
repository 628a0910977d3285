//! Small pieces: no library file over 400 lines of code, and no function over clippy's
//! `too-many-lines-threshold` (60, in `clippy.toml`) without a one-line reason above its
//! `#[allow(clippy::too_many_lines)]`.

use crate::source::{modules, without_tests};

const MAX_CODE_LINES: usize = 400;

#[test]
fn no_library_file_is_over_400_lines_of_code() {
    let long: Vec<String> = modules()
        .iter()
        .map(|m| (code_lines(without_tests(&m.text)), m))
        .filter(|(n, _)| *n > MAX_CODE_LINES)
        .map(|(n, m)| format!("{}: {n} lines of code", m.file.display()))
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_CODE_LINES}:\n{}",
        long.join("\n")
    );
}

#[test]
fn a_long_function_says_why() {
    let threshold = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/clippy.toml"))
        .expect("clippy.toml");
    assert!(
        threshold.contains("too-many-lines-threshold = 60"),
        "clippy.toml sets the function length"
    );
    let mut silent = Vec::new();
    for m in modules() {
        let lines: Vec<&str> = m.text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if !line.contains("allow(clippy::too_many_lines)") {
                continue;
            }
            let reason = lines[..i]
                .iter()
                .rev()
                .map(|l| l.trim())
                .find(|l| !l.starts_with("#["));
            if !reason.is_some_and(|l| l.starts_with("// ")) {
                silent.push(format!("{}:{}", m.file.display(), i + 1));
            }
        }
    }
    assert!(
        silent.is_empty(),
        "a `// why` comment goes right above these allows:\n{}",
        silent.join("\n")
    );
}

/// Lines that are neither blank nor only a comment.
fn code_lines(text: &str) -> usize {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}
