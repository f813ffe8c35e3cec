//! Tests: fleet_coordinators. Several `fleet-coordinator serve` processes sharing one fleet on one
//! real PostgreSQL (Debian's, a throwaway cluster per test), with real agents running real
//! programs: a token raced at two coordinators, a node's session moved between coordinators,
//! `collect` and `stop` sent to a coordinator that does not hold the session, a coordinator
//! SIGKILLed mid-dispatch, PostgreSQL restarted mid-dispatch, a revoke cutting sessions wherever
//! they are held, a coordinator added after a node's welcome, and content that outlives the
//! coordinator it was imported through. A program appends its argument
//! to a side-effect file, so every run's executions are counted.
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, script, wait_until};
use testkit::postgres::Postgres;

const WAIT: Duration = Duration::from_secs(60);

/// `n` coordinators on one database, sharing the fleet's key (copied into each data folder, as
/// an operator would), each knowing the others.
struct Fleet {
    pg: Rc<Postgres>,
    /// The fleet's database.
    url: String,
    dir: tempfile::TempDir,
    coords: Vec<Coordinator>,
    agents: Vec<Agent>,
    /// What every coordinator is started with beside `--store`.
    flags: Vec<String>,
}

impl Fleet {
    fn new(n: usize) -> Fleet {
        Fleet::with_flags(n, &[])
    }

    /// `n` coordinators, each started with `flags` beside `--store`.
    fn with_flags(n: usize, flags: &[&str]) -> Fleet {
        let mut fleet = Fleet::on(Rc::new(Postgres::start()), flags);
        for _ in 0..n {
            fleet.start_coordinator();
        }
        let everyone = wait_until(WAIT, || {
            let join: Value = serde_json::from_str(&fleet.coords[0].token(&[])).unwrap();
            join["alternates"].as_array().map_or(0, Vec::len) == n - 1
        });
        assert!(everyone, "the coordinators never all knew each other");
        fleet
    }

    /// No coordinator yet, on a fresh database of `pg`.
    fn on(pg: Rc<Postgres>, flags: &[&str]) -> Fleet {
        let url = pg.fresh_database();
        Fleet {
            pg,
            url,
            dir: testkit::tempdir(),
            coords: Vec::new(),
            agents: Vec::new(),
            flags: flags.iter().map(|f| f.to_string()).collect(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// One more coordinator on the fleet's database (the first makes the fleet's key; the others
    /// get a copy of it, as an operator adds one); returns its index at once.
    fn start_coordinator(&mut self) -> usize {
        let first = self.path("coord-0");
        let data = self.path(&format!("coord-{}", self.coords.len()));
        if !self.coords.is_empty() {
            std::fs::create_dir(&data).unwrap();
            let key = fleet_coordinator::KEY_FILE;
            std::fs::copy(first.join(key), data.join(key)).unwrap();
        }
        let mut flags = vec!["--store", self.url.as_str()];
        flags.extend(self.flags.iter().map(String::as_str));
        self.coords.push(Coordinator::start(&data, &flags));
        self.coords.len() - 1
    }

    /// [`Fleet::start_coordinator`], returning once the first coordinator knows it.
    fn add_coordinator(&mut self) -> usize {
        let added = self.start_coordinator();
        let known = wait_until(WAIT, || {
            let join: Value = serde_json::from_str(&self.coords[0].token(&[])).unwrap();
            join["alternates"].as_array().map_or(0, Vec::len) == added
        });
        assert!(known, "the first coordinator never heard of the new one");
        added
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

    /// The first run's row of `set`, read through coordinator `via`.
    fn row(&self, via: usize, set: &str) -> Value {
        self.rows(via, set).swap_remove(0)
    }

    /// Every run's row of `set`, read through coordinator `via`.
    fn rows(&self, via: usize, set: &str) -> Vec<Value> {
        let out = testkit::ok(
            self.coords[via]
                .command()
                .args(["status", "--set", set, "--json"]),
        );
        serde_json::from_str(&out).unwrap()
    }

    /// Waits until every run of every set is final (read through coordinator `via`); returns each
    /// set's first row.
    fn wait_final(&self, via: usize, sets: &[String]) -> Vec<Value> {
        let mut rows: HashMap<&str, Vec<Value>> = HashMap::new();
        let all_final = |runs: &Vec<Value>| !runs.is_empty() && runs.iter().all(is_final);
        let done = wait_until(Duration::from_secs(120), || {
            for set in sets {
                if !rows.get(set.as_str()).is_some_and(all_final) {
                    rows.insert(set, self.rows(via, set));
                }
            }
            rows.values().all(all_final)
        });
        let open: Vec<&Value> = (rows.values().flatten()).filter(|r| !is_final(r)).collect();
        assert!(done, "runs never ended: {open:#?}");
        sets.iter().map(|s| rows[s.as_str()][0].clone()).collect()
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

/// An operator who forgot to copy the fleet's key: the folder's own key is refused by the store,
/// which knows the fleet's, for `serve` and for every operator command, naming both keys; nothing
/// is recorded.
#[test]
fn a_coordinator_key_that_is_not_the_fleets_is_refused_naming_both() {
    let mut fleet = Fleet::new(1);
    fleet.add_agent("m1", 0);
    let stray_data = fleet.path("coord-stray");
    // The folder made a key of its own the first time it was used.
    let stray_out = testkit::output(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(&stray_data)
            .args(["serve", "--listen", "127.0.0.1:0", "--store", &fleet.url]),
    );
    assert!(!stray_out.status.success());
    let fleet_key = stray_key(&fleet.coords[0].data);
    let line = format!(
        "the coordinator key in {} is {}, but the store {} belongs to the fleet of {fleet_key}: copy the fleet's coordinator.key into this data folder (or pass the data folder of a coordinator of that fleet), or use a store of its own",
        stray_data.display(),
        stray_key(&stray_data),
        fleet.url,
    );
    let stderr = String::from_utf8_lossy(&stray_out.stderr);
    assert!(stderr.trim_end().ends_with(&line), "{stderr}");
    let refused = testkit::fails(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(&stray_data)
            .args(["--store", &fleet.url, "token", "--name", "m2"]),
    );
    assert!(refused.trim_end().ends_with(&line), "{refused}");
    // Never recorded as a member, and no token minted.
    let join: Value = serde_json::from_str(&fleet.coords[0].token(&[])).unwrap();
    assert_eq!(
        join["alternates"].as_array().map_or(0, Vec::len),
        0,
        "{join}"
    );
    let nodes: Value = serde_json::from_str(&testkit::ok(
        fleet.coords[0].command().args(["nodes", "--json"]),
    ))
    .unwrap();
    assert_eq!(nodes[0]["runs_out"], 0, "{nodes:#}");
}

/// The public key of the coordinator whose data folder is `data`, as `nodes` shows keys.
fn stray_key(data: &Path) -> String {
    let pem = std::fs::read_to_string(data.join(fleet_coordinator::KEY_FILE)).unwrap();
    let key = rcgen::KeyPair::from_pem(&pem).unwrap();
    fleet_proto::pin::key_text(key.public_key_raw())
}

#[test]
fn content_copied_between_coordinators_resumes_from_what_a_cut_copy_left() {
    // One copy kept: `run` pushes none, so the holder of the session copies it on staging.
    let mut fleet = Fleet::with_flags(2, &["--content-copies", "1"]);
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

/// Revoke during a run, for a node whose session each of three coordinators holds, the command
/// always given to the first: each session is cut within a second of the command (by the first
/// coordinator at once, by the others when they look at the store), the run ends `lost` with
/// reason `revoked` and its program never finishes, the agent logs one line and exits 78 (its
/// unit's `RestartPreventExitStatus`); started again, it stops at once without dialing.
#[test]
fn revoke_cuts_the_session_on_every_coordinator_within_a_second() {
    let mut fleet = Fleet::new(3);
    let (effects, program) = fleet.effect_program("sleep 30");
    let mut cut_after = Vec::new();
    for via in 0..3 {
        let name = format!("m{via}");
        let a = fleet.add_agent(&name, via);
        assert_eq!(
            fleet.holder(a),
            via,
            "{name} holds its session at coordinator {via}"
        );
        let set = fleet.run(0, &name, &program, &name);
        let running = wait_until(WAIT, || fleet.row(0, &set)["state"] == "running");
        assert!(running, "{:#}", fleet.row(0, &set));
        let said = testkit::ok(fleet.coords[0].command().args(["revoke", "--node", &name]));
        let revoked = std::time::Instant::now();
        assert!(
            said.contains("is revoked: its key is refused from now on (1 run(s) ended lost)"),
            "{said}"
        );
        let told = wait_until(WAIT, || {
            fleet.agents[a].count("the fleet's operator ended this node") == 1
        });
        cut_after.push(revoked.elapsed());
        assert!(told, "{name}: {}", fleet.agents[a].log_text());
        let status = fleet.agents[a].wait_exit(WAIT).expect("the agent stops");
        assert_eq!(status.code(), Some(78), "{}", fleet.agents[a].log_text());
        let log = fleet.agents[a].log_text();
        assert_eq!(
            log.matches("the fleet's operator revoked this machine's key")
                .count(),
            1,
            "{log}"
        );
        let row = fleet.row(0, &set);
        assert_eq!(
            (row["state"].as_str(), row["error"].as_str()),
            (Some("lost"), Some("revoked"))
        );
        let node = (fleet.coords[0].nodes().into_iter())
            .find(|n| n["name"] == name.as_str())
            .unwrap();
        assert_eq!(node["ended"]["end"], "revoked", "{node:#}");
        // Started again, the agent stops at once: it never dials a coordinator.
        let mut again = Agent::spawn(
            &fleet.path(&format!("{name}-again.log")),
            testkit::agent::machine_command(&fleet.path(&name)),
        );
        let status = again
            .wait_exit(WAIT)
            .expect("a revoked agent stops at start");
        assert_eq!(status.code(), Some(78));
        let log = again.log_text();
        assert!(
            log.contains("the fleet's operator revoked this machine's key"),
            "{log}"
        );
        assert!(!log.contains("session"), "it never dialed: {log}");
    }
    eprintln!("sessions cut after: {cut_after:?}");
    for (via, after) in cut_after.iter().enumerate() {
        assert!(
            *after < Duration::from_secs(1),
            "the session held by coordinator {via} was cut {after:?} after the revoke"
        );
    }
    assert!(
        !std::fs::read_to_string(&effects)
            .unwrap_or_default()
            .contains('m'),
        "no revoked run finished"
    );
}

/// A coordinator started after a node's session began is told to the node in that session (no
/// new welcome), and kept in its membership; once the first coordinator is SIGKILLed, the node
/// redials the one it learned and the next run finishes there.
#[test]
fn a_coordinator_added_later_is_learned_in_session_and_taken_over_to() {
    let mut fleet = Fleet::new(1);
    let a = fleet.add_agent("m", 0);
    let b = fleet.add_coordinator();
    let b_addr = fleet.coords[b].addr.clone();
    let learned = wait_until(WAIT, || {
        fleet.agents[a].count("learned the fleet's coordinators") >= 1
    });
    assert!(learned, "{}", fleet.agents[a].log_text());
    assert_eq!(
        fleet.agents[a].count("session open"),
        1,
        "no new session was needed"
    );
    let membership = || std::fs::read_to_string(fleet.path("m/state/membership.json")).unwrap();
    let kept = wait_until(WAIT, || membership().contains(&b_addr));
    assert!(kept, "kept in the membership: {}", membership());
    fleet.coords[0].kill();
    let moved = wait_until(WAIT, || {
        fleet.agents[a].count("session open") >= 2 && fleet.holder(a) == b
    });
    assert!(moved, "{}", fleet.agents[a].log_text());
    let (effects, program) = fleet.effect_program("true");
    let set = fleet.run(b, "m", &program, "after");
    let rows = fleet.wait_final(b, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{:#}", rows[0]);
    assert_each_executed_once(&effects, &["after".to_string()]);
}

/// A node that joins in the first moment of another coordinator's life, and whose own coordinator
/// is SIGKILLed right after its session opened, is not stranded: its join file and its welcome
/// name every coordinator the store says serves the fleet then (each records itself before it
/// prints its address), so it moves, and a run through the new one finishes. No pause between
/// the steps, 20 times in a row.
#[test]
fn a_node_joined_in_a_new_coordinators_first_moment_moves_to_it_when_its_own_dies() {
    let pg = Rc::new(Postgres::start());
    for round in 0..20 {
        // The default heartbeat: a coordinator hears of the others once per heartbeat.
        let mut fleet = Fleet::on(pg.clone(), &["--heartbeat", "5s", "--lease", "15s"]);
        fleet.start_coordinator();
        let b = fleet.start_coordinator();
        let a = fleet.add_agent("m", 0);
        assert_eq!(fleet.holder(a), 0, "round {round}: joined at the first");
        fleet.coords[0].kill();
        let (effects, program) = fleet.effect_program("true");
        let arg = format!("round-{round}");
        let set = fleet.run(b, "m", &program, &arg);
        let rows = fleet.wait_final(b, &[set]);
        let log = fleet.agents[a].log_text();
        assert_eq!(
            rows[0]["state"], "finished",
            "round {round}: {:#}\n{log}",
            rows[0]
        );
        assert_each_executed_once(&effects, &[arg]);
    }
}

/// A run submitted through a coordinator that has just started, before the one holding the
/// node's session has heard of it (its sweep comes every 10 s here): that one asks the store which
/// coordinators serve it now and copies the program from the new one; the run finishes once.
#[test]
fn a_run_through_a_coordinator_just_started_finds_its_content() {
    // One copy kept: `run` pushes none, so the new coordinator alone holds the program.
    let flags = [
        "--heartbeat",
        "10s",
        "--lease",
        "30s",
        "--content-copies",
        "1",
    ];
    let mut fleet = Fleet::with_flags(1, &flags);
    fleet.add_agent("m", 0);
    let b = fleet.start_coordinator();
    let (effects, program) = fleet.effect_program("true");
    let set = fleet.run(b, "m", &program, "fresh");
    let rows = fleet.wait_final(b, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{:#}", rows[0]);
    assert_each_executed_once(&effects, &["fresh".to_string()]);
    let log = fleet.coords[0].log_text();
    assert!(
        log.contains("content copied from another coordinator"),
        "{log}"
    );
}

/// Content imported through one coordinator is held by a second before `run` returns
/// (`--content-copies 2`, the default): that coordinator SIGKILLed and its data folder deleted
/// while the run still waits for its node, the run finishes once, its program copied from the
/// other holder.
#[test]
fn content_imported_through_a_coordinator_outlives_it() {
    let mut fleet = Fleet::new(3);
    let a = fleet.add_agent("m", 0);
    let holder = fleet.holder(a);
    let through = (holder + 1) % 3;
    // The node busy with one run at a time, so the next one waits unstaged: nobody copies its
    // program for a node before the coordinator it came through is gone.
    testkit::ok(
        fleet.coords[0]
            .command()
            .args(["capacity", "--node", "m", "--runs", "1"]),
    );
    let busy = script(&fleet.path("busy.sh"), "sleep 3");
    let first = fleet.run(holder, "m", &busy, "busy");
    let running = wait_until(WAIT, || fleet.row(holder, &first)["state"] == "running");
    assert!(running, "{:#}", fleet.row(holder, &first));
    let (effects, program) = fleet.effect_program("true");
    let set = fleet.run(through, "m", &program, "kept");
    let hex = fleet_coordinator::file_sha256(&program).unwrap();
    let holders: Vec<usize> = (0..3)
        .filter(|i| {
            let blobs = fleet.path(&format!("coord-{i}/blobs"));
            testkit::agent::files_under(&blobs)
                .iter()
                .any(|f| f.to_string_lossy().contains(&hex))
        })
        .collect();
    assert!(holders.len() >= 2, "held by {holders:?} when run returned");
    // The second copy was pushed while `run` read the file, not copied after it.
    let pushed = |i: &usize| {
        let log = fleet.coords[*i].log_text();
        log.lines()
            .any(|l| l.contains("content pushed and checked") && l.contains(&hex))
    };
    assert!(
        holders.iter().filter(|i| **i != through).any(pushed),
        "no holder says the copy was pushed to it"
    );
    // Gone for good: killed, and its data folder deleted.
    fleet.coords[through].kill();
    std::fs::remove_dir_all(fleet.path(&format!("coord-{through}"))).unwrap();
    let rows = fleet.wait_final(holder, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{:#}", rows[0]);
    assert_each_executed_once(&effects, &["kept".to_string()]);
}

/// A holder of content gone for good: the sweep has another coordinator copy it, so the count is
/// back without any run asking; then the coordinator the content came through goes for good too,
/// and the run, waiting for a matching node all along, still finishes once from the copy.
#[test]
fn the_sweep_restores_the_copies_of_a_holder_gone_for_good() {
    let mut fleet = Fleet::new(3);
    let (effects, program) = fleet.effect_program("true");
    // No node matches yet: the run waits, and its content must outlive both its holders.
    let set = testkit::ok(
        fleet.coords[0]
            .command()
            .args([
                "run",
                "--where",
                "label.pool=later",
                "--count",
                "1",
                "--wait-for-match",
                "--program",
            ])
            .arg(&program)
            .args(["--", "kept"]),
    );
    let set = set.trim().to_string();
    let hex = fleet_coordinator::file_sha256(&program).unwrap();
    let root = fleet.dir.path().to_path_buf();
    let holds = |i: usize| {
        let blobs = root.join(format!("coord-{i}/blobs"));
        (testkit::agent::files_under(&blobs).iter()).any(|f| f.to_string_lossy().contains(&hex))
    };
    let holders: Vec<usize> = (0..3).filter(|&i| holds(i)).collect();
    assert_eq!(
        holders.len(),
        2,
        "two copies when run returned: {holders:?}"
    );
    assert!(holders.contains(&0), "the importing coordinator holds it");
    let gone = holders[1];
    let third = 3 - gone;
    assert!(!holds(third));
    fleet.coords[gone].kill();
    std::fs::remove_dir_all(fleet.path(&format!("coord-{gone}"))).unwrap();
    let restored = wait_until(WAIT, || holds(third));
    assert!(
        restored,
        "the sweep never copied the content to coord-{third}"
    );
    fleet.coords[0].kill();
    std::fs::remove_dir_all(fleet.path("coord-0")).unwrap();
    // A matching machine joins through the one coordinator left.
    let machine = fleet.path("m1");
    std::fs::create_dir_all(&machine).unwrap();
    let join = fleet.coords[third].token(&["--name", "m1", "--label", "pool=later"]);
    std::fs::write(machine.join("fleet.json"), join).unwrap();
    fleet.agents.push(Agent::spawn(
        &fleet.path("m1.log"),
        testkit::agent::machine_command(&machine),
    ));
    let rows = fleet.wait_final(third, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{:#}", rows[0]);
    assert_each_executed_once(&effects, &["kept".to_string()]);
}

/// A rolling restart of three coordinators, twice over (SIGTERM, start, next), while 500 runs are
/// sent to 20 real agents through whichever coordinator is up: every run executes exactly once
/// (each appends its own run folder), every row ends finished, and after each restart every node
/// holds a session again within two leases.
#[test]
fn a_rolling_restart_twice_over_loses_and_doubles_nothing() {
    const AGENTS: usize = 20;
    let mut fleet = Fleet::new(3);
    for i in 0..AGENTS {
        fleet.add_agent(&format!("w{i}"), i % 3);
    }
    let effects = fleet.path("effects");
    let program = script(
        &fleet.path("once.sh"),
        &format!("echo \"$PWD\" >> {}", effects.display()),
    );
    let lease = Duration::from_secs(2);
    let mut sets = Vec::new();
    let mut back_after = Vec::new();
    for (turn, repeat) in [5, 4, 4, 4, 4, 4].into_iter().enumerate() {
        let restarted = turn % 3;
        let through = (restarted + 1) % 3;
        let out = testkit::ok(
            fleet.coords[through]
                .command()
                .args(["run", "--all", "--repeat", &repeat.to_string(), "--program"])
                .arg(&program),
        );
        sets.push(out.trim().to_string());
        let opened: Vec<usize> = (0..AGENTS)
            .map(|a| fleet.agents[a].count("session open"))
            .collect();
        let held_there: Vec<usize> = (0..AGENTS)
            .filter(|&a| fleet.holder(a) == restarted)
            .collect();
        let exited = fleet.coords[restarted].restart_gracefully();
        assert!(
            exited.is_some_and(|s| s.success()),
            "coordinator {restarted} exited {exited:?}"
        );
        let stopped = std::time::Instant::now();
        let back = wait_until(WAIT, || {
            held_there
                .iter()
                .all(|&a| fleet.agents[a].count("session open") > opened[a])
        });
        back_after.push(stopped.elapsed());
        assert!(
            back,
            "the nodes of coordinator {restarted} never held a session again"
        );
    }
    let rows = fleet.wait_final(0, &sets);
    let runs: Vec<Value> = sets.iter().flat_map(|set| fleet.rows(0, set)).collect();
    assert_eq!(rows.len(), sets.len());
    assert_eq!(runs.len(), 500);
    for row in &runs {
        assert_eq!(row["state"], "finished", "{row:#}");
    }
    let lines = std::fs::read_to_string(&effects).unwrap_or_default();
    let folders: std::collections::HashSet<&str> = lines.lines().collect();
    assert_eq!(
        lines.lines().count(),
        500,
        "each run once: {} lines",
        lines.lines().count()
    );
    assert_eq!(folders.len(), 500, "no run twice");
    eprintln!("nodes back after each restart: {back_after:?}");
    for (turn, after) in back_after.iter().enumerate() {
        assert!(
            *after < 2 * lease,
            "restart {turn}: the nodes were back only after {after:?}"
        );
    }
}

/// A node whose coordinator died (SIGKILL, started again) moves to another at once, then goes
/// back to the one it joined through once that answers again (it dials home every 15 to 45 s),
/// leaving the other only once home has welcomed it: restart after restart, the sessions do not
/// pile up on the coordinators restarted last, and going home costs no moment without a session.
#[test]
fn a_node_goes_back_to_its_coordinator_once_it_is_up_again() {
    let mut fleet = Fleet::new(2);
    let a = fleet.add_agent("m", 0);
    assert_eq!(fleet.holder(a), 0);
    fleet.coords[0].restart();
    let home = wait_until(Duration::from_secs(120), || {
        fleet.agents[a].count("going back to the coordinator it joined through") >= 1
            && fleet.holder(a) == 0
    });
    assert!(home, "{}", fleet.agents[a].log_text());
    let log = fleet.agents[a].log_text();
    let opened: Vec<&str> = (log.lines())
        .filter(|l| l.contains("session open"))
        .collect();
    // Home, away while it restarted, home again.
    assert!(opened.len() >= 3, "{log}");
    let b = &fleet.coords[1].addr;
    assert!(
        opened
            .iter()
            .any(|l| l.contains(&format!("coordinator={b}"))),
        "{log}"
    );
    // Home welcomed it before it left the session elsewhere: no moment without a session.
    let left = "session closed by the agent";
    assert!(
        wait_until(WAIT, || fleet.coords[1].log_text().contains(left)),
        "{}",
        fleet.coords[1].log_text()
    );
    let when = |log: String, needle: &str| {
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains(needle))
            .map(str::to_string);
        line.and_then(|l| l.split_whitespace().next().map(str::to_string))
    };
    let home_opened = when(fleet.coords[0].log_text(), "session open").expect("home opened");
    let away_closed = when(fleet.coords[1].log_text(), left).expect("away closed");
    assert!(
        home_opened <= away_closed,
        "home opened the session at {home_opened}, after the node left the other at {away_closed}"
    );
}

/// A coordinator stopped by its operator (SIGTERM) says so to its sessions: its node dials it
/// again while it starts (a restart), instead of moving to another and coming home later.
#[test]
fn a_node_waits_for_its_coordinator_to_restart_instead_of_moving() {
    let mut fleet = Fleet::new(2);
    let a = fleet.add_agent("m", 0);
    assert_eq!(fleet.holder(a), 0);
    let opened = fleet.agents[a].count("session open");
    let exited = fleet.coords[0].restart_gracefully();
    assert!(exited.is_some_and(|s| s.success()), "exited {exited:?}");
    let back = wait_until(WAIT, || fleet.agents[a].count("session open") > opened);
    let log = fleet.agents[a].log_text();
    assert!(back, "{log}");
    assert_eq!(fleet.holder(a), 0, "{log}");
    assert!(
        log.contains("the coordinator stops serving (its operator stopped or restarted it)"),
        "{log}"
    );
    let b = &fleet.coords[1].addr;
    assert!(
        !log.lines()
            .any(|l| l.contains("session open") && l.contains(&format!("coordinator={b}"))),
        "it moved to {b}: {log}"
    );
}

/// A coordinator stopped by its operator gives the nodes it held a failover grace (the longer of
/// two leases and 5 min) to hold a session again: a node that first waits for it to come back
/// (10 s), then moves, keeps its run, which would be judged lost after one lease (8 s here).
#[test]
fn a_stopped_coordinators_node_keeps_its_run_while_it_waits_and_moves() {
    let mut fleet = Fleet::with_flags(2, &["--lease", "8s"]);
    let a = fleet.add_agent("m", 0);
    assert_eq!(fleet.holder(a), 0);
    let (effects, program) = fleet.effect_program("sleep 16");
    let set = fleet.run(1, "m", &program, "once");
    let running = wait_until(WAIT, || fleet.row(1, &set)["state"] == "running");
    assert!(running, "{:#}", fleet.row(1, &set));
    let exited = fleet.coords[0].stop_gracefully();
    assert!(exited.is_some_and(|s| s.success()), "exited {exited:?}");
    let moved = wait_until(WAIT, || fleet.holder(a) == 1);
    assert!(moved, "{}", fleet.agents[a].log_text());
    let row = fleet
        .wait_final(1, std::slice::from_ref(&set))
        .swap_remove(0);
    let logs = || {
        let coordinators: Vec<String> = fleet.coords.iter().map(|c| c.log_text()).collect();
        format!(
            "{}\n{}",
            coordinators.join("\n"),
            fleet.agents[a].log_text()
        )
    };
    assert_eq!(row["state"], "finished", "{row:#}\n{}", logs());
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "once\n");
    let told = fleet.coords[0].log_text();
    assert!(
        told.contains("the nodes held here have a failover grace to be back nodes=1 grace_s=300 "),
        "{told}"
    );
}

/// The database down while a node says hello: the node is told why in its own line (not "it does
/// not know this node"), the coordinator logs it at WARN, and once the database is back the node
/// holds a session again.
#[test]
fn a_hello_while_the_store_is_down_is_told_why() {
    let mut fleet = Fleet::new(1);
    let a = fleet.add_agent("m", 0);
    fleet.agents[a].kill();
    fleet.pg.stop();
    let again = Agent::spawn(
        &fleet.path("m-again.log"),
        testkit::agent::machine_command(&fleet.path("m")),
    );
    let told = wait_until(WAIT, || {
        again.count("session lost: the coordinator cannot serve a session now: ") >= 1
    });
    assert!(told, "{}", again.log_text());
    assert_eq!(
        again.count("it does not know this node"),
        0,
        "{}",
        again.log_text()
    );
    // The coordinator logs once the node has been told, so its line may come a moment later.
    let warned = wait_until(WAIT, || {
        fleet.coords[0]
            .log_text()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("closed a connection without serving it: "))
    });
    assert!(warned, "{}", fleet.coords[0].log_text());
    fleet.pg.start_again();
    assert!(
        again.wait_for("session open", 1, WAIT),
        "{}",
        again.log_text()
    );
}

/// A coordinator started with `flags`, then the node `m` joined through the first and busy with
/// one run at a time (a `sleep 2` out), and a run of `program` sent through the second, which
/// alone holds the program (`--content-copies 1`); returns that run's set id. It cannot go out
/// before the busy run ends.
fn a_run_only_the_second_coordinator_holds(fleet: &mut Fleet, program: &Path) -> String {
    fleet.add_agent("m", 0);
    let a = fleet.agents.len() - 1;
    assert_eq!(fleet.holder(a), 0);
    testkit::ok(
        fleet.coords[0]
            .command()
            .args(["capacity", "--node", "m", "--runs", "1"]),
    );
    let busy = script(&fleet.path("busy.sh"), "sleep 2");
    let first = fleet.run(0, "m", &busy, "busy");
    let running = wait_until(WAIT, || fleet.row(0, &first)["state"] == "running");
    assert!(running, "{:#}", fleet.row(0, &first));
    fleet.run(1, "m", program, "held-once")
}

/// Content whose only holder is away: the run waits (its row says why), it does not fail; once
/// the holder is back, it is delivered and finishes once.
#[test]
fn a_run_whose_content_has_no_reachable_holder_waits_for_one() {
    let mut fleet = Fleet::with_flags(2, &["--content-copies", "1"]);
    let (effects, program) = fleet.effect_program("true");
    let set = a_run_only_the_second_coordinator_holds(&mut fleet, &program);
    fleet.coords[1].kill();
    let hex = fleet_coordinator::file_sha256(&program).unwrap();
    let waits = wait_until(WAIT, || {
        let row = fleet.row(0, &set);
        row["state"] == "waiting" && row["error"].as_str().is_some_and(|e| e.contains(&hex))
    });
    assert!(waits, "{:#}", fleet.row(0, &set));
    fleet.coords[1].restart();
    let rows = fleet.wait_final(0, &[set]);
    assert_eq!(rows[0]["state"], "finished", "{:#}", rows[0]);
    assert_each_executed_once(&effects, &["held-once".to_string()]);
}

/// Content whose every holder is gone for good: the run fails at the waiting timeout, its one
/// line naming the digest; never a hang.
#[test]
fn a_run_whose_content_is_gone_fails_at_the_waiting_timeout_naming_it() {
    let mut fleet = Fleet::with_flags(2, &["--content-copies", "1", "--waiting-timeout", "4s"]);
    let (effects, program) = fleet.effect_program("true");
    let set = a_run_only_the_second_coordinator_holds(&mut fleet, &program);
    fleet.coords[1].kill();
    std::fs::remove_dir_all(fleet.path("coord-1")).unwrap();
    let rows = fleet.wait_final(0, &[set]);
    let hex = fleet_coordinator::file_sha256(&program).unwrap();
    let error = rows[0]["error"].as_str().unwrap_or_default();
    assert_eq!(rows[0]["state"], "failed", "{:#}", rows[0]);
    assert!(
        error.starts_with("node ")
            && error.contains("did not take the run within 4 s: ")
            && error.contains(&hex),
        "{error}"
    );
    assert!(!error.contains('\n'));
    assert!(!effects.exists(), "it never ran");
}

/// A join file's address that is a DNS name is resolved again at each try, and each address it
/// resolves to is tried in turn. The machine has a network namespace and a hosts file of its own:
/// the name first resolves only to an address where no coordinator listens; once the name also
/// resolves to the coordinator's address (after the dead one), the node joins.
#[test]
fn a_dns_name_is_resolved_at_each_try_and_each_of_its_addresses_tried() {
    let dir = testkit::tempdir();
    let net = testkit::netns::Net::new("fd", 0);
    let live_ip = net.add_host_address(200);
    let coord = Coordinator::start_on(&dir.path().join("coord"), &format!("{live_ip}:0"), &[]);
    let port = coord.addr.rsplit_once(':').unwrap().1.to_string();
    let name = "coordinator.fleet.test";
    let dead = format!("{} {name}\n", net.host_ip);
    net.set_hosts(&format!("127.0.0.1 localhost\n{dead}"));
    let mut join: Value = serde_json::from_str(&coord.token(&["--name", "m1"])).unwrap();
    join["address"] = Value::from(format!("{name}:{port}"));
    let machine = dir.path().join("m1");
    std::fs::create_dir_all(&machine).unwrap();
    std::fs::write(machine.join("fleet.json"), join.to_string()).unwrap();
    let agent = Agent::spawn(
        &dir.path().join("m1.log"),
        net.command(&testkit::agent::machine_command(&machine)),
    );
    let refused = format!("address={name}:{port}");
    let tried = wait_until(WAIT, || {
        (agent.log_text().lines())
            .filter(|l| l.contains("join attempt failed") && l.contains(&refused))
            .count()
            >= 2
    });
    assert!(tried, "{}", agent.log_text());
    assert_eq!(agent.count("Joined"), 0, "{}", agent.log_text());
    // The name now answers the dead address first, then the coordinator's.
    net.set_hosts(&format!("127.0.0.1 localhost\n{dead}{live_ip} {name}\n"));
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "{}",
        agent.log_text()
    );
    assert_eq!(coord.nodes().len(), 1);
}

#[test]
fn a_command_on_the_folder_of_a_postgres_coordinator_that_is_down_is_refused_not_answered_from_an_empty_store()
 {
    let mut fleet = Fleet::new(1);
    fleet.add_agent("worker-0", 0);
    fleet.coords[0].kill();
    let data = fleet.path("coord-0");
    for args in [&["nodes"][..], &["rollout", "status"], &["release", "list"]] {
        let line = fleet.coords[0].refusal(args);
        assert_eq!(
            line,
            format!(
                "fleet-coordinator: no coordinator answers on {}'s socket, and its fleet's store is in PostgreSQL: start `fleet-coordinator serve` on it again, or pass --store postgres://... to act on the store directly",
                data.display()
            ),
            "{args:?}"
        );
    }
    assert!(
        !data.join(fleet_coordinator::STORE_FILE).exists(),
        "an empty embedded store was made in the folder"
    );
    // With the store named, the command reads the fleet's store itself.
    let nodes = testkit::ok(
        fleet.coords[0]
            .command()
            .args(["--store", &fleet.url, "nodes", "--json"]),
    );
    let nodes: Value = serde_json::from_str(&nodes).unwrap();
    assert_eq!(nodes.as_array().unwrap().len(), 1, "{nodes:#}");
}
