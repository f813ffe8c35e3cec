//! `token` and `user-data`: join files, printed as JSON or rendered as `#cloud-config`.
use super::{Place, operate};
use crate::cli::{TokenArgs, TokenCmd, UserDataArgs};
use anyhow::Result;
use fleet_coordinator::commands::MintTokens;
use fleet_coordinator::{self as coordinator, TokenRequest, userdata};
use std::io::Write;

/// `token`: one join file, pretty; with `--count N`, N join files a line each.
pub fn token(place: &Place, t: TokenCmd) -> Result<()> {
    let request = token_request(&t.token);
    if t.count == 1 {
        let join = operate(place, request)?;
        println!("{}", serde_json::to_string_pretty(&join)?);
        return Ok(());
    }
    let count = t.count as usize;
    let joins = operate(place, MintTokens { request, count })?;
    let mut out = std::io::stdout().lock();
    for join in joins {
        writeln!(out, "{}", serde_json::to_string(&join)?)?;
    }
    Ok(())
}

/// `user-data`: a join file for a machine of `--arch`, with its bundle's SHA-256, as cloud-init
/// user data.
pub fn user_data(place: &Place, u: UserDataArgs) -> Result<()> {
    let bundles = u.bundles.unwrap_or_else(|| place.data.join("bundles"));
    let bundle = coordinator::bundle_path(&bundles, &u.arch);
    let sum = coordinator::file_sha256(&bundle).map_err(|cause| {
        coordinator::CoordinatorError::Bundle {
            path: bundle.clone(),
            cause,
        }
    })?;
    let mut request = token_request(&u.token);
    request.bundle_sha256 = Some(sum);
    let join = operate(place, request)?;
    print!("{}", userdata::render(&join, &u.arch));
    Ok(())
}

fn token_request(t: &TokenArgs) -> TokenRequest {
    TokenRequest {
        ttl_ms: t.ttl.as_millis() as u64,
        name: t.name.clone(),
        labels: t.labels.iter().cloned().collect(),
        address: t.address.clone(),
        bundle_sha256: t.bundle_sha256.clone(),
    }
}
