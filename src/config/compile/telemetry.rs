//! `telemetry.traces`: the collector's URL, the protocol (the `OTEL_EXPORTER_OTLP_*PROTOCOL`
//! variables when the file names none), the sampling and the export headers.

use super::Problems;
use crate::config::file;
use crate::config::settings::{OtlpProtocol, TracesSettings};

/// The section's settings (`None`: no tracing), each problem at its key.
pub(super) fn traces(raw: Option<&file::Telemetry>, p: &mut Problems) -> Option<TracesSettings> {
    let raw = raw?.traces.as_ref()?;
    let endpoint =
        (raw.endpoint.as_deref()).and_then(|e| p.take("telemetry.traces.endpoint", endpoint(e)));
    let protocol = match &raw.protocol {
        Some(name) => p.take("telemetry.traces.protocol", protocol(name)),
        None => from_env(p),
    };
    let ratio = raw.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&ratio) {
        p.add(
            "telemetry.traces.sample_ratio",
            format!("{ratio} is not a share of requests: give a number from 0 to 1"),
        );
    }
    for (name, value) in &raw.headers {
        let at = format!("telemetry.traces.headers.{name}");
        if http::HeaderName::try_from(name.as_str()).is_err() {
            p.add(at, "is not a valid header name");
        } else if http::HeaderValue::try_from(value.as_str()).is_err() {
            p.add(at, "is not a valid header value");
        }
    }
    if raw
        .service_name
        .as_deref()
        .is_some_and(|n| n.trim().is_empty())
    {
        p.add("telemetry.traces.service_name", "must not be empty");
    }
    Some(TracesSettings {
        endpoint,
        protocol: protocol?,
        sample_ratio: ratio,
        sample_refused: raw.sample_refused,
        headers: raw.headers.clone().into_iter().collect(),
        service_name: raw.service_name.clone(),
    })
}

/// An `http://` or `https://` URL with a host.
fn endpoint(text: &str) -> Result<String, String> {
    let uri: http::Uri = text
        .parse()
        .map_err(|_| format!("`{text}` is not a URL: write it as http://collector:4318"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(_)) => Ok(text.to_owned()),
        _ => Err(format!(
            "`{text}` is not an http:// or https:// URL with a host: write it as http://collector:4318"
        )),
    }
}

fn protocol(name: &str) -> Result<OtlpProtocol, String> {
    match name {
        "http/protobuf" => Ok(OtlpProtocol::HttpProtobuf),
        "grpc" => Ok(OtlpProtocol::Grpc),
        "http/json" => Err("`http/json` is not supported: use http/protobuf or grpc".into()),
        other => Err(format!(
            "unknown protocol `{other}`: use http/protobuf or grpc"
        )),
    }
}

/// The protocol the environment names (the traces' variable first), else `http/protobuf`.
fn from_env(p: &mut Problems) -> Option<OtlpProtocol> {
    for var in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(name) = std::env::var(var).ok().filter(|v| !v.is_empty()) {
            return p.take(
                format!("telemetry.traces.protocol ({var})"),
                protocol(&name),
            );
        }
    }
    Some(OtlpProtocol::HttpProtobuf)
}
