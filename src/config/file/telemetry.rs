//! The `telemetry` section as written: where tollgate exports its traces.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

/// `telemetry:`: what tollgate tells the operator's observability systems.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Telemetry {
    /// OpenTelemetry traces: a span per request and per upstream attempt, over OTLP.
    pub traces: Option<Traces>,
}

/// `telemetry.traces:`: the OTLP exporter and the sampling.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Traces {
    /// The collector's URL (default: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, else `http://localhost:4318`, `:4317` for gRPC).
    pub endpoint: Option<String>,
    /// `http/protobuf` (default) or `grpc`.
    #[schemars(extend("x-choices" = ["http/protobuf", "grpc"]))]
    pub protocol: Option<String>,
    /// The share of requests with no sampled caller whose traces are exported, 0 to 1
    /// (default 1).
    pub sample_ratio: Option<f64>,
    /// Export every request tollgate refused (429, a ban, capacity), whatever the sampling.
    #[serde(default)]
    pub sample_refused: bool,
    /// Headers sent with every export (an API key of a hosted backend).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The resource's `service.name` (default: `OTEL_SERVICE_NAME`, else `tollgate`).
    pub service_name: Option<String>,
}
