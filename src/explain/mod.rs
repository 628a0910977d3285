//! What the proxy would do with a request now, and why, without doing it: the screening, the
//! route, each limit's identity, bucket and ban, and the decision. The admin API's
//! `/api/v1/explain` and `tollgate explain` both answer with `explain`.
//!
//! Nothing here takes a token, counts a strike, holds a slot or mints a bucket: the state is
//! read with `limiter::peek` (in process, or one read-only script call in Redis per limit).

pub mod cli;
mod limit;
mod text;

use std::net::IpAddr;

use http::header::HOST;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use serde::{Deserialize, Serialize};

pub use self::limit::{BanRule, BanState, Exempted, Identity, Kind, LimitExplained, Now, Outcome};
pub use self::text::render;
use crate::identity::{self, RequestView};
use crate::runtime::Runtime;

/// The request to explain, as the query (`method=`, `host=`, `path=`, `header=N:V`..., `ip=`)
/// or the command line gives it. Unset parts take their defaults: GET, `localhost`, `/`,
/// from 127.0.0.1.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pub method: Option<String>,
    pub host: Option<String>,
    /// The path, with its query string if any.
    pub path: Option<String>,
    /// `NAME:VALUE`, in order; repeated names are all sent.
    pub headers: Vec<String>,
    /// The address the request comes from (the TCP peer: behind a trusted proxy, the
    /// forwarded headers given still apply).
    pub ip: Option<String>,
}

impl Query {
    /// The query of `/api/v1/explain`'s parameters; an unknown one is an error (a typo would
    /// otherwise explain another request than the one meant).
    pub fn from_pairs(pairs: &[(String, String)]) -> Result<Self, String> {
        let mut q = Self::default();
        for (k, v) in pairs {
            let slot = match k.as_str() {
                "method" => &mut q.method,
                "host" => &mut q.host,
                "path" => &mut q.path,
                "ip" => &mut q.ip,
                "header" => {
                    q.headers.push(v.clone());
                    continue;
                }
                other => {
                    return Err(format!(
                        "unknown parameter `{other}` (expected method, host, path, header, ip)"
                    ))
                }
            };
            *slot = Some(v.clone());
        }
        Ok(q)
    }

    /// These parameters as `/api/v1/explain`'s query string, percent-encoded.
    pub fn to_query_string(&self) -> String {
        use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
        let single = [
            ("method", &self.method),
            ("host", &self.host),
            ("path", &self.path),
            ("ip", &self.ip),
        ];
        let pairs = single
            .iter()
            .filter_map(|(k, v)| v.as_deref().map(|v| (*k, v)))
            .chain(self.headers.iter().map(|h| ("header", h.as_str())));
        pairs
            .map(|(k, v)| format!("{k}={}", utf8_percent_encode(v, NON_ALPHANUMERIC)))
            .collect::<Vec<_>>()
            .join("&")
    }

    /// The bodiless HTTP/1.1 request these parameters describe, and the address it comes from.
    fn request(&self) -> Result<(Request<()>, IpAddr), String> {
        let method = self.method.as_deref().unwrap_or("GET");
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|_| format!("`{method}` is not an HTTP method"))?;
        let path = self.path.as_deref().unwrap_or("/");
        let uri: Uri = path
            .parse()
            .ok()
            .filter(|u: &Uri| u.scheme().is_none() && path.starts_with('/'))
            .ok_or_else(|| format!("`{path}` is not a path (as in `/v1/items?page=2`)"))?;
        let ip = self.ip.as_deref().unwrap_or("127.0.0.1");
        let ip: IpAddr = ip
            .parse()
            .map_err(|_| format!("`{ip}` is not an IP address"))?;
        let mut req = Request::new(());
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        for h in &self.headers {
            let (name, value) = h
                .split_once(':')
                .ok_or_else(|| format!("header `{h}` is not NAME:VALUE"))?;
            let name = HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| format!("`{name}` is not a header name"))?;
            let value = HeaderValue::from_str(value.trim())
                .map_err(|_| format!("the value of header `{name}` is not a header value"))?;
            headers.append(name, value);
        }
        // An HTTP/1.1 client always sends a Host.
        if !headers.contains_key(HOST) {
            let host = self.host.as_deref().unwrap_or("localhost");
            let value =
                HeaderValue::from_str(host).map_err(|_| format!("`{host}` is not a host"))?;
            headers.insert(HOST, value);
        } else if self.host.is_some() {
            return Err("give the host once: `host=` or `header=Host:...`".into());
        }
        Ok((req, ip))
    }
}

/// What the proxy would do with one request now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Explanation {
    /// Whose state this is: the running proxy's, or the config's alone (fresh buckets).
    pub source: String,
    /// Where the limits count: `local` or `redis`.
    pub backend: String,
    pub request: Asked,
    /// The route the request matches; `None` when none does (or screening refused it).
    pub route: Option<String>,
    pub decision: Decision,
    /// The route's limits in route order (empty without a route).
    pub limits: Vec<LimitExplained>,
}

/// The request as the proxy sees it, once screened (host canonical, path normalised).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Asked {
    pub method: String,
    pub host: String,
    pub path: String,
    /// The TCP peer assumed (`ip=`).
    pub peer: String,
    /// The client address limits see: the peer, or behind a trusted proxy the forwarded one.
    pub client_ip: Option<String>,
    /// The names of the headers given (their values are not repeated).
    pub headers: Vec<String>,
}

/// The decision the proxy would make now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Decision {
    pub outcome: Verdict,
    /// The limit that decides a `limited` outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Seconds until a `limited` request would be admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<f64>,
    /// The HTTP status the client would get when the proxy answers itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Why, in a sentence.
    pub reason: String,
}

/// A decision's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every enforced limit admits (or the route has none): forwarded or answered.
    Admitted,
    /// A limit rejects (a bucket, a ban, a concurrency cap): 429, or 503 failing closed.
    Limited,
    /// Every limit of the route exempts the client: nothing is counted.
    Exempt,
    /// No route matches: 404.
    NoRoute,
    /// Screening refuses the request before routing.
    Refused,
}

/// Explain `query` against `rt` at `now_us` (the proxy's clock, as its buckets count), in Redis
/// when `rt` has it. `source` says whose state it is. An error is a query that describes no
/// request.
pub(crate) async fn explain(
    rt: &Runtime,
    query: &Query,
    now_us: f64,
    source: String,
) -> Result<Explanation, String> {
    let (mut req, peer) = query.request()?;
    let settings = &*rt.settings;
    let mut out = Explanation {
        source,
        backend: if rt.redis.is_some() { "redis" } else { "local" }.to_owned(),
        request: asked(&req, peer),
        route: None,
        decision: Decision {
            outcome: Verdict::NoRoute,
            limit: None,
            retry_after_s: None,
            status: Some(404),
            reason: "no route matches the request".into(),
        },
        limits: Vec::new(),
    };
    let max_uri = settings
        .listeners
        .first()
        .map_or(8 << 10, |l| l.settings.max_uri_bytes);
    if let Err(e) = crate::screen::screen(&mut req, max_uri) {
        out.decision.outcome = Verdict::Refused;
        out.decision.status = Some(e.status().as_u16());
        out.decision.reason = format!("refused before routing: {e}");
        return Ok(out);
    }
    out.request = asked(&req, peer);
    let Some(route) = rt.find(&req) else {
        return Ok(out);
    };
    out.route = Some(route.name.to_string());
    let client_ip = identity::client_ip_from(
        peer,
        req.headers(),
        &settings.trusted_proxies,
        settings.client_ip_header,
    );
    out.request.client_ip = Some(client_ip.to_string());
    // As the request path does: a case-insensitive route's limits read the path lower-cased.
    let folded;
    let uri = if route.fold_path && req.uri().path().bytes().any(|b| b.is_ascii_uppercase()) {
        folded = crate::proxy::fold_path(req.uri()).map_err(|e| e.to_string())?;
        &folded
    } else {
        req.uri()
    };
    let jwt = (settings.jwt.as_deref())
        .map(|v| identity::jwt::Context::new(v, identity::bearer(req.headers())));
    let view = RequestView {
        method: req.method(),
        uri,
        headers: req.headers(),
        client_ip,
        jwt: jwt.as_ref(),
    };
    let at = limit::At {
        redis: rt.redis.as_deref(),
        now_us,
        peer: crate::limiter::local::Peer::of(client_ip),
    };
    for l in &route.limits {
        out.limits.push(limit::explain(l, &view, &at).await);
    }
    out.decision = decide(&out.limits);
    Ok(out)
}

/// The request's parts as explained.
fn asked(req: &Request<()>, peer: IpAddr) -> Asked {
    Asked {
        method: req.method().to_string(),
        host: identity::host(req.uri(), req.headers())
            .unwrap_or_default()
            .to_owned(),
        path: req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
        peer: peer.to_string(),
        client_ip: None,
        headers: req.headers().keys().map(ToString::to_string).collect(),
    }
}

/// The route's decision from its limits' outcomes, in the order the request path takes them:
/// concurrency slots first (a request they refuse is checked no further), then a ban in force
/// (refused before any bucket), then the buckets, all or nothing (a rejection by one takes
/// nothing from the others).
fn decide(limits: &[LimitExplained]) -> Decision {
    let refusing = |l: &&LimitExplained| {
        matches!(
            l.outcome,
            Outcome::Limited | Outcome::Banned | Outcome::FailedClosed
        )
    };
    let concurrency = limits
        .iter()
        .filter(|l| matches!(l.kind, Kind::Concurrency { .. }))
        .find(refusing);
    let banned = limits.iter().find(|l| l.outcome == Outcome::Banned);
    let first = concurrency
        .or(banned)
        .or_else(|| limits.iter().find(refusing));
    if let Some(l) = first {
        let (status, why) = match l.outcome {
            Outcome::Banned => (429, "the identity is banned"),
            Outcome::FailedClosed => (503, "Redis did not answer and the limit fails closed"),
            _ if matches!(l.kind, Kind::Concurrency { .. }) => (429, "every slot is taken"),
            _ => (429, "not enough tokens"),
        };
        let others = if limits.len() > 1 {
            "; nothing would be taken from the other limits"
        } else {
            ""
        };
        return Decision {
            outcome: Verdict::Limited,
            limit: Some(l.name.clone()),
            retry_after_s: Some(l.retry_after_s),
            status: Some(status),
            reason: format!("{why}{others}"),
        };
    }
    if !limits.is_empty() && limits.iter().all(|l| l.outcome == Outcome::Exempt) {
        return Decision {
            outcome: Verdict::Exempt,
            limit: None,
            retry_after_s: None,
            status: None,
            reason: "every limit of the route exempts the client: nothing is counted".into(),
        };
    }
    Decision {
        outcome: Verdict::Admitted,
        limit: None,
        retry_after_s: None,
        status: None,
        reason: if limits.is_empty() {
            "the route has no limits".into()
        } else {
            "every enforced limit admits the request".into()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(name: &str, kind: Kind, outcome: Outcome) -> LimitExplained {
        LimitExplained {
            name: name.into(),
            kind,
            cost: 1,
            shadow: false,
            on_failure: "open".into(),
            ban: None,
            key: vec!["ip".into()],
            exempt: None,
            identity: None,
            now: None,
            ban_state: None,
            error: None,
            outcome,
            retry_after_s: if outcome == Outcome::Admitted {
                0.0
            } else {
                2.0
            },
        }
    }

    fn bucket() -> Kind {
        Kind::TokenBucket {
            rate: "1/s".into(),
            per_sec: 1.0,
            burst: 5,
        }
    }

    #[test]
    fn the_decision_takes_limits_in_the_request_paths_order() {
        let slots = Kind::Concurrency {
            max: 1,
            lease_s: 30.0,
        };
        // A bucket first in the route, slots second: the slots decide (they are taken first).
        let d = decide(&[
            limit("a", bucket(), Outcome::Limited),
            limit("b", slots, Outcome::Limited),
        ]);
        assert_eq!(
            (d.outcome, d.limit.as_deref()),
            (Verdict::Limited, Some("b"))
        );
        assert!(d.reason.contains("every slot is taken"), "{}", d.reason);
        // A ban refuses before any bucket.
        let d = decide(&[
            limit("a", bucket(), Outcome::Limited),
            limit("b", bucket(), Outcome::Banned),
        ]);
        assert_eq!(d.limit.as_deref(), Some("b"));
        // Shadow and failed-open limits admit; all exempt is exempt; none is admitted.
        let d = decide(&[
            limit("a", bucket(), Outcome::ShadowLimited),
            limit("b", bucket(), Outcome::FailedOpen),
        ]);
        assert_eq!(d.outcome, Verdict::Admitted);
        let d = decide(&[limit("a", bucket(), Outcome::Exempt)]);
        assert_eq!(d.outcome, Verdict::Exempt);
        assert_eq!(decide(&[]).reason, "the route has no limits");
        let d = decide(&[limit("a", bucket(), Outcome::FailedClosed)]);
        assert_eq!((d.outcome, d.status), (Verdict::Limited, Some(503)));
    }

    #[test]
    fn a_query_round_trips_and_describes_one_request() {
        let q = Query {
            method: Some("POST".into()),
            host: Some("api.example.com".into()),
            path: Some("/v1/items?a=1&b=2".into()),
            headers: vec!["X-API-Key:a b&c".into(), "Cookie:sid=1; x=2".into()],
            ip: Some("2001:db8::1".into()),
        };
        let pairs: Vec<(String, String)> = q
            .to_query_string()
            .split('&')
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap();
                let v = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
                (k.to_owned(), v.into_owned())
            })
            .collect();
        assert_eq!(Query::from_pairs(&pairs).unwrap(), q);
        let (req, ip) = q.request().unwrap();
        assert_eq!(ip, "2001:db8::1".parse::<IpAddr>().unwrap());
        assert_eq!(req.method(), Method::POST);
        assert_eq!(req.uri().query(), Some("a=1&b=2"));
        assert_eq!(req.headers()["x-api-key"], "a b&c");
        assert_eq!(req.headers()[HOST], "api.example.com");
        let bad = |q: Query| q.request().unwrap_err();
        assert!(bad(Query {
            path: Some("v1".into()),
            ..Query::default()
        })
        .contains("not a path"));
        assert!(bad(Query {
            headers: vec!["no-colon".into()],
            ..Query::default()
        })
        .contains("NAME:VALUE"));
        assert!(bad(Query {
            ip: Some("localhost".into()),
            ..Query::default()
        })
        .contains("not an IP"));
        assert!(Query::from_pairs(&[("hots".into(), "x".into())]).is_err());
    }
}
