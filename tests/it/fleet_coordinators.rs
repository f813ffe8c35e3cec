//! Tests: fleet_coordinators. Several `fleet-coordinator serve` processes sharing one fleet on one
//! real PostgreSQL (Debian's, a throwaway cluster per test), with real agents running real
//! programs: a token raced at two coordinators, a node's session moved between coordinators,
//! `collect` and `stop` sent to a coordinator that does not hold the session, a coordinator
//! SIGKILLed mid-dispatch, and PostgreSQL restarted mid-dispatch. A program appends its argument
//! to a side-effect file, so every run's executions are counted.
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, script, wait_until};
use testkit::postgres::Postgres;

const WAIT: Duration = Duration::from_secs(60);

/// `n` coordinators on one database, sharing the fleet's key (copied into each data folder, as
/// an operator would), each knowing the others.
struct Fleet {
    pg: Postgres,
    /// The fleet's database.
    url: String,
    dir: tempfile::TempDir,
    coords: Vec<Coordinator>,
    agents: Vec<Agent>,
}

impl Fleet {
    fn new(n: usize) -> Fleet {
        let pg = Postgres::start();
        let url = pg.fresh_database();
        let dir = testkit::tempdir();
        let first = dir.path().join("coord-0");
        let mut coords = vec![Coordinator::start(&first, &["--store", &url])];
        for i in 1..n {
            let data = dir.path().join(format!("coord-{i}"));
            std::fs::create_dir(&data).unwrap();
            let key = fleet_coordinator::KEY_FILE;
            std::fs::copy(first.join(key), data.join(key)).unwrap();
            coords.push(Coordinator::start(&data, &["--store", &url]));
        }
        let fleet = Fleet {
            pg,
            url,
            dir,
            coords,
            agents: Vec::new(),
        };
        let everyone = wait_until(WAIT, || {
            let join: Value = serde_json::from_str(&fleet.coords[0].token(&[])).unwrap();
            join["alternates"].as_array().map_or(0, Vec::len) == n - 1
        });
        assert!(everyone, "the coordinators never all knew each other");
        fleet
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A machine named `name` joining with a join file minted by coordinator `via`.
    fn add_agent(&mut self, name: &str, via: usize) -> usize {
        let machine = self.path(name);
        std::fs::create_dir_all(&machine).unwrap();
        let join = self.coords[via].token(&["--name", name]);
        std::fs::write(machine.join("fleet.json"), join).unwrap();
        let agent = Agent::spawn(
            &self.path(&format!("{name}.log")),
            testkit::agent::machine_command(&machine),
        );
        assert!(
            agent.wait_for("session open", 1, WAIT),
            "{name}: {}",
            agent.log_text()
        );
        self.agents.push(agent);
        self.agents.len() - 1
    }

    /// The coordinator (by index) holding the newest session of agent `a`, from its log.
    fn holder(&self, a: usize) -> usize {
        let log = self.agents[a].log_text();
        let line = (log.lines().rev())
            .find(|l| l.contains("session open"))
            .expect("a session opened");
        (self.coords.iter())
            .position(|c| line.contains(&format!("coordinator={}", c.addr)))
            .unwrap_or_else(|| panic!("no coordinator in {line}"))
    }

    /// A program that appends its first argument to the side-effect file, after `first`.
    fn effect_program(&self, first: &str) -> (PathBuf, PathBuf) {
        let effects = self.path("effects");
        let body = format!("{first}\necho \"$1\" >> {}", effects.display());
        (effects, script(&self.path("effect.sh"), &body))
    }

    /// `run --node NODE --program P -- ARG` through coordinator `via`; returns the set id.
    fn run(&self, via: usize, node: &str, program: &Path, arg: &str) -> String {
        let out = testkit::ok(
            self.coords[via]
                .command()
                .args(["run", "--node", node, "--program"])
                .arg(program)
                .args(["--", arg]),
        );
        out.trim().to_string()
    }

    fn row(&self, via: usize, set: &str) -> Value {
        let out = testkit::ok(
            self.coords[via]
                .command()
                .args(["status", "--set", set, "--json"]),
        );
        serde_json::from_str::<Value>(&out).unwrap()[0].clone()
    }

    /// Waits until every set's row is final (read through coordinator `via`); returns the rows.
    fn wait_final(&self, via: usize, sets: &[String]) -> Vec<Value> {
        let mut rows: HashMap<&str, Value> = HashMap::new();
        let done = wait_until(Duration::from_secs(120), || {
            for set in sets {
                if !rows.get(set.as_str()).is_some_and(is_final) {
                    rows.insert(set, self.row(via, set));
                }
            }
            rows.values().all(is_final)
        });
        let open: Vec<&Value> = rows.values().filter(|r| !is_final(r)).collect();
        assert!(done, "runs never ended: {open:#?}");
        sets.iter().map(|s| rows[s.as_str()].clone()).collect()
    }
}

fn is_final(row: &Value) -> bool {
    matches!(row["state"].as_str(), Some("finished" | "failed" | "lost"))
}

/// Every argument in `args` appears exactly once in the side-effect file.
fn assert_each_executed_once(effects: &Path, args: &[String]) {
    let text = std::fs::read_to_string(effects).unwrap_or_default();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for line in text.lines() {
        *seen.entry(line).or_default() += 1;
    }
    for arg in args {
        assert_eq!(
            seen.get(arg.as_str()),
            Some(&1),
            "{arg} executed {:?} times",
            seen.get(arg.as_str())
        );
    }
    assert_eq!(text.lines().count(), args.len(), "nothing else ran");
}

/// One token, presented at two coordinators at once by two machines: one joins, the other is
/// refused (and gives up when the token's lifetime is over); the database holds one node.
#[test]
fn a_token_raced_at_two_coordinators_joins_one_machine() {
    let fleet = Fleet::new(2);
    let join: Value =
        serde_json::from_str(&fleet.coords[0].token(&["--ttl", "4s", "--name", "raced"])).unwrap();
    let mut agents = Vec::new();
    for (i, coord) in fleet.coords.iter().enumerate() {
        let machine = fleet.path(&format!("racer-{i}"));
        std::fs::create_dir_all(&machine).unwrap();
        let mut file = join.clone();
        file["address"] = Value::from(coord.addr.clone());
        file["alternates"] = Value::Array(Vec::new());
        std::fs::write(machine.join("fleet.json"), file.to_string()).unwrap();
        agents.push(testkit::agent::machine_command(&machine));
    }
    let mut agents: Vec<Agent> = (agents.into_iter().enumerate())
        .map(|(i, cmd)| Agent::spawn(&fleet.path(&format!("racer-{i}.log")), cmd))
        .collect();
    let joined = wait_until(WAIT, || agents.iter().any(|a| a.count("Joined") > 0));
    assert!(joined, "nobody joined");
    let loser = agents
        .iter()
        .position(|a| a.count("Joined") == 0)
        .expect("only one machine joins");
    let status = agents[loser]
        .wait_exit(Duration::from_secs(30))
        .expect("the refused machine gives up once the token's lifetime is over");
    assert!(!status.success());
    assert!(
        agents[loser]
            .log_text()
            .contains("the coordinator did not accept the join token"),
        "{}",
        agents[loser].log_text()
    );
    let db = fleet.coords[0].nodes();
    assert_eq!(db.len(), 1, "{db:#?}");
    assert_eq!(db[0]["name"], "raced");
}

/// A node whose coordinator is SIGKILLed moves to another coordinator of the fleet, and runs
/// created before and after (through a third one) each execute once and end finished.
#[test]
fn a_session_moves_to_another_coordinator_with_no_run_lost_or_doubled() {
    let mut fleet = Fleet::new(3);
    let a = fleet.add_agent("worker", 0);
    let holder = fleet.holder(a);
    let creator = (holder + 1) % 3;
    let (effects, program) = fleet.effect_program("true");
    let mut args = Vec::new();
    let mut sets = Vec::new();
    for i in 0..10 {
        args.push(format!("before-{i}"));
        sets.push(fleet.run(creator, "worker", &program, &args[i]));
    }
    fleet.coords[holder].kill();
    for i in 0..10 {
        args.push(format!("after-{i}"));
        sets.push(fleet.run(creator, "worker", &program, &args[10 + i]));
    }
    let rows = fleet.wait_final(creator, &sets);
    for row in &rows {
        assert_eq!(row["state"], "finished", "{row:#}");
    }
    assert_each_executed_once(&effects, &args);
    let moved_to = fleet.holder(a);
    assert_ne!(
        moved_to, holder,
        "the node moved away from the killed coordinator"
    );
}

/// `stop` and `collect` sent to a coordinator that does not hold the node's session reach the
/// node through the one that does; the collected file comes back whole.
#[test]
fn collect_and_stop_reach_the_node_through_the_coordinator_holding_its_session() {
    let mut fleet = Fleet::new(3);
    let a = fleet.add_agent("worker", 0);
    let holder = fleet.holder(a);
    let (x, y) = ((holder + 1) % 3, (holder + 2) % 3);

    let sleeper = script(&fleet.path("sleeper.sh"), "sleep 60");
    let set = fleet.run(x, "worker", &sleeper, "long");
    let mut row = Value::Null;
    let running = wait_until(WAIT, || {
        row = fleet.row(y, &set);
        row["state"] == "running"
    });
    assert!(running, "{row:#}");
    let run = row["run_id"].as_str().unwrap().to_string();
    let stopped = testkit::ok(fleet.coords[y].command().args(["stop", "--run", &run]));
    assert_eq!(stopped.trim(), format!("stopped {run}"));
    let row = fleet.wait_final(x, std::slice::from_ref(&set)).remove(0);
    assert_eq!(row["outcome"]["stopped"], true, "{row:#}");

    let writer = script(
        &fleet.path("writer.sh"),
        "head -c 3000000 /dev/urandom > out.bin; echo done",
    );
    let set = fleet.run(y, "worker", &writer, "file");
    let row = fleet.wait_final(y, std::slice::from_ref(&set)).remove(0);
    assert_eq!(row["state"], "finished", "{row:#}");
    let run = row["run_id"].as_str().unwrap();
    let out = fleet.path("collected.bin");
    let printed = testkit::ok(
        fleet.coords[x]
            .command()
            .args(["collect", "--run", run, "--path", "out.bin", "--out"])
            .arg(&out),
    );
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(bytes.len(), 3_000_000);
    let digest = fleet_proto::Digest::of_reader(&bytes[..])
        .unwrap()
        .to_string();
    assert!(printed.contains(&digest), "{printed}");
}

/// 200 runs over three machines while the coordinator holding some of their sessions is
/// SIGKILLed mid-dispatch: its nodes move to the others, every run executes once and ends
/// finished.
#[test]
fn a_coordinator_killed_mid_dispatch_runs_every_run_exactly_once() {
    const RUNS: usize = 200;
    let mut fleet = Fleet::new(3);
    for i in 0..3 {
        fleet.add_agent(&format!("worker-{i}"), i);
    }
    let victim = fleet.holder(0);
    let creator = (victim + 1) % 3;
    let (effects, program) = fleet.effect_program("true");
    let mut args = Vec::new();
    let mut sets = Vec::new();
    for i in 0..RUNS {
        if i == RUNS / 3 {
            fleet.coords[victim].kill();
        }
        args.push(format!("run-{i}"));
        sets.push(fleet.run(creator, &format!("worker-{}", i % 3), &program, &args[i]));
    }
    let rows = fleet.wait_final(creator, &sets);
    for row in &rows {
        assert_eq!(row["state"], "finished", "{row:#}");
    }
    assert_each_executed_once(&effects, &args);
    for a in 0..3 {
        assert_ne!(fleet.holder(a), victim, "worker-{a} moved away");
    }
}

/// PostgreSQL restarted while runs are dispatched: the coordinators keep their sessions, hold
/// their changes until the database is back, and every run executes once and ends finished.
#[test]
fn postgres_restarted_mid_dispatch_loses_nothing() {
    const RUNS: usize = 60;
    let mut fleet = Fleet::new(2);
    fleet.add_agent("worker-0", 0);
    fleet.add_agent("worker-1", 1);
    let (effects, program) = fleet.effect_program("sleep 0.2");
    let mut args = Vec::new();
    let mut sets = Vec::new();
    for i in 0..RUNS {
        if i == RUNS / 2 {
            fleet.pg.restart();
        }
        args.push(format!("run-{i}"));
        let via = i % 2;
        let node = format!("worker-{}", i % 2);
        // A run asked for while the database is down is refused in one line; asked again.
        let mut set = None;
        let asked = wait_until(WAIT, || {
            let out = fleet.coords[via]
                .command()
                .args(["run", "--node", &node, "--program"])
                .arg(&program)
                .args(["--", &args[i]])
                .output()
                .unwrap();
            if out.status.success() {
                set = Some(String::from_utf8_lossy(&out.stdout).trim().to_string());
            }
            set.is_some()
        });
        assert!(asked, "run {i} was never accepted");
        sets.push(set.unwrap());
    }
    let rows = fleet.wait_final(0, &sets);
    for row in &rows {
        assert_eq!(row["state"], "finished", "{row:#}");
    }
    assert_each_executed_once(&effects, &args);
    for agent in &fleet.agents {
        assert_eq!(
            agent.count("session lost"),
            0,
            "the session was kept: {}",
            agent.log_text()
        );
    }
}

#[test]
fn a_coordinator_on_the_fleet_store_with_another_key_is_named_when_content_is_copied_from_it() {
    let mut fleet = Fleet::new(1);
    fleet.add_agent("m1", 0);
    // An operator forgot to copy the fleet's key: this one made a key of its own.
    let stray_data = fleet.path("coord-stray");
    let stray = Coordinator::start(&stray_data, &["--store", &fleet.url]);
    let known = wait_until(WAIT, || {
        let join: Value = serde_json::from_str(&fleet.coords[0].token(&[])).unwrap();
        join["alternates"].as_array().map_or(0, Vec::len) == 1
    });
    assert!(known, "the stray coordinator was never recorded");
    // The program lands in the stray coordinator's blob store; the node's coordinator must copy it.
    let (_, program) = fleet.effect_program("");
    let set = testkit::ok(
        stray
            .command()
            .args(["run", "--node", "m1", "--program"])
            .arg(&program),
    );
    let rows = fleet.wait_final(0, &[set.trim().to_string()]);
    assert_eq!(rows[0]["state"], "failed", "{}", rows[0]);
    let line = format!(
        "the coordinator at {} presented key {}",
        stray.addr,
        stray_key(&stray_data)
    );
    let log = fleet.coords[0].log_text();
    assert!(
        log.lines().any(|l| l.contains(&line)
            && l.contains("not this fleet's key")
            && l.contains(
                "holds another coordinator.key; copy this fleet's key there and restart it"
            )),
        "{log}"
    );
}

/// The public key of the coordinator whose data folder is `data`, as `nodes` shows keys.
fn stray_key(data: &Path) -> String {
    let pem = std::fs::read_to_string(data.join(fleet_coordinator::KEY_FILE)).unwrap();
    let key = rcgen::KeyPair::from_pem(&pem).unwrap();
    fleet_proto::pin::key_text(key.public_key_raw())
}

#[test]
fn content_copied_between_coordinators_resumes_from_what_a_cut_copy_left() {
    let mut fleet = Fleet::new(2);
    let agent = fleet.add_agent("m1", 0);
    let holder = fleet.holder(agent);
    let other = 1 - holder;
    // A program of 1 MiB, imported through the coordinator without the session.
    let (effects, program) = fleet.effect_program(&format!("# {}", "x".repeat(1 << 20)));
    let bytes = std::fs::read(&program).unwrap();
    let digest = fleet_proto::Digest::of_reader(&bytes[..]).unwrap();
    // The holder kept the first half of an earlier copy that was cut.
    let half = bytes.len() / 2;
    let blobs = fleet_coordinator::blobs(&fleet.coords[holder].data);
    let partial = blobs.partial(&digest);
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, &bytes[..half]).unwrap();
    let set = fleet.run(other, "m1", &program, "resumed");
    let rows = fleet.wait_final(other, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{}", rows[0]);
    assert_each_executed_once(&effects, &["resumed".to_string()]);
    assert!(blobs.has(&digest), "the copy landed whole at the holder");
    let sent = format!(
        "to=another coordinator digest={digest} offset={half} bytes={}",
        bytes.len() - half
    );
    let log = fleet.coords[other].log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("content sent") && l.contains(&sent)),
        "the copy did not resume from {half}:\n{log}"
    );
}
