//! Every seed in `fuzz/corpus/NAME` and every kept crash in `fuzz/regressions/NAME`, through the
//! same function libFuzzer drives, on stable: what fuzzing found stays fixed, and each target
//! has seeds to start from. `fuzz/findings/NAME` holds inputs that still fail, awaiting their
//! fix (replayed by the ignored `open_findings`).
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `dir`, sorted; none when it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .map(|e| e.expect("a corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs each input through `target`, naming the one that fails.
fn replay(name: &str, target: fn(&[u8]), files: &[PathBuf]) {
    for file in files {
        let data = std::fs::read(file).expect("read an input");
        if let Err(panic) = std::panic::catch_unwind(|| target(&data)) {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{name}: {} fails: {why}", file.display());
        }
    }
}

fn target(name: &str) -> fuzz_targets::Target {
    fuzz_targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
        .expect("a target of that name")
}

macro_rules! replay_target {
    ($name:ident) => {
        #[test]
        fn $name() {
            let name = stringify!($name);
            let seeds = inputs(&fuzz_dir().join("corpus").join(name));
            assert!(!seeds.is_empty(), "fuzz/corpus/{name} has no seed");
            replay(name, target(name), &seeds);
            replay(
                name,
                target(name),
                &inputs(&fuzz_dir().join("regressions").join(name)),
            );
        }
    };
}

replay_target!(frames);
replay_target!(joinfile);
replay_target!(oci_text);
replay_target!(oci_documents);
replay_target!(tar);
replay_target!(docker_api);
replay_target!(node_records);

#[test]
fn every_target_is_replayed_and_has_a_fuzz_target() {
    let replayed = [
        "frames",
        "joinfile",
        "oci_text",
        "oci_documents",
        "tar",
        "docker_api",
        "node_records",
    ];
    for (name, _) in fuzz_targets::TARGETS {
        assert!(replayed.contains(name), "{name} is not replayed here");
        let script = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&script).expect("fuzz/fuzz_targets/NAME.rs");
        assert!(
            text.contains(&format!("fuzz_targets::{name}(data)")),
            "{}",
            script.display()
        );
    }
}

#[test]
#[ignore = "inputs whose bug is not fixed yet: see docs/fuzzing.md"]
fn open_findings() {
    let (mut failing, mut passing) = (Vec::new(), Vec::new());
    for (name, f) in fuzz_targets::TARGETS {
        for file in inputs(&fuzz_dir().join("findings").join(name)) {
            let data = std::fs::read(&file).expect("read an input");
            match std::panic::catch_unwind(|| f(&data)) {
                Err(_) => failing.push(file.display().to_string()),
                Ok(()) => passing.push(file.display().to_string()),
            }
        }
    }
    assert!(
        failing.is_empty() && passing.is_empty(),
        "still failing: {failing:#?}\nfixed (move them to fuzz/regressions): {passing:#?}"
    );
}
