//! `--baseline REV` of the benches: the binaries of another commit, extracted once (`git
//! archive`) into `target/bench-baseline/<commit>/src` and built there with a target folder of
//! their own beside it, so every bench reuses what one built.
use crate::{cross, util};
use anyhow::{Result, bail};
use std::path::PathBuf;
use std::process::Command;

/// Release binaries of one commit.
pub struct Baseline {
    /// The commit, 12 hex digits.
    commit: String,
    /// The commit as the command line named it.
    rev: String,
    /// The folder of its release binaries.
    release: PathBuf,
}

impl Baseline {
    pub fn bin(&self, name: &str) -> PathBuf {
        self.release.join(name)
    }

    /// How a report names it, beside "this tree".
    pub fn label(&self) -> String {
        format!("`{}` ({})", self.commit, self.rev)
    }
}

/// Builds `packages` of `rev` in the release profile: for `target` (a musl target, static,
/// as [`cross::build_static`] builds today's binaries), or for the host with `None`.
pub fn build(rev: &str, target: Option<&str>, packages: &[&str]) -> Result<Baseline> {
    let out = Command::new("git")
        .args(["rev-parse", "--short=12", &format!("{rev}^{{commit}}")])
        .current_dir(util::root())
        .output()?;
    if !out.status.success() {
        bail!("`{rev}` names no commit of this checkout: pass a commit it has (git log)");
    }
    let commit = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dir = cross::target_dir().join("bench-baseline").join(&commit);
    let src = dir.join("src");
    let marker = src.join(".bench-baseline-commit");
    // Extracted once: a fresh copy would rebuild everything.
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(commit.as_str()) {
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src)?;
        util::run(Command::new("sh").arg("-c").arg(format!(
            "git archive {commit} | tar -x -C '{}'",
            src.display()
        )))?;
        std::fs::write(&marker, &commit)?;
    }
    let mut cmd = Command::new("cargo");
    match target {
        Some(target) => {
            cross::install_toolchain()?;
            cmd.args(["zigbuild", "--release", "--target", target])
                .env_remove("RUSTFLAGS");
        }
        None => {
            cmd.args(["build", "--release"]);
        }
    }
    for p in packages {
        cmd.args(["-p", p]);
    }
    util::run(
        cmd.env("CARGO_TARGET_DIR", dir.join("target"))
            .current_dir(&src),
    )?;
    let release = match target {
        Some(target) => dir.join("target").join(target).join("release"),
        None => dir.join("target/release"),
    };
    Ok(Baseline {
        commit,
        rev: rev.to_string(),
        release,
    })
}

/// The binaries a bench compares, each with its report's name: this tree's folder `ours`, and
/// with `rev` the baseline's, built for `target` like [`build`].
pub fn sides(
    ours: PathBuf,
    rev: Option<&str>,
    target: Option<&str>,
    packages: &[&str],
) -> Result<Vec<(String, PathBuf)>> {
    let mut sides = vec![("this tree".to_string(), ours)];
    if let Some(rev) = rev {
        let baseline = build(rev, target, packages)?;
        sides.push((baseline.label(), baseline.release));
    }
    Ok(sides)
}

/// A row's name for one side: the row's own alone, the side's added when there are more.
pub fn row_name(row: &str, side: &str, sides: usize) -> String {
    match sides {
        1 => row.to_string(),
        _ => format!("{row}, {side}"),
    }
}

/// One figure of each side, in a sentence: alone as it was, else each after its side's name.
pub fn each<T>(sides: &[(String, T)], figure: impl Fn(usize) -> String) -> String {
    (sides.iter().enumerate())
        .map(|(side, (name, _))| match sides.len() {
            1 => figure(side),
            _ => format!("{name}: {}", figure(side)),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// A markdown table of figures: a column for each side's figures, then a target.
pub struct Table<'a, F> {
    columns: &'a [(String, F)],
    pub markdown: String,
}

impl<'a, F> Table<'a, F> {
    pub fn new(columns: &'a [(String, F)], figure: &str, target: &str) -> Self {
        let mut markdown = format!("| {figure} |");
        for (name, _) in columns {
            markdown.push_str(&format!(" {name} |"));
        }
        markdown.push_str(&format!(" {target} |\n|---|"));
        markdown.push_str(&"---|".repeat(columns.len()));
        markdown.push_str("---|\n");
        Table { columns, markdown }
    }

    pub fn row(&mut self, figure: &str, cell: impl Fn(&F) -> String, target: &str) {
        self.markdown.push_str(&format!("| {figure} |"));
        for (_, f) in self.columns {
            self.markdown.push_str(&format!(" {} |", cell(f)));
        }
        self.markdown.push_str(&format!(" {target} |\n"));
    }
}
