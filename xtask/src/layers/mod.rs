//! `cargo xtask layers`: the map's checkable claims, checked. ARCHITECTURE.md holds one
//! ```` ```layers ```` block naming each crate's modules in layers, bottom to top; this reads the
//! `use` lines and paths of every source file and fails, naming the file and line, on an import
//! that points up a layer, an import cycle among the modules of any folder, a module the block
//! does not place, a public module list that drifted, a package depending across or up the
//! package order, and a public function that returns `Result<_, String>`.
mod graph;
mod source;
mod spec;

use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use graph::Tree;

/// What the check found, beside what it counts.
#[derive(Debug, Default)]
pub struct Findings {
    pub problems: Vec<String>,
    pub counts: Vec<String>,
}

pub fn run(graph: bool) -> Result<()> {
    let root = crate::util::root();
    let mut findings = check_sources(&root)?;
    if graph {
        let spec = spec::Spec::parse(&std::fs::read_to_string(root.join("ARCHITECTURE.md"))?)?;
        for krate in &spec.crates {
            eprintln!("{}:", krate.root.display());
            for line in Tree::read(&root, &krate.root)?.top_edges() {
                eprintln!("  {line}");
            }
        }
    }
    check_packages(&root, &mut findings)?;
    for line in &findings.counts {
        eprintln!("{line}");
    }
    if findings.problems.is_empty() {
        eprintln!("layers: every import points down or across, no cycle, the map's lists hold");
        return Ok(());
    }
    for problem in &findings.problems {
        eprintln!("{problem}");
    }
    bail!(
        "{} layer problem(s): move the item down a layer (or the module up in ARCHITECTURE.md's layers block), then rerun `cargo xtask layers`",
        findings.problems.len()
    )
}

/// Checks every crate the block names, in the checkout at `root`.
pub fn check_sources(root: &Path) -> Result<Findings> {
    let map =
        std::fs::read_to_string(root.join("ARCHITECTURE.md")).context("reading ARCHITECTURE.md")?;
    let spec = spec::Spec::parse(&map)?;
    let mut findings = Findings::default();
    let mut coordinator_methods = 0;
    for krate in &spec.crates {
        let tree = Tree::read(root, &krate.root)?;
        tree.check(krate, &mut findings);
        let (upward, cycles) = tree.count(krate);
        if krate.root.ends_with("coordinator/src/lib.rs") {
            coordinator_methods = tree.inherent_methods("Coordinator");
        }
        let main_lines = krate
            .root
            .ends_with("main.rs")
            .then(|| line_count(&root.join(&krate.root)));
        findings.counts.push(format!(
            "{}: {} modules, {} public, {} import(s) up, {} cycle(s), {} public fn(s) returning Result<_, String>{}",
            krate.root.display(),
            tree.len(),
            tree.public().len(),
            upward,
            cycles,
            tree.string_errors(),
            main_lines.map(|n| format!(", {n} lines")).unwrap_or_default(),
        ));
    }
    findings.counts.push(format!(
        "inherent methods on Coordinator: {coordinator_methods}"
    ));
    Ok(findings)
}

/// Each workspace package depends only on packages in lower levels of the block's order, and
/// every library and binary of the workspace is a crate the block names.
fn check_packages(root: &Path, findings: &mut Findings) -> Result<()> {
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md"))?;
    let spec = spec::Spec::parse(&map)?;
    let out = std::process::Command::new("cargo")
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let packages = meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?;
    let level: BTreeMap<&str, usize> = spec
        .packages
        .iter()
        .enumerate()
        .flat_map(|(n, names)| names.iter().map(move |name| (name.as_str(), n)))
        .collect();
    let named: Vec<&PathBuf> = spec.crates.iter().map(|c| &c.root).collect();
    for package in packages {
        let name = package["name"].as_str().unwrap_or_default();
        let Some(&mine) = level.get(name) else {
            findings.problems.push(format!(
                "package {name} is in no level of the block's `packages` line: add it"
            ));
            continue;
        };
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or_default();
            let normal = dep["kind"].is_null() || dep["kind"] == "build";
            if let (true, Some(&theirs)) = (normal, level.get(dep_name))
                && theirs >= mine
            {
                findings.problems.push(format!(
                    "package {name} depends on {dep_name}, which is not below it in the block's `packages` line"
                ));
            }
        }
        for target in package["targets"].as_array().into_iter().flatten() {
            let kinds = target["kind"].as_array().into_iter().flatten();
            if !kinds.into_iter().any(|k| k == "lib" || k == "bin") {
                continue;
            }
            let src = PathBuf::from(target["src_path"].as_str().unwrap_or_default());
            let relative = src.strip_prefix(root).unwrap_or(&src).to_path_buf();
            if !named.contains(&&relative) {
                findings.problems.push(format!(
                    "{}: a crate root the layers block does not name: add a `crate {}` entry",
                    relative.display(),
                    relative.display()
                ));
            }
        }
    }
    Ok(())
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy of the checkout's ARCHITECTURE.md and the sources the block names.
    fn copy_of_checkout() -> tempdir::TempDir {
        let root = crate::util::root();
        let dir = tempdir::TempDir::new();
        let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        std::fs::write(dir.path().join("ARCHITECTURE.md"), &map).unwrap();
        for krate in spec::Spec::parse(&map).unwrap().crates {
            let src = krate.root.parent().unwrap();
            copy_tree(&root.join(src), &dir.path().join(src));
        }
        dir
    }

    fn copy_tree(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy_tree(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }

    #[test]
    fn main_passes_and_a_planted_upward_import_fails_naming_file_and_line() {
        let copy = copy_of_checkout();
        let clean = check_sources(copy.path()).unwrap();
        assert_eq!(
            clean.problems,
            Vec::<String>::new(),
            "the checkout itself passes"
        );

        let store = copy.path().join("agent/coordinator/src/store/mod.rs");
        let text = std::fs::read_to_string(&store).unwrap();
        let lines = text.lines().count();
        std::fs::write(
            &store,
            format!("{text}\n#[allow(unused_imports)]\nuse crate::runs::RunRequest;\n"),
        )
        .unwrap();
        let planted = check_sources(copy.path()).unwrap();
        let expected = format!(
            "agent/coordinator/src/store/mod.rs:{}: `crate::runs::RunRequest`",
            lines + 3
        );
        assert!(
            planted
                .problems
                .iter()
                .any(|p| p.starts_with(&expected) && p.contains("points up")),
            "{:?}",
            planted.problems
        );
    }

    #[test]
    fn a_planted_cycle_fails_naming_both_ends() {
        let copy = copy_of_checkout();
        let cli = copy.path().join("agent/cli/src");
        std::fs::write(
            cli.join("duration.rs"),
            "pub use crate::logging::X;\npub struct D;\n",
        )
        .unwrap();
        let logging = std::fs::read_to_string(cli.join("logging.rs")).unwrap();
        std::fs::write(
            cli.join("logging.rs"),
            format!("{logging}\npub struct X(crate::duration::D);\n"),
        )
        .unwrap();
        let found = check_sources(copy.path()).unwrap();
        let cycle = found
            .problems
            .iter()
            .find(|p| p.contains("cycle"))
            .expect("a cycle is found");
        assert!(cycle.contains("agent/cli/src/duration.rs:1"), "{cycle}");
        assert!(cycle.contains("agent/cli/src/logging.rs:"), "{cycle}");
    }

    /// A temporary folder removed on drop (xtask takes no tempfile dependency for this).
    mod tempdir {
        pub struct TempDir(std::path::PathBuf);
        impl TempDir {
            pub fn new() -> TempDir {
                static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path =
                    std::env::temp_dir().join(format!("xtask-layers-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&path).unwrap();
                TempDir(path)
            }
            pub fn path(&self) -> &std::path::Path {
                &self.0
            }
        }
        impl Drop for TempDir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}
