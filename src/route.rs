//! The compiled route table; `find` picks the first route, in file order, that matches.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};

use crate::forward::Upstream;
use crate::limiter::Limit;

/// One route of the table.
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub matcher: Matcher,
    pub action: Action,
    pub limits: Vec<Arc<Limit>>,
    /// Idle timeout, deadline and size cap of request bodies on this route.
    pub body: crate::body::BodyLimits,
    /// WebSocket upgrades are proxied (limits apply to the handshake request).
    pub websocket: bool,
    /// The fixed parts of each limit's response headers, in `limits` order.
    pub rendered: Vec<crate::response::Rendered>,
    /// This route's metric counters, fetched on first use.
    pub counters: std::sync::OnceLock<crate::metrics::RouteCounters>,
}

/// What a route does with an admitted request.
#[derive(Debug)]
pub enum Action {
    Forward(Arc<Upstream>),
    Respond(Respond),
}

/// A response the proxy gives itself.
#[derive(Debug)]
pub struct Respond {
    pub status: StatusCode,
    pub body: Bytes,
    pub headers: HeaderMap,
}

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

/// The first route in file order that matches the request.
pub fn find<'a>(
    routes: &'a [Route],
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Option<&'a Route> {
    routes
        .iter()
        .find(|r| r.matcher.matches(method, uri, headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(name: &str, matcher: Matcher) -> Route {
        Route {
            name: name.into(),
            matcher,
            action: Action::Respond(Respond {
                status: StatusCode::OK,
                body: Bytes::new(),
                headers: HeaderMap::new(),
            }),
            limits: vec![],
            rendered: vec![],
            body: crate::body::BodyLimits::default(),
            websocket: false,
            counters: std::sync::OnceLock::new(),
        }
    }

    fn hit<'a>(routes: &'a [Route], method: &Method, uri: &str, host: &str) -> Option<&'a str> {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, host.parse().unwrap());
        find(routes, method, &uri.parse().unwrap(), &headers).map(|r| &*r.name)
    }

    #[test]
    fn first_match_in_order() {
        let routes = vec![
            route(
                "login",
                Matcher {
                    path: PathPattern::Exact("/login".into()),
                    methods: Some(vec![Method::POST]),
                    ..Matcher::default()
                },
            ),
            route(
                "api",
                Matcher {
                    host: Some(HostPattern::parse("*.example.com").unwrap()),
                    path: PathPattern::Prefix("/v1/".into()),
                    ..Matcher::default()
                },
            ),
            route("all", Matcher::default()),
        ];
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
        let routes = vec![route(
            "tenant",
            Matcher {
                headers: vec![("x-tenant".parse().unwrap(), "acme".parse().unwrap())],
                ..Matcher::default()
            },
        )];
        let mut h = HeaderMap::new();
        assert!(find(&routes, &Method::GET, &"/".parse().unwrap(), &h).is_none());
        h.insert("x-tenant", "acme".parse().unwrap());
        assert!(find(&routes, &Method::GET, &"/".parse().unwrap(), &h).is_some());
    }
}
