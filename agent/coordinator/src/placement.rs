//! Placement: `run --where EXPR [--count K]` picks nodes by their facts and labels. An expression
//! is terms joined by `,` (all must hold), each `KEY OP VALUE` with OP one of `=`, `!=`, `>=`,
//! `<=`, `>`, `<`: `arch=arm64`, `gpus>=1`, `label.pool=lab`, `cap=gpu`, `memory>=8GiB`.
use crate::store::NodeRecord;
use fleet_proto::NodeId;
use fleet_proto::facts::Facts;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// The keys an expression may name, for the message that refuses another.
const KNOWN: &str = "arch, os, kernel, version, name, cpus, gpus, memory, disk, cap, label.KEY";

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

impl Selector {
    /// Reads an expression; the error is one line naming what is wrong and what is known.
    pub fn parse(text: &str) -> Result<Selector, String> {
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
        self.terms.iter().all(|t| t.matches(node))
    }
}

/// The nodes `selector` may place a run on at `now` (holding their lease, taking runs, matching),
/// each with the runs it holds, those holding the fewest first.
pub fn candidates<'a>(
    nodes: &'a [NodeRecord],
    out: &BTreeMap<NodeId, u64>,
    selector: &Selector,
    now: u64,
) -> Vec<(u64, &'a NodeRecord)> {
    let mut matching: Vec<(u64, &NodeRecord)> = (nodes.iter())
        .filter(|n| n.takes_runs() && now < n.lease_until_ms && selector.matches(*n))
        .map(|n| (out.get(&n.id).copied().unwrap_or(0), n))
        .collect();
    matching.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.id.cmp(&b.1.id)));
    matching
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

described_by_fields!(NodeRecord);

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
        let numeric = matches!(key, Key::Cpus | Key::Gpus | Key::Memory | Key::Disk);
        if numeric && quantity(value).is_none() {
            return Err(format!(
                "--where term {part:?}: {value:?} is not a number{}",
                match key {
                    Key::Memory | Key::Disk => " of bytes (such as 8GiB)",
                    _ => "",
                }
            ));
        }
        if !numeric && !matches!(op, Op::Eq | Op::Ne) {
            return Err(format!(
                "--where term {part:?}: only = and != compare text; >, <, >= and <= are for cpus, gpus, memory and disk"
            ));
        }
        Ok(Term {
            key,
            op,
            value: value.to_string(),
        })
    }

    fn matches(&self, node: &impl Described) -> bool {
        let facts = node.facts();
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

/// A count, or bytes with a binary or decimal unit.
fn quantity(text: &str) -> Option<u64> {
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
    type Error = String;
    fn try_from(text: String) -> Result<Selector, String> {
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
                    })
                    .collect(),
                max_runs: None,
                measured_link: None,
                release: None,
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
        let err = |t| Selector::parse(t).unwrap_err();
        assert_eq!(
            err("colour=red"),
            "--where names \"colour\", which is not a fact: the keys are arch, os, kernel, version, name, cpus, gpus, memory, disk, cap, label.KEY"
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
}
