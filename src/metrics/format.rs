//! The exposition format a scraper asked for, read from its Accept header: the Prometheus text
//! format 0.0.4 or OpenMetrics 1.0.0, both encoded by prometheus-client from one registry.

use prometheus_client::registry::Registry;

/// A text exposition format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`: what a scraper gets unless it asks for OpenMetrics (curl,
    /// `promtool check metrics`, agents that speak only this format).
    Text,
    /// `application/openmetrics-text; version=1.0.0`: what Prometheus asks for first.
    OpenMetrics,
}

impl Format {
    /// The format `accept` prefers: OpenMetrics when it is accepted with a quality at least that
    /// of the text format (Prometheus sends `application/openmetrics-text;version=1.0.0,...,
    /// text/plain;version=0.0.4;q=0.5,*/*;q=0.1`), else the text format. An unreadable header
    /// gets the text format, as no header does.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut open, mut text) = (0.0_f64, 0.0_f64);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let kind = parts.next().unwrap_or("").to_ascii_lowercase();
            let (mut q, mut version) = (1.0, None);
            for param in parts {
                let Some((k, v)) = param.split_once('=') else {
                    continue;
                };
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.trim().parse().unwrap_or(0.0),
                    "version" => version = Some(v.trim().trim_matches('"').to_owned()),
                    _ => {}
                }
            }
            let version = version.as_deref();
            match kind.as_str() {
                "application/openmetrics-text"
                    if matches!(version, None | Some("1.0.0" | "0.0.1")) =>
                {
                    open = open.max(q);
                }
                "text/plain" if matches!(version, None | Some("0.0.4")) => text = text.max(q),
                "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if open > 0.0 && open >= text {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    /// The Content-Type of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// `registry` in this format.
    pub(super) fn encode(self, registry: &Registry) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(16 * 1024);
        match self {
            Self::Text => prometheus_client::encoding::prometheus_text::encode(&mut out, registry)?,
            Self::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, registry)?,
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::Format;

    #[test]
    fn prometheus_gets_openmetrics_and_everyone_else_text() {
        // Prometheus 2.x's scrape header, verbatim.
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        // Later releases weigh every type, and Prometheus 3 names text/plain 1.0.0 too.
        for later in [
            "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
        ] {
            assert_eq!(Format::negotiate(Some(later)), Format::OpenMetrics, "{later}");
        }
        for text in [
            None,
            Some("*/*"),
            Some("text/plain"),
            Some("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5"),
            Some("application/openmetrics-text;version=2.0.0"),
            Some("application/openmetrics-text;q=0"),
            Some("garbage;;=,"),
        ] {
            assert_eq!(Format::negotiate(text), Format::Text, "{text:?}");
        }
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text")),
            Format::OpenMetrics
        );
    }
}
