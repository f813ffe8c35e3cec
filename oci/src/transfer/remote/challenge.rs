//! `WWW-Authenticate` challenges: Basic, or Bearer with a token fetched from the realm for the wanted scopes.
use std::collections::BTreeMap;

/// What a 401 asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
        /// `insufficient_scope` when a token was sent but does not allow the request.
        error: Option<String>,
    },
}

/// Parses the first challenge of a `WWW-Authenticate` header (registries send one).
pub fn parse(header: &str) -> Option<Challenge> {
    let (scheme, rest) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    match scheme.to_ascii_lowercase().as_str() {
        "basic" => Some(Challenge::Basic),
        "bearer" => {
            let params = params(rest);
            Some(Challenge::Bearer {
                realm: params.get("realm")?.clone(),
                service: params.get("service").cloned(),
                scope: params.get("scope").cloned(),
                error: params.get("error").cloned(),
            })
        }
        _ => None,
    }
}

/// `key="value",key=value` pairs; quoted values may hold commas (scopes do).
fn params(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            match q.find('"') {
                Some(end) => (&q[..end], &q[end + 1..]),
                None => (q, ""),
            }
        } else {
            after.split_once(',').unwrap_or((after, ""))
        };
        out.insert(key, value.to_string());
        rest = next.trim_start_matches([',', ' ']);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_basic_and_bearer() {
        assert_eq!(parse(r#"Basic realm="x""#), Some(Challenge::Basic));
        let b = parse(
            r#"Bearer realm="https://auth/token",service="reg",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(
            b,
            Some(Challenge::Bearer {
                realm: "https://auth/token".into(),
                service: Some("reg".into()),
                scope: Some("repository:a/b:pull,push".into()),
                error: None,
            })
        );
        assert_eq!(parse("Negotiate"), None);
    }
}
