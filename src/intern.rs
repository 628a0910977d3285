//! Text kept for the life of the process, once per distinct value: header values that every
//! request clones (a limit's `RateLimit-Policy`, say) become `'static`, so a clone is a copy of
//! a pointer, not an atomic reference count that every worker thread writes (a cache line
//! passed between the cores on every request). A reload that renders the same text finds it
//! here; only text never seen before is added, so what is kept grows with distinct configs,
//! not with reloads.

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex, PoisonError};

static KEPT: LazyLock<Mutex<HashSet<&'static str>>> = LazyLock::new(Mutex::default);

/// `text`, kept for the life of the process.
pub fn text(text: &str) -> &'static str {
    let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(known) = kept.get(text) {
        return known;
    }
    let leaked: &'static str = Box::leak(text.to_owned().into_boxed_str());
    kept.insert(leaked);
    leaked
}

/// `value` as a header value, kept for the life of the process; `None` when it is not a
/// valid one.
pub fn header_value(value: &str) -> Option<http::HeaderValue> {
    http::HeaderValue::from_str(value).ok()?;
    Some(http::HeaderValue::from_static(text(value)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_text_is_kept_once() {
        let a = super::text(&format!("\"{}\";q=10;w=1", "kept"));
        let b = super::text("\"kept\";q=10;w=1");
        assert!(std::ptr::eq(a, b));
        assert_eq!(super::header_value("a b").unwrap(), "a b");
        assert!(super::header_value("a\nb").is_none());
    }
}
