//! Tests: agent_docker — the Docker runtime against the real engine (each test prints the
//! engine's version): the runtime suite, pulls by digest with and without a credential, exit
//! codes and OOM, inputs and argv, adoption by name.
use fleet_agent::runtime::{Gpus, Resources, Runtime, Workload};
use testkit::docker::{Containers, busybox_image, engine_version, remove_named};
use testkit::registry::Registry;
use testkit::runtime_suite::{self as suite, shell};

#[test]
fn the_docker_runtime_passes_the_runtime_suite() {
    remove_named("suite-");
    let containers = Containers::new("suite");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let image = busybox_image(&registry, "suite/sh", None);
    let subject = suite::Subject {
        runtime: &rt,
        shell: Workload::Image(image),
        name: "docker",
        argv_bytes: false,
    };
    // No GPU here: the engine's own answer to the device request is the refusal.
    let err = suite::run_all(
        &subject,
        Resources {
            gpus: Gpus::All,
            ..Resources::default()
        },
    );
    assert_eq!(
        err.to_string(),
        "run suite-limits: a GPU request (the engine says: could not select device driver \"\" with capabilities: [[gpu]]) is not supported by the docker runtime; install the NVIDIA Container Toolkit on this node, or run without GPUs"
    );
    // A staged program is the process runtime's workload.
    let program = Workload::Program(
        fleet_proto::Digest::parse(&format!("sha256:{}", "0".repeat(64))).unwrap(),
    );
    assert_eq!(
        rt.start(&shell("prog", &program, "true"))
            .unwrap_err()
            .to_string(),
        "run prog: a staged program is not supported by the docker runtime; run programs on the process runtime"
    );
}
