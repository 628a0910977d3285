//! The `identity` section: the JWT verifier, its secret and JWKS files read (on every load and
//! reload), and `jwt:` key sources refused where no verifier is configured.

use std::sync::Arc;

use super::{file, values, Problems};
use crate::identity::jwt::{Options, Shared, Verifier};

/// The verifier of `identity.jwt`, or `None` (with a problem when it is configured but broken).
// Every `identity.jwt` key with its check, in the file's order.
#[allow(clippy::too_many_lines)]
pub(super) fn jwt(raw: &file::File, p: &mut Problems) -> Option<Shared> {
    let Some(cfg) = raw.identity.as_ref().and_then(|i| i.jwt.as_ref()) else {
        jwt_sources_need_a_verifier(raw, p);
        return None;
    };
    let read = |key: &str, path: Option<&String>, p: &mut Problems| {
        let path = path?;
        std::fs::read(path)
            .map_err(|e| {
                p.add(
                    format!("identity.jwt.{key}"),
                    format!("cannot read `{path}`: {e}"),
                );
            })
            .ok()
    };
    let secret = read("hs256_secret_file", cfg.hs256_secret_file.as_ref(), p);
    let jwks = read("jwks_file", cfg.jwks_file.as_ref(), p);
    if cfg.hs256_secret_file.is_none() && cfg.jwks_file.is_none() {
        p.add(
            "identity.jwt",
            "needs `hs256_secret_file` or `jwks_file`: the keys tokens are verified with",
        );
        return None;
    }
    let leeway = cfg
        .leeway
        .as_ref()
        .and_then(|s| p.take("identity.jwt.leeway", values::duration(s)));
    // A file that could not be read was reported already.
    if cfg.hs256_secret_file.is_some() != secret.is_some()
        || cfg.jwks_file.is_some() != jwks.is_some()
    {
        return None;
    }
    let options = Options {
        hs256_secret: secret.as_deref(),
        jwks: jwks.as_deref(),
        issuers: &cfg.issuers,
        audiences: &cfg.audiences,
        leeway,
    };
    let error = match Verifier::new(&options) {
        Ok(verifier) => return Some(Arc::new(verifier)),
        Err(e) => e,
    };
    // Each file on its own, so the error names the key whose file is wrong.
    let alone = [
        (
            "identity.jwt.hs256_secret_file",
            Options {
                hs256_secret: secret.as_deref(),
                ..Options::default()
            },
        ),
        (
            "identity.jwt.jwks_file",
            Options {
                jwks: jwks.as_deref(),
                ..Options::default()
            },
        ),
    ];
    let mut named = false;
    for (key, options) in alone {
        if options.hs256_secret.is_some() || options.jwks.is_some() {
            if let Err(e) = Verifier::new(&options) {
                p.add(key, e);
                named = true;
            }
        }
    }
    if !named {
        p.add("identity.jwt", error);
    }
    None
}

/// A `jwt:` source without `identity.jwt` would never be present: refused.
fn jwt_sources_need_a_verifier(raw: &file::File, p: &mut Problems) {
    for (i, route) in raw.routes.iter().enumerate() {
        let i = raw.positions.routes.get(i).copied().unwrap_or(i);
        for (j, limit) in route.limits.iter().enumerate() {
            let named = limit.key.iter().enumerate().map(|(k, s)| ("key", k, s));
            let exempt = limit
                .exempt
                .iter()
                .enumerate()
                .map(|(k, s)| ("exempt", k, s));
            for (list, k, s) in named.chain(exempt) {
                if s.split('+').any(|part| part.trim().starts_with("jwt:")) {
                    p.add(
                        format!("routes[{i}].limits[{j}].{list}[{k}]"),
                        format!(
                            "`{s}` needs `identity.jwt`: the keys its tokens are verified with"
                        ),
                    );
                }
            }
        }
    }
}
