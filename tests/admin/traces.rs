//! OpenTelemetry traces against a real OTLP receiver (`tests/fixtures/otlp/receiver.py`, on the
//! official opentelemetry-proto messages), over OTLP/HTTP and OTLP/gRPC: the SERVER span of a
//! request continuing its caller's trace, a CLIENT span per upstream attempt whose ID the
//! upstream receives as its parent, the conventions' attributes and tollgate's own, sampling
//! (parent-based, by ratio, refusals kept), and a collector that fails or is slow.

use crate::common;

use std::time::Duration;

use common::otlp::Receiver;
use common::{
    config, refused_addr, sample, upstream_app, BinaryProxy, Http, MockUpstream, TestProxy,
};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(10);
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";

/// A route `/api/` to `app` with a limit of 2 a minute per client address, traced as `traces`.
fn traced(app: std::net::SocketAddr, traces: &str) -> String {
    config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\ntelemetry:\n  traces: {traces}\n{}routes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    upstream: app\n    limits:\n      - {{ name: per-client, rate: 2/m, burst: 2, key: [ip] }}\n",
        upstream_app(app, "5s")
    ))
}

fn traceparent(trace: &str, flags: &str) -> String {
    format!("00-{trace}-{CALLER}-{flags}")
}

fn kind(spans: &[Value], k: i64) -> Vec<&Value> {
    spans.iter().filter(|s| s["kind"] == k).collect()
}

const SERVER: i64 = 2;
const CLIENT: i64 = 3;

async fn a_request_is_a_server_span_and_its_attempt_a_client_span(protocol: &str) {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let endpoint = if protocol == "grpc" {
        receiver.grpc_url()
    } else {
        receiver.http_url()
    };
    let yaml = traced(
        app.addr(),
        &format!("{{ endpoint: \"{endpoint}\", protocol: {protocol}, service_name: edge-eu }}"),
    );
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    let parent = traceparent(TRACE, "01");
    let caller = [
        ("traceparent", parent.as_str()),
        ("tracestate", "vendor=abc"),
        ("user-agent", "trace-test/1"),
    ];
    let ok = http.get_with(&proxy.url("/api/x"), &caller).await;
    assert_eq!(ok.code(), 200);
    let spans = receiver.trace(TRACE, 2, WAIT);
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let server = kind(&spans, SERVER)[0];
    let client = kind(&spans, CLIENT)[0];
    assert_eq!(
        server["transport"],
        if protocol == "grpc" { "grpc" } else { "http" }
    );
    assert_eq!(
        server["parent_span_id"], CALLER,
        "the caller's span is the parent"
    );
    assert_eq!(server["trace_state"], "vendor=abc");
    assert_eq!(server["name"], "GET /api/*");
    let a = &server["attributes"];
    assert_eq!(a["http.request.method"], "GET");
    assert_eq!(a["url.path"], "/api/x");
    assert_eq!(a["url.scheme"], "http");
    assert_eq!(a["http.route"], "/api/*");
    assert_eq!(a["http.response.status_code"], 200);
    assert_eq!(a["server.address"], "127.0.0.1");
    assert_eq!(a["client.address"], "127.0.0.1");
    assert_eq!(a["network.protocol.version"], "1.1");
    assert_eq!(a["user_agent.original"], "trace-test/1");
    assert_eq!(a["tollgate.route"], "api");
    assert_eq!(a["tollgate.limit.name"], "per-client");
    assert_eq!(a["tollgate.limit.outcome"], "admitted");
    assert!(
        a["tollgate.identity"]
            .as_str()
            .is_some_and(|d| d.len() == 16),
        "{a}"
    );
    assert_eq!(server["events"][0]["name"], "tollgate.limit");
    assert_eq!(
        server["events"][0]["attributes"]["tollgate.limit.remaining"],
        1
    );
    assert_eq!(server["status"]["code"], 0, "unset");
    let r = &server["resource"];
    assert_eq!(r["service.name"], "edge-eu");
    assert_eq!(r["service.version"], env!("CARGO_PKG_VERSION"));
    assert!(r["service.instance.id"]
        .as_str()
        .is_some_and(|i| !i.is_empty()));
    assert_eq!(server["scope"], "tollgate");
    // The attempt: a child of the server span, its ID the upstream's parent.
    assert_eq!(client["parent_span_id"], server["span_id"]);
    assert_eq!(client["name"], "GET");
    let c = &client["attributes"];
    assert_eq!(c["server.address"], "127.0.0.1");
    assert_eq!(c["server.port"], i64::from(app.addr().port()));
    assert_eq!(c["http.response.status_code"], 200);
    let seen = app.last();
    let told = format!("00-{TRACE}-{}-01", client["span_id"].as_str().unwrap());
    assert_eq!(seen.header("traceparent"), told);
    assert_eq!(seen.header("tracestate"), "vendor=abc");
    // Over the limit: a 429 span, not an error.
    http.get_with(&proxy.url("/api/x"), &caller).await;
    let refused = http.get_with(&proxy.url("/api/x"), &caller).await;
    assert_eq!(refused.code(), 429);
    let spans = receiver.trace(TRACE, 5, WAIT);
    let limited = (kind(&spans, SERVER).into_iter())
        .find(|s| s["attributes"]["http.response.status_code"] == 429)
        .expect("the 429's span");
    assert_eq!(limited["attributes"]["tollgate.limit.outcome"], "limited");
    assert_eq!(limited["status"]["code"], 0, "a 429 is not an error span");
    assert_eq!(
        kind(&spans, CLIENT).len(),
        2,
        "nothing went upstream for the 429"
    );
    let scrape = proxy.scrape().await;
    let exported: u64 = sample(&scrape, "tollgate_trace_spans_total{result=\"exported\"}");
    assert!(exported >= 5, "{scrape}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_otlp_http() {
    a_request_is_a_server_span_and_its_attempt_a_client_span("http/protobuf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_over_otlp_grpc() {
    a_request_is_a_server_span_and_its_attempt_a_client_span("grpc").await;
}

/// Parent-based sampling: a caller's decision stands; a root request is sampled by
/// `sample_ratio` (0 here); `sample_refused` exports every refusal all the same. An
/// unsampled request still tells its upstream a `traceparent`, not sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_caller_and_keeps_refusals() {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let traces = format!(
        "{{ endpoint: \"{}\", sample_ratio: 0, sample_refused: true }}",
        receiver.http_url()
    );
    let proxy = TestProxy::start(&traced(app.addr(), &traces));
    let http = Http::new();
    let unsampled = "11111111111111111111111111111111";
    let sampled = "22222222222222222222222222222222";
    let no = traceparent(unsampled, "00");
    assert_eq!(
        http.get_with(&proxy.url("/api/a"), &[("traceparent", no.as_str())])
            .await
            .code(),
        200
    );
    let told = app.last();
    assert!(
        told.header("traceparent")
            .starts_with(&format!("00-{unsampled}-"))
            && told.header("traceparent").ends_with("-00"),
        "{}",
        told.header("traceparent")
    );
    // A root request at ratio 0: not exported; its upstream still gets a trace.
    assert_eq!(http.get(&proxy.url("/api/b")).await.code(), 200);
    assert!(app.last().header("traceparent").ends_with("-00"));
    let yes = traceparent(sampled, "01");
    let third = http
        .get_with(&proxy.url("/api/c"), &[("traceparent", yes.as_str())])
        .await;
    assert_eq!(third.code(), 429);
    // A refused request of a trace its caller did not sample: exported (sample_refused).
    let refused = http
        .get_with(&proxy.url("/api/d"), &[("traceparent", no.as_str())])
        .await;
    assert_eq!(refused.code(), 429);
    let kept = receiver.trace(unsampled, 1, WAIT);
    assert_eq!(kept.len(), 1, "{kept:#?}");
    assert_eq!(kept[0]["attributes"]["http.response.status_code"], 429);
    assert_eq!(receiver.trace(sampled, 1, WAIT).len(), 1);
    // Only those two: the admitted unsampled ones never came.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(receiver.spans().len(), 2, "{:#?}", receiver.spans());
}

/// A retry is a span of its own: the first attempt's connection refused, the second answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attempt_is_a_span_and_a_retry_is_counted() {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let dead = refused_addr();
    let yaml = config(&format!(
        "telemetry:\n  traces: {{ endpoint: \"{}\" }}\nupstreams:\n  app:\n    targets: [{dead}, {}]\n    retries: 1\n    connect_timeout: 1s\n    timeout: 5s\nroutes:\n  - name: api\n    match: {{ path_prefix: / }}\n    upstream: app\n",
        receiver.http_url(),
        app.addr()
    ));
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    let mut retried = None;
    for i in 0..2 {
        let trace = format!("{:032x}", 0xabc0 + i);
        let parent = traceparent(&trace, "01");
        assert_eq!(
            http.get_with(&proxy.url("/x"), &[("traceparent", parent.as_str())])
                .await
                .code(),
            200
        );
        let spans = receiver.trace(&trace, 2, WAIT);
        if kind(&spans, CLIENT).len() == 2 {
            retried = Some(receiver.trace(&trace, 3, WAIT));
        }
    }
    let spans = retried.expect("one request met the dead target first");
    let mut attempts = kind(&spans, CLIENT);
    attempts.sort_by_key(|s| s["start"].as_u64());
    assert_eq!(attempts[0]["attributes"]["error.type"], "connect");
    assert_eq!(attempts[0]["status"]["code"], 2, "an error");
    assert_eq!(attempts[1]["attributes"]["http.request.resend_count"], 1);
    assert_eq!(attempts[1]["attributes"]["http.response.status_code"], 200);
    let server = kind(&spans, SERVER)[0];
    assert!(attempts
        .iter()
        .all(|a| a["parent_span_id"] == server["span_id"]));
    assert_eq!(server["status"]["code"], 0);
}

/// A collector that refuses every export, or takes 30 s to answer: requests are not slowed,
/// spans are counted as failed or dropped, and the failure is logged at most every 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_or_slow_collector_never_slows_requests() {
    let app = MockUpstream::start();
    let http = Http::new();
    for mode in ["fail", "slow", "down"] {
        let receiver = Receiver::start(if mode == "down" { "ok" } else { mode });
        let endpoint = if mode == "down" {
            format!("http://{}", refused_addr())
        } else {
            receiver.grpc_url()
        };
        let traces = format!("{{ endpoint: \"{endpoint}\" }}");
        let yaml = traced(app.addr(), &traces.replace('}', ", protocol: grpc }"))
            .replace("rate: 2/m, burst: 2", "rate: 100000/s, burst: 100000");
        let proxy = BinaryProxy::start_with_env(
            &yaml,
            &[
                ("OTEL_BSP_MAX_QUEUE_SIZE", "16"),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ],
        );
        let started = std::time::Instant::now();
        for _ in 0..200 {
            assert_eq!(http.get(&proxy.url("/api/x")).await.code(), 200);
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(10),
            "{mode}: 200 requests took {took:?}"
        );
        let metrics = format!("http://{}/metrics", proxy.admin_addr());
        let deadline = std::time::Instant::now() + WAIT;
        let (failed, dropped) = loop {
            let scrape = http.get(&metrics).await.text().to_owned();
            let n = |r: &str| {
                common::find_sample::<u64>(
                    &scrape,
                    &format!("tollgate_trace_spans_total{{result=\"{r}\"}}"),
                )
                .unwrap_or(0)
            };
            let (failed, dropped) = (n("failed"), n("dropped"));
            if (mode == "fail" && failed > 0)
                || (mode == "slow" && dropped > 0)
                || std::time::Instant::now() > deadline
            {
                break (failed, dropped);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if mode == "slow" {
            assert!(dropped > 0, "a full queue drops and counts");
        } else {
            assert!(failed > 0, "{mode}: failed spans are counted");
            let warned = proxy
                .logs()
                .iter()
                .filter(|l| l.contains("the trace collector did not take"))
                .count();
            assert_eq!(warned, 1, "{mode}: one WARN in 10 s: {:#?}", proxy.logs());
        }
    }
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` and `OTEL_SERVICE_NAME` stand
/// in for what the file leaves out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_names_the_collector() {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let yaml = traced(app.addr(), "{}");
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_url()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc".to_owned()),
        ("OTEL_SERVICE_NAME", "from-env".to_owned()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let proxy = BinaryProxy::start_with_env(&yaml, &env);
    let http = Http::new();
    let parent = traceparent(TRACE, "01");
    assert_eq!(
        http.get_with(&proxy.url("/api/x"), &[("traceparent", parent.as_str())])
            .await
            .code(),
        200
    );
    let spans = receiver.trace(TRACE, 2, WAIT);
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert_eq!(spans[0]["transport"], "grpc");
    assert_eq!(spans[0]["resource"]["service.name"], "from-env");
}

/// A graceful shutdown sends the spans still queued before the process ends (a batch would
/// have waited a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_sends_the_queued_spans() {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let yaml = traced(
        app.addr(),
        &format!("{{ endpoint: \"{}\" }}", receiver.http_url()),
    )
    .replace("rate: 2/m, burst: 2", "rate: 100/s, burst: 100");
    let mut proxy = BinaryProxy::start_with_env(&yaml, &[("OTEL_BSP_SCHEDULE_DELAY", "60000")]);
    let http = Http::new();
    for _ in 0..20 {
        assert_eq!(http.get(&proxy.url("/api/x")).await.code(), 200);
    }
    proxy.terminate();
    assert!(proxy
        .wait_exit(Duration::from_secs(15))
        .is_some_and(|s| s.success()));
    let spans = receiver.wait(Duration::from_secs(5), |spans| spans.len() >= 40);
    assert_eq!(
        spans.len(),
        40,
        "20 requests, a SERVER and a CLIENT span each"
    );
}

/// Over Redis, to a capped upstream, with a candidate config beside: the span tells the Redis
/// call's time, the wait for the upstream's slot, and the candidate's verdict (a candidate
/// twice as strict refuses the second request the live limit admits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_span_tells_redis_the_queue_and_the_candidate() {
    let redis = common::redis::RedisServer::start();
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let candidate = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile_in(std::env::temp_dir())
        .unwrap()
        .into_temp_path();
    std::fs::write(
        &candidate,
        "upstreams:\n  app:\n    targets: [127.0.0.1:9]\nroutes:\n  - name: api\n    match: { path_prefix: /api/ }\n    upstream: app\n    limits:\n      - { name: strict, rate: 1/m, burst: 1, key: [ip] }\n",
    )
    .unwrap();
    let yaml = config(&format!(
        "candidate: {}\nlimiter:\n  backend: redis\n  redis: {{ url: \"{}\", timeout: 2s }}\ntelemetry:\n  traces: {{ endpoint: \"{}\" }}\nupstreams:\n  app:\n    targets: [{}]\n    max_in_flight: 1\n    queue: {{ size: 10, timeout: 5s }}\nroutes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    upstream: app\n    limits:\n      - {{ name: per-client, rate: 10/m, burst: 10, key: [ip] }}\n",
        candidate.file_name().unwrap().to_string_lossy(),
        redis.url(),
        receiver.http_url(),
        app.addr()
    ));
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    for (i, verdict) in [(1, "admitted"), (2, "limited")] {
        let trace = format!("{i:032x}");
        let parent = traceparent(&trace, "01");
        let r = http
            .get_with(&proxy.url("/api/x"), &[("traceparent", parent.as_str())])
            .await;
        assert_eq!(r.code(), 200);
        let spans = receiver.trace(&trace, 2, WAIT);
        let server = kind(&spans, SERVER)[0];
        let a = &server["attributes"];
        assert_eq!(a["tollgate.candidate.verdict"], verdict, "{a}");
        assert!(
            a["tollgate.redis.duration_ms"]
                .as_f64()
                .is_some_and(|ms| ms > 0.0),
            "{a}"
        );
        assert!(a["tollgate.queue.wait_ms"].as_f64().is_some(), "{a}");
        assert_eq!(a["tollgate.capacity.outcome"], "admitted");
        assert_eq!(
            server["events"][0]["attributes"]["tollgate.limit.remaining"],
            10 - i
        );
    }
}

/// A reload that turns the ratio up starts exporting root requests; tollgate's own 502 is an
/// error span naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_sampling_and_a_502_is_an_error() {
    let receiver = Receiver::start("ok");
    let app = MockUpstream::start();
    let dead = format!(
        "  dead:\n    targets: [{}]\n    connect_timeout: 1s\n",
        refused_addr()
    );
    let yaml = |ratio: &str| {
        let traces = format!(
            "{{ endpoint: \"{}\", sample_ratio: {ratio} }}",
            receiver.http_url()
        );
        traced(app.addr(), &traces)
            .replace("rate: 2/m, burst: 2", "rate: 100/s, burst: 100")
            .replace("upstreams:\n", &format!("upstreams:\n{dead}"))
            + "  - name: dead\n    match: { path_prefix: /dead/ }\n    upstream: dead\n"
    };
    let proxy = TestProxy::start(&yaml("0"));
    let http = Http::new();
    assert_eq!(http.get(&proxy.url("/api/x")).await.code(), 200);
    std::fs::write(proxy.config_path(), yaml("1")).unwrap();
    proxy.reload();
    assert!(proxy.wait_for_generation(2, WAIT).await);
    assert_eq!(http.get(&proxy.url("/dead/x")).await.code(), 502);
    let spans = receiver.wait(WAIT, |spans| !kind(spans, SERVER).is_empty());
    let servers = kind(&spans, SERVER);
    assert_eq!(
        servers.len(),
        1,
        "only the request after the reload: {spans:#?}"
    );
    let s = servers[0];
    assert_eq!(s["attributes"]["http.response.status_code"], 502);
    assert_eq!(s["attributes"]["error.type"], "upstream_unreachable");
    assert_eq!(s["status"]["code"], 2, "an error span");
}
