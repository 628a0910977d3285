//! The crate's modules read off `src/`: each file's module path and its code with comments,
//! string contents and unit-test modules taken out.

use std::path::{Path, PathBuf};

/// One source file of the library.
pub struct Module {
    /// `limiter::redis::batch`; empty for `lib.rs`.
    pub path: String,
    pub file: PathBuf,
    /// The file as written.
    pub text: String,
    /// The code outside `#[cfg(test)] mod tests`, with comments and string contents removed.
    pub code: String,
}

/// Every library module under `src/` (`main.rs` and `tests.rs` files excluded), sorted.
pub fn modules() -> Vec<Module> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut modules: Vec<Module> = files
        .into_iter()
        .filter_map(|file| {
            let rel = file.strip_prefix(&root).ok()?.with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            match parts.last().map(String::as_str) {
                Some("main" | "tests") => return None,
                Some("mod" | "lib") => {
                    parts.pop();
                }
                _ => {}
            }
            let text = std::fs::read_to_string(&file).ok()?;
            let code = strip(without_tests(&text));
            Some(Module {
                path: parts.join("::"),
                file,
                text,
                code,
            })
        })
        .collect();
    modules.sort_by(|a, b| a.path.cmp(&b.path));
    modules
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file up to its unit-test module, which comes last: `mod tests` (or `pub(super) mod
/// tests`) under a `#[cfg(...)]` that names `test` (`#[cfg(test)]`, `#[cfg(all(test, ...))]`).
pub fn without_tests(text: &str) -> &str {
    let mut at = 0;
    while let Some(i) = text[at..].find("#[cfg(") {
        let start = at + i;
        at = start + 1;
        let Some(len) = text[start..].find(']') else {
            break;
        };
        let cfg = &text[start + "#[cfg(".len()..start + len];
        let names_test = cfg
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .any(|w| w == "test");
        let rest = text[start + len + 1..].trim_start();
        let rest = ["pub(super) ", "pub(crate) ", "pub "]
            .iter()
            .find_map(|v| rest.strip_prefix(v))
            .unwrap_or(rest);
        if names_test && rest.starts_with("mod tests") {
            return &text[..start];
        }
    }
    text
}

#[test]
fn every_form_of_test_module_is_cut() {
    for (text, kept) in [
        ("fn a() {}\n#[cfg(test)]\nmod tests {}\n", "fn a() {}\n"),
        (
            "fn a() {}\n#[cfg(test)]\npub(super) mod tests {}\n",
            "fn a() {}\n",
        ),
        (
            "fn a() {}\n#[cfg(all(test, target_os = \"linux\"))]\nmod tests {}",
            "fn a() {}\n",
        ),
        (
            "#[cfg(unix)]\nmod tests {}\n#[cfg(test)]\nmod tests {}",
            "#[cfg(unix)]\nmod tests {}\n",
        ),
        (
            "#[cfg(test)]\nconst X: u8 = 1;\nfn b() {}",
            "#[cfg(test)]\nconst X: u8 = 1;\nfn b() {}",
        ),
    ] {
        assert_eq!(without_tests(text), kept, "{text:?}");
    }
}

/// `code` with comments removed and string and char literals emptied, so that paths in docs
/// and messages are not read as code.
pub fn strip(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = code[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let body = i + 2 + hashes;
                i = code[body..]
                    .find(&close)
                    .map_or(b.len(), |e| body + e + close.len());
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal ('a', '\n', '\''), not a lifetime ('a).
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                let end = code[i + 2..].find('\'').map_or(b.len(), |e| i + 2 + e + 1);
                i = end;
                out.push_str("' '");
            }
            _ => {
                let ch = code[i..].chars().next().expect("in bounds");
                out.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    out
}
