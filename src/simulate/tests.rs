use super::*;

const YAML: &str = "listeners:\n  - address: 127.0.0.1:0\nroutes:\n  - name: api\n    match: { path_prefix: /api/ }\n    respond: { status: 200 }\n    limits:\n      - { name: per-ip, rate: 1/min, burst: 1, key: [ip] }\n";

/// An access line of a request from 192.0.2.1 that arrived at `arrival_s` and took `took_ms`.
fn line(arrival_s: f64, took_ms: f64) -> String {
    let end_us = 1_796_000_000_000_000 + (arrival_s * 1e6) as i64 + (took_ms * 1e3) as i64;
    let end = jiff::Timestamp::from_microsecond(end_us).unwrap();
    format!(
        "{{\"timestamp\":\"{end}\",\"target\":\"tollgate::access\",\"http.request.method\":\"GET\",\"server.address\":\"api.example\",\"url.path\":\"/api/x\",\"client.address\":\"192.0.2.1\",\"duration_ms\":{took_ms:.3}}}\n"
    )
}

fn replay(lines: &[String]) -> (Totals, RouteStats) {
    let settings = crate::config::parse(YAML).unwrap();
    let mut replay = Replay::new(&settings);
    replay.read(lines.concat().as_bytes()).unwrap();
    let stats = replay.stats.remove(0);
    (replay.totals, stats)
}

#[test]
fn lines_are_replayed_in_arrival_order_not_in_the_order_they_were_written() {
    // Arrivals at 0 s (a request of 100 s), 30 s and 61 s, written as they ended: 30, 61, 0.
    // In arrival order: 0 admitted, 30 rejected (a token a minute), 61 admitted. In file
    // order the 30 s request would take the token and reject the other two.
    let (totals, api) = replay(&[line(30.0, 1.0), line(61.0, 1.0), line(0.0, 100_000.0)]);
    assert_eq!((api.admitted, api.rejected), (2, 1));
    assert_eq!((totals.replayed, totals.late), (3, 0));
    let top = api.limits[0].top();
    assert_eq!(top, vec![("ip=192.0.2.1", 1)]);
}

#[test]
fn a_request_older_than_the_reorder_window_is_replayed_late_and_counted() {
    let long = REORDER_US as f64 / 1000.0 + 60_000.0;
    let (totals, api) = replay(&[line(30.0, 1.0), line(10_000.0, 1.0), line(0.0, long)]);
    assert_eq!(totals.late, 1);
    assert_eq!(api.requests, 3);
}

/// A `count_when` limit replays by the logged statuses: successes pass whatever their number,
/// failures are counted, and once spent every request is refused, successes included.
#[test]
fn a_count_when_limit_replays_by_the_logged_statuses() {
    let yaml = YAML.replace(
        "{ name: per-ip, rate: 1/min, burst: 1, key: [ip] }",
        "{ name: failed, window: 2/1h, key: [ip], count_when: { status: [401] } }",
    );
    let settings = crate::config::parse(&yaml).unwrap();
    let mut replay = Replay::new(&settings);
    let with = |at: f64, status: u16| {
        line(at, 1.0).replace(
            "\"duration_ms\"",
            &format!("\"http.response.status_code\":{status},\"duration_ms\""),
        )
    };
    let mut lines: Vec<String> = (0..5).map(|i| with(f64::from(i), 200)).collect();
    lines.extend((5..8).map(|i| with(f64::from(i), 401)));
    lines.push(with(9.0, 200));
    replay.read(lines.concat().as_bytes()).unwrap();
    let api = replay.stats.remove(0);
    // 5 successes and 2 failures admitted; the third failure and the success after refused.
    assert_eq!((api.admitted, api.rejected), (7, 2));
}
