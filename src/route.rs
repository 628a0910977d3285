//! The route table: `Table::find` picks the first route, in file order, whose `match` holds.
//! `Index` narrows a large table down to the routes a request's path can match, so the cost of
//! a lookup does not grow with the number of routes.

use std::collections::HashMap;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri};

/// The conditions of a route's `match`; all given ones must hold.
#[derive(Debug, Default)]
pub struct Matcher {
    pub host: Option<HostPattern>,
    pub path: PathPattern,
    pub methods: Option<Vec<Method>>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
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
        let s = s.trim().to_ascii_lowercase();
        if let Some(rest) = s.strip_prefix("*.") {
            if rest.is_empty() || rest.contains(['*', ':', '/', ' ']) {
                return Err(format!("host pattern `{s}` must look like `*.example.com`"));
            }
            return Ok(HostPattern::Suffix(format!(".{rest}")));
        }
        if s.contains(':') {
            return Err(format!(
                "host `{s}` must not carry a port: hosts are matched without their port"
            ));
        }
        if s.is_empty() || s.contains(['*', '/', ' ']) {
            return Err(format!(
                "host `{s}` must be a name like `api.example.com` or a pattern like `*.example.com`"
            ));
        }
        Ok(HostPattern::Exact(s))
    }

    fn matches(&self, host: &str) -> bool {
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

impl Matcher {
    fn matches(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> bool {
        let path_ok = match &self.path {
            PathPattern::Any => true,
            PathPattern::Exact(p) => uri.path() == p,
            PathPattern::Prefix(p) => uri.path().starts_with(p.as_str()),
        };
        path_ok
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

/// Below this many routes, trying each in turn is faster than the index.
const INDEX_FROM: usize = 8;

/// Which routes a request path can match, by the route's path pattern: an exact path, a prefix
/// that covers a whole first segment (`/api/...` can only match paths whose first segment is
/// `api`), or anything else (`any`, `/`, `/ap`). Each list is in file order, and every route is
/// in exactly one, so merging the three lists a path selects gives its candidates in file order.
#[derive(Debug, Default)]
pub struct Index {
    enabled: bool,
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
            match &r.path {
                PathPattern::Exact(p) => index.exact.entry(p.as_str().into()).or_default().push(i),
                // `/api/` covers the whole segment `api`; `/api` would also match `/apix`.
                PathPattern::Prefix(p) if p.len() > 1 && p[1..].contains('/') => {
                    let segment = first_segment(p).unwrap_or_default();
                    index.by_segment.entry(segment.into()).or_default().push(i);
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
        let exact = index.exact.get(path).map_or(none, Vec::as_slice);
        let segment = first_segment(path)
            .and_then(|s| index.by_segment.get(s))
            .map_or(none, Vec::as_slice);
        let mut lists = [exact, segment, index.rest.as_slice()];
        loop {
            // The smallest head of the three lists is the next candidate in file order.
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

    /// The index must pick exactly the route the scan picks, for every kind of path pattern,
    /// with host and method conditions mixed in and routes shadowing each other.
    #[test]
    fn the_index_agrees_with_the_scan() {
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
                ..Matcher::default()
            });
            routes.push(Matcher {
                path: PathPattern::Exact(format!("/e/{i}")),
                ..Matcher::default()
            });
        }
        let table = Table::new(routes);
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
