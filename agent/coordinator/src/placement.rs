//! Placement: `run --where EXPR [--count K]` picks nodes by their facts and labels. An expression
//! is terms joined by `,` (all must hold), each `KEY OP VALUE` with OP one of `=`, `!=`, `>=`,
//! `<=`, `>`, `<`: `arch=arm64`, `gpus>=1`, `gpu.vendor=amd`, `label.pool=lab`, `cap=gpu`,
//! `memory>=8GiB`, `link>=100MB/s`. A node that never measured its link counts at the rate and
//! confidence the expression assumes (`assumed_link=RATE`, `assumed_link_confidence=F`;
//! by default 0 B/s, so no floor is met, at [`ASSUMED_LINK_CONFIDENCE`]).
use fleet_proto::NodeId;
use fleet_proto::facts::Facts;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// The keys an expression may name, for the message that refuses another.
const KNOWN: &str = "arch, os, kernel, version, name, cpus, gpus, gpu.vendor, gpu.arch, memory, disk, link, link_confidence, assumed_link, assumed_link_confidence, cap, label.KEY";

/// What a guess about a path never measured is worth: less than a node's own reading (0.9).
pub const ASSUMED_LINK_CONFIDENCE: f64 = 0.5;

/// A parsed `--where` expression; on the wire, its text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Selector {
    terms: Vec<Term>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Term {
    key: Key,
    op: Op,
    value: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Key {
    /// Compared as text (`arch` with its aliases: arm64 is aarch64, amd64 is x86_64).
    Arch,
    Os,
    Kernel,
    Version,
    Name,
    /// Compared as numbers.
    Cpus,
    Gpus,
    /// Bytes, with an optional unit (KiB, MiB, GiB, TiB, or KB, MB, GB, TB).
    Memory,
    Disk,
    /// Any of its GPUs is of this vendor (`nvidia`, `amd`, `intel`), or of this arch (`gfx1201`).
    GpuVendor,
    GpuArch,
    /// The measured link, a rate (`100MB/s`, `1Gbit/s`), and the confidence of its reading (0 to 1).
    Link,
    LinkConfidence,
    /// What a node that never measured its link counts as: not a test, always holds.
    AssumedLink,
    AssumedLinkConfidence,
    /// A capability: `gpu` when the machine has an accelerator, and each name in its label
    /// `caps` (a comma-separated list, `token --label caps=build,docker`).
    Cap,
    Label(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Ge,
    Le,
    Gt,
    Lt,
}

impl Op {
    fn text(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "!=",
            Op::Ge => ">=",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Lt => "<",
        }
    }
}

/// Why a `--where` expression cannot be read, in one line: what is wrong and what is known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(String);

impl Selector {
    /// Reads an expression; the error is one line naming what is wrong and what is known.
    pub fn parse(text: &str) -> Result<Selector, SelectorError> {
        Self::parse_line(text).map_err(SelectorError)
    }

    fn parse_line(text: &str) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for part in text.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(format!(
                    "--where {text:?} has an empty term: write KEY=VALUE terms joined by commas, such as arch=arm64,gpus>=1"
                ));
            }
            terms.push(Term::parse(part)?);
        }
        Ok(Selector { terms })
    }

    /// Whether the node's facts and labels satisfy every term. A node that has not reported its
    /// facts yet matches only terms on its name and labels.
    pub fn matches(&self, node: &impl Described) -> bool {
        let assumed = self.assumed_link();
        self.terms.iter().all(|t| t.matches(node, assumed))
    }

    /// The link a node that never measured one counts at: bytes a second and confidence.
    pub fn assumed_link(&self) -> Link {
        let term = |key: Key| self.terms.iter().find(|t| t.key == key);
        Link {
            bytes_per_s: term(Key::AssumedLink)
                .and_then(|t| rate(&t.value))
                .unwrap_or(0),
            confidence: (term(Key::AssumedLinkConfidence))
                .and_then(|t| confidence(&t.value))
                .unwrap_or(ASSUMED_LINK_CONFIDENCE),
        }
    }
}

/// A node's link as placement weighs it: measured, or assumed for one never measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bytes_per_s: u64,
    pub confidence: f64,
}

/// The node's measured link, else `assumed`; None before it reported any facts.
pub fn link_of(node: &impl Described, assumed: Link) -> Option<Link> {
    let facts = node.facts()?;
    Some(match &facts.measured_link {
        Some(m) => Link {
            bytes_per_s: m.bytes_per_s,
            confidence: m.confidence,
        },
        None => assumed,
    })
}

/// What orders the matching nodes before the least loaded (`run --prefer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preference {
    /// The fastest link first (measured, or as the expression assumes).
    Link,
    /// The nodes already holding the run's program or image (and inputs) first.
    Content,
}

impl std::str::FromStr for Preference {
    type Err = String;
    fn from_str(text: &str) -> Result<Preference, String> {
        match text {
            "link" => Ok(Preference::Link),
            "content" => Ok(Preference::Content),
            other => Err(format!(
                "--prefer {other:?} is not known: prefer link or content"
            )),
        }
    }
}

/// Reorders `matching` (least loaded first) by `preference`, keeping the load order among
/// equals: the fastest link first, or the most of `content` already held first.
pub fn prefer<N: Described>(
    matching: &mut [(u64, &N)],
    preference: Preference,
    selector: &Selector,
    content: &[fleet_proto::Digest],
) {
    match preference {
        Preference::Link => {
            let assumed = selector.assumed_link();
            let speed = |n: &N| link_of(n, assumed).map_or(0, |l| l.bytes_per_s);
            matching.sort_by_key(|(_, n)| std::cmp::Reverse(speed(n)));
        }
        Preference::Content => {
            let held = |n: &N| {
                let inventory = n.facts().and_then(|f| f.content.as_ref());
                inventory.map_or(0, |i| content.iter().filter(|d| i.holds(d)).count())
            };
            matching.sort_by_key(|(_, n)| std::cmp::Reverse(held(n)));
        }
    }
}

/// The nodes `selector` may place a run on at `now` (holding their lease, taking runs, matching),
/// each with the runs it holds, those holding the fewest first.
pub fn candidates<'a, N: Candidate>(
    nodes: &'a [N],
    out: &BTreeMap<NodeId, u64>,
    selector: &Selector,
    now: u64,
) -> Vec<(u64, &'a N)> {
    let mut matching: Vec<(u64, &N)> = (nodes.iter())
        .filter(|n| n.available(now) && selector.matches(*n))
        .map(|n| (out.get(n.id()).copied().unwrap_or(0), n))
        .collect();
    matching.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.id().cmp(b.1.id())));
    matching
}

/// A node a run may be placed on: what an expression reads of it, its id, and whether it takes
/// runs at a moment (the store's node record is one).
pub trait Candidate: Described {
    fn id(&self) -> &NodeId;
    /// Holding its lease at `now` and taking runs (not drained, not ended).
    fn available(&self, now: u64) -> bool;
}

/// What an expression reads of a node: its facts, name and labels (a stored node, or a row of
/// `nodes`).
pub trait Described {
    fn facts(&self) -> Option<&Facts>;
    fn name(&self) -> Option<&str>;
    fn labels(&self) -> &BTreeMap<String, String>;
}

/// [`Described`] for a type with `facts`, `name` and `labels` fields of those types.
macro_rules! described_by_fields {
    ($type:ty) => {
        impl $crate::placement::Described for $type {
            fn facts(&self) -> Option<&fleet_proto::facts::Facts> {
                self.facts.as_ref()
            }
            fn name(&self) -> Option<&str> {
                self.name.as_deref()
            }
            fn labels(&self) -> &std::collections::BTreeMap<String, String> {
                &self.labels
            }
        }
    };
}
pub(crate) use described_by_fields;

impl Term {
    fn parse(part: &str) -> Result<Term, String> {
        // The two-character operators first, so `>=` is not read as `>`.
        let ops = [Op::Ne, Op::Ge, Op::Le, Op::Eq, Op::Gt, Op::Lt];
        let found = ops
            .iter()
            .filter_map(|op| part.find(op.text()).map(|at| (at, *op)))
            .min_by_key(|(at, op)| (*at, std::cmp::Reverse(op.text().len())));
        let Some((at, op)) = found else {
            return Err(format!(
                "--where term {part:?} has no operator: write KEY OP VALUE with OP one of = != >= <= > <"
            ));
        };
        let (key, value) = (part[..at].trim(), part[at + op.text().len()..].trim());
        if value.is_empty() {
            return Err(format!(
                "--where term {part:?} has no value after {}",
                op.text()
            ));
        }
        let key = match key {
            "arch" => Key::Arch,
            "os" => Key::Os,
            "kernel" => Key::Kernel,
            "version" => Key::Version,
            "name" => Key::Name,
            "cpus" => Key::Cpus,
            "gpus" => Key::Gpus,
            "memory" => Key::Memory,
            "disk" => Key::Disk,
            "gpu.vendor" => Key::GpuVendor,
            "gpu.arch" => Key::GpuArch,
            "link" => Key::Link,
            "link_confidence" => Key::LinkConfidence,
            "assumed_link" => Key::AssumedLink,
            "assumed_link_confidence" => Key::AssumedLinkConfidence,
            "cap" => Key::Cap,
            k if k.starts_with("label.") && k.len() > "label.".len() => {
                Key::Label(k["label.".len()..].to_string())
            }
            other => {
                return Err(format!(
                    "--where names {other:?}, which is not a fact: the keys are {KNOWN}"
                ));
            }
        };
        match key {
            Key::Link | Key::AssumedLink if rate(value).is_none() => {
                return Err(format!(
                    "--where term {part:?}: {value:?} is not a rate: write a number, a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, kbit, Mbit or Gbit) and /s, such as 100MB/s"
                ));
            }
            Key::LinkConfidence | Key::AssumedLinkConfidence if confidence(value).is_none() => {
                return Err(format!(
                    "--where term {part:?}: {value:?} is not a confidence: write a number from 0 to 1, such as 0.5"
                ));
            }
            Key::AssumedLink | Key::AssumedLinkConfidence if op != Op::Eq => {
                return Err(format!(
                    "--where term {part:?}: an assumption is set with =, such as assumed_link=20MB/s"
                ));
            }
            Key::GpuVendor => {
                value
                    .parse::<fleet_proto::facts::GpuVendor>()
                    .map_err(|e| format!("--where term {part:?}: {e}"))?;
            }
            _ => {}
        }
        let numeric = matches!(key, Key::Cpus | Key::Gpus | Key::Memory | Key::Disk);
        let measured = matches!(key, Key::Link | Key::LinkConfidence);
        if numeric && quantity(value).is_none() {
            return Err(format!(
                "--where term {part:?}: {value:?} is not a number{}",
                match key {
                    Key::Memory | Key::Disk =>
                        " of bytes: write a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB or TiB), such as 8GiB",
                    _ => "",
                }
            ));
        }
        if !numeric && !measured && !matches!(op, Op::Eq | Op::Ne) {
            return Err(format!(
                "--where term {part:?}: only = and != compare text; >, <, >= and <= are for cpus, gpus, memory, disk, link and link_confidence"
            ));
        }
        Ok(Term {
            key,
            op,
            value: value.to_string(),
        })
    }

    fn matches(&self, node: &impl Described, assumed: Link) -> bool {
        let facts = node.facts();
        let compare = |ordering: Option<std::cmp::Ordering>| {
            use std::cmp::Ordering::*;
            match (self.op, ordering) {
                (_, None) => false,
                (Op::Eq, Some(o)) => o == Equal,
                (Op::Ne, Some(o)) => o != Equal,
                (Op::Ge, Some(o)) => o != Less,
                (Op::Le, Some(o)) => o != Greater,
                (Op::Gt, Some(o)) => o == Greater,
                (Op::Lt, Some(o)) => o == Less,
            }
        };
        let gpu_has = |has: &dyn Fn(&fleet_proto::facts::Accelerator) -> bool| {
            let any = facts.is_some_and(|f| f.accelerators.iter().any(has));
            if self.op == Op::Eq { any } else { !any }
        };
        let link = link_of(node, assumed);
        let text = |have: Option<&str>| {
            let equal = have == Some(self.value.as_str());
            if self.op == Op::Eq { equal } else { !equal }
        };
        let number = |have: Option<u64>| {
            let (Some(have), Some(want)) = (have, quantity(&self.value)) else {
                return false;
            };
            match self.op {
                Op::Eq => have == want,
                Op::Ne => have != want,
                Op::Ge => have >= want,
                Op::Le => have <= want,
                Op::Gt => have > want,
                Op::Lt => have < want,
            }
        };
        match &self.key {
            Key::Arch => {
                let have = facts.map(|f| canonical_arch(&f.arch));
                let equal = have == Some(canonical_arch(&self.value));
                if self.op == Op::Eq { equal } else { !equal }
            }
            Key::Os => text(facts.map(|f| f.os.as_str())),
            Key::Kernel => text(facts.map(|f| f.kernel.as_str())),
            Key::Version => text(facts.map(|f| f.agent_version.as_str())),
            Key::Name => text(node.name()),
            Key::Cpus => number(facts.map(|f| f.cpus as u64)),
            Key::Gpus => number(facts.map(|f| f.accelerators.len() as u64)),
            Key::Memory => number(facts.map(|f| f.memory_bytes)),
            Key::Disk => number(facts.map(|f| f.disk_free_bytes)),
            Key::GpuVendor => gpu_has(&|g| g.vendor.as_str() == self.value),
            Key::GpuArch => gpu_has(&|g| g.arch.as_deref() == Some(self.value.as_str())),
            Key::Link => compare(
                link.zip(rate(&self.value))
                    .map(|(l, want)| l.bytes_per_s.cmp(&want)),
            ),
            Key::LinkConfidence => compare(
                link.zip(confidence(&self.value))
                    .and_then(|(l, want)| l.confidence.partial_cmp(&want)),
            ),
            Key::AssumedLink | Key::AssumedLinkConfidence => true,
            Key::Cap => {
                let has = capabilities(facts, node).any(|c| c == self.value);
                if self.op == Op::Eq { has } else { !has }
            }
            Key::Label(k) => text(node.labels().get(k).map(String::as_str)),
        }
    }
}

/// What the machine can do: `gpu` from its facts, and the names in its label `caps`.
fn capabilities<'a>(
    facts: Option<&'a Facts>,
    node: &'a impl Described,
) -> impl Iterator<Item = &'a str> {
    let gpu = facts
        .is_some_and(|f| !f.accelerators.is_empty())
        .then_some("gpu");
    let listed = node
        .labels()
        .get("caps")
        .into_iter()
        .flat_map(|v| v.split(','));
    gpu.into_iter().chain(listed.map(str::trim))
}

/// One spelling per architecture: Debian's and OCI's names are Rust's.
fn canonical_arch(arch: &str) -> &str {
    match arch {
        "arm64" => "aarch64",
        "amd64" => "x86_64",
        other => other,
    }
}

/// Bytes a second: a byte quantity or bits (`kbit`, `Mbit`, `Gbit`) followed by `/s`.
fn rate(text: &str) -> Option<u64> {
    let per_s = text.trim().strip_suffix("/s")?;
    for (unit, bits) in [
        ("kbit", 1_000u64),
        ("Mbit", 1_000_000),
        ("Gbit", 1_000_000_000),
    ] {
        if let Some(n) = per_s.strip_suffix(unit) {
            return n.trim().parse::<u64>().ok()?.checked_mul(bits / 8);
        }
    }
    quantity(per_s)
}

/// A confidence: a number from 0 to 1.
fn confidence(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|c| (0.0..=1.0).contains(c))
}

/// A count, or bytes with a binary or decimal unit (`8GiB`, `10GB`).
pub fn quantity(text: &str) -> Option<u64> {
    let at = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(at);
    let n: u64 = digits.parse().ok()?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(scale)
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in self.terms.iter().enumerate() {
            let key = match &t.key {
                Key::Arch => "arch".to_string(),
                Key::Os => "os".into(),
                Key::Kernel => "kernel".into(),
                Key::Version => "version".into(),
                Key::Name => "name".into(),
                Key::Cpus => "cpus".into(),
                Key::Gpus => "gpus".into(),
                Key::Memory => "memory".into(),
                Key::Disk => "disk".into(),
                Key::GpuVendor => "gpu.vendor".into(),
                Key::GpuArch => "gpu.arch".into(),
                Key::Link => "link".into(),
                Key::LinkConfidence => "link_confidence".into(),
                Key::AssumedLink => "assumed_link".into(),
                Key::AssumedLinkConfidence => "assumed_link_confidence".into(),
                Key::Cap => "cap".into(),
                Key::Label(k) => format!("label.{k}"),
            };
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{key}{}{}", t.op.text(), t.value)?;
        }
        Ok(())
    }
}

impl TryFrom<String> for Selector {
    type Error = SelectorError;
    fn try_from(text: String) -> Result<Selector, SelectorError> {
        Selector::parse(&text)
    }
}

impl From<Selector> for String {
    fn from(s: Selector) -> String {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::NodeRecord;
    use fleet_proto::NodeId;
    use fleet_proto::facts::Accelerator;

    fn node(arch: &str, gpus: usize, labels: &[(&str, &str)]) -> NodeRecord {
        NodeRecord {
            id: NodeId::new("n-1"),
            public_key: "ed25519:k".into(),
            name: Some("m1".into()),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            facts: Some(Facts {
                arch: arch.into(),
                cpus: 4,
                memory_bytes: 8 << 30,
                disk_free_bytes: 100 << 30,
                kernel: "6.1.0".into(),
                os: "Debian GNU/Linux 12 (bookworm)".into(),
                agent_version: "0.1.0".into(),
                accelerators: (0..gpus)
                    .map(|i| Accelerator {
                        index: i as u32,
                        name: "H200".into(),
                        uuid: format!("GPU-{i}"),
                        memory_mib: 143_771,
                        driver: "550".into(),
                        vendor: Default::default(),
                        arch: None,
                    })
                    .collect(),
                max_runs: None,
                measured_link: None,
                release: None,
                engine: None,
                content: None,
            }),
            joined_at_ms: 0,
            last_heartbeat_ms: None,
            lease_until_ms: 0,
            generation: 0,
            last_event_id: 0,
            session_at: None,
            drained_since_ms: None,
            ended: None,
            idle_since_ms: None,
            protocol: None,
            capacity: None,
        }
    }

    fn matches(expr: &str, n: &NodeRecord) -> bool {
        Selector::parse(expr).unwrap().matches(n)
    }

    #[test]
    fn terms_hold_together_on_facts_labels_and_capabilities() {
        let arm = node("aarch64", 2, &[("pool", "lab"), ("caps", "build, docker")]);
        let x86 = node("x86_64", 0, &[]);
        assert!(matches("arch=arm64", &arm) && !matches("arch=arm64", &x86));
        assert!(matches("arch=amd64", &x86) && matches("arch!=arm64", &x86));
        assert!(matches("gpus>=1", &arm) && !matches("gpus>=1", &x86));
        assert!(matches("gpus>1,gpus<3,gpus=2", &arm));
        assert!(matches("label.pool=lab", &arm) && !matches("label.pool=lab", &x86));
        assert!(matches("label.pool!=lab", &x86));
        assert!(matches("cap=gpu", &arm) && matches("cap=docker", &arm));
        assert!(!matches("cap=gpu", &x86) && matches("cap!=gpu", &x86));
        assert!(matches("memory>=8GiB,disk>50GB,cpus=4", &arm));
        assert!(!matches("memory>8GiB", &arm));
        assert!(matches("name=m1, arch = aarch64", &arm));
        let mut blank = node("x86_64", 0, &[("pool", "lab")]);
        blank.facts = None;
        assert!(matches("label.pool=lab", &blank) && !matches("arch=x86_64", &blank));
        assert!(!matches("cpus>=1", &blank), "no facts, no number");
    }

    #[test]
    fn an_expression_reads_back_as_it_was_written() {
        for text in [
            "arch=arm64",
            "gpus>=1,label.pool=lab",
            "memory<=8GiB,cap!=gpu",
        ] {
            let s = Selector::parse(text).unwrap();
            assert_eq!(s.to_string(), text);
            let wire = serde_json::to_string(&s).unwrap();
            assert_eq!(serde_json::from_str::<Selector>(&wire).unwrap(), s);
        }
    }

    #[test]
    fn a_bad_expression_is_one_line_naming_what_is_known() {
        let err = |t| Selector::parse(t).unwrap_err().to_string();
        assert_eq!(
            err("colour=red"),
            "--where names \"colour\", which is not a fact: the keys are arch, os, kernel, version, name, cpus, gpus, gpu.vendor, gpu.arch, memory, disk, link, link_confidence, assumed_link, assumed_link_confidence, cap, label.KEY"
        );
        assert!(err("arch").contains("has no operator"), "{}", err("arch"));
        assert!(err("gpus>=many").contains("is not a number"));
        assert!(err("memory>=8 lots").contains("of bytes"));
        assert!(err("arch>arm64").contains("only = and != compare text"));
        assert!(err("arch=arm64,").contains("empty term"));
        assert!(err("arch=").contains("has no value"));
        assert!(err("label.=x").contains("not a fact"));
        for e in [err("colour=red"), err("arch"), err("gpus>=many")] {
            assert_eq!(e.lines().count(), 1);
        }
    }

    fn with_link(mut n: NodeRecord, bytes_per_s: Option<u64>) -> NodeRecord {
        let facts = n.facts.as_mut().unwrap();
        facts.measured_link = bytes_per_s.map(|b| fleet_proto::facts::MeasuredLink {
            bytes_per_s: b,
            age_ms: 0,
            valid_for_ms: 3_600_000,
            confidence: 0.9,
            basis: "whole_copy".into(),
        });
        n
    }

    #[test]
    fn the_link_is_the_measured_rate_or_the_one_the_expression_assumes() {
        let slow = with_link(node("x86_64", 0, &[]), Some(10_000_000));
        let fast = with_link(node("x86_64", 0, &[]), Some(100_000_000));
        let never = with_link(node("x86_64", 0, &[]), None);
        assert!(!matches("link>=50MB/s", &slow) && matches("link>=50MB/s", &fast));
        assert!(matches("link<50MB/s", &slow) && matches("link>=800Mbit/s", &fast));
        assert!(matches("link>=95MiB/s", &fast) && !matches("link>=96MiB/s", &fast));
        assert!(
            !matches("link>=50MB/s", &never),
            "never measured: 0 B/s by default"
        );
        assert!(matches("link>=50MB/s,assumed_link=60MB/s", &never));
        assert!(
            !matches("link>=50MB/s,assumed_link=60MB/s", &slow),
            "a reading beats a guess"
        );
        assert!(matches("link_confidence>=0.9", &fast) && !matches("link_confidence>0.9", &fast));
        assert!(!matches("link_confidence>=0.6", &never), "assumed at 0.5");
        assert!(matches(
            "link_confidence>=0.6,assumed_link_confidence=0.7",
            &never
        ));
        let mut blank = never.clone();
        blank.facts = None;
        assert!(!matches("link<50MB/s", &blank), "no facts, no link");
    }

    #[test]
    fn gpus_are_chosen_by_vendor_and_arch() {
        use fleet_proto::facts::GpuVendor;
        let mut amd = node("x86_64", 1, &[]);
        let gpu = &mut amd.facts.as_mut().unwrap().accelerators[0];
        (gpu.vendor, gpu.arch) = (GpuVendor::Amd, Some("gfx1201".into()));
        let nvidia = node("x86_64", 2, &[]);
        let none = node("x86_64", 0, &[]);
        assert!(matches("gpu.vendor=amd,gpu.arch=gfx1201,gpus>=1", &amd));
        assert!(!matches("gpu.vendor=amd", &nvidia) && matches("gpu.vendor=nvidia", &nvidia));
        assert!(!matches("gpu.arch=gfx942", &amd) && matches("gpu.arch!=gfx942", &amd));
        assert!(matches("gpu.vendor!=amd", &none) && !matches("gpu.vendor=intel", &none));
    }

    #[test]
    fn a_preference_orders_the_matching_before_the_load() {
        let mut a = with_link(node("x86_64", 0, &[]), Some(10_000_000));
        a.id = NodeId::new("n-a");
        let mut b = with_link(node("x86_64", 0, &[]), Some(100_000_000));
        b.id = NodeId::new("n-b");
        let program = fleet_proto::Digest::of(b"program");
        a.facts.as_mut().unwrap().content =
            Some(fleet_proto::facts::ContentInventory::of([program], 0));
        let selector = Selector::parse("arch=x86_64").unwrap();
        let order = |preference| {
            let mut matching = vec![(0, &a), (3, &b)];
            prefer(&mut matching, preference, &selector, &[program]);
            matching
                .iter()
                .map(|(_, n)| n.id.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(order(Preference::Link), ["n-b", "n-a"]);
        assert_eq!(order(Preference::Content), ["n-a", "n-b"]);
        assert_eq!(
            "fastest".parse::<Preference>().unwrap_err(),
            "--prefer \"fastest\" is not known: prefer link or content"
        );
    }

    #[test]
    fn a_bad_rate_vendor_or_confidence_is_one_line() {
        let err = |t| Selector::parse(t).unwrap_err().to_string();
        assert!(
            err("link>=100MB").contains("is not a rate"),
            "{}",
            err("link>=100MB")
        );
        assert!(err("link>=fast/s").contains("is not a rate"));
        assert!(err("link_confidence>=2").contains("from 0 to 1"));
        assert!(err("gpu.vendor=matrox").contains("the vendors are nvidia, amd, intel"));
        assert!(err("gpu.arch>gfx9").contains("only = and != compare text"));
        assert!(err("assumed_link>=1MB/s").contains("is set with ="));
        for e in [err("link>=100MB"), err("gpu.vendor=matrox")] {
            assert_eq!(e.lines().count(), 1);
        }
        let text = "link>=100MB/s,link_confidence>=0.5,assumed_link=20MB/s,gpu.vendor=amd";
        assert_eq!(Selector::parse(text).unwrap().to_string(), text);
    }
}
