//! Tests: agent_docker — the Docker runtime against the real engine (each test prints the
//! engine's version): the runtime suite, pulls by digest with and without a credential, exit
//! codes and OOM, inputs and argv, adoption by name.
use fleet_agent::runtime::{Gpus, RegistryAuth, Resources, RunState, Runtime, Started, Workload};
use std::time::Duration;
use testkit::docker::{Containers, engine_version, remove_named};
use testkit::registry::{Options, Registry};
use testkit::runtime_suite::{self as suite, collected, shell, wait_for};

#[test]
fn the_docker_runtime_passes_the_runtime_suite() {
    remove_named("suite-");
    let containers = Containers::new("suite");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let image = containers.image(&registry, "suite/sh", None);
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

/// Standard base64 and base64url of the credential header differ for this password ('?' and
/// '>' land on '/' and '+'), so an engine reading the wrong alphabet would see a bad credential.
const PASSWORD: &str = "pa?s>w?rd>>~~";

fn counts(registry: &Registry) -> (usize, usize) {
    let gets = |what: &str| {
        registry
            .requests()
            .iter()
            .filter(|r| r.starts_with("GET ") && r.contains(what))
            .count()
    };
    (gets("/manifests/"), gets("/blobs/"))
}

#[test]
fn a_pull_by_digest_with_a_credential_then_a_second_run_pulls_nothing() {
    use base64::Engine as _;
    let containers = Containers::new("pull");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::start(Options {
        user: Some(("ci", PASSWORD)),
        ..Options::default()
    });
    let host = registry.host();
    let header = serde_json::json!({"username": "ci", "password": PASSWORD, "serveraddress": host})
        .to_string();
    let b64 = base64::engine::general_purpose::STANDARD;
    let b64url = base64::engine::general_purpose::URL_SAFE;
    assert_ne!(b64.encode(&header), b64url.encode(&header));
    // An image of this test's own: the engine has never seen its digest.
    let image = containers.image(&registry, "team/sh", Some(&format!("ci:{PASSWORD}")));
    let workload = Workload::Image(image.clone());

    let err = rt
        .start(&shell("pull-anon", &workload, "true"))
        .unwrap_err();
    let line = err.to_string();
    assert!(
        line.starts_with(&format!("run pull-anon: cannot pull {image}: "))
            && line.ends_with("; check the image, and give a credential if the registry needs one")
            && !line.contains('\n'),
        "{line}"
    );

    let mut spec = shell("pull-1", &workload, "echo pulled");
    spec.registry_auth = Some(RegistryAuth {
        username: "ci".into(),
        password: PASSWORD.into(),
    });
    assert_eq!(rt.start(&spec).unwrap(), Started::New);
    let done = wait_for(&rt, "pull-1", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
    let after_pull = counts(&registry);
    assert!(after_pull.0 >= 1 && after_pull.1 >= 1, "{after_pull:?}");
    assert!(
        registry
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /v2/team/sh/manifests/sha256:") && r.ends_with(" 200")),
        "{:?}",
        registry.requests()
    );

    // The same digest again, even without the credential: no manifest or blob is fetched.
    let begun = std::time::Instant::now();
    rt.start(&shell("pull-2", &workload, "echo again")).unwrap();
    wait_for(&rt, "pull-2", RunState::Finished);
    eprintln!(
        "repeat run of a present image: {:?} from start to finished",
        begun.elapsed()
    );
    assert_eq!(counts(&registry), after_pull);
}

#[test]
fn exit_codes_an_abort_a_kill_and_an_oom_kill_under_a_memory_limit() {
    let containers = Containers::new("exits");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(containers.image(&registry, "exits/sh", None));
    let cases = [
        ("exit-0", "exit 0", 0, false),
        ("exit-1", "exit 1", 1, false),
        ("exit-abort", "kill -ABRT $$", 134, false),
        ("exit-kill", "kill -KILL $$", 137, false),
        (
            "exit-oom",
            "dd if=/dev/zero of=/dev/null bs=64M count=1",
            137,
            true,
        ),
    ];
    for (run, script, _, oom) in cases {
        let mut spec = shell(run, &workload, script);
        if oom {
            spec.resources.memory_bytes = Some(16 << 20);
        }
        rt.start(&spec).unwrap();
    }
    for (run, _, code, oom) in cases {
        let done = wait_for(&rt, run, RunState::Finished);
        let outcome = done.report.outcome.unwrap();
        assert_eq!(
            (outcome.exit_code, outcome.oom_killed),
            (Some(code), Some(oom)),
            "{run}: {outcome:?}"
        );
        assert!(!outcome.stopped && !outcome.timed_out, "{run}");
    }
}

#[test]
fn inputs_are_in_run_argv_is_exact_and_limits_reach_the_engine() {
    let containers = Containers::new("inputs");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(containers.image(&registry, "inputs/sh", None));
    let dir = testkit::tempdir();
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "input bytes\n").unwrap();
    let mut spec = shell(
        "inputs-1",
        &workload,
        r#"cat /run/data.txt > seen; printf '[%s]\n' "$@" > args; pwd > where"#,
    );
    let args = ["a b", "it's", "\"q\"", "", "  lead", "$HOME", "*"];
    spec.argv.extend(args.iter().map(Into::into));
    spec.inputs = vec![("data.txt".into(), data)];
    spec.resources = Resources {
        cpu_millis: Some(500),
        pids: Some(64),
        ..Resources::default()
    };
    rt.start(&spec).unwrap();
    let done = wait_for(&rt, "inputs-1", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
    assert_eq!(collected(&rt, "inputs-1", "seen"), b"input bytes\n");
    assert_eq!(collected(&rt, "inputs-1", "where"), b"/run\n");
    let expected: String = args.iter().map(|a| format!("[{a}]\n")).collect();
    assert_eq!(
        String::from_utf8(collected(&rt, "inputs-1", "args")).unwrap(),
        expected
    );
    let host = testkit::ok(std::process::Command::new("docker").args([
        "inspect",
        "--format",
        "{{.HostConfig.NanoCpus}} {{.HostConfig.PidsLimit}} {{.HostConfig.Init}} {{.Name}}",
        "octomy-run-inputs-1",
    ]));
    assert_eq!(host.trim(), "500000000 64 true /octomy-run-inputs-1");
}

#[test]
fn a_duplicate_launch_is_refused_by_the_name() {
    let containers = Containers::new("dup");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(containers.image(&registry, "dup/sh", None));
    let spec = shell("dup-1", &workload, "sleep 2");
    assert_eq!(rt.start(&spec).unwrap(), Started::New);
    // Another runtime with no memory of the first (a restarted agent): the engine's name is
    // the claim, so nothing new is launched.
    let fresh = containers.runtime();
    assert_eq!(fresh.start(&spec).unwrap(), Started::Already);
    assert_eq!(containers.names(), ["octomy-run-dup-1"]);
    // An agent that does not own the container is refused by the name.
    let other = Containers::new("dup-other");
    let err = other.runtime().start(&spec).unwrap_err();
    assert_eq!(
        err.to_string(),
        "run dup-1: the container name octomy-run-dup-1 is taken by a container that is not this agent's run dup-1; remove that container or use another run id"
    );
    assert!(other.names().is_empty());
    wait_for(&rt, "dup-1", RunState::Finished);
}

#[test]
fn a_stalled_pull_is_abandoned_with_a_clear_line() {
    let containers = Containers::new("stall");
    let rt = containers.runtime().with_pull_stall(Duration::from_secs(2));
    engine_version(&rt);
    // A "registry" that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let image = format!(
        "{}/stuck/sh@sha256:{}",
        silent.local_addr().unwrap(),
        "5".repeat(64)
    );
    let begun = std::time::Instant::now();
    let err = rt
        .start(&shell("stall-1", &Workload::Image(image.clone()), "true"))
        .unwrap_err();
    assert!(begun.elapsed() < Duration::from_secs(20));
    let host = silent.local_addr().unwrap();
    assert_eq!(
        err.to_string(),
        format!(
            "run stall-1: the pull of {image} made no progress for 2 s and was abandoned; check that the node reaches {host}"
        )
    );
    assert!(containers.names().is_empty());
}
