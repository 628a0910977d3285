//! Envoy rate limit service domains, live: descriptor rules matched as envoyproxy/ratelimit
//! matches them, each rule's limit one of the engine's (its buckets kept across reloads).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::Limit;
use crate::config::settings::{DescriptorSpec, DomainSpec, LimiterSettings, RlsLimit, RlsUnit};

/// Every domain of the `rls` config, by name, and the limits calls' own `limit` overrides
/// asked for.
#[derive(Debug, Default)]
pub struct Domains {
    by_name: HashMap<String, Level>,
    limiter: Option<LimiterSettings>,
    /// Calls' override rules by domain and numbers: the index of each in `call_rules`.
    call_index: Mutex<HashMap<(String, u32, RlsUnit), usize>>,
    /// Made on a call's first use, at most `MAX_CALL_LIMITS`; never removed while this
    /// runtime lives, so they can be lent out like the config's.
    call_rules: Box<[OnceLock<Arc<Rule>>]>,
    /// The previous runtime's call limits, by name: their buckets kept across a reload.
    inherited: HashMap<Arc<str>, Arc<Limit>>,
}

/// The most distinct `limit` overrides (domain and numbers) held: each is a limit with its
/// own buckets, and the numbers come from the callers.
const MAX_CALL_LIMITS: usize = 1024;

/// A descriptor's rule: one of the config's, or one made for a call's own `limit` override.
#[derive(Debug, Clone)]
pub enum RuleRef<'a> {
    Config(&'a Rule),
    Call(Arc<Rule>),
}

impl std::ops::Deref for RuleRef<'_> {
    type Target = Rule;

    fn deref(&self) -> &Rule {
        match self {
            Self::Config(r) => r,
            Self::Call(r) => r,
        }
    }
}

/// The rules of one level: by `key` and `value`, by a value's prefix (`value: foo*`), and by
/// `key` alone (any value, each counted apart).
#[derive(Debug, Default)]
struct Level {
    exact: HashMap<String, HashMap<String, Rule>>,
    prefixed: Vec<(String, String, Rule)>,
    any: HashMap<String, Rule>,
}

/// A matched descriptor rule: its limit, if it has one, and what Envoy is told about it
/// (`meta` with no `limit`: `requests_per_unit: 0`, every request over).
#[derive(Debug)]
pub struct Rule {
    pub limit: Option<Arc<Limit>>,
    pub meta: Option<RlsLimit>,
    /// `unlimited: true`: matched and never limited.
    pub unlimited: bool,
    pub detailed_metric: bool,
    next: Level,
}

impl Rule {
    /// `requests_per_unit: 0`: every request is over the limit.
    pub fn refuses_all(&self) -> bool {
        self.limit.is_none() && self.meta.is_some()
    }
}

impl Domains {
    /// The live domains of `specs`, keeping the buckets of `old`'s limits of the same name.
    pub fn build(
        specs: &[DomainSpec],
        old: &HashMap<&str, &Arc<Limit>>,
        limiter: &LimiterSettings,
    ) -> Self {
        let by_name = (specs.iter())
            .map(|d| (d.domain.clone(), Level::build(&d.rules, old, limiter)))
            .collect();
        let inherited = (old.iter())
            .filter(|(name, _)| name.starts_with("rls:") && name.contains(":limit="))
            .map(|(_, l)| (l.name.clone(), Arc::clone(l)))
            .collect();
        Self {
            by_name,
            limiter: Some(limiter.clone()),
            call_index: Mutex::default(),
            call_rules: (0..MAX_CALL_LIMITS).map(|_| OnceLock::new()).collect(),
            inherited,
        }
    }

    /// The rule of a call's own `limit` override of `count` per `unit` in `domain`, as the
    /// reference applies it (whatever the config says, a fixed window); `None` past
    /// `MAX_CALL_LIMITS` distinct ones (the config's rule applies).
    pub fn call_rule(&self, domain: &str, count: u32, unit: RlsUnit) -> Option<Arc<Rule>> {
        let mut index = self.call_index.lock();
        let key = (domain.to_owned(), count, unit);
        if let Some(&i) = index.get(&key) {
            return self.call_rules[i].get().cloned();
        }
        let slot = self.call_rules.get(index.len())?;
        let limiter = self.limiter.as_ref()?;
        let spec = match count {
            0 => None,
            _ => Some(crate::config::compile::rls_call_limit(
                domain, unit, count, limiter,
            )?),
        };
        let limit = spec.as_ref().map(|spec| {
            let old = self.inherited.get(&spec.name).map(|l| &**l);
            Limit::build(spec, old, limiter)
        });
        let rule = Arc::new(Rule {
            meta: Some(RlsLimit {
                rule: format!("limit={count}/{}", unit.secs()),
                spec,
                name: String::new(),
                unit,
                requests_per_unit: count,
                replaces: Vec::new(),
            }),
            limit,
            unlimited: false,
            detailed_metric: false,
            next: Level::default(),
        });
        let _ = slot.set(rule.clone());
        let next = index.len();
        index.insert(key, next);
        Some(rule)
    }

    /// The rule for a request's descriptor `entries` (key, value) in `domain`: the deepest
    /// rule matching every entry in turn, a value's own rule before a prefix's before the
    /// key's; `None` when an entry matches nothing (not limited).
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<&'a Rule> {
        let mut level = self.by_name.get(domain)?;
        let (last, before) = entries.split_last()?;
        for &(key, value) in before {
            level = &level.find(key, value)?.next;
        }
        level.find(last.0, last.1)
    }

    /// The domains' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// Every rule with a limit: its domain, what Envoy is told of it, and its limit.
    pub fn rules(&self) -> Vec<(&str, &RlsLimit, &Arc<Limit>)> {
        let mut out = Vec::new();
        for (domain, level) in &self.by_name {
            level.visit(&mut |rule| {
                if let (Some(meta), Some(limit)) = (&rule.meta, &rule.limit) {
                    out.push((domain.as_str(), meta, limit));
                }
            });
        }
        out.sort_by(|a, b| a.2.name.cmp(&b.2.name));
        out
    }

    /// Every limit of every domain, those of calls' overrides made so far included.
    pub fn limits(&self) -> impl Iterator<Item = &Arc<Limit>> {
        let mut out = Vec::new();
        for level in self.by_name.values() {
            level.collect(&mut out);
        }
        let calls = (self.call_rules.iter())
            .map_while(OnceLock::get)
            .filter_map(|r| r.limit.as_ref());
        out.into_iter().chain(calls)
    }
}

impl Level {
    fn build(
        rules: &[DescriptorSpec],
        old: &HashMap<&str, &Arc<Limit>>,
        limiter: &LimiterSettings,
    ) -> Self {
        let mut level = Self::default();
        for r in rules {
            let limit = (r.limit.as_ref())
                .and_then(|m| m.spec.as_ref())
                .map(|spec| {
                    let previous = old.get(&*spec.name).map(|l| &***l);
                    Limit::build(spec, previous, limiter)
                });
            let rule = Rule {
                limit,
                meta: r.limit.clone(),
                unlimited: r.unlimited,
                detailed_metric: r.detailed_metric,
                next: Self::build(&r.children, old, limiter),
            };
            match &r.value {
                Some(v) if v.ends_with('*') => {
                    let prefix = v.trim_end_matches('*').to_owned();
                    level.prefixed.push((r.key.clone(), prefix, rule));
                }
                Some(v) => {
                    let values = level.exact.entry(r.key.clone()).or_default();
                    values.insert(v.clone(), rule);
                }
                None => {
                    level.any.insert(r.key.clone(), rule);
                }
            }
        }
        level
    }

    fn find(&self, key: &str, value: &str) -> Option<&Rule> {
        if let Some(rule) = self.exact.get(key).and_then(|values| values.get(value)) {
            return Some(rule);
        }
        (self.prefixed.iter())
            .find(|(k, prefix, _)| k == key && value.starts_with(prefix.as_str()))
            .map(|(_, _, r)| r)
            .or_else(|| self.any.get(key))
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a Arc<Limit>>) {
        self.visit(&mut |rule| out.extend(&rule.limit));
    }

    /// Call `f` with every rule of this level and the levels below it.
    fn visit<'a>(&'a self, f: &mut impl FnMut(&'a Rule)) {
        let rules = (self.exact.values().flat_map(HashMap::values))
            .chain(self.prefixed.iter().map(|(_, _, r)| r))
            .chain(self.any.values());
        for rule in rules {
            f(rule);
            rule.next.visit(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domains(yaml: &str) -> Domains {
        let limiter = crate::config::parse("listeners: [{address: 127.0.0.1:0}]")
            .expect("a config")
            .limiter;
        let spec = crate::config::compile::rls_domain(yaml, &limiter).expect("a valid file");
        Domains::build(&[spec], &HashMap::new(), &limiter)
    }

    fn found(d: &Domains, entries: &[(&str, &str)]) -> Option<u32> {
        let rule = d.find("rl", entries)?;
        rule.meta.as_ref().map(|m| m.requests_per_unit)
    }

    #[test]
    fn rules_match_as_envoyproxy_ratelimit_matches_them() {
        let d = domains(
            "domain: rl\ndescriptors:\n  - key: source_cluster\n    value: proxy\n    descriptors:\n      - key: destination_cluster\n        value: bar\n        rate_limit: { unit: minute, requests_per_unit: 1 }\n      - key: destination_cluster\n        rate_limit: { unit: minute, requests_per_unit: 2 }\n      - key: destination_cluster\n        value: pre*\n        rate_limit: { unit: minute, requests_per_unit: 3 }\n  - key: remote_address\n    rate_limit: { unit: second, requests_per_unit: 10 }\n  - key: key1\n    rate_limit: { unlimited: true }\n",
        );
        let sc = ("source_cluster", "proxy");
        assert_eq!(found(&d, &[sc, ("destination_cluster", "bar")]), Some(1));
        assert_eq!(found(&d, &[sc, ("destination_cluster", "prefix")]), Some(3));
        assert_eq!(found(&d, &[sc, ("destination_cluster", "other")]), Some(2));
        // A descriptor that stops above a rule's depth, or goes past it, is not limited.
        assert_eq!(found(&d, &[sc]), None);
        assert!(d
            .find("rl", &[sc, ("destination_cluster", "bar"), ("x", "y")])
            .is_none());
        assert_eq!(found(&d, &[("remote_address", "10.0.0.1")]), Some(10));
        assert!(d.find("rl", &[("unknown", "x")]).is_none());
        assert!(d.find("other", &[("remote_address", "10.0.0.1")]).is_none());
        let unlimited = d.find("rl", &[("key1", "v")]).expect("matched");
        assert!(unlimited.unlimited && unlimited.limit.is_none());
        assert_eq!(d.limits().count(), 4);
    }
}
