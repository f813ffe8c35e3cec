//! The release and rollout commands: `release trust|revoke|list|add`, `update` and `rollout
//! start|status|pause|resume|abort`.
use super::{Context, Operation};
use crate::CoordinatorError;
use crate::release::{TakenRelease, UpdateSent};
use crate::rollout::{Rollout, RolloutPlan, RolloutState};
use crate::store::ReleaseRecord;
use fleet_proto::pin::PinnedKey;
use fleet_proto::release::{ReleaseOffer, ReleaseTrust};
use serde::{Deserialize, Serialize};

/// `release trust --root KEY`: answers the roots a release may be certified by.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrustRoot {
    pub root: PinnedKey,
}

impl Operation for TrustRoot {
    type Answer = Vec<PinnedKey>;

    async fn apply(self, at: &Context) -> Result<Vec<PinnedKey>, CoordinatorError> {
        at.on_store(move |c, _| Ok(c.store().trust_release_root(&self.root)?))
            .await
    }
}

/// `release revoke --key KEY`: answers the roots and the revoked release keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokeReleaseKey {
    pub key: PinnedKey,
}

impl Operation for RevokeReleaseKey {
    type Answer = ReleaseTrust;

    async fn apply(self, at: &Context) -> Result<ReleaseTrust, CoordinatorError> {
        at.on_store(move |c, _| Ok(c.store().revoke_release_key(&self.key)?))
            .await
    }
}

/// `release list`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Releases {}

impl Operation for Releases {
    type Answer = Vec<ReleaseRecord>;
    const READ_ONLY: bool = true;

    async fn apply(self, at: &Context) -> Result<Vec<ReleaseRecord>, CoordinatorError> {
        at.on_store(|c, _| Ok(c.store().releases()?)).await
    }
}

/// `release add DIR`, its binaries already in the data folder's blob store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TakeRelease {
    pub offer: ReleaseOffer,
}

impl Operation for TakeRelease {
    type Answer = TakenRelease;

    async fn apply(self, at: &Context) -> Result<TakenRelease, CoordinatorError> {
        (at.coordinator())
            .take_release(self.offer, at.serving())
            .await
    }
}

/// `update --node N [--release SEQUENCE]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateNode {
    pub node: String,
    pub release: Option<u64>,
}

impl Operation for UpdateNode {
    type Answer = UpdateSent;

    async fn apply(self, at: &Context) -> Result<UpdateSent, CoordinatorError> {
        at.coordinator().update_node(&self.node, self.release).await
    }
}

/// `rollout start ...`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartRollout {
    pub plan: RolloutPlan,
}

impl Operation for StartRollout {
    type Answer = Rollout;

    async fn apply(self, at: &Context) -> Result<Rollout, CoordinatorError> {
        at.on_store(move |c, _| c.start_rollout(self.plan)).await
    }
}

/// `rollout status`: None when the fleet has had no rollout.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ShowRollout {}

impl Operation for ShowRollout {
    type Answer = Option<Rollout>;
    const READ_ONLY: bool = true;

    async fn apply(self, at: &Context) -> Result<Option<Rollout>, CoordinatorError> {
        at.on_store(|c, _| c.rollout()).await
    }
}

/// `rollout pause`, `resume`, `abort`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetRollout {
    pub to: RolloutState,
}

impl Operation for SetRollout {
    type Answer = Rollout;

    async fn apply(self, at: &Context) -> Result<Rollout, CoordinatorError> {
        at.on_store(move |c, _| c.set_rollout(self.to)).await
    }
}
