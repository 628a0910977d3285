//! `rls:` and the envoyproxy/ratelimit files it names: each descriptor's `rate_limit`
//! compiled into a limit of the engine, with tollgate's keys (`algorithm`, `burst`,
//! `on_failure`, `leasing`, `ban`) checked as a route's limit's are.

use super::{parse_addr, Problems};
use crate::config::file::{self, Descriptor, RlsFile};
use crate::config::settings::{
    DescriptorSpec, DomainSpec, LimiterSettings, RlsLimit, RlsSettings, RlsUnit,
};
use crate::config::Problem;

/// The `rls` section: address and TLS (its domains are read from their files afterwards).
pub(super) fn section(raw: Option<&file::Rls>, p: &mut Problems) -> Option<RlsSettings> {
    let raw = raw?;
    let address = p.take("rls.address", parse_addr(&raw.address));
    let tls = (raw.tls.as_ref()).and_then(|t| super::listeners::tls(t, "rls.tls", p));
    Some(RlsSettings {
        address: address?,
        tls,
        config: raw.config.clone(),
        domains: Vec::new(),
    })
}

/// One envoyproxy/ratelimit file's text, compiled under `limiter`'s settings (field paths as
/// the file's, for `locate`).
pub fn domain(text: &str, limiter: &LimiterSettings) -> Result<DomainSpec, Vec<Problem>> {
    let root = crate::config::yaml::tree(text).map_err(|p| vec![p])?;
    let raw: RlsFile = crate::config::yaml::typed(&root).map_err(|(path, message)| {
        vec![Problem {
            path,
            message,
            at: None,
        }]
    })?;
    let mut p = Problems::default();
    if raw.domain.trim().is_empty() {
        p.add("domain", "must name the domain Envoy's requests carry");
    }
    let mut c = Compiler {
        domain: &raw.domain,
        limiter,
        p: &mut p,
    };
    let rules = c.rules(&raw.descriptors, "descriptors", "");
    if !p.0.is_empty() {
        return Err(p.0);
    }
    Ok(DomainSpec {
        domain: raw.domain,
        file: std::path::PathBuf::new(),
        rules,
    })
}

/// The limit of a call's own `limit` override of `count` per `unit` in `domain`, counted as
/// the reference counts (a fixed window), named after its numbers; `None` for numbers the
/// engine cannot count.
pub fn call_limit(
    domain: &str,
    unit: RlsUnit,
    count: u32,
    limiter: &LimiterSettings,
) -> Option<crate::config::settings::LimitSpec> {
    let mut p = Problems::default();
    let mut c = Compiler {
        domain,
        limiter,
        p: &mut p,
    };
    let here = format!("limit={count}/{}", unit.secs());
    c.spec(&Descriptor::default(), unit, count, "", &here)
}

struct Compiler<'a> {
    domain: &'a str,
    limiter: &'a LimiterSettings,
    p: &'a mut Problems,
}

impl Compiler<'_> {
    /// The rules of one level: `path` their list's field path, `above` the descriptor path of
    /// the level above (`key=value` pairs joined by `.`).
    fn rules(&mut self, list: &[Descriptor], path: &str, above: &str) -> Vec<DescriptorSpec> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(list.len());
        for (i, d) in list.iter().enumerate() {
            let path = format!("{path}[{i}]");
            if d.key.is_empty() {
                self.p.add(format!("{path}.key"), "must not be empty");
            }
            let entry = match &d.value {
                Some(v) => format!("{}={v}", d.key),
                None => d.key.clone(),
            };
            if !seen.insert(entry.clone()) {
                self.p.add(
                    &path,
                    format!(
                        "duplicate descriptor `{entry}` at this level (each key and value once)"
                    ),
                );
            }
            let here = if above.is_empty() {
                entry
            } else {
                format!("{above}.{entry}")
            };
            let (limit, unlimited) = self.limit(d, &path, &here);
            let children = self.rules(&d.descriptors, &format!("{path}.descriptors"), &here);
            out.push(DescriptorSpec {
                key: d.key.clone(),
                value: d.value.clone(),
                limit,
                unlimited,
                detailed_metric: d.detailed_metric,
                children,
            });
        }
        out
    }

    /// A descriptor's limit, and whether it is `unlimited`.
    fn limit(&mut self, d: &Descriptor, path: &str, here: &str) -> (Option<RlsLimit>, bool) {
        let Some(r) = &d.rate_limit else {
            for (key, set) in [
                ("algorithm", d.algorithm.is_some()),
                ("burst", d.burst.is_some()),
                ("on_failure", d.on_failure.is_some()),
                ("leasing", d.leasing.is_some()),
                ("ban", d.ban.is_some()),
            ] {
                if set {
                    self.p
                        .add(format!("{path}.{key}"), "needs a `rate_limit` beside it");
                }
            }
            return (None, false);
        };
        let path_rl = format!("{path}.rate_limit");
        if r.unlimited {
            if r.unit.is_some() || r.requests_per_unit.is_some() {
                self.p.add(
                    &path_rl,
                    "`unlimited: true` takes no `unit` or `requests_per_unit`",
                );
            }
            return (None, true);
        }
        let Some((unit, count)) = self.numbers(r, &path_rl) else {
            return (None, false);
        };
        // `requests_per_unit: 0` refuses every request, as envoyproxy/ratelimit's block lists
        // use it: no bucket to keep.
        let spec = match count {
            0 => None,
            _ => Some(self.spec(d, unit, count, path, here)),
        };
        let limit = spec
            .map_or(Some(None), |s| s.map(Some))
            .map(|spec| RlsLimit {
                spec,
                rule: here.to_owned(),
                name: r.name.clone().unwrap_or_default(),
                unit,
                requests_per_unit: count,
                replaces: r.replaces.iter().map(|x| x.name.clone()).collect(),
            });
        (limit, false)
    }

    /// `rate_limit`'s `unit` and `requests_per_unit`, both required.
    fn numbers(&mut self, r: &file::RateLimit, path: &str) -> Option<(RlsUnit, u32)> {
        const UNITS: &str = "second, minute, hour, day, week, month or year";
        let unit = match r.unit.as_deref() {
            Some(u) => RlsUnit::parse(u).or_else(|| {
                let message = format!("`{u}` is not a unit: {UNITS}");
                self.p.add(format!("{path}.unit"), message);
                None
            }),
            None => {
                self.p
                    .add(format!("{path}.unit"), format!("is required ({UNITS})"));
                None
            }
        };
        if r.requests_per_unit.is_none() {
            let message = "is required (the requests a unit allows)";
            self.p.add(format!("{path}.requests_per_unit"), message);
        }
        Some((unit?, r.requests_per_unit?))
    }

    /// The engine's limit for `count` per `unit`, counted as `algorithm` says.
    fn spec(
        &mut self,
        d: &Descriptor,
        unit: RlsUnit,
        count: u32,
        path: &str,
        here: &str,
    ) -> Option<crate::config::settings::LimitSpec> {
        let secs = unit.secs();
        let bucket = d.algorithm.as_deref() == Some("token_bucket");
        let as_route = file::Limit {
            name: format!("rls:{}:{here}", self.domain),
            rate: bucket.then(|| format!("{count}/{secs}s")),
            burst: if bucket {
                Some(d.burst.unwrap_or(count))
            } else {
                d.burst
            },
            quota: None,
            timezone: None,
            window: (!bucket).then(|| format!("{count}/{secs}s")),
            algorithm: if bucket {
                None
            } else {
                Some(d.algorithm.clone().unwrap_or_else(|| "fixed".into()))
            },
            concurrency: None,
            lease: None,
            ban: d.ban.clone(),
            leasing: d.leasing.clone(),
            count_when: None,
            key: vec!["ip".into()],
            cost: None,
            shadow: d.shadow_mode,
            exempt: Vec::new(),
            on_failure: d.on_failure.clone(),
        };
        let mut inner = Problems::default();
        let spec = super::routes::spec(&as_route, path, self.limiter, &mut inner);
        // The engine's wording names its own keys: say them as this file writes them.
        for mut problem in inner.0 {
            for (engine, here) in [(".window", ".rate_limit"), (".rate", ".rate_limit")] {
                if let Some(stem) = problem.path.strip_suffix(engine) {
                    problem.path = format!("{stem}{here}");
                }
            }
            self.p.0.push(problem);
        }
        spec
    }
}
