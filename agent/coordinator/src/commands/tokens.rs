//! `token` and `user-data`: join files, one or many in one transaction.
use super::{Context, Operation};
use crate::CoordinatorError;
use crate::tokens::TokenRequest;
use fleet_proto::joinfile::JoinFile;
use serde::{Deserialize, Serialize};

impl Operation for TokenRequest {
    type Answer = JoinFile;

    async fn apply(self, at: &Context) -> Result<JoinFile, CoordinatorError> {
        at.on_store(move |c, address| c.mint_token(&self, address))
            .await
    }
}

/// `token --count N`: `count` join files of the same request, minted in one transaction.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MintTokens {
    pub request: TokenRequest,
    pub count: usize,
}

impl Operation for MintTokens {
    type Answer = Vec<JoinFile>;

    async fn apply(self, at: &Context) -> Result<Vec<JoinFile>, CoordinatorError> {
        at.on_store(move |c, address| c.mint_tokens(&self.request, self.count, address))
            .await
    }
}
