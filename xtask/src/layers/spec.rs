//! The ```` ```layers ```` block of ARCHITECTURE.md:
//!
//! ```text
//! packages  fleet-vocab fleet-cli | run-store fleet-proto | ...    (levels bottom to top)
//! crate agent/coordinator/src/lib.rs
//! public    check metrics operator ...    (the root's `pub mod`s; libraries only)
//! layer     error                         (the lowest layer)
//! layer     store tokens                  (each next line is one layer up)
//! layers    a b | c                       (or several layers on one line, bottom first)
//! ```
use anyhow::{Result, bail};
use std::path::PathBuf;

#[derive(Debug)]
pub struct Crate {
    /// The crate root (`lib.rs` or `main.rs`), relative to the checkout.
    pub root: PathBuf,
    /// The root's public modules, where the block lists them.
    pub public: Option<Vec<String>>,
    /// Top-level modules, one list per layer, bottom first.
    pub layers: Vec<Vec<String>>,
}

impl Crate {
    /// The layer a top-level module is in.
    pub fn layer_of(&self, module: &str) -> Option<usize> {
        self.layers
            .iter()
            .position(|l| l.iter().any(|m| m == module))
    }
}

#[derive(Debug)]
pub struct Spec {
    /// Package names by level, bottom first: a package depends only on lower levels.
    pub packages: Vec<Vec<String>>,
    pub crates: Vec<Crate>,
}

impl Spec {
    pub fn parse(markdown: &str) -> Result<Spec> {
        let Some(start) = markdown.find("```layers\n") else {
            bail!(
                "ARCHITECTURE.md has no ```layers block: the layer check reads the crates' layers from it"
            );
        };
        let body = &markdown[start + "```layers\n".len()..];
        let body = &body[..body.find("```").unwrap_or(body.len())];
        let mut spec = Spec {
            packages: Vec::new(),
            crates: Vec::new(),
        };
        for (n, line) in body.lines().enumerate() {
            let mut words = line.split_whitespace();
            let Some(keyword) = words.next() else {
                continue;
            };
            let rest: Vec<String> = words.map(str::to_string).collect();
            let current = spec.crates.last_mut();
            match (keyword, current) {
                ("packages", _) => {
                    spec.packages = rest.split(|w| w == "|").map(<[String]>::to_vec).collect();
                }
                ("crate", _) if rest.len() == 1 => spec.crates.push(Crate {
                    root: PathBuf::from(&rest[0]),
                    public: None,
                    layers: Vec::new(),
                }),
                ("public", Some(krate)) => krate.public = Some(rest),
                ("layer", Some(krate)) => krate.layers.push(rest),
                ("layers", Some(krate)) => {
                    krate
                        .layers
                        .extend(rest.split(|w| w == "|").map(<[String]>::to_vec));
                }
                _ => bail!(
                    "ARCHITECTURE.md's layers block, line {}: `{line}` is not `packages`, `crate PATH`, `public ...`, `layer ...` or `layers ... | ...` under a crate",
                    n + 1
                ),
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_read_and_a_stray_line_is_refused() {
        let text = "# Map\n```layers\npackages a b | c\ncrate x/src/lib.rs\npublic m n\nlayer m\nlayer n o\nlayers p | q r\n```\n";
        let spec = Spec::parse(text).unwrap();
        assert_eq!(spec.packages, vec![vec!["a", "b"], vec!["c"]]);
        assert_eq!(spec.crates[0].layer_of("o"), Some(1));
        assert_eq!(spec.crates[0].layer_of("r"), Some(3));
        assert_eq!(
            spec.crates[0].public.as_deref(),
            Some(&["m".to_string(), "n".to_string()][..])
        );
        let err = Spec::parse("```layers\nlayer m\n```")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1: `layer m` is not"), "{err}");
    }
}
