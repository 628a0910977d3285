//! The admin API's bans and overrides: `POST`, `GET` and `DELETE` of `/api/v1/bans` and
//! `/api/v1/overrides` (what they do is `control`'s).

use http::{HeaderValue, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::json;

use super::call::{json_response, problem, Call};
use crate::control::entry::{now_ms, NewBan, NewOverride};
use crate::control::{Ban, Kind, Override};
use crate::response::Body;
use crate::state::State;

/// `POST /api/v1/bans`: 201 with the ban.
pub(super) async fn post_ban(state: &State, call: &Call) -> Response<Body> {
    let req: NewBan = match body(call, "ban") {
        Ok(req) => req,
        Err(res) => return *res,
    };
    let runtime = state.runtime.load_full();
    if let Err(why) = verifiable(&req.identity, &runtime) {
        return problem(StatusCode::BAD_REQUEST, "Invalid ban", &why);
    }
    // A rate limit service's domain is banned from as `rls:DOMAIN`.
    let domains: Vec<String> = (runtime.rls.iter())
        .flat_map(|d| d.names().map(|n| format!("rls:{n}")))
        .collect();
    let routes: Vec<&str> = (runtime.routes.iter().map(|r| &*r.name))
        .chain(domains.iter().map(String::as_str))
        .collect();
    let now = now_ms();
    let ban = match Ban::new(req, now, &routes) {
        Ok(ban) => ban,
        Err(why) => return problem(StatusCode::BAD_REQUEST, "Invalid ban", &why),
    };
    let (id, view) = (ban.id.clone(), ban.view(now));
    match state.control.add_ban(ban, runtime.redis.as_ref()).await {
        Ok(()) => created("bans", &id, &json!(view)),
        Err(why) => not_stored("ban", &why),
    }
}

/// `POST /api/v1/overrides`: 201 with the override.
pub(super) async fn post_override(state: &State, call: &Call) -> Response<Body> {
    let req: NewOverride = match body(call, "override") {
        Ok(req) => req,
        Err(res) => return *res,
    };
    let runtime = state.runtime.load_full();
    if let Err(why) = verifiable(&req.identity, &runtime) {
        return problem(StatusCode::BAD_REQUEST, "Invalid override", &why);
    }
    let limits: Vec<&crate::limiter::Limit> = runtime.limits().map(|l| &**l).collect();
    let now = now_ms();
    let o = match Override::new(req, now, &limits) {
        Ok(o) => o,
        Err(why) => return problem(StatusCode::BAD_REQUEST, "Invalid override", &why),
    };
    let (id, view) = (o.id.clone(), o.view(now));
    match state.control.add_override(o, runtime.redis.as_ref()).await {
        Ok(()) => created("overrides", &id, &json!(view)),
        Err(why) => not_stored("override", &why),
    }
}

/// A `jwt:` identity needs `identity.jwt` in the live config, as an exemption does in the
/// file: without it no request has verified claims, and the entry would never match.
fn verifiable(identity: &str, runtime: &crate::runtime::Runtime) -> Result<(), String> {
    if identity.trim().starts_with("jwt:") && runtime.settings.jwt.is_none() {
        return Err(format!(
            "`{}` needs `identity.jwt`: the keys its tokens are verified with",
            identity.trim()
        ));
    }
    Ok(())
}

/// `GET /api/v1/bans`.
pub(super) fn list_bans(state: &State) -> Response<Body> {
    json_response(StatusCode::OK, &json!({ "bans": state.control.bans() }))
}

/// `GET /api/v1/overrides`.
pub(super) fn list_overrides(state: &State) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({ "overrides": state.control.overrides() }),
    )
}

/// `DELETE /api/v1/bans/ID` and `/api/v1/overrides/ID`: 204, or 404 for an unknown ID.
pub(super) async fn delete(state: &State, kind: Kind, id: &str) -> Response<Body> {
    let redis = state.runtime.load().redis.clone();
    let what = match kind {
        Kind::Ban => "ban",
        Kind::Override => "override",
    };
    match state.control.remove(kind, id, redis.as_ref()).await {
        Ok(true) => {
            let mut res = crate::response::fixed(StatusCode::NO_CONTENT, "text/plain", "");
            res.headers_mut().remove(http::header::CONTENT_TYPE);
            res
        }
        Ok(false) => problem(
            StatusCode::NOT_FOUND,
            &format!("No such {what}"),
            &format!("no {what} in force has the ID `{id}`"),
        ),
        Err(why) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "Redis is unavailable",
            &format!("the {what} is not deleted: {why}"),
        ),
    }
}

/// The body as a `T`, or the 400 that says why it is not one.
fn body<T: DeserializeOwned>(call: &Call, what: &str) -> Result<T, Box<Response<Body>>> {
    serde_json::from_slice(&call.body).map_err(|e| {
        let title = match e.classify() {
            serde_json::error::Category::Data => format!("The body is not a valid {what}"),
            _ => "The body is not valid JSON".to_owned(),
        };
        Box::new(problem(StatusCode::BAD_REQUEST, &title, &e.to_string()))
    })
}

fn created(list: &str, id: &str, view: &serde_json::Value) -> Response<Body> {
    let mut res = json_response(StatusCode::CREATED, view);
    if let Ok(at) = HeaderValue::try_from(format!("/api/v1/{list}/{id}")) {
        res.headers_mut().insert(http::header::LOCATION, at);
    }
    res
}

fn not_stored(what: &str, why: &str) -> Response<Body> {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Redis is unavailable",
        &format!("the {what} is not stored (every replica reads it from Redis): {why}"),
    )
}
