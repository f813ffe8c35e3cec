//! Tests: agent_docker — the Docker runtime against the real engine (each test prints the
//! engine's version): the runtime suite, pulls by digest with and without a credential, exit
//! codes and OOM, inputs and argv, adoption by name.
use fleet_agent::runtime::{Gpus, RegistryAuth, Resources, RunState, Runtime, Started, Workload};
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, wait_until};
use testkit::docker::{Containers, SlowEngine, engine_version, remove_named};
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
        shell: Workload::Image(image_ref(&image)),
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
    let workload = Workload::Image(image_ref(&image));

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
    let workload = Workload::Image(image_ref(&containers.image(&registry, "exits/sh", None)));
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
    let workload = Workload::Image(image_ref(&containers.image(&registry, "inputs/sh", None)));
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
fn a_large_input_goes_into_the_container_in_flat_memory() {
    if testkit::in_own_process("a_large_input_goes_into_the_container_in_flat_memory") {
        large_input_in_flat_memory("big", None);
    }
}

#[test]
fn a_large_input_goes_in_flat_memory_when_the_engine_reads_it_slowly() {
    if testkit::in_own_process("a_large_input_goes_in_flat_memory_when_the_engine_reads_it_slowly")
    {
        // 256 MiB at 32 MiB/s: the input waits on the engine for about 8 s.
        large_input_in_flat_memory("slow", Some(SlowEngine::start(32 << 20)));
    }
}

/// Starts a container with a 256 MiB input through `engine` (the local one when `None`) and
/// measures the peak RSS of this process, which runs nothing else (see `in_own_process`).
fn large_input_in_flat_memory(name: &str, engine: Option<SlowEngine>) {
    let containers = Containers::new(name);
    let rt = match &engine {
        Some(slow) => containers.runtime_at(&slow.address),
        None => containers.runtime(),
    };
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(
        &registry,
        &format!("{name}/sh"),
        None,
    )));
    let dir = testkit::tempdir();
    let big = dir.path().join("big.bin");
    const SIZE: u64 = 256 << 20;
    std::fs::File::create(&big).unwrap().set_len(SIZE).unwrap();
    let run = format!("{name}-1");
    let mut spec = shell(&run, &workload, "ls -l /run/big.bin > seen");
    spec.inputs = vec![("big.bin".into(), big)];
    testkit::reset_peak_rss();
    let before = testkit::peak_rss_mib(std::process::id());
    let begun = std::time::Instant::now();
    rt.start(&spec).unwrap();
    let took = begun.elapsed();
    let grew = testkit::peak_rss_mib(std::process::id()) - before;
    let done = wait_for(&rt, &run, RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
    let seen = String::from_utf8(collected(&rt, &run, "seen")).unwrap();
    assert!(seen.contains(&format!(" {SIZE} ")), "{seen}");
    eprintln!(
        "the peak RSS grew by {grew} MiB while a {} MiB input went in ({:.1} s)",
        SIZE >> 20,
        took.as_secs_f64()
    );
    assert!(grew < 32, "the peak RSS grew by {grew} MiB");
}

#[test]
fn a_duplicate_launch_is_refused_by_the_name() {
    let containers = Containers::new("dup");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(&registry, "dup/sh", None)));
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
    let spec = shell("stall-1", &Workload::Image(image_ref(&image)), "true");
    let begun = std::time::Instant::now();
    // On a thread of its own, so a pull that is never abandoned fails the test, not hangs it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(rt.start(&spec)));
    let err = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the stalled pull was never abandoned")
        .unwrap_err();
    let took = begun.elapsed();
    eprintln!("abandoned {:.1} s after the start", took.as_secs_f64());
    assert!(
        took >= Duration::from_secs(2),
        "abandoned after {took:?}, before its 2 s without progress"
    );
    let host = silent.local_addr().unwrap();
    assert_eq!(
        err.to_string(),
        format!(
            "run stall-1: the pull of {image} made no progress for 2 s and was abandoned; check that the node reaches {host}"
        )
    );
    assert!(containers.names().is_empty());
}

/// `fleet-coordinator status --set SET --json`'s one row.
fn row(coord: &Coordinator, set: &str) -> serde_json::Value {
    let out = testkit::ok(coord.command().args(["status", "--set", set, "--json"]));
    serde_json::from_str::<serde_json::Value>(&out).unwrap()[0].clone()
}

fn wait_row(
    coord: &Coordinator,
    set: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    let ok = wait_until(Duration::from_secs(60), || {
        last = row(coord, set);
        check(&last)
    });
    assert!(ok, "row never matched: {last:#}");
    last
}

#[test]
fn an_image_runs_through_the_coordinator_beside_a_program_and_survives_an_agent_sigkill() {
    let dir = testkit::tempdir();
    let path = |name: &str| dir.path().join(name);
    let registry = Registry::start(Options {
        user: Some(("ci", PASSWORD)),
        ..Options::default()
    });
    let images = Containers::new("e2e-images");
    engine_version(&images.runtime());
    let image = images.image(&registry, "e2e/sh", Some(&format!("ci:{PASSWORD}")));
    let auth = path("auth.json");
    std::fs::write(
        &auth,
        serde_json::json!({"username": "ci", "password": PASSWORD}).to_string(),
    )
    .unwrap();

    let coord = Coordinator::start(&path("coord"), &[]);
    std::fs::write(path("fleet.json"), coord.token(&["--name", "worker"])).unwrap();
    let start_agent = |n: usize| {
        let cmd = testkit::agent::machine_command(dir.path());
        let agent = Agent::spawn(&path(&format!("agent-{n}.log")), cmd);
        assert!(
            agent.wait_for("session open", 1, Duration::from_secs(30)),
            "{}",
            agent.log_text()
        );
        agent
    };
    let mut agent = start_agent(1);
    assert!(
        agent.log_text().contains("Docker engine reached"),
        "{}",
        agent.log_text()
    );
    let node_id = coord.nodes()[0]["id"].as_str().unwrap().to_string();
    let containers = Containers::of_agent(&node_id);

    // A tag is not an identity: refused before anything is recorded.
    let tagged = format!("{}/e2e/sh:v1", registry.host());
    assert_eq!(
        coord.refusal(&["run", "--all", "--image", &tagged]),
        format!(
            "fleet-coordinator: image {tagged} is named by a tag, which can move; name it as HOST/REPO@sha256:HEX"
        )
    );

    let run = |extra: &[&str], args: &[&str]| {
        let out = testkit::ok(
            coord
                .command()
                .args(["run", "--all"])
                .args(extra)
                .arg("--")
                .args(args),
        );
        out.trim().to_string()
    };
    let set = run(
        &["--image", &image, "--registry-auth", auth.to_str().unwrap()],
        &["-c", "sleep 4; echo done > out; exit 7"],
    );
    // A program on the same node, beside the image.
    let program = testkit::agent::script(&path("prog.sh"), "echo program");
    let program_set = run(&["--program", program.to_str().unwrap()], &[]);

    let running = wait_row(&coord, &set, |r| r["state"] == "running");
    let run_id = running["run_id"].as_str().unwrap().to_string();
    agent.kill();
    assert_eq!(containers.names(), [format!("octomy-run-{run_id}")]);
    let _agent = start_agent(2);
    let done = wait_row(&coord, &set, |r| r["state"] == "finished");
    assert_eq!(done["outcome"]["exit_code"], 7, "{done:#}");
    assert!(done["outcome"]["started_at"].is_string(), "{done:#}");
    // starting, running, finished: each once, the end reported once after the restart.
    assert_eq!(done["events"].as_array().unwrap().len(), 3, "{done:#}");
    let collected = path("out");
    let digest = testkit::ok(coord.command().args([
        "collect",
        "--run",
        &run_id,
        "--path",
        "out",
        "--out",
        collected.to_str().unwrap(),
    ]));
    assert_eq!(std::fs::read_to_string(&collected).unwrap(), "done\n");
    assert!(digest.trim().starts_with("sha256:"));
    let program_row = wait_row(&coord, &program_set, |r| r["state"] == "finished");
    assert_eq!(program_row["outcome"]["exit_code"], 0, "{program_row:#}");

    // An operator's stop reaches the container through the node's session.
    let long = run(
        &["--image", &image, "--registry-auth", auth.to_str().unwrap()],
        &["-c", "sleep 60"],
    );
    let running = wait_row(&coord, &long, |r| r["state"] == "running");
    let long_run = running["run_id"].as_str().unwrap();
    let begun = std::time::Instant::now();
    let out = testkit::ok(coord.command().args(["stop", "--run", long_run]));
    assert_eq!(out.trim(), format!("stopped {long_run}"));
    let stopped = wait_row(&coord, &long, |r| r["state"] == "finished");
    eprintln!(
        "finished {:.1} s after the stop",
        begun.elapsed().as_secs_f64()
    );
    // The stop ended it, not the program's own 60 s.
    assert_eq!(stopped["outcome"]["stopped"], true, "{stopped:#}");

    // The credential is in no store, state folder, run store or log: only in the file given.
    let holding: Vec<_> = testkit::agent::files_under(dir.path())
        .into_iter()
        .filter(|p| {
            std::fs::read(p)
                .is_ok_and(|b| b.windows(PASSWORD.len()).any(|w| w == PASSWORD.as_bytes()))
        })
        .collect();
    assert_eq!(holding, [auth]);
}

#[test]
fn an_end_and_a_timeout_are_reported_as_they_happen_not_at_the_next_watch() {
    let dir = testkit::tempdir();
    let path = |name: &str| dir.path().join(name);
    let registry = Registry::plain();
    let images = Containers::new("events-images");
    engine_version(&images.runtime());
    let image = images.image(&registry, "events/sh", None);
    // The agent's watch runs every heartbeat: at one an hour, no watch comes within the test's
    // waits, so whatever is reported came from the engine's event stream or the timeout's timer.
    let coord = Coordinator::start(&path("coord"), &["--heartbeat", "1h", "--lease", "3h"]);
    let _agent = worker(&coord, dir.path());
    let node_id = coord.nodes()[0]["id"].as_str().unwrap().to_string();
    let _containers = Containers::of_agent(&node_id);
    let run = |extra: &[&str]| {
        let mut cmd = coord.command();
        cmd.args(["run", "--all", "--image", &image]).args(extra);
        testkit::ok(&mut cmd).trim().to_string()
    };

    let begun = std::time::Instant::now();
    let set = run(&["--", "-c", "sleep 1; exit 3"]);
    let done = wait_row(&coord, &set, |r| r["state"] == "finished");
    eprintln!("the end reported after {:?}", begun.elapsed());
    assert_eq!(done["outcome"]["exit_code"], 3, "{done:#}");

    let begun = std::time::Instant::now();
    let set = run(&["--timeout", "1s", "--", "-c", "sleep 60"]);
    let done = wait_row(&coord, &set, |r| r["state"] == "finished");
    let took = begun.elapsed();
    eprintln!("the timeout reported after {took:?}");
    assert_eq!(done["outcome"]["timed_out"], true, "{done:#}");
    assert!(took >= Duration::from_secs(1), "reported after {took:?}");
}

#[test]
fn without_an_engine_programs_run_and_images_are_refused_in_one_line() {
    let dir = testkit::tempdir();
    let path = |name: &str| dir.path().join(name);
    let coord = Coordinator::start(&path("coord"), &[]);
    std::fs::write(path("fleet.json"), coord.token(&["--name", "worker"])).unwrap();
    let socket = path("no-engine.sock");
    let mut cmd = testkit::agent::machine_command(dir.path());
    cmd.arg("--docker-host")
        .arg(format!("unix://{}", socket.display()));
    let agent = Agent::spawn(&path("agent.log"), cmd);
    assert!(
        agent.wait_for("session open", 1, Duration::from_secs(30)),
        "{}",
        agent.log_text()
    );
    let image = format!("127.0.0.1:5000/none/sh@sha256:{}", "7".repeat(64));
    let set = testkit::ok(coord.command().args(["run", "--all", "--image", &image]));
    let failed = wait_row(&coord, set.trim(), |r| r["state"] == "failed");
    let run_id = failed["run_id"].as_str().unwrap();
    assert_eq!(
        failed["error"].as_str().unwrap(),
        format!(
            "run {run_id}: images need a Docker engine and none answers: reaching the Docker engine at unix://{} failed: the socket {} does not exist; start the engine or pass --docker-host",
            socket.display(),
            socket.display()
        )
    );
    let program = testkit::agent::script(&path("prog.sh"), "echo program");
    let set = testkit::ok(
        coord
            .command()
            .args(["run", "--all", "--program"])
            .arg(&program),
    );
    let done = wait_row(&coord, set.trim(), |r| r["state"] == "finished");
    assert_eq!(done["outcome"]["exit_code"], 0, "{done:#}");
}

#[test]
fn a_registry_credential_needs_a_serving_coordinator_and_an_image() {
    let dir = testkit::tempdir();
    let auth = dir.path().join("auth.json");
    std::fs::write(&auth, r#"{"username": "u", "password": "p"}"#).unwrap();
    let image = format!("127.0.0.1:5000/none/sh@sha256:{}", "7".repeat(64));
    let data = dir.path().join("coord");
    let refusal = |args: &[&str]| {
        let mut cmd = testkit::cmd("fleet-coordinator");
        cmd.arg("--data").arg(&data).args(args);
        testkit::fails(&mut cmd).lines().last().unwrap().to_string()
    };
    assert_eq!(
        refusal(&[
            "run",
            "--all",
            "--image",
            &image,
            "--registry-auth",
            auth.to_str().unwrap()
        ]),
        "fleet-coordinator: --registry-auth needs a serving coordinator: the credential is kept only in its memory until the node takes the run, never in the store; start `fleet-coordinator serve` first"
    );
    std::fs::write(&auth, "u:p").unwrap();
    assert_eq!(
        refusal(&[
            "run",
            "--all",
            "--image",
            &image,
            "--registry-auth",
            auth.to_str().unwrap()
        ]),
        format!(
            "fleet-coordinator: --registry-auth {} is not JSON with a \"username\" and a \"password\"; write it as {{\"username\": \"USER\", \"password\": \"PASS\"}}",
            auth.display()
        )
    );
}

#[test]
fn a_stray_container_goes_after_its_grace_and_only_the_newest_finished_runs_keep_theirs() {
    use fleet_agent::runtime::docker::Tidy;
    let containers = Containers::new("tidy");
    let rt = containers.runtime().with_tidy(Tidy {
        every: Duration::ZERO,
        stray_grace: Duration::from_secs(4),
        keep_finished: 2,
        image_delay: Duration::from_secs(3600),
    });
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(&registry, "tidy/sh", None)));
    let state = testkit::tempdir();
    let store = fleet_agent::state::Store::open(state.path()).unwrap();
    for n in 0..3 {
        let run = format!("tidy-{n}");
        store.track_run(&as_run_id(&run), &workload).unwrap();
        rt.start(&shell(&run, &workload, "true")).unwrap();
        wait_for(&rt, &run, RunState::Finished);
        // The engine dates containers in whole seconds: one second apart keeps their order.
        std::thread::sleep(Duration::from_millis(1100));
    }
    fleet_agent::runtime::sync_runs(&store, &rt).unwrap();
    // Launched, never recorded: what a crash between the create and the record leaves.
    rt.start(&shell("tidy-stray", &workload, "sleep 30"))
        .unwrap();
    let record = |run: &fleet_proto::RunId| store.run(run).ok().flatten().map(|r| r.state);
    assert_eq!(rt.tidy(&record).unwrap(), ["tidy-0"]);
    let mut names = containers.names();
    names.sort();
    assert_eq!(
        names,
        [
            "octomy-run-tidy-1",
            "octomy-run-tidy-2",
            "octomy-run-tidy-stray"
        ]
    );
    // The stray's grace passing is what is tested, not a wait for an event.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(rt.tidy(&record).unwrap(), ["tidy-stray"]);
    let mut names = containers.names();
    names.sort();
    assert_eq!(names, ["octomy-run-tidy-1", "octomy-run-tidy-2"]);
    // The node's record of the removed run stays final; the runtime no longer holds it.
    assert_eq!(record(&as_run_id("tidy-0")), Some(RunState::Finished));
    assert!(rt.status(&testkit::rid("tidy-0")).is_err());
}

#[test]
fn a_remote_engine_over_mutual_tls_runs_and_each_tls_failure_is_one_line() {
    use fleet_agent::runtime::DockerRuntime;
    use fleet_agent::runtime::docker::{EngineAddress, TlsFiles};
    let pki = testkit::pki::Pki::new();
    let engine = testkit::docker::TlsEngine::start(&pki);
    let containers = Containers::new("tls");
    let address =
        |cert: &std::path::Path, key: &std::path::Path, ca: &std::path::Path| EngineAddress {
            host: Some(engine.host.clone()),
            tls: Some(TlsFiles {
                cert: Some(cert.to_path_buf()),
                key: Some(key.to_path_buf()),
                ca: ca.to_path_buf(),
            }),
        };
    let rt = containers.runtime_at(&address(&pki.client_cert, &pki.client_key, &pki.ca_cert));
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(&registry, "tls/sh", None)));
    rt.start(&shell("tls-1", &workload, "echo over tls > out"))
        .unwrap();
    let done = wait_for(&rt, "tls-1", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
    assert_eq!(collected(&rt, "tls-1", "out"), b"over tls\n");

    let refused = |address: EngineAddress| {
        DockerRuntime::connect(&address, "/nonexistent", "tls", Default::default())
            .unwrap_err()
            .to_string()
    };
    let at = format!("reaching the Docker engine at {} failed: ", engine.host);
    assert_eq!(
        refused(address(&pki.stranger_cert, &pki.stranger_key, &pki.ca_cert)),
        format!(
            "{at}the engine refused this client's certificate; pass --docker-tls-cert and --docker-tls-key signed by the CA the engine trusts; start the engine or pass --docker-host"
        )
    );
    // No client certificate at all (only --docker-tls-ca), where the engine requires one.
    assert_eq!(
        refused(EngineAddress {
            host: Some(engine.host.clone()),
            tls: Some(TlsFiles {
                cert: None,
                key: None,
                ca: pki.ca_cert.clone(),
            }),
        }),
        format!(
            "{at}the engine requires a client certificate and none was given; pass --docker-tls-cert and --docker-tls-key signed by the CA the engine trusts; start the engine or pass --docker-host"
        )
    );
    assert_eq!(
        refused(address(
            &pki.client_cert,
            &pki.client_key,
            &pki.other_ca_cert
        )),
        format!(
            "{at}the engine's certificate is not trusted through --docker-tls-ca; pass the CA that signed it; start the engine or pass --docker-host"
        )
    );
    let missing = std::path::Path::new("/nonexistent/cert.pem");
    assert_eq!(
        refused(address(missing, &pki.client_key, &pki.ca_cert)),
        format!(
            "{at}cannot read --docker-tls-cert {} (No such file or directory (os error 2)); pass an existing PEM file",
            missing.display()
        )
    );
    assert_eq!(
        refused(EngineAddress {
            host: Some(engine.host.clone()),
            tls: None
        }),
        format!(
            "{at}{} needs --docker-tls-cert, --docker-tls-key and --docker-tls-ca",
            engine.host
        )
    );
}

#[test]
fn an_image_this_agent_pulled_goes_once_no_run_needs_it_after_its_delay() {
    use fleet_agent::runtime::docker::Tidy;
    let containers = Containers::new("images");
    let rt = containers.runtime().with_tidy(Tidy {
        every: Duration::ZERO,
        stray_grace: Duration::from_secs(3600),
        keep_finished: 0,
        image_delay: Duration::from_secs(4),
    });
    engine_version(&rt);
    let registry = Registry::plain();
    let image = containers.image(&registry, "images/sh", None);
    let workload = Workload::Image(image_ref(&image));
    let present = || {
        std::process::Command::new("docker")
            .args(["image", "inspect", &image])
            .output()
            .unwrap()
            .status
            .success()
    };
    let state = testkit::tempdir();
    let store = fleet_agent::state::Store::open(state.path()).unwrap();
    store.track_run(&as_run_id("images-1"), &workload).unwrap();
    rt.start(&shell("images-1", &workload, "true")).unwrap();
    wait_for(&rt, "images-1", RunState::Finished);
    fleet_agent::runtime::sync_runs(&store, &rt).unwrap();
    let record = |run: &fleet_proto::RunId| store.run(run).ok().flatten().map(|r| r.state);
    // The container goes (retention 0); the image was used too recently to go.
    assert_eq!(rt.tidy(&record).unwrap(), ["images-1"]);
    assert!(present());
    // The image's delay passing is what is tested, not a wait for an event.
    std::thread::sleep(Duration::from_secs(4));
    rt.tidy(&record).unwrap();
    assert!(!present(), "{image} is still on the engine");
    // A run of it again pulls it again.
    rt.start(&shell("images-2", &workload, "true")).unwrap();
    assert_eq!(
        wait_for(&rt, "images-2", RunState::Finished)
            .report
            .outcome
            .unwrap()
            .exit_code,
        Some(0)
    );
}

#[test]
fn a_timeout_stops_with_the_grace_then_kills_and_observing_never_waits_for_it() {
    let containers = Containers::new("grace");
    let rt = containers.runtime();
    engine_version(&rt);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(&registry, "grace/sh", None)));
    // Ignores the polite signal: only the kill after the grace ends it.
    let mut spec = shell("grace-1", &workload, "trap '' TERM; sleep 30");
    spec.timeout = Some(Duration::from_millis(500));
    spec.grace = Some(Duration::from_secs(4));
    rt.start(&spec).unwrap();
    // The timer records the timeout here before its polite signal starts the grace.
    let timed_out = containers.marks().join("grace-1.timed-out");
    let begun = std::time::Instant::now();
    let mut slowest = Duration::ZERO;
    let mut answered_in_grace = 0;
    let done = loop {
        let in_grace = timed_out.exists();
        let asked = std::time::Instant::now();
        let status = rt.status(&testkit::rid("grace-1")).unwrap();
        slowest = slowest.max(asked.elapsed());
        if status.state.is_final() {
            break status;
        }
        answered_in_grace += usize::from(in_grace);
        assert!(begun.elapsed() < Duration::from_secs(120), "never ended");
        // Pacing between status calls, not a wait.
        std::thread::sleep(Duration::from_millis(50));
    };
    let outcome = done.report.outcome.unwrap();
    assert_eq!(
        (outcome.exit_code, outcome.timed_out, outcome.stopped),
        (Some(137), true, false)
    );
    // Killed after the grace, not before.
    assert!(
        begun.elapsed() >= Duration::from_secs(4),
        "{:?}",
        begun.elapsed()
    );
    // Status calls asked during the grace answered in it: none waited the grace out (the
    // agent's watch runs beside its heartbeats).
    eprintln!("{answered_in_grace} status calls answered in the grace, the slowest in {slowest:?}");
    assert!(
        answered_in_grace > 0,
        "no status call asked during the grace answered before the kill"
    );
}

#[test]
fn an_engine_whose_oldest_api_is_1_44_is_spoken_to_at_its_version() {
    use fleet_agent::runtime::docker::EngineAddress;
    use testkit::docker::{Docker29StandIn, STAND_IN_API};
    // Docker 29 refuses any API older than 1.44; no such engine can run here, so a stand-in
    // speaks for one in front of the real engine (see `Docker29StandIn`).
    let engine = Docker29StandIn::start();
    let containers = Containers::new("api-1-44");
    let rt = containers.runtime_at(&EngineAddress {
        host: Some(engine.host.clone()),
        tls: None,
    });
    assert_eq!(engine_version(&rt), "29.0.0 (API 1.44)");
    assert_eq!(rt.api_version(), STAND_IN_API);
    let registry = Registry::plain();
    let workload = Workload::Image(image_ref(&containers.image(&registry, "api/sh", None)));
    rt.start(&shell("api-1", &workload, "echo spoken at 1.44 > out"))
        .unwrap();
    let done = wait_for(&rt, "api-1", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
    assert_eq!(collected(&rt, "api-1", "out"), b"spoken at 1.44\n");
    // The negotiation's bare `/version`, then every request at 1.44 (the stand-in refuses
    // any other version, and a bare path would be served at the engine's newest).
    let requests = engine.requests();
    eprintln!(
        "{} requests through the stand-in: {requests:?}",
        requests.len()
    );
    assert_eq!(requests[0], "GET /version");
    let other: Vec<_> = requests[1..]
        .iter()
        .filter(|r| !r.split(' ').nth(1).unwrap().starts_with("/v1.44/"))
        .collect();
    assert!(other.is_empty(), "{other:?}");
}

/// An image name the tests made, as the typed reference a workload holds.
fn image_ref(name: &str) -> fleet_proto::run::ImageRef {
    fleet_proto::run::ImageRef::parse(name).unwrap()
}

/// One machine named `worker` joined to `coord`, its session open; files under `dir`.
fn worker(coord: &Coordinator, dir: &std::path::Path) -> Agent {
    std::fs::write(dir.join("fleet.json"), coord.token(&["--name", "worker"])).unwrap();
    let agent = Agent::spawn(&dir.join("agent.log"), testkit::agent::machine_command(dir));
    assert!(
        agent.wait_for("session open", 1, Duration::from_secs(30)),
        "{}",
        agent.log_text()
    );
    agent
}

/// An ECDSA P-256 key pair made by openssl: (private PEM, public PEM).
fn p256_pair(dir: &std::path::Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (key, public) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.pub")),
    );
    let openssl = |args: &[&str]| {
        testkit::ok(std::process::Command::new("openssl").args(args));
    };
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        key.to_str().unwrap(),
    ]);
    openssl(&[
        "pkey",
        "-in",
        key.to_str().unwrap(),
        "-pubout",
        "-out",
        public.to_str().unwrap(),
    ]);
    (key, public)
}

#[test]
fn the_signing_policy_refuses_an_unsigned_image_and_another_keys_and_runs_the_fleets() {
    let dir = testkit::tempdir();
    let path = |name: &str| dir.path().join(name);
    let registry = Registry::start(Options {
        user: Some(("ci", PASSWORD)),
        ..Options::default()
    });
    let creds = format!("ci:{PASSWORD}");
    let images = Containers::new("signed-images");
    engine_version(&images.runtime());
    let image = images.image(&registry, "signed/sh", Some(&creds));
    let (digest_part, repo) = (
        image.split_once('@').unwrap().1,
        image.split_once('@').unwrap().0,
    );
    let remote = format!("docker://{repo}@{digest_part}");
    let auth = path("auth.json");
    std::fs::write(
        &auth,
        serde_json::json!({"username": "ci", "password": PASSWORD}).to_string(),
    )
    .unwrap();
    let (fleet_key, fleet_pub) = p256_pair(dir.path(), "fleet");
    let (other_key, other_pub) = p256_pair(dir.path(), "other");
    let sign = |key: &std::path::Path| {
        testkit::ok(
            testkit::cmd("oci")
                .args(["sign", &remote, "--plain-http", "--creds", &creds, "--key"])
                .arg(key),
        );
    };

    let coord = Coordinator::start(&path("coord"), &[]);
    let set_policy = testkit::ok(
        coord
            .command()
            .args(["policy", "--require-signature"])
            .arg(&fleet_pub),
    );
    let fleet_id = set_policy.trim().to_string();
    assert!(fleet_id.starts_with("sha256:"), "{set_policy}");
    // The key id is the SHA-256 of the key's DER, as openssl computes it.
    let der = testkit::output(
        std::process::Command::new("openssl")
            .args(["pkey", "-pubin", "-outform", "DER", "-in"])
            .arg(&fleet_pub),
    )
    .stdout;
    use sha2::Digest as _;
    assert_eq!(
        fleet_id,
        format!("sha256:{}", hex::encode(sha2::Sha256::digest(&der)))
    );
    // A key file that is not one is refused with its line, and the policy stays as it was.
    std::fs::write(path("junk.pub"), "not a key").unwrap();
    assert_eq!(
        coord.refusal(&[
            "policy",
            "--require-signature",
            path("junk.pub").to_str().unwrap()
        ]),
        format!(
            "fleet-coordinator: {} is not an ECDSA P-256 public key in PEM (BEGIN PUBLIC KEY): it has no -----BEGIN PUBLIC KEY----- line; make one with openssl pkey -in KEY -pubout -out KEY.pub",
            path("junk.pub").display()
        )
    );
    assert_eq!(testkit::ok(coord.command().arg("policy")).trim(), fleet_id);

    let _agent = worker(&coord, dir.path());
    let run = |extra: &[&str]| {
        let mut cmd = coord.command();
        cmd.args(["run", "--all", "--image", &image, "--registry-auth"])
            .arg(&auth)
            .args(extra)
            .args(["--", "-c", "echo signed"]);
        cmd
    };
    let refused =
        |cmd: &mut std::process::Command| testkit::fails(cmd).lines().last().unwrap().to_string();
    let prefix = format!(
        "fleet-coordinator: the fleet runs only images signed by {fleet_id} and refuses {image}: "
    );
    assert_eq!(
        refused(&mut run(&[])),
        format!(
            "{prefix}docker://{repo}@{digest_part} has no signature (no tag sha256-HEX.sig and no signature referrer): sign it with oci sign --key KEY"
        )
    );
    sign(&other_key);
    let line = refused(&mut run(&[]));
    assert!(
        line.starts_with(&format!(
            "{prefix}docker://{repo}@{digest_part} has no valid signature by {fleet_id}: tag sha256-"
        )) && line.ends_with("it was made by none of these keys"),
        "{line}"
    );
    // The other key's signature checks out with its own key: the refusal is the policy's.
    testkit::ok(
        testkit::cmd("oci")
            .args([
                "verify",
                &remote,
                "--plain-http",
                "--creds",
                &creds,
                "--key",
            ])
            .arg(&other_pub),
    );

    sign(&fleet_key);
    let set = testkit::ok(&mut run(&[])).trim().to_string();
    let done = wait_row(&coord, &set, |r| r["state"] == "finished");
    assert_eq!(done["outcome"]["exit_code"], 0, "{done:#}");
    assert_eq!(done["signed_by"], fleet_id.as_str(), "{done:#}");

    // Cleared, the fleet runs the image with no signature checked, and the row names none.
    testkit::ok(coord.command().args(["policy", "--clear"]));
    let set = testkit::ok(&mut run(&[])).trim().to_string();
    let done = wait_row(&coord, &set, |r| r["state"] == "finished");
    assert!(done.get("signed_by").is_none(), "{done:#}");
}

/// `check`: a healthy node passes every row, its engine reading the image's manifest from the
/// real registry as a pull would; against a registry nobody answers at, the registry row fails
/// naming the registry and the engine's error, the command exits 1 with one line, and the other
/// rows still pass.
#[test]
fn check_passes_a_healthy_node_and_names_an_unreachable_registry() {
    let dir = testkit::tempdir();
    let registry = Registry::plain();
    let images = Containers::new("check-images");
    engine_version(&images.runtime());
    let image = images.image(&registry, "check/sh", None);
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let _agent = worker(&coord, dir.path());
    let node_id = coord.nodes()[0]["id"].as_str().unwrap().to_string();
    let _containers = Containers::of_agent(&node_id);
    let manifests = counts(&registry).0;
    let out = testkit::ok(
        coord
            .command()
            .args(["check", "--all", "--registry", &image, "--json"]),
    );
    let checked: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = checked[0]["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["check"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["session", "registry", "store", "clock", "disk", "engine"]
    );
    for row in rows {
        assert_eq!(row["verdict"], "pass", "{row}");
    }
    let digest = image.rsplit_once('@').unwrap().1;
    assert!(
        rows[1]["detail"].as_str().unwrap().contains(digest),
        "{rows:#?}"
    );
    assert!(
        counts(&registry).0 > manifests,
        "the registry was asked for the manifest"
    );
    // The table, and a registry where nothing listens.
    let dead_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("127.0.0.1:{dead_port}/check/sh:1");
    let out = coord
        .command()
        .args(["check", "--node", "worker", "--registry", &dead])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim(),
        "fleet-coordinator: 1 of 1 node(s) failed a check: see the rows marked fail"
    );
    let table = String::from_utf8_lossy(&out.stdout);
    eprintln!("{table}");
    let failed: Vec<&str> = table.lines().filter(|l| l.contains(" fail ")).collect();
    assert_eq!(failed.len(), 1, "{table}");
    assert!(failed[0].contains(" registry "), "{table}");
    assert!(
        failed[0].contains(&format!("127.0.0.1:{dead_port}")),
        "{table}"
    );
    assert!(failed[0].contains("connection refused"), "{table}");
    assert_eq!(
        table.lines().filter(|l| l.contains(" pass ")).count(),
        5,
        "{table}"
    );
}

/// A run id the test names.
fn as_run_id(s: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(s).unwrap()
}
