//! The route table: `Table::find` picks the first route, in file order, whose `match` holds.
//! `Index` narrows a large table down to the routes a request's path can match, so the cost of
//! a lookup does not grow with the number of routes.
//!
//! Paths are compared as the backends behind a proxy read them (docs/hardening.md): an exact
//! `path` holds with or without one trailing slash, a `path_prefix` ending in `/` also holds
//! for the path without it (`/admin/` for `/admin`), and a route for a case-insensitive
//! backend (IIS) compares without ASCII case. Hosts are compared without case and without one
//! trailing dot.

use std::collections::HashMap;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};

use crate::identity::without_trailing_slash;

/// The conditions of a route's `match`; all given ones must hold.
#[derive(Debug, Default)]
pub struct Matcher {
    pub host: Option<HostPattern>,
    pub path: PathPattern,
    pub methods: Option<Vec<Method>>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The path is compared without ASCII case (`match.path_case: insensitive`).
    pub fold_case: bool,
    /// An exact path matches with a file extension too (`match.path_extensions`).
    pub extensions: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum HostPattern {
    /// `api.example.com`, compared without case.
    Exact(String),
    /// `*.example.com` is stored as `.example.com`: any subdomain, not the apex.
    Suffix(String),
}

impl HostPattern {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut s = s.trim().to_ascii_lowercase();
        // `api.example.com.` is the same name (requests are compared without the dot).
        if s.ends_with('.') {
            s.pop();
        }
        // A pattern no valid Host could meet (screening refuses `a,b`, `a b`, `a..b`) is an
        // error, not a route that silently never matches.
        let valid = |name: &str| crate::screen::parse_host(name.as_bytes()).is_some();
        if let Some(rest) = s.strip_prefix("*.") {
            if rest.is_empty() || rest.contains(['*', ':', '/', ' ']) || !valid(rest) {
                return Err(format!("host pattern `{s}` must look like `*.example.com`"));
            }
            return Ok(HostPattern::Suffix(format!(".{rest}")));
        }
        if s.contains(':') {
            return Err(format!(
                "host `{s}` must not carry a port: hosts are matched without their port"
            ));
        }
        if s.is_empty() || s.contains(['*', '/', ' ']) || !valid(&s) {
            return Err(format!(
                "host `{s}` must be a name like `api.example.com` or a pattern like `*.example.com`"
            ));
        }
        Ok(HostPattern::Exact(s))
    }

    fn matches(&self, host: &str) -> bool {
        // Screening canonicalises the host already; the dot is dropped here too so that the
        // table holds on its own.
        let host = host.strip_suffix('.').unwrap_or(host);
        match self {
            HostPattern::Exact(h) => host.eq_ignore_ascii_case(h),
            HostPattern::Suffix(suffix) => {
                host.len() > suffix.len()
                    && host.is_char_boundary(host.len() - suffix.len())
                    && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
            }
        }
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub enum PathPattern {
    #[default]
    Any,
    Exact(String),
    Prefix(String),
}

fn same(a: &str, b: &str, fold: bool) -> bool {
    if fold {
        a.eq_ignore_ascii_case(b)
    } else {
        a == b
    }
}

impl Matcher {
    fn path_matches(&self, path: &str) -> bool {
        let fold = self.fold_case;
        match &self.path {
            PathPattern::Any => true,
            PathPattern::Exact(p) => {
                let path = without_trailing_slash(path);
                let p = without_trailing_slash(p);
                same(path, p, fold)
                    || (self.extensions
                        && without_extension(path).is_some_and(|b| same(b, p, fold)))
            }
            PathPattern::Prefix(p) => {
                let starts = path.len() >= p.len()
                    && path.is_char_boundary(p.len())
                    && same(&path[..p.len()], p, fold);
                // `/admin/` also holds for `/admin`, which backends serve as the same page
                // (nginx redirects it there).
                starts || (p.len() > 1 && p.ends_with('/') && same(path, &p[..p.len() - 1], fold))
            }
        }
    }

    fn matches(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> bool {
        self.path_matches(uri.path())
            && self.methods.as_ref().is_none_or(|m| m.contains(method))
            && self.host.as_ref().is_none_or(|h| {
                crate::identity::host(uri, headers).is_some_and(|host| h.matches(host))
            })
            && self
                .headers
                .iter()
                .all(|(name, value)| headers.get_all(name).iter().any(|v| v == value))
    }
}

/// `path` without a file extension of its last segment (`/login.json` is `/login`): 1 to 16
/// ASCII letters and digits after the last dot.
pub fn without_extension(path: &str) -> Option<&str> {
    let (base, ext) = path.rsplit_once('.')?;
    let plain =
        !ext.is_empty() && ext.len() <= 16 && ext.bytes().all(|b| b.is_ascii_alphanumeric());
    (plain && !base.ends_with('/') && !base.is_empty()).then_some(base)
}

/// Below this many routes, trying each in turn is faster than the index.
const INDEX_FROM: usize = 8;

/// Which routes a request path can match, by the route's path pattern: an exact path, a prefix
/// that covers a whole first segment (`/api/...` can only match paths whose first segment is
/// `api`), or anything else (`any`, `/`, `/ap`). Each list is in file order, and every route is
/// in exactly one, so merging the three lists a path selects gives its candidates in file order.
#[derive(Debug, Default)]
pub struct Index {
    enabled: bool,
    /// Some route compares paths without case: its keys are lower case, and a path with upper
    /// case is looked up lower-cased as well.
    folded: bool,
    exact: HashMap<Box<str>, Vec<u32>>,
    by_segment: HashMap<Box<str>, Vec<u32>>,
    rest: Vec<u32>,
}

/// The first segment of `path` (`api` for `/api/v1`), without its slashes.
fn first_segment(path: &str) -> Option<&str> {
    let rest = path.strip_prefix('/')?;
    Some(rest.split('/').next().unwrap_or(rest))
}

impl Index {
    fn new(routes: &[Matcher]) -> Self {
        let mut index = Index {
            enabled: routes.len() >= INDEX_FROM,
            ..Index::default()
        };
        if !index.enabled {
            return index;
        }
        for (i, r) in routes.iter().enumerate() {
            let i = u32::try_from(i).unwrap_or(u32::MAX);
            let key = |k: &str| -> Box<str> {
                if r.fold_case {
                    k.to_ascii_lowercase().into()
                } else {
                    k.into()
                }
            };
            index.folded |= r.fold_case;
            match &r.path {
                // Matched with an extension too: not under its bare path.
                PathPattern::Exact(_) if r.extensions => index.rest.push(i),
                PathPattern::Exact(p) => index
                    .exact
                    .entry(key(without_trailing_slash(p)))
                    .or_default()
                    .push(i),
                // `/api/` covers the whole segment `api` (and the path `/api`); `/api` would
                // also match `/apix`.
                PathPattern::Prefix(p) if p.len() > 1 && p[1..].contains('/') => {
                    let segment = first_segment(p).unwrap_or_default();
                    index.by_segment.entry(key(segment)).or_default().push(i);
                }
                _ => index.rest.push(i),
            }
        }
        index
    }
}

/// Every route's match conditions, in file order, with their path index.
#[derive(Debug, Default)]
pub struct Table {
    matchers: Vec<Matcher>,
    index: Index,
}

impl Table {
    pub fn new(matchers: Vec<Matcher>) -> Self {
        let index = Index::new(&matchers);
        Self { matchers, index }
    }

    /// Route `i`'s match conditions.
    pub fn matcher(&self, i: usize) -> Option<&Matcher> {
        self.matchers.get(i)
    }

    /// The index of the first route in file order that matches the request.
    pub fn find<B>(&self, req: &Request<B>) -> Option<usize> {
        self.find_parts(req.method(), req.uri(), req.headers())
    }

    /// `find`, given the request's parts.
    pub fn find_parts(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Option<usize> {
        if !self.index.enabled {
            return self.scan(method, uri, headers);
        }
        let index = &self.index;
        let path = uri.path();
        let none: &[u32] = &[];
        let lookup = |path: &str| {
            let exact = index.exact.get(without_trailing_slash(path));
            let segment = first_segment(path).and_then(|s| index.by_segment.get(s));
            (
                exact.map_or(none, Vec::as_slice),
                segment.map_or(none, Vec::as_slice),
            )
        };
        let (exact, segment) = lookup(path);
        // Only a table with case-insensitive routes, and only a path with upper case, pays for
        // a lower-cased copy. The two lookups never share a key, so no route comes twice.
        let lower = (index.folded && path.bytes().any(|b| b.is_ascii_uppercase()))
            .then(|| path.to_ascii_lowercase());
        let (exact_lower, segment_lower) = lower.as_deref().map_or((none, none), lookup);
        let mut lists = [
            exact,
            segment,
            exact_lower,
            segment_lower,
            index.rest.as_slice(),
        ];
        loop {
            // The smallest head of the lists is the next candidate in file order.
            let (which, next) = lists
                .iter()
                .enumerate()
                .filter_map(|(w, l)| l.first().map(|&i| (w, i)))
                .min_by_key(|&(_, i)| i)?;
            lists[which] = &lists[which][1..];
            let next = next as usize;
            if self.matchers.get(next)?.matches(method, uri, headers) {
                return Some(next);
            }
        }
    }

    /// The first match by trying each route in turn.
    fn scan(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Option<usize> {
        self.matchers
            .iter()
            .position(|m| m.matches(method, uri, headers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Named routes: the names, and the table of their matchers.
    struct Named(Vec<String>, Table);

    fn table(routes: Vec<(&str, Matcher)>) -> Named {
        let (names, matchers): (Vec<_>, Vec<_>) =
            routes.into_iter().map(|(n, m)| (n.to_owned(), m)).unzip();
        Named(names, Table::new(matchers))
    }

    fn hit<'a>(routes: &'a Named, method: &Method, uri: &str, host: &str) -> Option<&'a str> {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, host.parse().unwrap());
        let found = routes.1.find_parts(method, &uri.parse().unwrap(), &headers);
        found.map(|i| routes.0[i].as_str())
    }

    /// Routes of every kind the index sorts: exact paths, prefixes with and without a
    /// trailing `/`, none, with and without a host, a method or case folding.
    fn mixed_routes() -> Vec<Matcher> {
        let mut routes = Vec::new();
        for i in 0..12 {
            let seg = ["api", "app", "a", "static", ""][i % 5];
            let path = match i % 4 {
                0 => PathPattern::Exact(format!("/{seg}/x{i}")),
                1 => PathPattern::Prefix(format!("/{seg}/")),
                2 => PathPattern::Prefix(format!("/{seg}")),
                _ => PathPattern::Any,
            };
            let host = (i % 3 == 0).then(|| HostPattern::Exact("h.test".into()));
            let methods = (i % 5 == 4).then(|| vec![Method::POST]);
            routes.push(Matcher {
                host,
                path,
                methods,
                fold_case: i % 3 == 1,
                ..Matcher::default()
            });
            routes.push(Matcher {
                path: PathPattern::Exact(format!("/e/{i}")),
                ..Matcher::default()
            });
        }
        routes
    }

    /// The index must pick exactly the route the scan picks, for every kind of path pattern,
    /// with host and method conditions mixed in and routes shadowing each other.
    #[test]
    fn the_index_agrees_with_the_scan() {
        let table = Table::new(mixed_routes());
        assert!(table.index.enabled);
        let paths = [
            "/",
            "/api",
            "/api/",
            "/api/x0",
            "/api/y",
            "/apix",
            "/app/x",
            "/a",
            "/a/",
            "/ab",
            "/static/x3",
            "/static",
            "//",
            "/e/3",
            "/e/30",
            "/x",
            "/api/x8",
            "/app/x1",
            "/API/X0",
            "/Api/y",
            "/APP/x",
            "/api/x0/",
            "/e/3/",
            "/E/3",
            "/static/X3/",
        ];
        for path in paths {
            for method in [Method::GET, Method::POST] {
                for host in ["h.test", "other.test"] {
                    let mut headers = HeaderMap::new();
                    headers.insert(http::header::HOST, host.parse().unwrap());
                    let uri: Uri = path.parse().unwrap();
                    let scan = table.scan(&method, &uri, &headers);
                    let indexed = table.find_parts(&method, &uri, &headers);
                    assert_eq!(indexed, scan, "{method} {host}{path}");
                }
            }
        }
    }

    #[test]
    fn first_match_in_order() {
        let routes = table(vec![
            (
                "login",
                Matcher {
                    path: PathPattern::Exact("/login".into()),
                    methods: Some(vec![Method::POST]),
                    ..Matcher::default()
                },
            ),
            (
                "api",
                Matcher {
                    host: Some(HostPattern::parse("*.example.com").unwrap()),
                    path: PathPattern::Prefix("/v1/".into()),
                    ..Matcher::default()
                },
            ),
            ("all", Matcher::default()),
        ]);
        assert_eq!(hit(&routes, &Method::POST, "/login", "x"), Some("login"));
        assert_eq!(hit(&routes, &Method::GET, "/login", "x"), Some("all"));
        assert_eq!(
            hit(&routes, &Method::GET, "/v1/a", "API.example.com:8080"),
            Some("api")
        );
        assert_eq!(
            hit(&routes, &Method::GET, "/v1/a", "example.com"),
            Some("all")
        );
        assert_eq!(
            hit(&routes, &Method::GET, "/v1/a", "evil-example.com"),
            Some("all")
        );
    }

    #[test]
    fn paths_match_as_backends_read_them() {
        let m = |path: PathPattern, fold_case: bool| Matcher {
            path,
            fold_case,
            ..Matcher::default()
        };
        let login = m(PathPattern::Exact("/login".into()), false);
        assert!(login.path_matches("/login") && login.path_matches("/login/"));
        assert!(!login.path_matches("/login//") && !login.path_matches("/Login"));
        let slash = m(PathPattern::Exact("/login/".into()), false);
        assert!(slash.path_matches("/login") && slash.path_matches("/login/"));
        let root = m(PathPattern::Exact("/".into()), false);
        assert!(root.path_matches("/") && !root.path_matches("/x"));
        let admin = m(PathPattern::Prefix("/admin/".into()), false);
        assert!(admin.path_matches("/admin") && admin.path_matches("/admin/x"));
        assert!(!admin.path_matches("/adminx") && !admin.path_matches("/Admin/x"));
        let iis = m(PathPattern::Prefix("/Admin/".into()), true);
        assert!(iis.path_matches("/ADMIN/x") && iis.path_matches("/admin"));
        let iis = m(PathPattern::Exact("/login".into()), true);
        assert!(iis.path_matches("/LOGIN/") && !iis.path_matches("/logins"));
        // A prefix that would cut a character in two does not match (nor panic).
        let prefix = m(PathPattern::Prefix("/ab".into()), true);
        assert!(!prefix.path_matches("/a\u{e9}"));
        // Suffix patterns, opted in: `/login.json` is `/login`; `/login.x/y` and `/.json` not.
        let spring = Matcher {
            extensions: true,
            ..m(PathPattern::Exact("/w/login".into()), false)
        };
        for yes in ["/w/login", "/w/login.json", "/w/login.XML/"] {
            assert!(spring.path_matches(yes), "{yes}");
        }
        for no in [
            "/w/login.",
            "/w/login.a-b",
            "/w/login.json/x",
            "/w/.json",
            "/w/loginx.json",
        ] {
            assert!(!spring.path_matches(no), "{no}");
        }
        assert!(!login.path_matches("/login.json"), "opt-in only");
    }

    #[test]
    fn host_patterns_no_valid_host_could_meet_are_refused() {
        for bad in [
            "a,b",
            "a..b",
            ".a",
            "a b",
            "a@b",
            "*.a,b",
            "*..a",
            "caf\u{e9}.test",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad}");
        }
        for ok in [
            "a",
            "in_ternal.svc",
            "127.0.0.1",
            "*.example.com",
            "API.Example.COM.",
        ] {
            assert!(HostPattern::parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn hosts_match_without_one_trailing_dot() {
        let exact = HostPattern::parse("Known.Example.").unwrap();
        assert_eq!(exact, HostPattern::Exact("known.example".into()));
        assert!(exact.matches("known.example") && exact.matches("KNOWN.example."));
        assert!(!exact.matches("known.example.."));
        let suffix = HostPattern::parse("*.example.com").unwrap();
        assert!(suffix.matches("a.example.com.") && !suffix.matches("example.com."));
    }

    #[test]
    fn header_values_must_match() {
        let routes = Table::new(vec![Matcher {
            headers: vec![("x-tenant".parse().unwrap(), "acme".parse().unwrap())],
            ..Matcher::default()
        }]);
        let mut h = HeaderMap::new();
        assert!(routes
            .find_parts(&Method::GET, &"/".parse().unwrap(), &h)
            .is_none());
        h.insert("x-tenant", "acme".parse().unwrap());
        assert!(routes
            .find_parts(&Method::GET, &"/".parse().unwrap(), &h)
            .is_some());
    }
}
