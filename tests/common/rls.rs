//! A client of Envoy's rate limit service: tonic's generated client over hyper-util's HTTP/2
//! client, calling `ShouldRateLimit` as Envoy does.

use std::net::SocketAddr;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::rls::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate::rls::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::rls::pb::rate_limit_response::Code;
use tollgate::rls::pb::rate_limit_service_client::RateLimitServiceClient;
pub use tollgate::rls::pb::{RateLimitRequest, RateLimitResponse};

type Channel = Client<HttpConnector, tonic::body::Body>;

/// A connection to the service at one address.
#[derive(Clone)]
pub struct Rls {
    client: RateLimitServiceClient<Channel>,
}

impl Rls {
    pub fn to(addr: SocketAddr) -> Self {
        let http = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let origin = format!("http://{addr}").parse().expect("a URI");
        Self {
            client: RateLimitServiceClient::with_origin(http, origin),
        }
    }

    /// `ShouldRateLimit` for `descriptors` (each a list of key, value entries) in `domain`.
    pub async fn call(
        &self,
        domain: &str,
        descriptors: &[&[(&str, &str)]],
        hits_addend: u32,
    ) -> RateLimitResponse {
        self.try_call(request(domain, descriptors, hits_addend))
            .await
            .expect("the service answers")
    }

    /// `ShouldRateLimit` as asked, its error status kept.
    pub async fn try_call(
        &self,
        req: impl tonic::IntoRequest<RateLimitRequest>,
    ) -> Result<RateLimitResponse, tonic::Status> {
        let mut client = self.client.clone();
        client
            .should_rate_limit(req)
            .await
            .map(tonic::Response::into_inner)
    }

    /// The overall codes of `n` calls of one descriptor, `OK` or `OVER_LIMIT`.
    pub async fn codes(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
        n: usize,
    ) -> Vec<&'static str> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(code(&self.call(domain, &[entries], 0).await));
        }
        out
    }
}

/// A request for `descriptors` in `domain`.
pub fn request(
    domain: &str,
    descriptors: &[&[(&str, &str)]],
    hits_addend: u32,
) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: (descriptors.iter())
            .map(|entries| RateLimitDescriptor {
                entries: (entries.iter())
                    .map(|(k, v)| Entry {
                        key: (*k).into(),
                        value: (*v).into(),
                    })
                    .collect(),
                ..RateLimitDescriptor::default()
            })
            .collect(),
        hits_addend,
    }
}

/// The overall code of an answer, by name.
pub fn code(r: &RateLimitResponse) -> &'static str {
    name(r.overall_code)
}

/// A code's name.
pub fn name(code: i32) -> &'static str {
    match Code::try_from(code) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

/// The value of the response header `name` Envoy is told to add.
pub fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    (r.response_headers_to_add.iter())
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}
