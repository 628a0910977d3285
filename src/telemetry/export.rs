//! The exporter's side: a bounded queue the requests hand finished spans to without ever
//! waiting (a full queue drops the span and counts it), and a thread of its own that sends
//! them in batches with the SDK's OTLP exporter, over HTTP/protobuf (tollgate's own hyper
//! client, rustls for `https://`) or gRPC (tonic's channel).
//!
//! Not the SDK's `BatchSpanProcessor`: spans are made whole at a request's end here, not
//! through the SDK's span API, and its count of dropped spans is private.

use std::sync::LazyLock;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry_otlp::WithTonicConfig as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{SpanData, SpanExporter as _};
use opentelemetry_sdk::Resource;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc;

use super::{OtlpProtocol, TracesSettings};
use crate::log_gate::LogGate;

/// Spans by what became of them: `exported`, `dropped` (the queue was full), `failed` (the
/// collector refused them, or did not answer).
pub type SpanCounts = Family<Vec<(&'static str, &'static str)>, Counter>;

static SPANS: LazyLock<SpanCounts> = LazyLock::new(SpanCounts::default);

/// `tollgate_trace_spans_total{result}`.
pub fn spans() -> SpanCounts {
    SPANS.clone()
}

fn count(result: &'static str, n: usize) {
    (SPANS.get_or_create(&vec![("result", result)])).inc_by(n as u64);
}

/// The requests' end of the queue.
#[derive(Debug)]
pub struct Queue {
    spans: mpsc::Sender<SpanData>,
    flushes: mpsc::UnboundedSender<Flush>,
}

impl Queue {
    /// Have every span queued so far sent, waiting at most `timeout` (a shutdown's last act).
    pub fn flush(&self, timeout: Duration) {
        let (ack, acked) = std::sync::mpsc::sync_channel(1);
        if self.flushes.send(ack).is_ok() {
            let _ = acked.recv_timeout(timeout);
        }
    }

    /// Queue `span`, or drop and count it when the queue is full.
    pub fn push(&self, span: SpanData) {
        if self.spans.try_send(span).is_err() {
            count("dropped", 1);
        }
    }
}

/// How the exporter batches (`OTEL_BSP_*`, read as the OpenTelemetry SDKs do, except that a
/// batch goes after 1 s instead of 5).
struct Batching {
    delay: Duration,
    max_queue: usize,
    max_batch: usize,
}

impl Batching {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let max_queue = var("OTEL_BSP_MAX_QUEUE_SIZE").map_or(2048, |n| n.max(1) as usize);
        Self {
            delay: Duration::from_millis(var("OTEL_BSP_SCHEDULE_DELAY").unwrap_or(1000)),
            max_queue,
            max_batch: (var("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").map_or(512, |n| n.max(1) as usize))
                .min(max_queue),
        }
    }
}

/// Start the exporter of `settings` on a thread of its own; its queue, or why the exporter
/// cannot be built.
pub fn start(settings: &TracesSettings) -> Result<Queue, String> {
    let batching = Batching::from_env();
    let (spans, queue) = mpsc::channel(batching.max_queue);
    let (flushes, asked) = mpsc::unbounded_channel();
    let (built, ready) = std::sync::mpsc::sync_channel(1);
    let settings = settings.clone();
    std::thread::Builder::new()
        .name("tollgate-otlp".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let runtime = match runtime {
                Ok(r) => r,
                Err(e) => return drop(built.send(Err(e.to_string()))),
            };
            runtime.block_on(async move {
                match exporter(&settings) {
                    Ok(exporter) => {
                        let _ = built.send(Ok(()));
                        run(exporter, (queue, asked), &batching).await;
                    }
                    Err(e) => drop(built.send(Err(e))),
                }
            });
        })
        .map_err(|e| format!("cannot start the trace exporter's thread: {e}"))?;
    ready
        .recv()
        .map_err(|_| "the trace exporter's thread stopped".to_owned())??;
    Ok(Queue { spans, flushes })
}

/// What the exporter's thread is told besides spans: send what it holds now, then say so.
type Flush = std::sync::mpsc::SyncSender<()>;

/// Send batches until the queue closes (then what is left), and at once when told to flush.
async fn run(
    exporter: opentelemetry_otlp::SpanExporter,
    (mut queue, mut flushes): (mpsc::Receiver<SpanData>, mpsc::UnboundedReceiver<Flush>),
    batching: &Batching,
) {
    let sender = Sender {
        exporter,
        gate: LogGate::new(Duration::from_secs(10)),
        started: tokio::time::Instant::now(),
    };
    let mut open = true;
    while open {
        let mut batch = Vec::new();
        let mut flush = None;
        tokio::select! {
            span = queue.recv() => match span {
                Some(span) => batch.push(span),
                None => break,
            },
            Some(ack) = flushes.recv() => flush = Some(ack),
        }
        let until = tokio::time::Instant::now() + batching.delay;
        while flush.is_none() && batch.len() < batching.max_batch {
            tokio::select! {
                span = queue.recv() => match span {
                    Some(span) => batch.push(span),
                    None => {
                        open = false;
                        break;
                    }
                },
                Some(ack) = flushes.recv() => flush = Some(ack),
                () = tokio::time::sleep_until(until) => break,
            }
        }
        if flush.is_some() {
            while let Ok(span) = queue.try_recv() {
                batch.push(span);
            }
        }
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(batching.max_batch));
            sender.send(std::mem::replace(&mut batch, rest)).await;
        }
        if let Some(ack) = flush {
            let _ = ack.send(());
        }
    }
    let _ = sender.exporter.shutdown();
}

/// The exporter, and the gate its failures are logged through.
struct Sender {
    exporter: opentelemetry_otlp::SpanExporter,
    gate: LogGate,
    started: tokio::time::Instant,
}

impl Sender {
    /// Export `batch`, counted; a failure logged at most every 10 s.
    async fn send(&self, batch: Vec<SpanData>) {
        let n = batch.len();
        match self.exporter.export(batch).await {
            Ok(()) => count("exported", n),
            Err(e) => {
                count("failed", n);
                let now_us = u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX);
                if let Some(held_back) = self.gate.open(now_us) {
                    tracing::warn!(error = %e, spans = n, failures_not_logged = held_back, "the trace collector did not take a batch of spans");
                }
            }
        }
    }
}

/// The SDK's OTLP exporter for `settings`, with the resource tollgate reports as.
fn exporter(settings: &TracesSettings) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match settings.protocol {
        OtlpProtocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .with_http_client(http::Client::new()?);
            if let Some(url) = &settings.endpoint {
                b = b.with_endpoint(http_endpoint(url));
            }
            if !settings.headers.is_empty() {
                b = b.with_headers(settings.headers.iter().cloned().collect());
            }
            b.build()
        }
        OtlpProtocol::Grpc => {
            let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
            if let Some(url) = &settings.endpoint {
                b = b.with_endpoint(url.clone());
            }
            if !settings.headers.is_empty() {
                let mut map = ::http::HeaderMap::new();
                for (k, v) in &settings.headers {
                    if let (Ok(k), Ok(v)) = (
                        ::http::HeaderName::try_from(k.as_str()),
                        ::http::HeaderValue::try_from(v.as_str()),
                    ) {
                        map.insert(k, v);
                    }
                }
                b = b.with_metadata(tonic::metadata::MetadataMap::from_headers(map));
            }
            b.build()
        }
    };
    let mut exporter = built.map_err(|e| format!("cannot export traces: {e}"))?;
    exporter.set_resource(&resource(settings));
    Ok(exporter)
}

/// An OTLP/HTTP base URL (no path) with the traces' path, as `OTEL_EXPORTER_OTLP_ENDPOINT` is
/// read; a URL with a path is used as it is.
fn http_endpoint(url: &str) -> String {
    match url.parse::<::http::Uri>() {
        Ok(uri) if matches!(uri.path(), "" | "/") && uri.query().is_none() => {
            format!("{}/v1/traces", url.trim_end_matches('/'))
        }
        _ => url.to_owned(),
    }
}

/// `service.name` (the config's, else `OTEL_SERVICE_NAME`, else `tollgate`), `service.version`
/// and `service.instance.id` (one per process), with `OTEL_RESOURCE_ATTRIBUTES`.
fn resource(settings: &TracesSettings) -> Resource {
    static INSTANCE: LazyLock<String> = LazyLock::new(|| format!("{:032x}", fastrand::u128(..)));
    let name = (settings.service_name.clone())
        .or_else(|| {
            std::env::var("OTEL_SERVICE_NAME")
                .ok()
                .filter(|n| !n.is_empty())
        })
        .unwrap_or_else(|| "tollgate".to_owned());
    Resource::builder()
        .with_service_name(name)
        .with_attributes([
            KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            KeyValue::new("service.instance.id", INSTANCE.clone()),
        ])
        .build()
}

/// The HTTP client OTLP/HTTP exports go through: hyper's, with rustls and the system's roots.
mod http {
    use bytes::Bytes;
    use http_body_util::{BodyExt as _, Full};
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    use opentelemetry_http::HttpError;

    type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

    #[derive(Debug, Clone)]
    pub(super) struct Client(hyper_util::client::legacy::Client<Connector, Full<Bytes>>);

    impl Client {
        pub(super) fn new() -> Result<Self, String> {
            let tls = hyper_rustls::HttpsConnectorBuilder::new()
                .with_native_roots()
                .map_err(|e| format!("cannot read the system's CA certificates: {e}"))?
                .https_or_http()
                .enable_http1()
                .build();
            Ok(Self(
                hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(tls),
            ))
        }
    }

    #[async_trait::async_trait]
    impl opentelemetry_http::HttpClient for Client {
        async fn send_bytes(
            &self,
            request: ::http::Request<Bytes>,
        ) -> Result<::http::Response<Bytes>, HttpError> {
            let response = self.0.request(request.map(Full::new)).await?;
            let (parts, body) = response.into_parts();
            // A collector's answer is a few bytes; bounded all the same.
            let body = http_body_util::Limited::new(body, 4 << 20)
                .collect()
                .await?;
            Ok(::http::Response::from_parts(parts, body.to_bytes()))
        }
    }
}
