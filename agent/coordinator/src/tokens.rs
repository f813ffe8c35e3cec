//! One-time join tokens: minted in batches, stored only as their SHA-256, handed out inside the
//! join file that names every coordinator of the fleet.
use crate::Coordinator;
use crate::error::CoordinatorError;
use crate::store::TokenRecord;
use base64::Engine;
use fleet_proto::clock::now_ms;
use fleet_proto::joinfile::{JoinFile, Secret, TOKEN_PREFIX};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// A join file to mint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TokenRequest {
    pub ttl_ms: u64,
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The advertised `host:port`; the serving coordinator fills in its own when absent.
    pub address: Option<String>,
    pub bundle_sha256: Option<String>,
}

/// A fresh one-time token: the prefix and 32 random bytes.
fn new_token() -> String {
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    )
}

pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Coordinator {
    /// Mints a one-time token, stores only its hash, and returns the join file that carries it.
    pub fn mint_token(
        &self,
        request: &TokenRequest,
        default_address: Option<&str>,
    ) -> Result<JoinFile, CoordinatorError> {
        let mut joins = self.mint_tokens(request, 1, default_address)?;
        joins
            .pop()
            .ok_or_else(|| CoordinatorError::Request("no token was minted".into()))
    }

    /// Mints `count` tokens of the same request in one transaction; returns their join files.
    pub fn mint_tokens(
        &self,
        request: &TokenRequest,
        count: usize,
        default_address: Option<&str>,
    ) -> Result<Vec<JoinFile>, CoordinatorError> {
        let address = request
            .address
            .clone()
            .or_else(|| default_address.map(str::to_string))
            .ok_or(CoordinatorError::NoAddress)?;
        let now = now_ms();
        let expires_at_ms = now + request.ttl_ms;
        let record = TokenRecord {
            expires_at_ms,
            name: request.name.clone(),
            labels: request.labels.clone(),
            spent_by: None,
            bootstrap_failure: None,
        };
        // The fleet's other coordinators (on a shared store) as the store says now, not as this
        // one last heard: one started a moment ago is in the join file too.
        if let Some(lease) = self.fleet().heard_within() {
            self.learn_fleet(lease)?;
        }
        let alternates = self.fleet().others_than(&address);
        let release_roots = self.store().release_roots()?;
        let tokens: Vec<String> = (0..count).map(|_| new_token()).collect();
        let hashed: Vec<(String, TokenRecord)> = (tokens.iter())
            .map(|token| (token_hash(token), record.clone()))
            .collect();
        self.store().add_tokens(&hashed, now)?;
        Ok(tokens
            .into_iter()
            .map(|token| JoinFile {
                alternates: alternates.clone(),
                address: address.clone(),
                coordinator_key: self.public_key_text(),
                token: Secret(token),
                expires_at_ms: Some(expires_at_ms),
                ttl_ms: Some(request.ttl_ms),
                bundle_sha256: request.bundle_sha256.clone(),
                name: request.name.clone(),
                labels: request.labels.clone(),
                release_roots: release_roots.clone(),
            })
            .collect())
    }
}
