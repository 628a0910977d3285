//! The admin API under `/api/v1/`: the bearer-token check and the dispatch to each endpoint.
//! JSON in, JSON out; errors are problem+json.

use http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};

use super::call::{json_response, problem, read, Call};
use crate::response::Body;
use crate::state::State;

/// Serve one `/api/` request: off (404) without `admin.token_file`, 401 without its token.
pub(super) async fn handle(state: &State, req: Request<Incoming>) -> Response<Body> {
    let token = state.runtime.load().settings.admin_token.clone();
    let Some(token) = token else {
        return problem(
            StatusCode::NOT_FOUND,
            "The admin API is off",
            "set admin.token_file to a file holding its bearer token",
        );
    };
    let peer = req.extensions().get::<std::net::SocketAddr>().copied();
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    if !given.is_some_and(|g| token.accepts(g)) {
        refused(peer, req.uri().path());
        let mut res = problem(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "send the admin token as `Authorization: Bearer TOKEN`",
        );
        res.headers_mut().insert(
            WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"tollgate-admin\""),
        );
        return res;
    }
    let call = match read(req).await {
        Ok(call) => call,
        Err(res) => return res,
    };
    let res = dispatch(state, &call).await;
    logged(peer, &call, res.status());
    res
}

/// Log an API call that passed the token check. The query is not logged: explain's carries
/// API keys and cookies. What the dashboard reads every 2 s per open page (its data, the bans
/// and overrides in force) goes to `debug`; changes and other reads to `info`.
fn logged(peer: Option<std::net::SocketAddr>, call: &Call, status: StatusCode) {
    let peer = peer.map_or_else(String::new, |p| p.to_string());
    let (method, path, status) = (&call.method, &call.path, status.as_u16());
    let polled = matches!(call.path.as_str(), "/dashboard" | "/bans" | "/overrides");
    if call.method == Method::GET && polled {
        tracing::debug!(%peer, %method, %path, status, "admin API call");
    } else {
        tracing::info!(%peer, %method, %path, status, "admin API call");
    }
}

/// Log a request refused for its token: at most one line a second, with the number held back
/// (a client guessing tokens must not flood the log).
fn refused(peer: Option<std::net::SocketAddr>, path: &str) {
    static GATE: std::sync::LazyLock<crate::log_gate::LogGate> = std::sync::LazyLock::new(|| {
        crate::log_gate::LogGate::new(std::time::Duration::from_secs(1))
    });
    if let Some(held_back) = GATE.open(crate::limiter::clock::wall_us() as u64) {
        tracing::warn!(
            peer = %peer.map_or_else(String::new, |p| p.to_string()),
            path,
            similar_since_last = held_back,
            "admin API request without the right token refused"
        );
    }
}

/// The endpoint for `call`.
async fn dispatch(state: &State, call: &Call) -> Response<Body> {
    use crate::control::Kind;
    match (&call.method, call.path.as_str()) {
        (&Method::GET, "/") => json_response(StatusCode::OK, &index()),
        (&Method::GET, "/explain") => explain(state, call).await,
        (&Method::POST, "/bans") => super::entries::post_ban(state, call).await,
        (&Method::GET, "/bans") => super::entries::list_bans(state),
        (&Method::DELETE, p) if p.starts_with("/bans/") => {
            super::entries::delete(state, Kind::Ban, &p["/bans/".len()..]).await
        }
        (&Method::POST, "/overrides") => super::entries::post_override(state, call).await,
        (&Method::GET, "/overrides") => super::entries::list_overrides(state),
        (&Method::DELETE, p) if p.starts_with("/overrides/") => {
            super::entries::delete(state, Kind::Override, &p["/overrides/".len()..]).await
        }
        (&Method::GET, "/dashboard") => super::dashboard::data(state, call),
        _ => problem(
            StatusCode::NOT_FOUND,
            "No such endpoint",
            &format!(
                "{} /api/v1{} is not an endpoint: GET /api/v1/ lists them",
                call.method, call.path
            ),
        ),
    }
}

/// What `GET /api/v1/` lists.
fn index() -> Value {
    json!({ "endpoints": [
        {
            "method": "GET",
            "path": "/api/v1/explain",
            "query": "method=, host=, path=, header=NAME:VALUE (repeated), ip=",
            "does": "what the proxy would do with that request now, without counting it",
        },
        { "method": "GET", "path": "/api/v1/bans", "does": "the operators' bans in force" },
        {
            "method": "POST",
            "path": "/api/v1/bans",
            "body": "{identity, ttl, reason?, routes?}",
            "does": "ban an identity (exempt syntax) from every route or some, for ttl",
        },
        { "method": "DELETE", "path": "/api/v1/bans/ID", "does": "lift a ban" },
        { "method": "GET", "path": "/api/v1/overrides", "does": "the operators' overrides in force" },
        {
            "method": "POST",
            "path": "/api/v1/overrides",
            "body": "{limit, identity, rate and burst? | quota, ttl, reason?}",
            "does": "count an identity at other numbers on one limit, for ttl",
        },
        { "method": "DELETE", "path": "/api/v1/overrides/ID", "does": "end an override" },
        {
            "method": "GET",
            "path": "/api/v1/dashboard",
            "query": "step= (seconds per point, 1 to 60, default 5)",
            "does": "the live dashboard's data: limits' counts and rates, most limited identities, store, config, upstreams",
        },
    ] })
}

/// `GET /api/v1/explain`: the request of the query, explained against the live runtime.
async fn explain(state: &State, call: &Call) -> Response<Body> {
    let query = match crate::explain::Query::from_pairs(&call.query) {
        Ok(q) => q,
        Err(e) => return problem(StatusCode::BAD_REQUEST, "Bad explain query", &e),
    };
    let runtime = state.runtime.load_full();
    let source = format!(
        "the running proxy (config generation {})",
        *state.generation.borrow()
    );
    let now = state.clock.now();
    let control = state.control.active();
    match crate::explain::explain(&runtime, control.as_deref(), &query, now, source).await {
        Ok(e) => json_response(StatusCode::OK, &e),
        Err(e) => problem(StatusCode::BAD_REQUEST, "Bad explain query", &e),
    }
}
