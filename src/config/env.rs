//! `${VAR}` in config strings: the environment variable's value, so secrets stay out of the
//! file (and out of a ConfigMap); `${VAR:-default}` when it may be unset; `$${` for a literal.

use serde_json::Value;

use super::Problem;

/// Replace every `${VAR}` in the string values of `root` (mapping keys are left as written),
/// reading variables with `lookup`. Each unset variable without a default is a problem at the
/// field it is in.
pub fn substitute(root: &mut Value, lookup: &dyn Fn(&str) -> Option<String>) -> Vec<Problem> {
    let mut problems = Vec::new();
    walk(root, String::new(), lookup, &mut problems);
    problems
}

fn walk(
    v: &mut Value,
    path: String,
    lookup: &dyn Fn(&str) -> Option<String>,
    p: &mut Vec<Problem>,
) {
    match v {
        Value::String(s) if s.contains('$') => match expand(s, lookup) {
            // A value that is one reference and nothing else takes the type its text reads
            // as (`max_inflight: ${MAX}` is a number), as in docker compose.
            Ok(expanded) if is_one_reference(s) => {
                *v = match super::yaml::scalar(&expanded) {
                    Some(typed @ (Value::Number(_) | Value::Bool(_))) => typed,
                    _ => Value::String(expanded),
                };
            }
            Ok(expanded) => *s = expanded,
            Err(message) => p.push(Problem {
                path,
                message,
                at: None,
            }),
        },
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                walk(item, format!("{path}[{i}]"), lookup, p);
            }
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                let path = if path.is_empty() {
                    key.to_owned()
                } else {
                    format!("{path}.{key}")
                };
                walk(item, path, lookup, p);
            }
        }
        _ => {}
    }
}

/// `${NAME}` or `${NAME:-default}`, alone.
fn is_one_reference(s: &str) -> bool {
    s.starts_with("${") && s.ends_with('}') && s[2..].find('}') == Some(s.len() - 3)
}

/// `s` with its `${...}` replaced.
fn expand(s: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(literal) = after.strip_prefix("${") {
            out.push_str("${");
            rest = literal;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body
                .find('}')
                .ok_or_else(|| format!("`${{{body}` has no closing `}}`"))?;
            let (name, default) = match body[..end].split_once(":-") {
                Some((name, default)) => (name, Some(default)),
                None => (&body[..end], None),
            };
            let valid = !name.is_empty()
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !name.as_bytes()[0].is_ascii_digit();
            if !valid {
                return Err(format!(
                    "`${{{}}}` is not a variable reference: use `${{NAME}}` or `${{NAME:-default}}` \
                     (write `$${{` for a literal `${{`)",
                    &body[..end]
                ));
            }
            match (lookup(name), default) {
                (Some(value), _) => out.push_str(&value),
                (None, Some(default)) => out.push_str(default),
                (None, None) => {
                    return Err(format!(
                        "environment variable `{name}` is not set (use `${{{name}:-default}}` \
                         for a default)"
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "PASSWORD" => Some("s3cret".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn variables_defaults_and_literals() {
        assert_eq!(
            expand("redis://:${PASSWORD}@r:6379", &env).unwrap(),
            "redis://:s3cret@r:6379"
        );
        assert_eq!(expand("${UNSET:-fallback}", &env).unwrap(), "fallback");
        assert_eq!(expand("${EMPTY:-fallback}", &env).unwrap(), "");
        assert_eq!(
            expand("cost $5 and $${KEEP}", &env).unwrap(),
            "cost $5 and ${KEEP}"
        );
        assert!(expand("${UNSET}", &env)
            .unwrap_err()
            .contains("`UNSET` is not set"));
        assert!(expand("${9X}", &env)
            .unwrap_err()
            .contains("not a variable reference"));
        assert!(expand("${OPEN", &env).unwrap_err().contains("no closing"));
    }

    #[test]
    fn problems_name_the_field() {
        let mut v = super::super::yaml::tree(
            "limiter:\n  redis:\n    url: redis://:${NOPE}@h\nroutes:\n  - name: ${PASSWORD}\n",
        )
        .unwrap();
        let problems = substitute(&mut v, &env);
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].path, "limiter.redis.url");
        assert_eq!(v["routes"][0]["name"].as_str(), Some("s3cret"));
    }

    #[test]
    fn a_lone_reference_takes_the_type_of_its_value() {
        let lookup = |n: &str| (n == "MAX").then(|| "500".to_owned());
        let mut v = super::super::yaml::tree(
            "max_inflight: ${MAX}
name: x${MAX}
flag: ${F:-true}
",
        )
        .unwrap();
        assert!(substitute(&mut v, &lookup).is_empty());
        assert_eq!(v["max_inflight"].as_u64(), Some(500));
        assert_eq!(v["name"].as_str(), Some("x500"));
        assert_eq!(v["flag"].as_bool(), Some(true));
    }
}
