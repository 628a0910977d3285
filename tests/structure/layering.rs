//! Module layering: every `use crate::`/`use super::` and every inline `crate::`/`super::` path
//! is an edge; the edges must form no cycle between sibling modules, and between top-level
//! modules they must follow the layers of `src/lib.rs`'s Layout section.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::source::{modules, Module};

/// An edge between two modules, with the file that makes it.
type Edges = BTreeMap<(String, String), BTreeSet<String>>;

#[test]
fn no_module_cycles_counting_inline_paths() {
    let mods = modules();
    let known: BTreeSet<&str> = mods.iter().map(|m| m.path.as_str()).collect();
    let edges = sibling_edges(&mods, &known);
    let cycles = cycles(&edges);
    let mut report = String::new();
    for cycle in &cycles {
        let _ = writeln!(report, "cycle: {}", cycle.join(" -> "));
        for pair in cycle.windows(2) {
            let files = &edges[&(pair[0].clone(), pair[1].clone())];
            let _ = writeln!(report, "  {} -> {} in {files:?}", pair[0], pair[1]);
        }
    }
    assert!(cycles.is_empty(), "{report}");
}

#[test]
fn top_level_modules_use_only_their_layer_and_those_above() {
    let mods = modules();
    let lib = mods.iter().find(|m| m.path.is_empty()).expect("src/lib.rs");
    let layers = layers(&lib.text);
    let declared: BTreeSet<String> = mods
        .iter()
        .filter(|m| !m.path.is_empty() && !m.path.contains("::"))
        .map(|m| m.path.clone())
        .collect();
    let listed: BTreeSet<String> = layers.keys().cloned().collect();
    let unlisted: Vec<_> = declared.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&declared).collect();
    assert!(
        unlisted.is_empty() && stale.is_empty(),
        "src/lib.rs's Layout must list every module once: missing {unlisted:?}, no such module {stale:?}"
    );
    let known: BTreeSet<&str> = mods.iter().map(|m| m.path.as_str()).collect();
    let mut wrong = Vec::new();
    for ((from, to), files) in sibling_edges(&mods, &known) {
        let (Some(a), Some(b)) = (layers.get(&from), layers.get(&to)) else {
            continue;
        };
        if b > a {
            wrong.push(format!(
                "{from} (layer {a}) uses {to} (layer {b}, below it) in {files:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_path_reader_sees_uses_and_inline_paths() {
    let code = "use crate::a::{b::{self, C}, d};\nfn f() { crate::e::g(); super::h::i(); }";
    let mut seen = Vec::new();
    paths(code, |p| seen.push(p.to_owned()));
    assert_eq!(
        seen,
        [
            "crate::a::b::self",
            "crate::a::b::C",
            "crate::a::d",
            "crate::e::g",
            "super::h::i"
        ]
    );
}

/// The layer of each top-level module, from the Layout's bullets: each bullet starts with
/// its modules in backticks, then a colon (`` - `a`, `b`: what they are``); first is 0.
fn layers(lib: &str) -> BTreeMap<String, usize> {
    let mut layers = BTreeMap::new();
    let mut layer = 0;
    let doc = lib.lines().filter_map(|l| l.strip_prefix("//!"));
    for line in doc.skip_while(|l| !l.contains("# Layout")) {
        let Some(bullet) = line.trim_start().strip_prefix("- ") else {
            continue;
        };
        // The bullet's head ends at its first colon outside backticks.
        let mut ticks = 0;
        let Some(end) = bullet.find(|c| {
            ticks += usize::from(c == '`');
            c == ':' && ticks % 2 == 0
        }) else {
            continue;
        };
        let head = &bullet[..end];
        for name in head.split('`').skip(1).step_by(2) {
            layers.insert(name.to_owned(), layer);
        }
        layer += 1;
    }
    layers
}

/// Module-to-module edges, lifted to the siblings under their closest common parent (a
/// module's use of its own parent or child is not an edge).
fn sibling_edges(mods: &[Module], known: &BTreeSet<&str>) -> Edges {
    let mut edges = Edges::new();
    for m in mods {
        paths(&m.code, |p| {
            let Some(target) = resolve(&m.path, p, known) else {
                return;
            };
            let (a, b) = (split(&m.path), split(&target));
            let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            if common == a.len() || common == b.len() {
                return;
            }
            let from = a[..=common].join("::");
            let to = b[..=common].join("::");
            let file = m.file.display().to_string();
            edges.entry((from, to)).or_default().insert(file);
        });
    }
    edges
}

fn split(path: &str) -> Vec<&str> {
    path.split("::").filter(|s| !s.is_empty()).collect()
}

/// Calls `seen` with every `crate::`, `super::` or `self::` path, use trees expanded.
fn paths(code: &str, mut seen: impl FnMut(&str)) {
    let mut rest = String::with_capacity(code.len());
    let mut at = 0;
    while let Some(i) = find_word(&code[at..], "use") {
        let start = at + i;
        let Some(end) = code[start..].find(';') else {
            break;
        };
        rest.push_str(&code[at..start]);
        for path in expand(code[start + 3..start + end].trim()) {
            if ["crate::", "super::", "self::"]
                .iter()
                .any(|p| path.starts_with(p))
            {
                seen(&path);
            }
        }
        at = start + end + 1;
    }
    rest.push_str(&code[at..]);
    for root in ["crate", "super"] {
        let mut at = 0;
        while let Some(i) = find_word(&rest[at..], root) {
            let start = at + i;
            let tail = &rest[start..];
            let len = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            let path = tail[..len].trim_end_matches(':');
            if path.contains("::") && !rest[..start].ends_with(':') {
                seen(path);
            }
            at = start + len.max(1);
        }
    }
}

/// The offset of `word` in `s` where it stands alone (not part of an identifier).
fn find_word(s: &str, word: &str) -> Option<usize> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut at = 0;
    while let Some(i) = s[at..].find(word) {
        let start = at + i;
        let before = s[..start].chars().next_back();
        let after = s[start + word.len()..].chars().next();
        if !before.is_some_and(ident) && !after.is_some_and(ident) {
            return Some(start);
        }
        at = start + word.len();
    }
    None
}

/// `a::{b::{self, C}, d}` as `a::b::self`, `a::b::C`, `a::d`.
fn expand(tree: &str) -> Vec<String> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or("").trim();
        return vec![path.to_owned()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let (mut depth, mut item, mut out) = (0, String::new(), Vec::new());
    for c in inner.chars().chain(std::iter::once(',')) {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c == ',' && depth == 0 {
            if !item.trim().is_empty() {
                out.extend(
                    expand(item.trim())
                        .into_iter()
                        .map(|e| format!("{prefix}{e}")),
                );
            }
            item.clear();
        } else {
            item.push(c);
        }
    }
    out
}

/// The module `path` (written in module `from`) refers to: the longest known prefix.
fn resolve(from: &str, path: &str, known: &BTreeSet<&str>) -> Option<String> {
    let mut segs = path.split("::").map(str::trim);
    let mut base: Vec<&str> = match segs.next()? {
        "crate" => Vec::new(),
        "self" => split(from),
        "super" => {
            let mut b = split(from);
            b.pop();
            b
        }
        _ => return None,
    };
    let rest: Vec<&str> = segs.collect();
    let mut rest = rest.as_slice();
    while rest.first() == Some(&"super") {
        base.pop();
        rest = &rest[1..];
    }
    let mut best = None;
    for i in 0..=rest.len() {
        let candidate: Vec<&str> = base.iter().chain(&rest[..i]).copied().collect();
        let name = candidate.join("::");
        if known.contains(name.as_str()) {
            best = Some(name);
        }
    }
    best
}

/// Every cycle of the edge graph, one per strongly connected component, as a closed walk.
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    let mut adj: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        adj.entry(a).or_default().insert(b);
    }
    let mut found = Vec::new();
    let mut done: BTreeSet<&str> = BTreeSet::new();
    for &start in adj.keys() {
        if done.contains(start) {
            continue;
        }
        // A path from `start` back to itself, by breadth-first search.
        let mut prev: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut closed = None;
        while let Some(v) = queue.pop_front() {
            for &w in adj.get(v).into_iter().flatten() {
                if w == start {
                    closed = Some(v);
                    break;
                }
                if !prev.contains_key(w) {
                    prev.insert(w, v);
                    queue.push_back(w);
                }
            }
            if closed.is_some() {
                break;
            }
        }
        if let Some(mut v) = closed {
            let mut back = Vec::new();
            while v != start {
                back.push(v);
                v = prev[v];
            }
            let mut walk = vec![start.to_owned()];
            walk.extend(back.iter().rev().map(|s| (*s).to_owned()));
            walk.push(start.to_owned());
            done.extend(back);
            done.insert(start);
            found.push(walk);
        }
    }
    found
}
