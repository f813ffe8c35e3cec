//! A run as both sides see it: its state, what it runs, how, and how it ended.
//!
//! One [`RunState`] goes from the node's store through the wire to the coordinator's rows and
//! views; an [`Outcome`] is filled by whichever runtime ran the work and read by the coordinator
//! without knowing which one did.
use fleet_vocab::{Bytes, Digest, RunId};
use serde::{Deserialize, Serialize};

/// Where a run is in its life. `waiting` is the coordinator's alone (no node has taken it yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Waiting,
    Starting,
    Running,
    Finished,
    Failed,
    Lost,
}

impl RunState {
    /// Whether nothing can follow this state.
    pub fn is_final(self) -> bool {
        matches!(self, RunState::Finished | RunState::Failed | RunState::Lost)
    }

    /// Whether a run in `self` may move to `next`: only forward, and never out of a final state.
    pub fn may_become(self, next: RunState) -> bool {
        !self.is_final() && next.rank() > self.rank()
    }

    fn rank(self) -> u8 {
        match self {
            RunState::Waiting => 0,
            RunState::Starting => 1,
            RunState::Running => 2,
            RunState::Finished | RunState::Failed | RunState::Lost => 3,
        }
    }

    /// The lowercase name used on the wire, in stores and in tables.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Waiting => "waiting",
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Finished => "finished",
            RunState::Failed => "failed",
            RunState::Lost => "lost",
        }
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a run executes: a program staged on the node by its digest, or an image by digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    Program(Digest),
    /// `HOST/REPO@sha256:HEX` on the wire: an image is named by its manifest digest, never by a
    /// tag; one that does not read so is refused where it is read.
    Image(ImageRef),
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workload::Program(digest) => write!(f, "program {digest}"),
            Workload::Image(image) => write!(f, "image {image}"),
        }
    }
}

/// An image named by its manifest digest: `HOST[:PORT]/REPO@sha256:HEX`. A tag is never an
/// identity (it can move), so one is refused wherever an image is named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// `HOST[:PORT]`, the registry the image is pulled from.
    pub host: String,
    pub repository: String,
    pub digest: Digest,
}

/// Why an image reference (`HOST/REPO@sha256:HEX`) cannot be read, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ImageRefError(String);

impl ImageRef {
    /// Reads `HOST[:PORT]/REPO@sha256:HEX`; any other shape is one line saying what to write.
    pub fn parse(text: &str) -> Result<ImageRef, ImageRefError> {
        Self::parse_line(text).map_err(ImageRefError)
    }

    fn parse_line(text: &str) -> Result<ImageRef, String> {
        let wanted = "name it as HOST/REPO@sha256:HEX";
        let Some((name, digest)) = text.split_once('@') else {
            let what = if text
                .rsplit('/')
                .next()
                .is_some_and(|last| last.contains(':'))
            {
                "is named by a tag, which can move"
            } else {
                "has no digest"
            };
            return Err(format!("image {text} {what}; {wanted}"));
        };
        let digest = Digest::parse(digest)
            .map_err(|_| format!("image {text}: {digest} is not sha256:<64 hex>; {wanted}"))?;
        let Some((host, repository)) = name.split_once('/') else {
            return Err(format!("image {text} names no registry host; {wanted}"));
        };
        let host_like = host.contains('.') || host.contains(':') || host == "localhost";
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|part| {
                !part.is_empty()
                    && part.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b)
                    })
            });
        if !host_like {
            return Err(format!("image {text} names no registry host; {wanted}"));
        }
        if repository
            .rsplit('/')
            .next()
            .is_some_and(|last| last.contains(':'))
        {
            return Err(format!(
                "image {text} has both a tag and a digest; {wanted}"
            ));
        }
        if !repo_ok {
            return Err(format!(
                "image {text}: repository {repository} must be lowercase letters, digits, '.', '_', '-' and '/'; {wanted}"
            ));
        }
        Ok(ImageRef {
            host: host.to_string(),
            repository: repository.to_string(),
            digest,
        })
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}@{}", self.host, self.repository, self.digest)
    }
}

serde_as_text!(ImageRef, ImageRef::parse);

/// A registry credential for pulling one image. It travels only in the start command that needs
/// it and is never printed: `Debug` shows the user name alone.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RegistryAuth({}, <password>)", self.username)
    }
}

/// What a run may use beyond the defaults; a runtime that cannot enforce a limit refuses the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// CPU time as thousandths of a core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Gpus::is_none")]
    pub gpus: Gpus,
    /// The most processes (and threads) the run may have at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

impl Resources {
    pub fn is_default(&self) -> bool {
        *self == Resources::default()
    }
}

/// Which accelerators a run is given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gpus {
    #[default]
    None,
    All,
    /// By index or UUID, as `nvidia-smi` lists them.
    Ids(Vec<String>),
}

impl Gpus {
    pub fn is_none(&self) -> bool {
        *self == Gpus::None
    }
}

/// How a run runs, the same from the operator's request through the coordinator's row to the
/// node's start command (flattened into each, so the JSON keeps these fields at its top level).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunOptions {
    /// Arguments after the program: any bytes, a JSON string when UTF-8, else `{"hex": ...}`.
    #[serde(default)]
    pub argv: Vec<Bytes>,
    pub timeout_ms: Option<u64>,
    pub output_limit: Option<u64>,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Input files as `(NAME, digest)`; the node fetches each by digest before the start.
    #[serde(default)]
    pub inputs: Vec<(String, Digest)>,
    #[serde(default, skip_serializing_if = "Resources::is_default")]
    pub resources: Resources,
}

/// How a run ended, whichever runtime ran it. Fields a runtime cannot know stay `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The exit code when the program exited by itself.
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    /// Its timeout ended it.
    pub timed_out: bool,
    /// An operator's stop ended it.
    pub stopped: bool,
    /// The kernel killed it for memory; `None` where the runtime cannot tell.
    pub oom_killed: Option<bool>,
    pub stdout: Option<OutputEnd>,
    pub stderr: Option<OutputEnd>,
    /// RFC 3339, by the node's clock.
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
}

/// One output stream as it ended: everything written is counted and hashed, the end is kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputEnd {
    pub bytes: u64,
    pub kept: u64,
    pub truncated: bool,
    pub sha256: Digest,
    /// The last bytes written (up to 1 KiB).
    pub last: Bytes,
}

/// What a state change carries: the outcome once there is one, the reason a run failed or was
/// lost, and the runtime's own record, opaque to the coordinator.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub detail: serde_json::Value,
}

impl RunReport {
    /// A report that only says why.
    pub fn error(reason: impl Into<String>) -> RunReport {
        RunReport {
            error: Some(reason.into()),
            ..RunReport::default()
        }
    }
}

/// One run state change, as the node spools it and sends it; the coordinator dedupes by `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Stable and monotonic across restarts; never reused, starting at 1.
    pub id: u64,
    pub run_id: RunId,
    pub state: RunState,
    #[serde(default)]
    pub report: RunReport,
    /// When the agent recorded it, in milliseconds since the Unix epoch (the node's clock).
    pub at_unix_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_move_only_forward() {
        use RunState::*;
        assert!(Waiting.may_become(Starting));
        assert!(Starting.may_become(Finished));
        assert!(!Running.may_become(Starting));
        assert!(!Finished.may_become(Lost));
        assert!(!Lost.may_become(Finished));
    }

    #[test]
    fn an_unknown_state_does_not_parse() {
        let err = serde_json::from_str::<RunState>(r#""paused""#).unwrap_err();
        assert!(
            err.to_string().contains("unknown variant `paused`"),
            "{err}"
        );
    }

    #[test]
    fn an_image_workload_travels_as_its_name_and_a_tag_is_refused_on_reading() {
        let name = format!("127.0.0.1:5000/tools/sh@sha256:{}", "ab".repeat(32));
        let workload = Workload::Image(ImageRef::parse(&name).unwrap());
        let wire = serde_json::to_value(&workload).unwrap();
        assert_eq!(wire, serde_json::json!({ "image": name }));
        assert_eq!(serde_json::from_value::<Workload>(wire).unwrap(), workload);
        let tagged = serde_json::json!({ "image": "127.0.0.1:5000/tools/sh:latest" });
        let err = serde_json::from_value::<Workload>(tagged).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image 127.0.0.1:5000/tools/sh:latest is named by a tag, which can move; name it as HOST/REPO@sha256:HEX"
        );
    }

    #[test]
    fn an_image_is_named_by_digest_only() {
        let hex = "ab".repeat(32);
        let image = ImageRef::parse(&format!("127.0.0.1:5000/tools/sh@sha256:{hex}")).unwrap();
        assert_eq!(
            (image.host.as_str(), image.repository.as_str()),
            ("127.0.0.1:5000", "tools/sh")
        );
        assert_eq!(
            image.to_string(),
            format!("127.0.0.1:5000/tools/sh@sha256:{hex}")
        );
        let refused = |text: &str| ImageRef::parse(text).unwrap_err().to_string();
        assert_eq!(
            refused("registry.example/sh:1.0"),
            "image registry.example/sh:1.0 is named by a tag, which can move; name it as HOST/REPO@sha256:HEX"
        );
        assert_eq!(
            refused("sh@sha256:00"),
            "image sh@sha256:00: sha256:00 is not sha256:<64 hex>; name it as HOST/REPO@sha256:HEX"
        );
        assert_eq!(
            refused(&format!("library/sh@sha256:{hex}")),
            format!(
                "image library/sh@sha256:{hex} names no registry host; name it as HOST/REPO@sha256:HEX"
            )
        );
        assert_eq!(
            refused(&format!("r.example/sh:1@sha256:{hex}")),
            format!(
                "image r.example/sh:1@sha256:{hex} has both a tag and a digest; name it as HOST/REPO@sha256:HEX"
            )
        );
    }

    #[test]
    fn a_credential_never_prints_its_password() {
        let auth = RegistryAuth {
            username: "ci".into(),
            password: "s3cr?t>".into(),
        };
        assert_eq!(format!("{auth:?}"), "RegistryAuth(ci, <password>)");
    }

    #[test]
    fn argv_carries_any_bytes() {
        let options = RunOptions {
            argv: vec![Bytes(b"plain".to_vec()), Bytes(vec![0xff, 0x00])],
            ..RunOptions::default()
        };
        let json = serde_json::to_value(&options).unwrap();
        assert_eq!(
            json["argv"],
            serde_json::json!(["plain", { "hex": "ff00" }])
        );
        let back: RunOptions = serde_json::from_value(json).unwrap();
        assert_eq!(back, options);
    }
}
