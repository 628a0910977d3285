//! What the proxy would do with a request now, and why, without doing it: the screening, the
//! route, each limit's identity, bucket and ban, and the decision. The admin API's
//! `/api/v1/explain` and `tollgate explain` both answer with `explain`.
//!
//! Nothing here takes a token, counts a strike, holds a slot or mints a bucket: the state is
//! read with `limiter::peek` (in process, or one read-only script call in Redis per limit).

pub mod cli;
mod decision;
mod descriptors;
mod limit;
mod text;

use std::net::IpAddr;

use http::header::HOST;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use serde::{Deserialize, Serialize};

use self::decision::decide;
pub use self::decision::{Decision, Verdict};
pub use self::descriptors::DescriptorExplained;
pub use self::limit::{BanRule, BanState, Exempted, Identity, Kind, LimitExplained, Now, Outcome};
pub use self::text::render;
use crate::identity;
use crate::runtime::{Route, Runtime};

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
    /// A rate limit service call instead of a request: its domain (`domain=`)...
    pub domain: Option<String>,
    /// ...and its descriptors, each `KEY=VALUE,KEY=VALUE` (`descriptor=`, repeated).
    pub descriptors: Vec<String>,
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
                "domain" => &mut q.domain,
                "header" => {
                    q.headers.push(v.clone());
                    continue;
                }
                "descriptor" => {
                    q.descriptors.push(v.clone());
                    continue;
                }
                other => {
                    return Err(format!(
                        "unknown parameter `{other}` (expected method, host, path, header, ip; or domain and descriptor)"
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
            ("domain", &self.domain),
        ];
        let pairs = single
            .iter()
            .filter_map(|(k, v)| v.as_deref().map(|v| (*k, v)))
            .chain(self.headers.iter().map(|h| ("header", h.as_str())))
            .chain(self.descriptors.iter().map(|d| ("descriptor", d.as_str())));
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
    /// An operator's ban in force for the client on this route (as `GET /api/v1/bans` lists
    /// it): the request is refused before any limit is asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_ban: Option<serde_json::Value>,
    /// The route's limits in route order (empty without a route).
    pub limits: Vec<LimitExplained>,
    /// A capped upstream's slots and queue, and what they would do with the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityExplained>,
    /// A rate limit service call's descriptors, in order, with the rule each matched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub descriptors: Vec<DescriptorExplained>,
}

/// What a capped upstream would do with an admitted request now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CapacityExplained {
    pub upstream: String,
    /// `forward` (a target has a free slot), `wait` (in the queue) or `refuse` (503: the
    /// queue is full).
    pub would: String,
    pub in_flight: usize,
    /// All targets' caps together, fixed or learned now.
    pub cap: usize,
    pub queued: usize,
    pub queue_size: usize,
    /// The longest it would wait before its `503`.
    pub queue_timeout_s: f64,
    pub priority: String,
}

/// `route`'s upstream's capacity, when it is capped.
fn capacity(route: &Route) -> Option<CapacityExplained> {
    let crate::runtime::Action::Forward(upstream) = &route.action else {
        return None;
    };
    let stats = upstream.capacity()?;
    let free = stats.targets.iter().any(|(n, cap)| n < cap);
    let would = if stats.queued == 0 && free {
        "forward"
    } else if stats.queued < stats.queue_size {
        "wait"
    } else {
        "refuse"
    };
    Some(CapacityExplained {
        upstream: upstream.name.to_string(),
        would: would.to_owned(),
        in_flight: stats.in_flight(),
        cap: stats.cap(),
        queued: stats.queued,
        queue_size: stats.queue_size,
        queue_timeout_s: stats.timeout.as_secs_f64(),
        priority: route.priority.as_str().to_owned(),
    })
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

/// Explain `query` against `rt` at `now` (the proxy's clock, as its buckets count), in Redis
/// when `rt` has it. `source` says whose state it is. An error is a query that describes no
/// request.
pub(crate) async fn explain(
    rt: &Runtime,
    control: Option<&crate::control::InForce>,
    query: &Query,
    now: crate::limiter::Moment,
    source: String,
) -> Result<Explanation, String> {
    if let Some(domain) = &query.domain {
        return descriptors::explain(rt, control, (domain, &query.descriptors), now, source).await;
    }
    let (mut req, peer) = query.request()?;
    let mut out = Explanation {
        source,
        backend: if rt.redis.is_some() { "redis" } else { "local" }.to_owned(),
        request: asked(&req, peer),
        route: None,
        decision: Decision::no_route(),
        operator_ban: None,
        limits: Vec::new(),
        capacity: None,
        descriptors: Vec::new(),
    };
    let max_uri = (rt.settings.listeners.first()).map_or(8 << 10, |l| l.settings.max_uri_bytes);
    if let Err(e) = crate::screen::screen(&mut req, max_uri, true) {
        out.decision = Decision::refused(&e);
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
        &rt.settings.trusted_proxies,
        rt.settings.client_ip_header,
    );
    out.request.client_ip = Some(client_ip.to_string());
    let at = limit::At {
        redis: rt.redis.as_deref(),
        now_us: now.us(),
        peer: crate::limiter::local::Peer::of(client_ip),
    };
    let arrival = identity::Arrival::of(&req, client_ip);
    let (limits, ban) = limits(rt, control, route, &arrival, &at).await;
    out.limits = limits;
    out.decision = match &ban {
        Some(ban) => Decision::operator_ban(ban),
        None => decide(&out.limits),
    };
    out.operator_ban = ban.and_then(|b| serde_json::to_value(b).ok());
    if matches!(out.decision.outcome, Verdict::Admitted | Verdict::Exempt) {
        out.capacity = capacity(route);
    }
    if crate::response::grpc::is_call(&req) {
        out.decision.grpc_status = out.decision.status.map(|s| match s {
            429 => rt.settings.grpc_limited_status,
            s => http::StatusCode::from_u16(s).map_or(2, crate::response::grpc::code),
        });
    }
    Ok(out)
}

/// Each of `route`'s limits explained for the request, reading identities as the request path
/// does (the same `Arrival`), with the operators' override of each and their ban in force.
async fn limits(
    rt: &Runtime,
    control: Option<&crate::control::InForce>,
    route: &Route,
    arrival: &identity::Arrival<'_>,
    at: &limit::At<'_>,
) -> (Vec<LimitExplained>, Option<crate::control::BanView>) {
    let jwt = rt.settings.jwt.as_deref().map(|v| arrival.jwt(v));
    let view = arrival.view(route.fold_path, jwt.as_ref());
    let now_ms = crate::control::entry::now_ms();
    let ban = control.and_then(|c| {
        c.ban_for(&view, &route.name, now_ms)
            .map(|b| b.view(now_ms))
    });
    let mut out = Vec::with_capacity(route.limits.len());
    for l in &route.limits {
        let tuned = control.and_then(|c| {
            let o = c.override_for(&l.name, &view, now_ms)?;
            let t = c.tuning(l, &view, now_ms)?;
            Some((t, serde_json::to_value(o.view(now_ms)).ok()?))
        });
        out.push(limit::explain(l, &view, at, tuned).await);
    }
    (out, ban)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_round_trips_and_describes_one_request() {
        let q = Query {
            method: Some("POST".into()),
            host: Some("api.example.com".into()),
            path: Some("/v1/items?a=1&b=2".into()),
            headers: vec!["X-API-Key:a b&c".into(), "Cookie:sid=1; x=2".into()],
            ip: Some("2001:db8::1".into()),
            ..Query::default()
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
