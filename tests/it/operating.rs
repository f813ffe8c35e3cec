//! Tests: operating machines. `fleet-coordinator drain` with real agents running real programs
//! (the process runtime), on the embedded store and on a real PostgreSQL: a drained node finishes
//! what it holds and takes nothing new, across a coordinator restart, until it is taken back.
//! A program appends its argument to a side-effect file, so every run's executions are counted.
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, script, wait_until};
use testkit::netns::Net;
use testkit::postgres::Postgres;

const WAIT: Duration = Duration::from_secs(60);

/// One coordinator and its machines, on the store `store` names (`--store URL`, or none).
struct Fleet {
    dir: tempfile::TempDir,
    coord: Coordinator,
    agents: Vec<Agent>,
    /// Keeps the database up while the fleet lives.
    _pg: Option<Postgres>,
}

impl Fleet {
    fn new(postgres: bool) -> Fleet {
        Fleet::serving(postgres, &[])
    }

    /// Like [`Fleet::new`], the coordinator serving with `flags` too.
    fn serving(postgres: bool, flags: &[&str]) -> Fleet {
        Fleet::listening(postgres, "127.0.0.1:0", flags)
    }

    /// Like [`Fleet::serving`], the coordinator listening on `listen`.
    fn listening(postgres: bool, listen: &str, flags: &[&str]) -> Fleet {
        let dir = testkit::tempdir();
        let pg = postgres.then(Postgres::start);
        let url = pg.as_ref().map(Postgres::fresh_database);
        let mut store: Vec<&str> = match &url {
            Some(url) => vec!["--store", url],
            None => vec![],
        };
        store.extend_from_slice(flags);
        let coord = Coordinator::start_on(&dir.path().join("coord"), listen, &store);
        Fleet {
            dir,
            coord,
            agents: Vec::new(),
            _pg: pg,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A machine named `name`, joined and holding a session; returns its node id.
    fn add_agent(&mut self, name: &str) -> String {
        self.add_machine(name, &[], false, &[])
    }

    /// A machine named `name` joined with `token_flags` (`--label K=V`), the aarch64 agent under
    /// qemu-aarch64-static when `arm64`, its agent given `agent_flags`; returns its node id once
    /// its facts are in.
    fn add_machine(
        &mut self,
        name: &str,
        token_flags: &[&str],
        arm64: bool,
        agent_flags: &[&str],
    ) -> String {
        let native = self.machine_command(name, token_flags, agent_flags);
        let command = match arm64 {
            false => native,
            true => {
                let binary =
                    testkit::target_dir().join("aarch64-unknown-linux-musl/release/fleet-agent");
                assert!(
                    binary.exists(),
                    "{} is missing: run `cargo xtask ci`, or `cargo zigbuild --release --target aarch64-unknown-linux-musl -p fleet-agent`",
                    binary.display()
                );
                let mut qemu = std::process::Command::new("qemu-aarch64-static");
                qemu.arg(&binary).args(native.get_args());
                qemu
            }
        };
        self.start_machine(name, command)
    }

    /// A machine named `name` whose agent runs in the network namespace `net`, reaching the
    /// coordinator (which must listen there) at the host's side of its pair.
    fn add_machine_in(&mut self, net: &Net, name: &str, agent_flags: &[&str]) -> String {
        let port = self.coord.addr.rsplit_once(':').unwrap().1.to_string();
        let address = format!("{}:{port}", net.host_ip);
        let native = self.machine_command(name, &["--address", &address], agent_flags);
        self.start_machine(name, net.command(&native))
    }

    /// Writes the machine's join file (its token minted with `token_flags`) and returns its
    /// agent's command, with `agent_flags`.
    fn machine_command(&self, name: &str, token_flags: &[&str], agent_flags: &[&str]) -> Command {
        let machine = self.path(name);
        std::fs::create_dir_all(&machine).unwrap();
        let mut flags = vec!["--name", name];
        flags.extend_from_slice(token_flags);
        let join = self.coord.token(&flags);
        std::fs::write(machine.join("fleet.json"), join).unwrap();
        let mut native = testkit::agent::machine_command(&machine);
        native.args(agent_flags);
        // The machine's own tools first (a stand-in `systemctl` where a test puts one).
        let path = std::env::var("PATH").unwrap_or_default();
        native.env("PATH", format!("{}:{path}", machine.join("bin").display()));
        native
    }

    /// Starts the machine's agent as `command`; returns its node id once its facts are in.
    fn start_machine(&mut self, name: &str, command: Command) -> String {
        let agent = Agent::spawn(&self.path(&format!("{name}.log")), command);
        assert!(
            agent.wait_for("session open", 1, WAIT),
            "{name}: {}",
            agent.log_text()
        );
        self.agents.push(agent);
        let reported = wait_until(WAIT, || self.node(name)["facts"].is_object());
        assert!(reported, "{name} never reported its facts");
        self.node(name)["id"].as_str().unwrap().to_string()
    }

    fn node(&self, name: &str) -> Value {
        (self.coord.nodes().into_iter())
            .find(|n| n["name"] == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// A program that sleeps `secs`, then appends its argument to the side-effect file.
    fn program(&self, name: &str, secs: f64) -> PathBuf {
        let effects = self.effects();
        let body = format!("sleep {secs}\necho \"$1\" >> {}", effects.display());
        script(&self.path(&format!("{name}.sh")), &body)
    }

    fn effects(&self) -> PathBuf {
        self.path("effects")
    }

    /// `fleet-coordinator run ARGS --program P -- ARG`; the set id.
    fn run(&self, args: &[&str], program: &Path, arg: &str) -> String {
        let out = testkit::ok(
            self.coord
                .command()
                .arg("run")
                .args(args)
                .arg("--program")
                .arg(program)
                .args(["--", arg]),
        );
        out.trim().to_string()
    }

    fn rows(&self, set: &str) -> Vec<Value> {
        self.coord.rows(set)
    }

    fn drain(&self, args: &[&str]) -> String {
        testkit::ok(self.coord.command().arg("drain").args(args))
    }
}

fn is_final(row: &Value) -> bool {
    matches!(row["state"].as_str(), Some("finished" | "failed" | "lost"))
}

fn lines_of(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Drain while ten runs are out: all ten finish there, no new run starts there (by name it is
/// refused, `--all` passes it by), the row goes `Draining` then `Drained`, a coordinator restart
/// in between changes nothing, and `--undrain` takes it back.
fn drain_finishes_what_it_holds_and_takes_nothing_new(postgres: bool) {
    let mut fleet = Fleet::new(postgres);
    let a = fleet.add_agent("a");
    let b = fleet.add_agent("b");
    let slow = fleet.program("slow", 4.0);
    let held = fleet.run(&["--node", "a", "--repeat", "10"], &slow, "held");
    let said = fleet.drain(&["--node", "a"]);
    assert!(
        said.starts_with(&format!("{a} is Draining: it takes no new run (")),
        "{said}"
    );
    let row = fleet.node("a");
    assert_eq!(row["drain"], "Draining", "{row:#}");
    assert_eq!(row["state"], "Joined", "its lease holds: {row:#}");
    assert!(row["runs_out"].as_u64().unwrap() > 0, "{row:#}");
    assert!(row["drained_since_ms"].as_u64().is_some(), "{row:#}");
    let table = testkit::ok(fleet.coord.command().arg("nodes"));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&a) && l.contains(" Draining ")),
        "{table}"
    );

    // Nothing new reaches it: by name it is refused, in one line, and nothing is recorded.
    let quick = fleet.program("quick", 0.0);
    let refused = fleet
        .coord
        .refusal(&["run", "--node", "a", "--program", slow.to_str().unwrap()]);
    assert_eq!(
        refused,
        format!(
            "fleet-coordinator: the node a ({a}) is draining and takes no new run: send it to another node, or take it back with `fleet-coordinator drain --node a --undrain`"
        )
    );
    let all = fleet.run(&["--all"], &quick, "all");
    let rows = fleet.rows(&all);
    assert_eq!(rows.len(), 1, "--all passes the drained node by: {rows:#?}");
    assert_eq!(rows[0]["node_id"], b.as_str());

    // A restart of the coordinator changes nothing: the drain is in the store.
    fleet.coord.restart();
    assert_eq!(fleet.node("a")["drain"], "Draining");
    let refused_again = fleet.coord.refusal(&[
        "run",
        "--node",
        a.as_str(),
        "--program",
        slow.to_str().unwrap(),
    ]);
    assert!(
        refused_again.contains("is draining and takes no new run"),
        "{refused_again}"
    );

    // Everything it held finishes there, once each; then it shows Drained.
    let mut rows = Vec::new();
    let done = wait_until(Duration::from_secs(120), || {
        rows = fleet.rows(&held);
        rows.iter().all(is_final)
    });
    assert!(done, "the held runs never ended: {rows:#?}");
    assert!(
        rows.iter()
            .all(|r| r["state"] == "finished" && r["node_id"] == a.as_str()),
        "{rows:#?}"
    );
    let drained = wait_until(WAIT, || fleet.node("a")["drain"] == "Drained");
    assert!(drained, "{:#}", fleet.node("a"));
    assert_eq!(fleet.node("a")["runs_out"], 0);
    // What a pool loop reads: the drained ones, idle since their last run ended, by version.
    let row = fleet.node("a");
    assert_eq!(row["status"], "Drained", "{row:#}");
    let last_end = (rows.iter())
        .map(|r| r["updated_ms"].as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(row["idle_since_ms"].as_u64(), Some(last_end), "{row:#}");
    assert_eq!(
        row["facts"]["agent_version"],
        env!("CARGO_PKG_VERSION"),
        "{row:#}"
    );
    let ids = |args: &[&str]| -> Vec<String> {
        let out = testkit::ok(fleet.coord.command().args(["nodes", "--json"]).args(args));
        let nodes: Vec<Value> = serde_json::from_str(&out).unwrap();
        nodes
            .iter()
            .map(|n| n["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(ids(&["--state", "drained"]), vec![a.clone()]);
    assert_eq!(ids(&["--state", "Joined"]), vec![b.clone()]);
    assert_eq!(ids(&["--where", "name=b"]), vec![b.clone()]);
    assert!(ids(&["--state", "drained", "--where", "name=b"]).is_empty());
    let table = testkit::ok(fleet.coord.command().args(["nodes", "--state", "drained"]));
    let line = table.lines().nth(1).unwrap_or_default();
    assert!(
        line.starts_with(&a) && line.contains(" Drained "),
        "{table}"
    );
    assert!(line.contains(env!("CARGO_PKG_VERSION")), "{table}");
    assert_eq!(table.lines().count(), 2, "{table}");
    assert_eq!(
        fleet.coord.refusal(&["nodes", "--state", "sleepy"]),
        "fleet-coordinator: \"sleepy\" is not a node state: one of joined, lost, failed, draining, drained, retired, revoked"
    );
    let effects = lines_of(&fleet.effects());
    assert_eq!(
        effects.iter().filter(|l| *l == "held").count(),
        10,
        "{effects:?}"
    );
    assert_eq!(
        effects.iter().filter(|l| *l == "all").count(),
        1,
        "{effects:?}"
    );
    assert_eq!(effects.len(), 11, "nothing else ran: {effects:?}");

    // Taken back, it takes runs again.
    let said = fleet.drain(&["--node", &a, "--undrain"]);
    assert_eq!(said.trim(), format!("{a} takes new runs again"));
    let row = fleet.node("a");
    assert!(row.get("drain").is_none(), "{row:#}");
    let again = fleet.run(&["--node", "a"], &quick, "again");
    let done = wait_until(WAIT, || fleet.rows(&again).iter().all(is_final));
    assert!(done);
    assert_eq!(fleet.rows(&again)[0]["state"], "finished");

    // Bad input: one line each, nothing changed.
    assert_eq!(
        fleet.coord.refusal(&["drain", "--node", "nosuch"]),
        "fleet-coordinator: no node matches nosuch: see `fleet-coordinator nodes`"
    );
    assert!(fleet.node("a").get("drain").is_none());
}

#[test]
fn drain_on_the_embedded_store() {
    drain_finishes_what_it_holds_and_takes_nothing_new(false);
}

#[test]
fn drain_on_postgres() {
    drain_finishes_what_it_holds_and_takes_nothing_new(true);
}

/// `--where` picks by facts and labels, least loaded first: only the arm64 agents (the aarch64
/// build under qemu) for `arch=arm64`, only the labelled ones for `label.pool=lab` (from the
/// token, then from `label`), never a drained one; a bad expression or too few matches is one
/// line and records nothing.
#[test]
fn where_places_runs_by_facts_and_labels_least_loaded_first() {
    let mut fleet = Fleet::new(false);
    let x1 = fleet.add_machine("x1", &["--label", "pool=lab"], false, &[]);
    let x2 = fleet.add_machine("x2", &[], false, &[]);
    let arm1 = fleet.add_machine("arm1", &[], true, &[]);
    let arm2 = fleet.add_machine("arm2", &["--label", "pool=lab"], true, &[]);
    let quick = fleet.program("quick", 0.0);
    let nodes_of = |set: &str| nodes_of(&fleet, set);
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };

    let arm = fleet.run(&["--where", "arch=arm64", "--count", "2"], &quick, "arm");
    assert_eq!(nodes_of(&arm), sorted(vec![arm1.clone(), arm2.clone()]));
    let lab = fleet.run(&["--all", "--where", "label.pool=lab"], &quick, "lab");
    assert_eq!(nodes_of(&lab), sorted(vec![x1.clone(), arm2.clone()]));
    let both = fleet.run(
        &["--all", "--where", "arch=x86_64,label.pool=lab"],
        &quick,
        "both",
    );
    assert_eq!(nodes_of(&both), vec![x1.clone()]);

    // Least loaded first: x1 holds a slow run, so one x86_64 run goes to x2.
    let slow = fleet.program("slow", 5.0);
    fleet.run(&["--node", "x1"], &slow, "slow");
    let quick_x86 = fleet.run(&["--where", "arch=x86_64"], &quick, "least");
    assert_eq!(nodes_of(&quick_x86), vec![x2.clone()]);

    // Labels from the operator, and a drained node is passed by.
    let said =
        testkit::ok(
            fleet
                .coord
                .command()
                .args(["label", "--node", "x2", "pool=lab", "tier=gold"]),
        );
    assert_eq!(said.trim(), format!("{x2} pool=lab,tier=gold"));
    fleet.drain(&["--node", "x1"]);
    let lab_x86 = fleet.run(
        &["--all", "--where", "arch=x86_64,label.pool=lab"],
        &quick,
        "lab2",
    );
    assert_eq!(nodes_of(&lab_x86), vec![x2.clone()]);
    let said = testkit::ok(
        fleet
            .coord
            .command()
            .args(["label", "--node", "x2", "--remove", "pool"]),
    );
    assert_eq!(said.trim(), format!("{x2} tier=gold"));

    // Bad input: one line each; an expression that does not read is refused before the
    // program is added to the blob store.
    let never = script(&fleet.path("never.sh"), "echo never-stored");
    let blobs = || testkit::agent::files_under(&fleet.coord.data.join("blobs")).len();
    let stored = blobs();
    let program = never.to_str().unwrap();
    let refused = |args: &[&str]| {
        let mut all = vec!["run"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--program", program]);
        let err = testkit::fails(fleet.coord.command().args(&all));
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        lines[0].to_string()
    };
    let unknown = refused(&["--where", "colour=red"]);
    assert!(
        unknown.contains("--where names \"colour\", which is not a fact: the keys are arch, os, kernel, version, name, cpus, gpus, gpu.vendor, gpu.arch, memory, disk, link, link_confidence, assumed_link, assumed_link_confidence, cap, label.KEY"),
        "{unknown}"
    );
    let bad = refused(&["--where", "gpus>=many"]);
    assert!(bad.contains("\"many\" is not a number"), "{bad}");
    let unknown = refused(&["--where", "arch=x86_64", "--prefer", "fastest"]);
    assert_eq!(
        unknown,
        "fleet-coordinator: --prefer \"fastest\" is not known: prefer link or content"
    );
    let rate = refused(&["--where", "link>=100MB"]);
    assert!(rate.contains("\"100MB\" is not a rate"), "{rate}");
    assert_eq!(blobs(), stored, "nothing was added to the blob store");
    // Nothing matching: refused at once, `--count` too, unless it waits for a match.
    let none = refused(&["--all", "--where", "label.tier=platinum"]);
    assert_eq!(
        none,
        "fleet-coordinator: 0 of 4 nodes match --where label.tier=platinum (joined and not draining): widen the expression"
    );
    for count in [&["--count", "2"][..], &[]] {
        let mut args = vec!["--where", "label.tier=platinum"];
        args.extend_from_slice(count);
        assert_eq!(
            refused(&args),
            "fleet-coordinator: 0 of 4 nodes match --where label.tier=platinum (joined and not draining): widen the expression, or pass --wait-for-match to queue for one"
        );
    }
    let waits = fleet.run(
        &["--where", "label.tier=platinum", "--wait-for-match"],
        &quick,
        "platinum",
    );
    let rows = fleet.rows(&waits);
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(
        (&rows[0]["node_id"], &rows[0]["waiting_for"]["reason"]),
        (&Value::from("unplaced"), &Value::from("match")),
        "{rows:#?}"
    );
}

/// A program that stamps its start and end (`start ARG NANOSECONDS`) into `stamps`, sleeping
/// between.
fn stamping(fleet: &Fleet, secs: f64) -> PathBuf {
    let stamps = fleet.path("stamps");
    let body = format!(
        "echo \"start $1 $(date +%s%N)\" >> {s}\nsleep {secs}\necho \"end $1 $(date +%s%N)\" >> {s}",
        s = stamps.display()
    );
    script(&fleet.path("stamping.sh"), &body)
}

/// The stamps as (nanoseconds, +1 for a start or -1 for an end, argument), in time order; at
/// the same instant an end comes before a start (the slot was free).
fn moments(stamps: &[String]) -> Vec<(u128, i32, String)> {
    let mut moments: Vec<(u128, i32, String)> = (stamps.iter())
        .map(|l| {
            let parts: Vec<&str> = l.split(' ').collect();
            let step = if parts[0] == "start" { 1 } else { -1 };
            (parts[2].parse().unwrap(), step, parts[1].to_string())
        })
        .collect();
    moments.sort();
    moments
}

/// The most runs that were ever running at once.
fn most_at_once(stamps: &[String]) -> usize {
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step, _) in moments(stamps) {
        now += step;
        most = most.max(now);
    }
    most as usize
}

/// `fleet-coordinator capacity --node a --runs 2`, then two sets of five runs of `sleep 1`:
/// never more than two run there together, the rest wait and go out in order (no run of the
/// second set starts before four of the first have ended), all ten finish once each; the agent's
/// own `--max-runs` holds when lower; bad input is refused in one line.
#[test]
fn capacity_holds_runs_at_once_and_queues_the_rest() {
    let mut fleet = Fleet::new(false);
    let a = fleet.add_agent("a");
    let said =
        testkit::ok((fleet.coord.command()).args(["capacity", "--node", "a", "--runs", "2"]));
    assert_eq!(said.trim(), format!("{a} takes 2 run(s) at once (0 out)"));
    let program = stamping(&fleet, 1.0);
    let first = fleet.run(&["--node", "a", "--repeat", "5"], &program, "first");
    let second = fleet.run(&["--node", "a", "--repeat", "5"], &program, "second");
    let both = || [fleet.rows(&first), fleet.rows(&second)].concat();
    let mut queued = Vec::new();
    let seen_queued = wait_until(WAIT, || {
        let rows = both();
        queued = (rows.iter())
            .filter(|r| r["state"] == "waiting")
            .map(|r| r["waiting_for"].clone())
            .collect();
        rows.iter().filter(|r| r["state"] == "running").count() == 2 && queued.len() >= 4
    });
    assert!(seen_queued, "{:#?}", both());
    // Each waiting row says why: its node is at capacity.
    for why in &queued {
        assert_eq!(why["reason"], "capacity", "{queued:#?}");
        assert_eq!(why["capacity"], 2, "{queued:#?}");
        assert!(why["held"].as_u64().unwrap() > 2, "{queued:#?}");
    }
    let table = testkit::ok(fleet.coord.command().args(["status", "--set", &second]));
    assert!(
        table.contains("queued for capacity: its node holds"),
        "{table}"
    );
    let table = testkit::ok(fleet.coord.command().arg("nodes"));
    assert!(
        (table.lines())
            .any(|l| l.starts_with(&a) && l.split_whitespace().any(|w| w.ends_with("/2"))),
        "{table}"
    );
    let mut rows = Vec::new();
    let done = wait_until(Duration::from_secs(120), || {
        rows = both();
        rows.iter().all(is_final)
    });
    assert!(done, "{rows:#?}");
    assert!(rows.iter().all(|r| r["state"] == "finished"), "{rows:#?}");
    let stamps = lines_of(&fleet.path("stamps"));
    assert_eq!(stamps.len(), 20, "each of the ten ran once: {stamps:?}");
    assert_eq!(most_at_once(&stamps), 2, "{stamps:?}");
    // A run of the second set goes out only once at most one of the first is still out.
    let mut first_ended = 0;
    for (_, step, arg) in moments(&stamps) {
        match (step, arg.as_str()) {
            (-1, "first") => first_ended += 1,
            (1, "second") => assert!(first_ended >= 4, "out of order: {stamps:?}"),
            _ => {}
        }
    }

    // The agent's own limit, when lower, is the one that holds.
    let b = fleet.add_machine("b", &[], false, &["--max-runs", "1"]);
    let row = fleet.node("b");
    assert_eq!(row["facts"]["max_runs"], 1, "{row:#}");
    assert_eq!(row["capacity"], 1, "{row:#}");
    let said = testkit::ok((fleet.coord.command()).args(["capacity", "--node", &b, "--runs", "4"]));
    assert_eq!(said.trim(), format!("{b} takes 1 run(s) at once (0 out)"));
    // Reset, the agent's own default holds: one run per CPU.
    let said = testkit::ok((fleet.coord.command()).args(["capacity", "--node", "a", "--reset"]));
    let cpus = fleet.node("a")["facts"]["cpus"].as_u64().unwrap();
    assert_eq!(fleet.node("a")["facts"]["max_runs"], cpus);
    assert_eq!(
        said.trim(),
        format!("{a} takes {cpus} run(s) at once (0 out)")
    );

    // Bad input: one line each.
    assert_eq!(
        fleet
            .coord
            .refusal(&["capacity", "--node", "a", "--runs", "0"]),
        "fleet-coordinator: a capacity of 0 runs would take nothing: drain the node instead (`fleet-coordinator drain`)"
    );
    assert_eq!(
        fleet
            .coord
            .refusal(&["capacity", "--node", "nosuch", "--runs", "1"]),
        "fleet-coordinator: no node matches nosuch: see `fleet-coordinator nodes`"
    );
}

/// A node with no room skips the wake-ups of runs queued behind its capacity, but a raised
/// capacity starts them at once: with a 5 s heartbeat and a 60 s lease, the two queued runs
/// are running within 10 s of `capacity --runs 3`, not at the node's next end or lease look.
#[test]
fn a_raised_capacity_starts_the_queued_runs_at_once() {
    let mut fleet = Fleet::serving(false, &["--heartbeat", "5s", "--lease", "60s"]);
    fleet.add_machine("a", &[], false, &["--max-runs", "4"]);
    testkit::ok((fleet.coord.command()).args(["capacity", "--node", "a", "--runs", "1"]));
    let program = fleet.program("long", 30.0);
    let set = fleet.run(&["--node", "a", "--repeat", "3"], &program, "long");
    let count = |rows: &[Value], state: &str| rows.iter().filter(|r| r["state"] == state).count();
    let mut rows = Vec::new();
    let queued = wait_until(WAIT, || {
        rows = fleet.rows(&set);
        count(&rows, "running") == 1 && count(&rows, "waiting") == 2
    });
    assert!(queued, "{rows:#?}");
    testkit::ok((fleet.coord.command()).args(["capacity", "--node", "a", "--runs", "3"]));
    // Well before the first run ends (30 s) or the lease's look (60 s).
    let started = wait_until(Duration::from_secs(10), || {
        rows = fleet.rows(&set);
        count(&rows, "running") == 3
    });
    assert!(started, "{rows:#?}");
}

/// Retire with a run out is refused in one line and changes nothing; with `--discard` the run
/// ends `lost` (reason `retired`) and its program is stopped, the agent removes its state,
/// disables its unit and exits 78 (its unit's `RestartPreventExitStatus`) with one line; the
/// row says `Retired`, a `drain` of it is refused, `forget` removes it and refuses a live node.
/// No systemd runs as PID 1 here: a stand-in `systemctl` on the machine's PATH records what the
/// agent asked of it.
fn retire_refused_with_runs_out_then_discarded(postgres: bool) {
    let mut fleet = Fleet::new(postgres);
    let bin = fleet.path("a/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let asked = fleet.path("systemctl-asked");
    script(
        &bin.join("systemctl"),
        &format!("echo \"$*\" >> {}", asked.display()),
    );
    let a = fleet.add_agent("a");
    let b = fleet.add_agent("b");
    let program = fleet.program("long", 30.0);
    let set = fleet.run(&["--node", "a"], &program, "retired-run");
    let running = wait_until(WAIT, || fleet.rows(&set)[0]["state"] == "running");
    assert!(running, "{:#?}", fleet.rows(&set));
    assert_eq!(
        fleet.coord.refusal(&["retire", "--node", "a"]),
        "fleet-coordinator: the node a holds 1 run(s) not final: drain it and wait for `Drained`, or pass --discard to end them lost"
    );
    assert_eq!(fleet.node("a")["state"], "Joined");
    assert!(fleet.node("a").get("ended").is_none());
    let said = testkit::ok(
        fleet
            .coord
            .command()
            .args(["retire", "--node", "a", "--discard"]),
    );
    assert_eq!(
        said.trim(),
        format!("{a} is retired: its key is refused from now on (1 run(s) ended lost)")
    );
    let row = &fleet.rows(&set)[0];
    assert_eq!(
        (row["state"].as_str(), row["error"].as_str()),
        (Some("lost"), Some("retired"))
    );
    let agent = &mut fleet.agents[0];
    let status = agent.wait_exit(WAIT).expect("the retired agent stops");
    assert_eq!(status.code(), Some(78), "{}", agent.log_text());
    let log = agent.log_text();
    assert_eq!(
        log.matches("the fleet's operator retired this machine: the agent stopped its runs, removed its state").count(),
        1,
        "{log}"
    );
    assert!(log.contains("and disabled fleet-agent.service"), "{log}");
    let state: Vec<_> = std::fs::read_dir(fleet.path("a/state")).unwrap().collect();
    assert!(state.is_empty(), "the state is removed: {state:?}");
    assert_eq!(
        std::fs::read_to_string(&asked).unwrap(),
        "disable fleet-agent.service\n"
    );
    assert!(
        lines_of(&fleet.effects()).is_empty(),
        "the discarded run never finished"
    );
    let nodes = fleet.coord.command().arg("nodes").output().unwrap();
    let table = String::from_utf8_lossy(&nodes.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&a) && l.contains("Retired")),
        "{table}"
    );
    assert_eq!(fleet.node("a")["ended"]["end"], "retired");
    assert_eq!(
        fleet.coord.refusal(&["drain", "--node", "a"]),
        "fleet-coordinator: the node a is retired: nothing about it changes any more; `fleet-coordinator forget --node a` removes it"
    );
    assert_eq!(
        fleet
            .coord
            .refusal(&["run", "--node", "a", "--program", program.to_str().unwrap()]),
        "fleet-coordinator: the node a is retired and takes no run: send it to another node"
    );
    assert_eq!(
        fleet.coord.refusal(&["forget", "--node", "b"]),
        "fleet-coordinator: the node b is live (it holds its lease): retire or revoke it first"
    );
    let said = testkit::ok(fleet.coord.command().args(["forget", "--node", "a"]));
    assert_eq!(said.trim(), format!("{a} is forgotten"));
    let ids: Vec<Value> = fleet
        .coord
        .nodes()
        .iter()
        .map(|n| n["id"].clone())
        .collect();
    assert_eq!(ids, vec![Value::from(b.as_str())]);
    assert_eq!(
        fleet.rows(&set)[0]["state"],
        "lost",
        "its runs stay as history"
    );
}

#[test]
fn retire_on_the_embedded_store() {
    retire_refused_with_runs_out_then_discarded(false);
}

#[test]
fn retire_on_postgres() {
    retire_refused_with_runs_out_then_discarded(true);
}

/// `run --where label.pool=lab --retry-lost 1`: the agent holding the run is SIGKILLed and kept
/// down past its lease; the run is lost and placed again, once, on the other matching node (a
/// new row: attempt 2, naming the first, which names it). The first attempt's program outlives
/// its agent (runs are re-adopted after a restart), so it may run too: at most once per attempt
/// is the guarantee. When the first agent comes back, its late report is kept on the old row as
/// history and leaves the new row as it is.
#[test]
fn a_lost_run_runs_again_on_another_matching_node_once() {
    let mut fleet = Fleet::new(false);
    let a = fleet.add_machine("a", &["--label", "pool=lab"], false, &[]);
    let b = fleet.add_machine("b", &["--label", "pool=lab"], false, &[]);
    fleet.add_agent("c");
    // Each execution notes its argument and its run folder, which names the machine.
    let effects = fleet.effects();
    let program = script(
        &fleet.path("retried.sh"),
        &format!("sleep 3\necho \"$1 $PWD\" >> {}", effects.display()),
    );
    assert_eq!(
        fleet.coord.refusal(&[
            "run",
            "--node",
            "a",
            "--retry-lost",
            "1",
            "--program",
            program.to_str().unwrap()
        ]),
        "fleet-coordinator: --retry-lost places a lost run again on another matching node: use it with --where EXPR (not --node or --all)"
    );
    let set = fleet.run(
        &["--where", "label.pool=lab", "--retry-lost", "1"],
        &program,
        "once",
    );
    let running = wait_until(WAIT, || fleet.rows(&set)[0]["state"] == "running");
    assert!(running, "{:#?}", fleet.rows(&set));
    let first = fleet.rows(&set)[0].clone();
    let (held, other) = match first["node_id"].as_str() {
        Some(id) if id == a => (0, b.clone()),
        _ => (1, a.clone()),
    };
    fleet.agents[held].kill();
    let mut rows = Vec::new();
    let again = wait_until(WAIT, || {
        rows = fleet.rows(&set);
        rows.len() == 2 && is_final(&rows[1])
    });
    assert!(again, "{rows:#?}");
    let (old, new) = (&rows[0], &rows[1]);
    assert_eq!(old["state"], "lost", "{old:#}");
    assert_eq!(old["retried_as"], new["run_id"], "{old:#}");
    assert_eq!(new["previous"], old["run_id"], "{new:#}");
    assert_eq!(new["attempt"], 2);
    assert_eq!(
        new["node_id"],
        other.as_str(),
        "placed on the other matching node"
    );
    assert_eq!(new["state"], "finished", "{new:#}");
    let table = testkit::ok(fleet.coord.command().args(["status", "--set", &set]));
    assert!(
        table.contains(&format!(
            "(run again as {})",
            new["run_id"].as_str().unwrap()
        )),
        "{table}"
    );
    // The old attempt's program lives on without its agent and may finish: once at most.
    let machine = |name: &str| fleet.path(name).display().to_string();
    let (held_dir, other_dir) = match held {
        0 => (machine("a"), machine("b")),
        _ => (machine("b"), machine("a")),
    };
    let ran_on = |dir: &str| {
        lines_of(&effects)
            .iter()
            .filter(|l| l.contains(dir))
            .count()
    };
    assert_eq!(ran_on(&other_dir), 1, "{:?}", lines_of(&effects));
    assert!(ran_on(&held_dir) <= 1, "{:?}", lines_of(&effects));

    // The first agent comes back and reports the old attempt: history on the old row only.
    let name = if held == 0 { "a" } else { "b" };
    let mut back = testkit::agent::machine_command(&fleet.path(name));
    back.env("PATH", std::env::var("PATH").unwrap_or_default());
    let back = Agent::spawn(&fleet.path(&format!("{name}-back.log")), back);
    assert!(
        back.wait_for("session open", 1, WAIT),
        "{}",
        back.log_text()
    );
    let reported = wait_until(WAIT, || {
        fleet.rows(&set)[0]["events"].as_array().map_or(0, Vec::len)
            > old["events"].as_array().map_or(0, Vec::len)
    });
    assert!(
        reported,
        "the late report was kept: {:#?}",
        fleet.rows(&set)
    );
    let after = fleet.rows(&set);
    assert_eq!(after.len(), 2, "no third attempt: {after:#?}");
    assert_eq!(after[0]["state"], "lost", "{:#}", after[0]);
    assert_eq!(after[1], *new, "the new attempt's row is untouched");
}

/// `run --where label.pool=lab --count 2` with one lab machine: one row runs there, the other
/// waits queued for a match (status says so) and runs on the second lab machine once it joins;
/// never on a machine of another pool, never twice on the same one.
#[test]
fn a_set_asked_for_more_nodes_than_match_waits_for_a_match() {
    let mut fleet = Fleet::new(false);
    let a = fleet.add_machine("a", &["--label", "pool=lab"], false, &[]);
    fleet.add_agent("other");
    let program = fleet.program("quick", 0.0);
    let set = fleet.run(
        &["--where", "label.pool=lab", "--count", "2"],
        &program,
        "lab",
    );
    let mut rows = Vec::new();
    let one_done = wait_until(WAIT, || {
        rows = fleet.rows(&set);
        rows.iter().any(|r| r["state"] == "finished")
    });
    assert!(one_done, "{rows:#?}");
    assert_eq!(rows.len(), 2, "{rows:#?}");
    let queued = rows
        .iter()
        .find(|r| r["state"] == "waiting")
        .expect("one waits");
    assert_eq!(queued["node_id"], "unplaced", "{queued:#}");
    assert_eq!(queued["waiting_for"]["reason"], "match", "{queued:#}");
    let table = testkit::ok(fleet.coord.command().args(["status", "--set", &set]));
    assert!(table.contains("queued for a match"), "{table}");
    let b = fleet.add_machine("b", &["--label", "pool=lab"], false, &[]);
    let all_done = wait_until(WAIT, || {
        rows = fleet.rows(&set);
        rows.iter().all(|r| r["state"] == "finished")
    });
    assert!(all_done, "{rows:#?}");
    let mut nodes: Vec<&str> = rows
        .iter()
        .map(|r| r["node_id"].as_str().unwrap())
        .collect();
    nodes.sort();
    let mut want = vec![a.as_str(), b.as_str()];
    want.sort();
    assert_eq!(nodes, want, "one row on each lab machine");
    assert_eq!(lines_of(&fleet.effects()), vec!["lab", "lab"]);
}

/// A fetch window of one: the nodes fetch a dispatch's program one after another, the runs of
/// the others waiting their turn in order, and every run of two programs still runs once.
#[test]
fn a_fetch_window_of_one_delivers_every_run_in_turn() {
    let mut fleet = Fleet::serving(false, &["--fetch-window", "1"]);
    for name in ["m1", "m2", "m3"] {
        fleet.add_agent(name);
    }
    let (first, second) = (fleet.program("first", 0.0), fleet.program("second", 0.0));
    let sets = [
        fleet.run(&["--all"], &first, "first"),
        fleet.run(&["--all"], &second, "second"),
    ];
    let done = wait_until(WAIT, || {
        (sets.iter()).all(|set| {
            let rows = fleet.rows(set);
            rows.len() == 3 && rows.iter().all(is_final)
        })
    });
    assert!(done, "{:#?}", sets.map(|s| fleet.rows(&s)));
    for set in &sets {
        for row in fleet.rows(set) {
            assert_eq!(row["state"], "finished", "{row:#}");
        }
    }
    let mut effects = lines_of(&fleet.effects());
    effects.sort();
    assert_eq!(
        effects,
        ["first", "first", "first", "second", "second", "second"]
    );
}

/// The node each row of the set went to, sorted.
fn nodes_of(fleet: &Fleet, set: &str) -> Vec<String> {
    let mut ids: Vec<String> = (fleet.rows(set).iter())
        .map(|r| r["node_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

/// `--where link>=50MB/s` and `--prefer link` weigh the link each machine measured copying an
/// artifact (`replicate`). Two machines in network namespaces whose host side `tc` shapes to
/// 10 MB/s and to 100 MB/s: the floor picks the fast one, `link<50MB/s` the slow one; a third
/// machine that never copied anything counts at what the expression assumes.
#[test]
fn a_link_floor_picks_the_machine_whose_copies_were_fast_enough() {
    let mut fleet = Fleet::listening(false, "0.0.0.0:0", &[]);
    let (slow_net, fast_net) = (Net::new("lk", 0), Net::new("lk", 1));
    slow_net.shape("80mbit");
    fast_net.shape("800mbit");
    let root = |name: &str| fleet.path(name).join("artifacts");
    let (slow_root, fast_root) = (root("slow"), root("fast"));
    let slow = fleet.add_machine_in(
        &slow_net,
        "slow",
        &["--artifact-root", slow_root.to_str().unwrap()],
    );
    let fast = fleet.add_machine_in(
        &fast_net,
        "fast",
        &["--artifact-root", fast_root.to_str().unwrap()],
    );
    let never = fleet.add_agent("never");
    // 24 MB: about 2.4 s through the slow link, a quarter second through the fast one.
    let artifact = fleet.path("model.bin");
    let block: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut bytes = Vec::with_capacity(24 << 20);
    for i in 0..24u8 {
        bytes.extend(block.iter().map(|b| b ^ i));
    }
    std::fs::write(&artifact, bytes).unwrap();
    for name in ["slow", "fast"] {
        testkit::ok(
            fleet
                .coord
                .command()
                .args(["replicate", "--node", name, "--file"])
                .arg(&artifact),
        );
    }
    let rate = |name: &str| fleet.node(name)["facts"]["measured_link"]["bytes_per_s"].as_u64();
    let (slow_rate, fast_rate) = (rate("slow").unwrap(), rate("fast").unwrap());
    eprintln!("measured links: slow {slow_rate} B/s, fast {fast_rate} B/s");
    assert!(
        slow_rate < 12_000_000,
        "shaped to 10 MB/s, measured {slow_rate} B/s"
    );
    assert!(
        fast_rate >= 50_000_000,
        "shaped to 100 MB/s, measured {fast_rate} B/s"
    );
    assert_eq!(rate("never"), None, "it copied nothing");
    let quick = fleet.program("quick", 0.0);
    let floor = fleet.run(
        &["--where", "link>=50MB/s", "--count", "2"],
        &quick,
        "floor",
    );
    let floor_rows = fleet.rows(&floor);
    assert_eq!(floor_rows[0]["node_id"], fast.as_str(), "{floor_rows:#?}");
    assert_eq!(
        floor_rows[1]["node_id"], "unplaced",
        "the others are under the floor: {floor_rows:#?}"
    );
    // Measured, and confidently: the machine never measured is assumed 0 B/s at 0.5.
    let under = fleet.run(
        &["--where", "link<50MB/s,link_confidence>=0.9"],
        &quick,
        "under",
    );
    assert_eq!(nodes_of(&fleet, &under), [slow.as_str()]);
    let assumed = fleet.run(
        &["--all", "--where", "link>=50MB/s,assumed_link=1Gbit/s"],
        &quick,
        "assumed",
    );
    let mut expected = vec![fast.clone(), never.clone()];
    expected.sort();
    assert_eq!(nodes_of(&fleet, &assumed), expected);
    // The fastest first, whatever the load; then `nodes` filters alike.
    let slow_run = fleet.program("slow-run", 30.0);
    fleet.run(&["--node", "fast"], &slow_run, "busy");
    let preferred = fleet.run(
        &["--where", "arch=x86_64", "--prefer", "link"],
        &quick,
        "prefer",
    );
    assert_eq!(nodes_of(&fleet, &preferred), [fast.as_str()]);
    let listed =
        testkit::ok(
            fleet
                .coord
                .command()
                .args(["nodes", "--json", "--where", "link>=50MB/s"]),
        );
    let listed: Vec<Value> = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed.len(), 1, "{listed:#?}");
    assert_eq!(listed[0]["id"], fast.as_str());
}

/// `--prefer content` sends a run to the machine that already holds its program (its facts
/// list the digests it holds, sent again once it fetched new content), whatever the load.
#[test]
fn prefer_content_picks_the_machine_already_holding_the_program() {
    let mut fleet = Fleet::new(false);
    let a = fleet.add_agent("a");
    let b = fleet.add_agent("b");
    let on = |name: &str| {
        script(
            &fleet.path(&format!("on-{name}.sh")),
            &format!("echo {name}"),
        )
    };
    let (on_a, on_b) = (on("a"), on("b"));
    for (node, program) in [("a", &on_a), ("b", &on_b)] {
        let set = fleet.run(&["--node", node], program, "first");
        assert!(wait_until(WAIT, || fleet.rows(&set).iter().all(is_final)));
    }
    let digest = |p: &Path| format!("sha256:{}", fleet_coordinator::file_sha256(p).unwrap());
    let holds = |node: &str, p: &Path| {
        let inventory = fleet.node(node)["facts"]["content"]["digests"].clone();
        inventory
            .as_array()
            .is_some_and(|d| d.contains(&Value::from(digest(p))))
    };
    assert!(
        wait_until(WAIT, || holds("a", &on_a) && holds("b", &on_b)),
        "{:#}",
        fleet.node("a")
    );
    assert!(!holds("a", &on_b) && !holds("b", &on_a));
    // Each one loaded, so least-loaded alone would pick the other.
    let long = fleet.program("long", 30.0);
    fleet.run(&["--node", "a"], &long, "busy");
    fleet.run(&["--node", "b"], &long, "busy");
    fleet.run(&["--node", "b"], &long, "busier");
    for (program, holder) in [(&on_a, &a), (&on_b, &b)] {
        let set = fleet.run(
            &["--where", "arch=x86_64", "--prefer", "content"],
            program,
            "again",
        );
        assert_eq!(nodes_of(&fleet, &set), [holder.as_str()]);
    }
}
