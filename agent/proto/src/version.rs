//! Which versions of the node protocol each side speaks. The first message of every connection
//! states them ([`Opening`](crate::protocol::Opening)), the coordinator's welcome and join answer
//! state its own, and a connection speaks the highest version both do. A peer that states none
//! is of release 0.1.0, which spoke version 1 and nothing else.
use serde::{Deserialize, Serialize};
use std::fmt;

/// A version of the node protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ProtocolVersion(pub u32);

impl ProtocolVersion {
    /// The wire of release 0.1.0, whose messages state no version.
    pub const FIRST: ProtocolVersion = ProtocolVersion(1);
    /// What this build speaks best: version 1 and the versions stated in every first message.
    pub const CURRENT: ProtocolVersion = ProtocolVersion(2);
    /// The first version whose coordinator says it stops before it ends a session.
    pub const STOPPING_SAID: ProtocolVersion = ProtocolVersion(2);
}

impl fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The versions a side speaks, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versions {
    pub min: ProtocolVersion,
    pub max: ProtocolVersion,
}

impl Versions {
    /// What this build speaks: its own version and the release's before it, so one side of a
    /// fleet (its coordinators, or its agents) can be upgraded before the other.
    pub const SPOKEN: Versions = Versions {
        min: ProtocolVersion(ProtocolVersion::CURRENT.0 - 1),
        max: ProtocolVersion::CURRENT,
    };
    /// What a peer that states no versions speaks: release 0.1.0's.
    pub const UNSTATED: Versions = Versions {
        min: ProtocolVersion::FIRST,
        max: ProtocolVersion::FIRST,
    };

    /// For serde: a message without the field comes from a release that stated none.
    pub fn unstated() -> Versions {
        Versions::UNSTATED
    }

    /// The version a connection between the two speaks: the highest both do, if any.
    pub fn common(self, other: Versions) -> Option<ProtocolVersion> {
        let (min, max) = (self.min.max(other.min), self.max.min(other.max));
        (min <= max).then_some(max)
    }
}

impl fmt::Display for Versions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{} to {}", self.min, self.max)
        }
    }
}

/// A coordinator and an agent that share no version: what the coordinator answers instead of a
/// session, and what `nodes` shows for the node, in one line that names both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incompatible {
    pub agent: Versions,
    pub coordinator: Versions,
}

impl fmt::Display for Incompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let older = if self.agent.max < self.coordinator.min {
            "the agent"
        } else {
            "the coordinator"
        };
        write!(
            f,
            "the agent speaks protocol {} and the coordinator {}: upgrade {older} (a coordinator \
             serves agents of its own release and of the one before it)",
            self.agent, self.coordinator
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(min: u32, max: u32) -> Versions {
        Versions {
            min: ProtocolVersion(min),
            max: ProtocolVersion(max),
        }
    }

    #[test]
    fn two_sides_speak_the_highest_version_both_do() {
        assert_eq!(v(1, 2).common(v(1, 1)), Some(ProtocolVersion(1)));
        assert_eq!(v(1, 2).common(v(2, 3)), Some(ProtocolVersion(2)));
        assert_eq!(v(2, 3).common(v(1, 1)), None);
        assert_eq!(v(1, 2).common(v(3, 4)), None);
        assert_eq!(
            Versions::SPOKEN.common(Versions::UNSTATED),
            Some(ProtocolVersion::FIRST)
        );
    }

    #[test]
    fn the_refusal_names_both_ranges_and_the_side_to_upgrade() {
        let line = Incompatible {
            agent: v(0, 0),
            coordinator: v(1, 2),
        }
        .to_string();
        assert!(
            line.starts_with(
                "the agent speaks protocol 0 and the coordinator 1 to 2: upgrade the agent"
            ),
            "{line}"
        );
        let line = Incompatible {
            agent: v(3, 4),
            coordinator: v(1, 2),
        }
        .to_string();
        assert!(
            line.contains("protocol 3 to 4 and the coordinator 1 to 2: upgrade the coordinator"),
            "{line}"
        );
    }
}
