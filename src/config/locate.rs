//! Field path -> line and column, so that validation errors point into the file.
//!
//! The parser reports where it failed to *parse*, but the checks that run after parsing (a bad
//! rate, an unknown upstream) only know the field path. This walks the YAML event stream of
//! serde-saphyr's own parser (`granit_parser`) once, with spans, and records where each path
//! (`routes[1].limits[0].rate`) starts: the events give every key's position, which serde's
//! `Spanned` values give only for the fields a type declares.

use std::collections::HashMap;

use serde_saphyr::granit_parser::{Event, Marker, Parser, Span, SpannedEventReceiver};

/// Where each field path of a document starts (1-based line and column).
#[derive(Debug, Default)]
pub struct Locations(HashMap<String, (usize, usize)>);

impl Locations {
    /// Index `text`; a document that does not parse yields no locations (`yaml::tree` reports
    /// that error with its own position).
    pub fn index(text: &str) -> Self {
        let mut walker = Walker::default();
        if Parser::new_from_str(text).load(&mut walker, false).is_err() {
            return Self::default();
        }
        Self(walker.found)
    }

    /// The full path of the first key named `key` at or below `under`, in document order.
    pub fn key_under(&self, under: &str, key: &str) -> Option<String> {
        self.0
            .iter()
            .filter(|(p, _)| {
                p.strip_prefix(under)
                    .is_some_and(|rest| rest.starts_with(['.', '[']) || rest.is_empty())
                    && (p.ends_with(&format!(".{key}")) || *p == key)
            })
            .min_by_key(|(_, at)| **at)
            .map(|(p, _)| p.clone())
    }

    /// The position of `path`, or of its closest ancestor that has one.
    pub fn find(&self, path: &str) -> Option<(usize, usize)> {
        let mut p = path;
        loop {
            if let Some(at) = self.0.get(p) {
                return Some(*at);
            }
            p = &p[..p.rfind(['.', '['])?];
        }
    }
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, next: usize },
}

#[derive(Default)]
struct Walker {
    stack: Vec<Frame>,
    found: HashMap<String, (usize, usize)>,
}

impl Walker {
    /// The path of the node that starts now; `None` when the node is a mapping key.
    fn node_path(&mut self, scalar: Option<&str>, mark: Marker) -> Option<String> {
        let at = (mark.line(), mark.col() + 1);
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Seq { path, next }) => {
                *next += 1;
                Some(format!("{path}[{}]", *next - 1))
            }
            Some(Frame::Map { path, key }) => match key.take() {
                Some(k) => Some(join(path, &k)),
                None => {
                    let k = scalar.unwrap_or_default().to_owned();
                    self.found.insert(join(path, &k), at);
                    *key = Some(k);
                    None
                }
            },
        }
    }
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

impl<'input> SpannedEventReceiver<'input> for Walker {
    fn on_event(&mut self, ev: Event<'input>, span: Span) {
        let mark = span.start;
        let at = (mark.line(), mark.col() + 1);
        match ev {
            Event::Scalar(ref value, ..) => {
                if let Some(path) = self.node_path(Some(value), mark) {
                    self.found.insert(path, at);
                }
            }
            Event::Alias(_) => {
                if let Some(path) = self.node_path(None, mark) {
                    self.found.insert(path, at);
                }
            }
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let is_map = matches!(ev, Event::MappingStart(..));
                let path = self.node_path(None, mark).unwrap_or_default();
                self.found.entry(path.clone()).or_insert(at);
                self.stack.push(if is_map {
                    Frame::Map { path, key: None }
                } else {
                    Frame::Seq { path, next: 0 }
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_paths() {
        let text = "routes:\n  - name: a\n    limits:\n      - { name: x, rate: 10/sec }\n";
        let loc = Locations::index(text);
        assert_eq!(loc.find("routes[0].name"), Some((2, 11)));
        assert_eq!(loc.find("routes[0].limits[0].rate"), Some((4, 26)));
        // An absent field points at its parent.
        assert_eq!(loc.find("routes[0].limits[0].burst"), Some((4, 9)));
    }
}
