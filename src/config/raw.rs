//! YAML text -> `file::File`, one section and one list item at a time, so that a typo in one
//! route does not hide the problems of the others (and of the rest of the file).

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::file::{File, Positions, RateLimitHeaders};
use super::Problem;

/// Every top-level key, in the order `File` declares them.
const KEYS: &[&str] = &[
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
    "max_rss",
    "client_ip_header",
    "underscores_in_headers",
    "strip_untrusted_headers",
    "buffering",
    "request_id_header",
    "grpc",
    "identity",
    "rls",
    "telemetry",
    "candidate",
];

/// Parse what parses; report the rest with field paths. A YAML syntax error stops everything
/// (nothing after it can be trusted) and is reported with the parser's own position.
pub fn read(text: &str) -> (Option<File>, Vec<Problem>) {
    let mut root = match super::yaml::tree(text) {
        Ok(v) => v,
        Err(p) => return (None, vec![p]),
    };
    let mut problems = super::env::substitute(&mut root, &|name| std::env::var(name).ok());
    let map = match root {
        Value::Object(m) => m,
        Value::Null => Map::new(),
        _ => {
            problems.push(problem(
                String::new(),
                "the file must be a mapping of keys such as `listeners:` and `routes:`".into(),
            ));
            return (None, problems);
        }
    };
    for name in map.keys() {
        if !KEYS.contains(&name.as_str()) {
            problems.push(problem(name.to_owned(), unknown_key(name)));
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
        max_rss: r.one("max_rss"),
        client_ip_header: r.one("client_ip_header"),
        underscores_in_headers: r.one("underscores_in_headers"),
        strip_untrusted_headers: r.one("strip_untrusted_headers"),
        buffering: r.one("buffering"),
        request_id_header: r.one("request_id_header"),
        grpc: r.one("grpc"),
        identity: r.one("identity"),
        rls: r.one("rls"),
        telemetry: r.one("telemetry"),
        positions: Positions {
            listeners: listener_positions,
            routes: route_positions,
            broken_upstreams: std::mem::take(&mut r.broken),
        },
        candidate: r.one("candidate"),
    };
    (Some(file), r.problems)
}

struct Reader<'a> {
    map: &'a Map<String, Value>,
    problems: Vec<Problem>,
    /// Names of mapping items that did not parse (already reported).
    broken: Vec<String>,
}

impl Reader<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn parse<T: DeserializeOwned>(&mut self, path: &str, value: &Value) -> Option<T> {
        match super::yaml::typed(value) {
            Ok(v) => Some(v),
            Err((inner, message)) => {
                self.problems.push(problem_at(path, &inner, message));
                None
            }
        }
    }

    fn one<T: DeserializeOwned>(&mut self, key: &str) -> Option<T> {
        let value = self.get(key)?.clone();
        self.parse(key, &value)
    }

    /// A list, item by item: a broken item is reported and left out. Also returns where each
    /// kept item stood.
    fn list<T: DeserializeOwned>(&mut self, key: &str) -> (Vec<T>, Vec<usize>) {
        let Some(value) = self.get(key).cloned() else {
            return (Vec::new(), Vec::new());
        };
        let Value::Array(items) = value else {
            self.problems.push(problem(
                key.to_owned(),
                "must be a list (`- ...` items)".into(),
            ));
            return (Vec::new(), Vec::new());
        };
        let (mut out, mut positions) = (Vec::new(), Vec::new());
        for (i, item) in items.iter().enumerate() {
            if let Some(v) = self.parse(&format!("{key}[{i}]"), item) {
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
        let Value::Object(items) = value else {
            self.problems.push(problem(
                key.to_owned(),
                "must be a mapping of names (`name: {...}`)".into(),
            ));
            return std::collections::BTreeMap::new();
        };
        let mut out = std::collections::BTreeMap::new();
        for (name, item) in items {
            match self.parse(&format!("{key}.{name}"), &item) {
                Some(v) => {
                    out.insert(name, v);
                }
                None => self.broken.push(name),
            }
        }
        out
    }
}

/// An unknown top-level key, with the known key it most likely misspells.
fn unknown_key(name: &str) -> String {
    let keys = KEYS.join(", ");
    match super::yaml::did_you_mean(name, KEYS) {
        Some(near) => {
            format!("unknown key `{name}` (did you mean `{near}`?), expected one of: {keys}")
        }
        None => format!("unknown key `{name}`, expected one of: {keys}"),
    }
}

fn problem(path: String, message: String) -> Problem {
    Problem {
        path,
        message,
        at: None,
    }
}

/// A serde error at `inner` inside the item at `path`. An unknown field (`limts`) is marked
/// `PARENT\0FIELD` so that `parse` finds the key's exact path in the document.
fn problem_at(path: &str, inner: &str, message: String) -> Problem {
    let mut path = join(path, inner);
    if let Some(field) = backticked_after(&message, "unknown field ") {
        if let Some(parent) = path.strip_suffix(field).and_then(|p| p.strip_suffix('.')) {
            path = format!("{parent}\u{0}{field}");
        } else {
            path = format!("{path}\u{0}{field}");
        }
    }
    Problem {
        path,
        message,
        at: None,
    }
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() || child.is_empty() || child.starts_with('[') {
        format!("{parent}{child}")
    } else {
        format!("{parent}.{child}")
    }
}

fn backticked_after<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = s.strip_prefix(prefix)?.strip_prefix('`')?;
    rest.split_once('`').map(|(f, _)| f)
}

#[cfg(test)]
mod tests {
    use super::*;

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
