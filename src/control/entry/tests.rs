use super::overrides::{fresh, numbers};
use super::*;
use crate::config::settings::Period;

#[test]
fn identities_are_shown_without_their_secret() {
    let (m, shown) = Matcher::parse("header:X-API-Key=abc123").unwrap();
    assert!(shown.starts_with("header:x-api-key=blake3:"), "{shown}");
    assert!(!shown.contains("abc123"));
    assert_eq!(shown.len(), "header:x-api-key=blake3:".len() + 12);
    // Kept as a digest, read back alike.
    let back = Matcher::of_record(&m.record()).unwrap();
    assert_eq!(back, m);
    assert!(!serde_json::to_string(&m.record())
        .unwrap()
        .contains("abc123"));
    let (_, shown) = Matcher::parse("10.0.0.0/8").unwrap();
    assert_eq!(shown, "10.0.0.0/8");
    let (_, shown) = Matcher::parse("192.0.2.7").unwrap();
    assert_eq!(shown, "192.0.2.7/32");
    let (_, shown) = Matcher::parse("path=/login/").unwrap();
    assert_eq!(shown, "path=/login", "not a secret: shown as compared");
    assert!(Matcher::parse("cookie:sid=")
        .unwrap_err()
        .contains("empty value"));
    assert!(Matcher::parse("ip=1.2.3.4").is_err());
}

#[test]
fn ttls_are_bounded() {
    let s = Span::of("90s", 1_000).unwrap();
    assert_eq!((s.created_ms, s.expires_ms), (1_000, 91_000));
    assert_eq!(s.left_s(1_001), 90, "rounded up");
    assert_eq!(s.left_s(91_000), 0);
    assert!(s.expired(91_000) && !s.expired(90_999));
    assert!(Span::of("30d", 0).is_ok());
    assert!(Span::of("30d1s", 0).unwrap_err().contains("at most 30d"));
    assert!(Span::of("0s", 0).unwrap_err().contains("longer than zero"));
    assert!(Span::of("1", 0).unwrap_err().contains("needs a unit"));
}

#[test]
fn times_are_rfc3339_and_unix_seconds() {
    let t = Span {
        created_ms: 1_764_660_600_500,
        expires_ms: 1_764_664_200_500,
    }
    .times(1_764_660_600_500);
    assert_eq!(t.created, "2025-12-02T07:30:00Z");
    assert_eq!(t.created_unix, 1_764_660_600);
    assert_eq!(t.expires, "2025-12-02T08:30:00Z");
    assert_eq!(t.ttl_left_s, 3600);
}

#[test]
fn records_round_trip() {
    let req = NewBan {
        identity: "bearer=tok".into(),
        ttl: "1h".into(),
        reason: "INC-1".into(),
        routes: vec!["api".into()],
    };
    let ban = Ban::new(req, 5_000, &["api", "rest"]).unwrap();
    assert_eq!(Ban::of_record(&ban.to_record()).unwrap(), ban);
    assert!(!ban.to_record().contains("tok\""));
    let bad = NewBan {
        identity: "1.2.3.4".into(),
        ttl: "1h".into(),
        reason: "two\nlines".into(),
        routes: vec![],
    };
    assert!(Ban::new(bad, 0, &[]).unwrap_err().contains("one line"));
    for hidden in ["evil\u{202E}txt", "a\u{2028}b", "zero\u{200B}width"] {
        let bad = NewBan {
            identity: "1.2.3.4".into(),
            ttl: "1h".into(),
            reason: hidden.into(),
            routes: vec![],
        };
        assert!(
            Ban::new(bad, 0, &[]).unwrap_err().contains("U+202E"),
            "{hidden:?}"
        );
    }
}

#[test]
fn identities_are_written_as_requests_read_them() {
    let shown = |identity: &str| Matcher::parse(identity).map(|(_, shown)| shown);
    // IPv4-mapped addresses and networks are IPv4.
    assert_eq!(shown("::ffff:127.0.0.1").unwrap(), "127.0.0.1/32");
    assert_eq!(shown("::ffff:10.0.0.0/104").unwrap(), "10.0.0.0/8");
    // A host without its port, a path percent-encoded as a request sends it.
    assert_eq!(
        shown("host=API.example.com:80").unwrap(),
        "host=api.example.com"
    );
    assert_eq!(shown("path=/a b/<x>").unwrap(), "path=/a%20b/%3Cx%3E");
    // Header values trimmed and cookie values unquoted: the same digest as the plain value.
    let (plain, _) = Matcher::parse("header:X-Key=abc").unwrap();
    let (spaced, _) = Matcher::parse("header:X-Key= abc ").unwrap();
    assert_eq!(plain, spaced);
    let (cookie, _) = Matcher::parse("cookie:sid=abc").unwrap();
    let (quoted, _) = Matcher::parse("cookie:sid=\"abc\"").unwrap();
    assert_eq!(cookie, quoted);
}

#[test]
fn override_numbers_follow_the_config_syntax() {
    let (t, burst, period) = numbers(Some("500/s"), None, None).unwrap();
    assert_eq!(
        (t.rate.per_sec, t.rate.burst, burst, period),
        (500.0, 500, Some(500), None)
    );
    let (t, _, _) = numbers(Some("10/min"), Some(40), None).unwrap();
    assert!((t.rate.per_sec - 10.0 / 60.0).abs() < 1e-12);
    assert_eq!(t.rate.burst, 40);
    let (t, burst, period) = numbers(None, None, Some("100000/day")).unwrap();
    assert_eq!(
        (t.quota, burst, period),
        (Some(100_000), None, Some(Period::Day))
    );
    assert!(numbers(None, Some(3), Some("5/day")).is_err());
    assert!(numbers(Some("1/s"), None, Some("5/day")).is_err());
    assert!(numbers(None, None, None).is_err());
    assert!(numbers(Some("1/s"), Some(0), None).is_err());
    // A quota override's own bucket is the same wherever its record is read.
    let a = fresh(numbers(None, None, Some("5/day")).unwrap().0, "id1");
    let b = fresh(numbers(None, None, Some("5/day")).unwrap().0, "id1");
    assert!(a.fresh.is_some() && a == b);
    assert_ne!(
        a,
        fresh(numbers(None, None, Some("5/day")).unwrap().0, "id2")
    );
    assert_eq!(
        fresh(numbers(Some("1/s"), None, None).unwrap().0, "id1").fresh,
        None
    );
}
