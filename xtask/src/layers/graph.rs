//! One crate's module tree, found from its root by `mod NAME;` as rustc finds it, and the
//! imports between sibling modules that the layer rules judge.
use super::Findings;
use super::source::{self, Source};
use super::spec::Crate;
use anyhow::{Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

struct File {
    module: Module,
    path: PathBuf,
    source: Source,
}

/// Where an import was written.
struct Site {
    path: PathBuf,
    line: usize,
    text: String,
}

pub struct Tree {
    files: Vec<File>,
    index: BTreeMap<Module, usize>,
    /// Imports between siblings: (their parent, from, to) and where each was written.
    edges: BTreeMap<(Module, String, String), Vec<Site>>,
}

impl Tree {
    pub fn read(checkout: &Path, root: &Path) -> Result<Tree> {
        let mut files = Vec::new();
        let mut queue = vec![(Module::new(), root.to_path_buf())];
        while let Some((module, path)) = queue.pop() {
            let text = std::fs::read_to_string(checkout.join(&path))
                .with_context(|| format!("reading {}", path.display()))?;
            let source = source::read(&text, &module);
            let dir = match path.file_name().and_then(|n| n.to_str()) {
                Some("lib.rs" | "main.rs" | "mod.rs") => {
                    path.parent().unwrap_or(Path::new("")).to_path_buf()
                }
                _ => path.with_extension(""),
            };
            for (name, _) in &source.modules {
                let flat = dir.join(format!("{name}.rs"));
                let nested = dir.join(name).join("mod.rs");
                let found = [flat, nested]
                    .into_iter()
                    .find(|p| checkout.join(p).is_file());
                if let Some(child) = found {
                    let mut child_module = module.clone();
                    child_module.push(name.clone());
                    queue.push((child_module, child));
                }
            }
            files.push(File {
                module,
                path,
                source,
            });
        }
        files.sort_by(|a, b| a.module.cmp(&b.module));
        let index = files
            .iter()
            .enumerate()
            .map(|(n, f)| (f.module.clone(), n))
            .collect();
        let mut tree = Tree {
            files,
            index,
            edges: BTreeMap::new(),
        };
        tree.edges = tree.sibling_edges();
        Ok(tree)
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// The root's public modules.
    pub fn public(&self) -> Vec<String> {
        let root = &self.files[self.index[&Module::new()]];
        root.source
            .modules
            .iter()
            .filter(|(_, p)| *p)
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub fn string_errors(&self) -> usize {
        self.files
            .iter()
            .map(|f| f.source.string_errors.len())
            .sum()
    }

    pub fn inherent_methods(&self, type_name: &str) -> usize {
        self.files
            .iter()
            .flat_map(|f| &f.source.inherent_methods)
            .filter(|(t, _)| t == type_name)
            .map(|(_, n)| n)
            .sum()
    }

    /// The module a path lands in, following re-exports (`pub use`) to where the item lives.
    fn resolve(&self, path: &[String]) -> Module {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let depth = (0..=path.len())
                .rev()
                .find(|&n| self.index.contains_key(&path[..n]))
                .unwrap_or(0);
            let module = path[..depth].to_vec();
            let Some(next) = path.get(depth) else {
                return module;
            };
            let file = &self.files[self.index[&module]];
            match file
                .source
                .reexports
                .iter()
                .find(|(alias, _)| alias == next)
            {
                Some((_, target)) if !target.starts_with(&path[..depth + 1]) => {
                    path = target.iter().chain(&path[depth + 1..]).cloned().collect();
                }
                _ => return module,
            }
        }
        Module::new()
    }

    fn sibling_edges(&self) -> BTreeMap<(Module, String, String), Vec<Site>> {
        let mut edges: BTreeMap<_, Vec<Site>> = BTreeMap::new();
        for file in &self.files {
            for reference in &file.source.references {
                let to = self.resolve(&reference.path);
                let from = &file.module;
                let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
                if common < from.len() && common < to.len() {
                    edges
                        .entry((
                            from[..common].to_vec(),
                            from[common].clone(),
                            to[common].clone(),
                        ))
                        .or_default()
                        .push(Site {
                            path: file.path.clone(),
                            line: reference.line,
                            text: format!("crate::{}", reference.path.join("::")),
                        });
                }
            }
        }
        edges
    }

    /// `from -> to (N)` for each import between top-level modules.
    pub fn top_edges(&self) -> Vec<String> {
        self.edges
            .iter()
            .filter(|((parent, ..), _)| parent.is_empty())
            .map(|((_, from, to), sites)| format!("{from} -> {to} ({})", sites.len()))
            .collect()
    }

    /// Upward imports (each place written) and cycles (each group of modules).
    pub fn count(&self, krate: &Crate) -> (usize, usize) {
        (self.upward(krate).count(), self.cycles().len())
    }

    fn upward<'a>(&'a self, krate: &'a Crate) -> impl Iterator<Item = (&'a Site, String)> + 'a {
        self.edges
            .iter()
            .filter(|((parent, ..), _)| parent.is_empty())
            .flat_map(move |((_, from, to), sites)| {
                let (Some(a), Some(b)) = (krate.layer_of(from), krate.layer_of(to)) else {
                    return Vec::new();
                };
                if b <= a {
                    return Vec::new();
                }
                let why = format!("points up from {from} (layer {a}) to {to} (layer {b})");
                sites.iter().map(|s| (s, why.clone())).collect()
            })
    }

    /// Groups of sibling modules that import each other, round and round.
    fn cycles(&self) -> Vec<(Module, BTreeSet<String>)> {
        let mut by_parent: BTreeMap<&Module, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
        for (parent, from, to) in self.edges.keys() {
            by_parent
                .entry(parent)
                .or_default()
                .entry(from)
                .or_default()
                .insert(to);
        }
        let mut cycles = Vec::new();
        for (parent, graph) in by_parent {
            let reach = |start: &str| {
                let mut seen = BTreeSet::new();
                let mut stack = vec![start];
                while let Some(n) = stack.pop() {
                    for &next in graph.get(n).into_iter().flatten() {
                        if seen.insert(next) {
                            stack.push(next);
                        }
                    }
                }
                seen
            };
            let mut placed = BTreeSet::new();
            for &node in graph.keys() {
                let from_node = reach(node);
                if placed.contains(node) || !from_node.contains(node) {
                    continue;
                }
                let group: BTreeSet<String> = from_node
                    .iter()
                    .filter(|other| reach(other).contains(node))
                    .map(|s| s.to_string())
                    .collect();
                placed.extend(group.iter().cloned());
                cycles.push((parent.clone(), group));
            }
        }
        cycles
    }

    pub fn check(&self, krate: &Crate, findings: &mut Findings) {
        let root = krate.root.display();
        let declared: Vec<String> = self.files[self.index[&Module::new()]]
            .source
            .modules
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| self.index.contains_key(&vec![n.clone()]))
            .collect();
        for module in &declared {
            if krate.layer_of(module).is_none() {
                findings.problems.push(format!(
                    "{root}: module {module} is in no layer of ARCHITECTURE.md's layers block: add it to the `layer` line it belongs on"
                ));
            }
        }
        for module in krate
            .layers
            .iter()
            .flatten()
            .filter(|m| !declared.contains(m))
        {
            findings.problems.push(format!(
                "{root}: the layers block names {module}, which the crate does not declare: remove it"
            ));
        }
        if let Some(listed) = &krate.public {
            let (mut have, mut said) = (self.public(), listed.clone());
            have.sort();
            said.sort();
            if have != said {
                findings.problems.push(format!(
                    "{root}: the public modules drifted: the crate has `{}`, the block lists `{}`: make them agree",
                    have.join(" "),
                    said.join(" ")
                ));
            }
        }
        for (site, why) in self.upward(krate) {
            findings.problems.push(format!(
                "{}:{}: `{}` {why}",
                site.path.display(),
                site.line,
                site.text
            ));
        }
        for (parent, group) in self.cycles() {
            let ends: Vec<String> = self
                .edges
                .iter()
                .filter(|((p, from, to), _)| {
                    p == &parent && group.contains(from) && group.contains(to)
                })
                .map(|((_, from, to), sites)| {
                    format!(
                        "{from} -> {to} at {}:{}",
                        sites[0].path.display(),
                        sites[0].line
                    )
                })
                .collect();
            let folder = if parent.is_empty() {
                "the crate root".to_string()
            } else {
                parent.join("::")
            };
            findings.problems.push(format!(
                "{root}: an import cycle among the modules of {folder}: {}",
                ends.join("; ")
            ));
        }
        for file in &self.files {
            for line in &file.source.string_errors {
                findings.problems.push(format!(
                    "{}:{line}: a public function returns Result<_, String>: give it a typed error",
                    file.path.display()
                ));
            }
        }
    }
}
