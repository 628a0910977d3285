//! YAML text -> `file::File`, one section and one list item at a time, so that a typo in one
//! route does not hide the problems of the others (and of the rest of the file).

use serde::de::DeserializeOwned;
use serde_yaml::{Mapping, Value};

use super::file::{File, Positions, RateLimitHeaders};
use super::Problem;

/// Every top-level key, in the order `File` declares them.
const KEYS: [&str; 15] = [
    "listeners",
    "admin",
    "trusted_proxies",
    "limiter",
    "rate_limit_headers",
    "upstreams",
    "routes",
    "shutdown_timeout",
    "shutdown_delay",
    "max_inflight",
    "client_ip_header",
    "underscores_in_headers",
    "strip_untrusted_headers",
    "buffering",
    "request_id_header",
];

/// Parse what parses; report the rest with field paths. A YAML syntax error stops everything
/// (nothing after it can be trusted) and is reported with serde_yaml's own position.
pub fn read(text: &str) -> (Option<File>, Vec<Problem>) {
    let mut root: Value = match serde_yaml::from_str(text) {
        Ok(v) => v,
        Err(e) => return (None, vec![problem_at(String::new(), &e)]),
    };
    let mut problems = super::env::substitute(&mut root, &|name| std::env::var(name).ok());
    let map = match root {
        Value::Mapping(m) => m,
        Value::Null => Mapping::new(),
        _ => {
            problems.push(problem(
                String::new(),
                "the file must be a mapping of keys such as `listeners:` and `routes:`".into(),
            ));
            return (None, problems);
        }
    };
    for key in map.keys() {
        let name = key.as_str().unwrap_or("?");
        if !KEYS.contains(&name) {
            problems.push(problem(
                name.to_owned(),
                format!("unknown key `{name}`, expected one of: {}", KEYS.join(", ")),
            ));
        }
    }
    let mut r = Reader {
        map: &map,
        problems,
        broken: Vec::new(),
    };
    let (listeners, listener_positions) = r.list("listeners");
    let (routes, route_positions) = r.list("routes");
    let file = File {
        listeners,
        admin: r.one("admin"),
        trusted_proxies: r.one("trusted_proxies").unwrap_or_default(),
        limiter: r.one("limiter").unwrap_or_default(),
        rate_limit_headers: r
            .one::<RateLimitHeaders>("rate_limit_headers")
            .unwrap_or_default(),
        upstreams: r.named("upstreams"),
        routes,
        shutdown_timeout: r.one("shutdown_timeout"),
        shutdown_delay: r.one("shutdown_delay"),
        max_inflight: r.one("max_inflight"),
        client_ip_header: r.one("client_ip_header"),
        underscores_in_headers: r.one("underscores_in_headers"),
        strip_untrusted_headers: r.one("strip_untrusted_headers"),
        buffering: r.one("buffering"),
        request_id_header: r.one("request_id_header"),
        positions: Positions {
            listeners: listener_positions,
            routes: route_positions,
            broken_upstreams: std::mem::take(&mut r.broken),
        },
    };
    (Some(file), r.problems)
}

struct Reader<'a> {
    map: &'a Mapping,
    problems: Vec<Problem>,
    /// Names of mapping items that did not parse (already reported).
    broken: Vec<String>,
}

impl Reader<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn parse<T: DeserializeOwned>(&mut self, path: String, value: &Value) -> Option<T> {
        // Through text, not `from_value`: the text deserializer reads `timeout: 30` into a
        // String as the whole-file parse does (so validation can say what is wrong with it),
        // and its errors carry the path inside the item.
        let text = serde_yaml::to_string(value).unwrap_or_default();
        match serde_yaml::from_str(&text) {
            Ok(v) => Some(v),
            Err(e) => {
                let mut p = problem_at(path, &e);
                p.at = None; // a position in the re-serialized text: located by path instead
                self.problems.push(p);
                None
            }
        }
    }

    fn one<T: DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let value = self.get(key)?.clone();
        self.parse(key.to_owned(), &value)
    }

    /// A list, item by item: a broken item is reported and left out. Also returns where each
    /// kept item stood.
    fn list<T: DeserializeOwned>(&mut self, key: &str) -> (Vec<T>, Vec<usize>) {
        let Some(value) = self.get(key).cloned() else {
            return (Vec::new(), Vec::new());
        };
        let Value::Sequence(items) = value else {
            self.problems.push(problem(
                key.to_owned(),
                "must be a list (`- ...` items)".into(),
            ));
            return (Vec::new(), Vec::new());
        };
        let (mut out, mut positions) = (Vec::new(), Vec::new());
        for (i, item) in items.iter().enumerate() {
            if let Some(v) = self.parse(format!("{key}[{i}]"), item) {
                out.push(v);
                positions.push(i);
            }
        }
        (out, positions)
    }

    /// A mapping of names to items, item by item.
    fn named<T: DeserializeOwned>(&mut self, key: &str) -> std::collections::BTreeMap<String, T> {
        let Some(value) = self.get(key).cloned() else {
            return std::collections::BTreeMap::new();
        };
        let Value::Mapping(items) = value else {
            self.problems.push(problem(
                key.to_owned(),
                "must be a mapping of names (`name: {...}`)".into(),
            ));
            return std::collections::BTreeMap::new();
        };
        let mut out = std::collections::BTreeMap::new();
        for (name, item) in &items {
            let name = name
                .as_str()
                .map_or_else(|| format!("{name:?}"), str::to_owned);
            match self.parse(format!("{key}.{name}"), item) {
                Some(v) => {
                    out.insert(name, v);
                }
                None => self.broken.push(name),
            }
        }
        out
    }
}

fn problem(path: String, message: String) -> Problem {
    Problem {
        path,
        message,
        at: None,
    }
}

/// A serde error inside the item at `path`: point at the offending field when serde names it
/// (`unknown field `limts``, `missing field `rate``), else at the item.
fn problem_at(path: String, e: &serde_yaml::Error) -> Problem {
    let message = strip_location(&e.to_string());
    let mut path = path;
    // serde_yaml prefixes nested errors with their path inside the value: `limits[0]: ...`.
    let mut message_body = message.as_str();
    if let Some((inner, rest)) = message.split_once(": ") {
        if !inner.contains(' ') && !inner.is_empty() {
            path = join(&path, inner);
            message_body = rest;
        }
    }
    if let Some(field) = backticked_after(message_body, "unknown field ") {
        // The field may sit deeper than the item (`routes[1].limits[0].brust`): mark it so
        // `parse` can find its exact path in the document.
        path = format!("{path}\u{0}{field}");
    }
    Problem {
        path,
        message: message_body.to_owned(),
        at: e.location().map(|l| (l.line(), l.column())),
    }
}

fn join(parent: &str, child: &str) -> String {
    match (parent.is_empty(), child.starts_with('[')) {
        (true, _) => child.to_owned(),
        (false, true) => format!("{parent}{child}"),
        (false, false) => format!("{parent}.{child}"),
    }
}

fn backticked_after<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = s.strip_prefix(prefix)?.strip_prefix('`')?;
    rest.split_once('`').map(|(f, _)| f)
}

/// serde_yaml appends " at line L column C" to messages; the location is printed in front.
fn strip_location(msg: &str) -> String {
    let Some(i) = msg.find(" at line ") else {
        return msg.to_owned();
    };
    let tail = &msg[i + " at line ".len()..];
    // Skip "L column C" and keep whatever follows (", while scanning ...").
    let end = tail
        .find(|c: char| !(c.is_ascii_digit() || c == ' ' || "column".contains(c)))
        .unwrap_or(tail.len());
    format!("{}{}", &msg[..i], &tail[end..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_serde_locations() {
        assert_eq!(
            strip_location("bad at line 6 column 1, while scanning"),
            "bad, while scanning"
        );
        assert_eq!(strip_location("bad at line 6 column 12"), "bad");
        assert_eq!(strip_location("fine"), "fine");
    }

    #[test]
    fn one_broken_route_does_not_hide_another() {
        let text = "routes:\n  - { name: a, limts: [] }\n  - { name: b, respond: {}, limits: [{ name: x, rate: 1/s, key: [ip], brust: 2 }] }\n";
        let (file, problems) = read(text);
        assert_eq!(file.unwrap().routes.len(), 0);
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            ["routes[0]\u{0}limts", "routes[1].limits[0]\u{0}brust"]
        );
    }
}
