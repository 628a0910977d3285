//! YAML through serde-saphyr, the one parser: text -> a plain value tree, a typed item from one
//! node of it, and its errors as `Problem`s (syntax errors with an indentation hint).
//!
//! serde-saphyr deserializes into types and has no dynamic value of its own, so the tree that
//! `${VAR}` substitution and the section-by-section reading work on is `serde_json::Value`
//! (which serde-saphyr reads, anchors, aliases and `<<` merges resolved). A typed item is read
//! back through YAML text rather than `serde_json::from_value` because serde-saphyr is
//! type-driven: `timeout: 30` reads into a `String` field (so validation can say what is wrong
//! with it), as the whole-file parse would. `locate` walks the same parser's events
//! (`serde_saphyr::granit_parser`) for the positions of field paths.

use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_saphyr::MessageFormatter;

use super::Problem;

/// Booleans are `true` and `false` only (YAML 1.2, as the JSON Schema and editors read them):
/// `yes`, `on` and `y` are strings, refused where a boolean is expected.
///
/// The parser's budget is raised from serde-saphyr's defaults (250,000 nodes, 1,000,000
/// events), which refuse a config of 25,000 routes: `MAX_NODES` holds about 100,000 routes of
/// a few limits each, and a file past it is refused with the caps named (`too_large`).
fn options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
        budget: serde_saphyr::budget! { max_nodes: MAX_NODES, max_events: MAX_EVENTS },
    }
}

/// The most YAML nodes (mappings, sequences and scalars) a config file may hold.
pub const MAX_NODES: usize = 4_000_000;
/// The most parser events a config file may produce (every node, and each container's end).
pub const MAX_EVENTS: usize = 8_000_000;

/// A budget breach's message, with the caps it is measured against.
fn too_large(message: &str) -> String {
    format!(
        "{message} (a config file is read up to {MAX_NODES} YAML nodes, {MAX_EVENTS} parser \
         events, 64 MiB of scalar text and 64 levels of nesting)"
    )
}

/// The document as a value tree, or its syntax error at the position the parser gives.
pub fn tree(text: &str) -> Result<Value, Problem> {
    serde_saphyr::from_str_with_options::<Value>(text, options()).map_err(|e| {
        let at = position(&e);
        let mut message = message(&e);
        if let serde_saphyr::Error::Budget { .. } = e.without_snippet() {
            message = too_large(&message);
        }
        if let Some(hint) = at.and_then(|(line, _)| indentation_hint(text, line, &message)) {
            message.push_str("\n    hint: ");
            message.push_str(&hint);
        }
        Problem {
            path: String::new(),
            message,
            at,
        }
    })
}

/// The value `text` reads as on its own (`500`, `true`, `abc`), or `None` if it is not YAML.
pub fn scalar(text: &str) -> Option<Value> {
    serde_saphyr::from_str_with_options::<Value>(text, options()).ok()
}

/// A typed item from `value`. The error names the field inside the item (`limits[0].burst`,
/// empty for the item itself) and says what is wrong; its position is found by path, since
/// the parser's would point into the re-serialized text.
pub fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, (String, String)> {
    let text = serde_saphyr::to_string(value).map_err(|e| (String::new(), e.to_string()))?;
    let mut inner = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(&text, options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            inner = e.path().to_string();
            e.into_inner()
        })
    });
    result.map_err(|e| {
        let inner = if inner == "." { String::new() } else { inner };
        let message = match serde_wording(message(&e)) {
            m if m == "null is not allowed here" => {
                "has no value (YAML null): write `\"\"` for empty text, or leave the key out"
                    .to_owned()
            }
            m => m,
        };
        let found = at_path(value, &inner);
        let message = found
            .and_then(|v| type_message(&message, v))
            .unwrap_or(message);
        (inner, message)
    })
}

fn message(e: &serde_saphyr::Error) -> String {
    serde_saphyr::UserMessageFormatter
        .format_message(e.without_snippet())
        .into_owned()
}

fn position(e: &serde_saphyr::Error) -> Option<(usize, usize)> {
    let l = e.location()?;
    let (line, column) = (
        usize::try_from(l.line()).ok()?,
        usize::try_from(l.column()).ok()?,
    );
    (line > 0).then_some((line, column))
}

/// `unknown field `x`, expected one of a, b` as serde itself words it, the expected fields in
/// backticks (`expected `a` or `b``, `expected one of `a`, `b`, `c``).
fn serde_wording(message: String) -> String {
    let Some((head, list)) = message.split_once(", expected one of ") else {
        return message;
    };
    if !head.starts_with("unknown ") {
        return message;
    }
    let names: Vec<&str> = list.split(", ").collect();
    let fields: Vec<String> = names.iter().map(|f| format!("`{f}`")).collect();
    let hint = backticked(head)
        .and_then(|unknown| did_you_mean(unknown, &names))
        .map(|near| format!(" (did you mean `{near}`?)"))
        .unwrap_or_default();
    match fields.as_slice() {
        [one] => format!("{head}{hint}, expected {one}"),
        [a, b] => format!("{head}{hint}, expected {a} or {b}"),
        _ => format!("{head}{hint}, expected one of {}", fields.join(", ")),
    }
}

/// The first backticked word of `s`.
fn backticked(s: &str) -> Option<&str> {
    s.split_once('`')?.1.split_once('`').map(|(w, _)| w)
}

/// The known name `unknown` is most likely a misspelling of: the same but for case, `_` and
/// `-`, or at most two edits away.
pub(crate) fn did_you_mean<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    let bare = |s: &str| s.replace(['_', '-'], "").to_ascii_lowercase();
    let unknown_bare = bare(unknown);
    known
        .iter()
        .map(|k| {
            let d = if bare(k) == unknown_bare {
                0
            } else {
                strsim::damerau_levenshtein(unknown, k)
            };
            (d, *k)
        })
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// The node at a `serde_path_to_error` path (`limits[0].burst`) inside `value`.
fn at_path<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    let mut v = value;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (key, indices) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            v = v.get(key)?;
        }
        for index in indices.split(['[', ']']).filter(|s| !s.is_empty()) {
            v = v.get(index.parse::<usize>().ok()?)?;
        }
    }
    Some(v)
}

/// serde-saphyr's terse type errors (`invalid u32`, `expected string scalar`) in serde's own
/// words, which name what was found: `invalid type: string "five", expected u32`.
fn type_message(message: &str, found: &Value) -> Option<String> {
    let expected = match message {
        "expected string scalar" => "a string",
        "expected sequence start" => "a sequence",
        "expected mapping start" => "a map",
        m if m.starts_with("invalid boolean") => "a boolean",
        m => m.strip_prefix("invalid ").filter(|t| {
            t.starts_with(['u', 'i', 'f']) && t[1..].bytes().all(|b| b.is_ascii_alphanumeric())
        })?,
    };
    let found = match found {
        Value::String(s) => format!("string {s:?}"),
        Value::Number(n) if n.is_f64() => format!("floating point `{n}`"),
        Value::Number(n) => {
            return Some(format!(
                "invalid {}: integer `{n}`, expected {expected}",
                if expected.starts_with('a') {
                    "type"
                } else {
                    "value"
                }
            ))
        }
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Array(_) => "sequence".to_owned(),
        Value::Object(_) => "map".to_owned(),
        Value::Null => "null".to_owned(),
    };
    Some(format!("invalid type: {found}, expected {expected}"))
}

/// The indentation levels above a line, nearest first: each line (1-based) that starts a
/// shallower level than the one before it, with its column, up to the top level.
fn levels(above: &[&str], column: impl Fn(&str) -> usize) -> Vec<(usize, usize)> {
    let mut levels: Vec<(usize, usize)> = Vec::new();
    for (i, l) in above.iter().enumerate().rev() {
        if l.trim().is_empty() || l.trim_start().starts_with('#') {
            continue;
        }
        let n = column(l);
        if levels.last().is_none_or(|&(last, _)| n < last) {
            levels.push((n, i + 1));
        }
        if n == 0 {
            break;
        }
    }
    levels
}

/// For the errors a misplaced line typically causes, the key columns of the lines above the
/// failing one that it could line up with (the block it follows and the blocks around it).
fn indentation_hint(text: &str, line: usize, message: &str) -> Option<String> {
    const SIGNS: [&str; 3] = [
        "mapping values are not allowed",
        "did not find expected key",
        "did not find expected '-' indicator",
    ];
    if !SIGNS.iter().any(|s| message.contains(s)) {
        return None;
    }
    let lines: Vec<&str> = text.lines().collect();
    let this = *lines.get(line.checked_sub(1)?)?;
    // A misplaced list item is lined up by its `-`, anything else by its key.
    let item = this.trim_start().starts_with("- ");
    let column = |l: &str| {
        let indent = l.len() - l.trim_start_matches(' ').len();
        if item && l.trim_start().starts_with("- ") {
            indent
        } else {
            key_column(l)
        }
    };
    let here = column(this);
    // `key: value: more` on one line: the value needs quotes, the indentation is not at fault.
    let (key, value) = this.trim().trim_start_matches("- ").split_once(": ")?;
    if value.contains(": ") && !value.starts_with(['"', '\'', '{', '[']) {
        return Some(format!(
            "a value containing `: ` must be quoted, as in `{key}: \"{value}\"`"
        ));
    }
    let levels = levels(&lines[..line - 1], column);
    let &(above, above_line) = levels.first()?;
    let mut choices: Vec<String> = levels
        .iter()
        .map(|(n, l)| format!("{n} (line {l})"))
        .collect();
    let last = choices.pop()?;
    let choices = if choices.is_empty() {
        last
    } else {
        format!("{} or {last}", choices.join(", "))
    };
    let what = if item { "`-`" } else { "key" };
    let mut hint = format!(
        "check the indentation of line {line}: its {what} is {here} spaces in, the lines above \
         it are {choices}; it must line up with the one it belongs with"
    );
    let has_value = lines[above_line - 1]
        .trim()
        .trim_start_matches("- ")
        .split_once(": ")
        .is_some_and(|(_, v)| !v.trim().is_empty() && !v.trim_start().starts_with('#'));
    if here > above && has_value && !item {
        hint = format!("{hint} (line {above_line} has a value, so nothing can be nested under it)");
    }
    Some(hint)
}

/// Where a line's key starts: its indentation, plus the `- ` of a list item.
fn key_column(line: &str) -> usize {
    let rest = line.trim_start_matches(' ');
    let mut column = line.len() - rest.len();
    let mut rest = rest;
    while let Some(r) = rest.strip_prefix("- ") {
        let r2 = r.trim_start_matches(' ');
        column += rest.len() - r2.len();
        rest = r2;
    }
    column
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_breach_names_the_caps() {
        // Nesting past the depth cap is a budget breach, as too many nodes is.
        let deep = format!("a: {}1{}\n", "[".repeat(80), "]".repeat(80));
        let m = tree(&deep).expect_err("too deep").message;
        assert!(
            m.contains("4000000 YAML nodes") && m.contains("8000000 parser events"),
            "{m}"
        );
        // Any other error keeps its own message alone.
        let other = tree("a: [1\n").expect_err("unclosed").message;
        assert!(!other.contains("YAML nodes"), "{other}");
    }

    #[test]
    fn strings_read_numbers_as_written_and_errors_name_the_field() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Item {
            timeout: Option<String>,
            limits: Option<Vec<Limit>>,
        }
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Limit {
            burst: u32,
        }
        let v = tree("timeout: 30\n").unwrap();
        assert_eq!(typed::<Item>(&v).unwrap().timeout.as_deref(), Some("30"));
        let v = tree("timeout: '30'\nlimits: [{ burst: five }]\n").unwrap();
        let (path, message) = typed::<Item>(&v).unwrap_err();
        assert_eq!(path, "limits[0].burst");
        assert_eq!(message, r#"invalid type: string "five", expected u32"#);
        let v = tree("limits: [{}]\n").unwrap();
        assert_eq!(
            typed::<Item>(&v).unwrap_err(),
            ("limits[0]".into(), "missing field `burst`".into())
        );
    }

    #[test]
    fn any_string_survives_the_trip_through_text() {
        #[derive(serde::Deserialize)]
        struct Item {
            s: String,
            m: std::collections::BTreeMap<String, String>,
        }
        for s in [
            "a: b",
            "#x",
            "x #y",
            "'q'",
            "\"dq\"",
            "multi\nline\n",
            "null",
            "true",
            "yes",
            "~",
            "",
            " lead",
            "trail ",
            "*alias",
            "&anchor",
            "!tag",
            "%x",
            "@x",
            "`x",
            "- x",
            "? x",
            "{a}",
            "[a]",
            "0x10",
            "1e3",
            "0755",
            ".inf",
            "\tTab",
            "é ☃",
            "\u{1}\u{7f}",
            "\\",
            "a\\nb",
            "${NOT_EXPANDED}",
            "---",
            "...",
            "<<",
        ] {
            let value = serde_json::json!({ "s": s, "m": { s: s } });
            let item: Item = typed(&value).unwrap_or_else(|e| panic!("{s:?}: {e:?}"));
            assert_eq!(item.s, s);
            assert_eq!(item.m.get(s).map(String::as_str), Some(s), "{s:?} as a key");
        }
    }

    #[test]
    fn duplicate_keys_are_refused_where_they_are() {
        let p = tree("a: 1\nb: 2\na: 3\n").unwrap_err();
        assert_eq!(p.at, Some((3, 1)));
        assert!(
            p.message.contains("duplicate mapping key `a`"),
            "{}",
            p.message
        );
    }

    #[test]
    fn anchors_aliases_and_merge_keys_resolve() {
        let v = tree("a: &x { rate: 1/s, burst: 2 }\nb: *x\nc: { <<: *x, burst: 3 }\n").unwrap();
        assert_eq!(v["b"], v["a"]);
        assert_eq!(v["c"]["rate"], "1/s");
        assert_eq!(v["c"]["burst"], 3);
    }

    #[test]
    fn yaml_1_1_booleans_are_strings() {
        assert_eq!(tree("x: yes\n").unwrap()["x"], "yes");
    }
}
