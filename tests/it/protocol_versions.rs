//! The node protocol's versions against a real coordinator: an agent of the release before this
//! one (protocol 1), replayed from the frames recorded from it, is served; agents that share no
//! version with the coordinator are refused with one line naming both ranges, `nodes` says so,
//! and nothing is spent or written for them.
use fleet_agent::dial::{self, Dialed};
use fleet_proto::NodeId;
use fleet_proto::protocol::{self, Down, Opening, Up};
use fleet_proto::version::{Incompatible, ProtocolVersion, Versions};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;
use testkit::agent::{Coordinator, HandNode};

/// The frames an agent of protocol 1 sent, as recorded (`agent/proto/tests/frames/protocol-1`).
fn recorded_up(kind: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../agent/proto/tests/frames/protocol-1/up.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|f| f["type"] == kind)
        .unwrap_or_else(|| panic!("no recorded {kind} frame"))
}

struct Machine(HandNode);

impl Machine {
    fn new(dir: &Path, coord: &Coordinator, name: &str) -> Machine {
        Machine(HandNode::new(dir, coord, name))
    }

    /// One connection: `first` sent raw, then the coordinator's first answer, raw.
    fn ask(&self, first: &Value) -> Value {
        self.0.runtime.block_on(async {
            let mut dialed = self.dial().await;
            protocol::write_msg(&mut dialed.stream, first)
                .await
                .unwrap();
            let answer = protocol::read_msg::<_, Value>(&mut dialed.stream).await;
            answer
                .unwrap()
                .expect("an answer before the connection closes")
        })
    }

    async fn dial(&self) -> Dialed {
        let key = self.0.join.pinned_key();
        dial::dial(
            &self.0.join.address,
            &self.0.identity,
            &key,
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    }
}

fn node_row(coord: &Coordinator, id: &str) -> Value {
    let nodes = coord.nodes();
    let row = nodes.iter().find(|n| n["id"] == id);
    row.unwrap_or_else(|| panic!("no node {id} in {nodes:#?}"))
        .clone()
}

#[test]
fn an_agent_of_protocol_1_is_served_from_its_recorded_frames() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let machine = Machine::new(dir.path(), &coord, "old");
    // Its join, as recorded, with this fleet's token in place of the recorded one.
    let mut join = recorded_up("join");
    join["token"] = json!(machine.0.join.token.0);
    assert!(
        join.get("speaks").is_none(),
        "protocol 1 stated no versions"
    );
    let joined = machine.ask(&join);
    assert_eq!(joined["type"], "joined", "{joined}");
    let node_id = joined["node_id"]
        .as_str()
        .expect("the node id it reads")
        .to_string();
    // Its session: hello, facts and a heartbeat, each as recorded.
    let mut hello = recorded_up("hello");
    hello["node_id"] = json!(node_id);
    let facts = recorded_up("facts");
    let heartbeat = recorded_up("heartbeat");
    let welcome = machine.0.runtime.block_on(async {
        let mut dialed = machine.dial().await;
        let stream = &mut dialed.stream;
        protocol::write_msg(stream, &hello).await.unwrap();
        let welcome: Value = protocol::read_msg(stream).await.unwrap().unwrap();
        protocol::write_msg(stream, &facts).await.unwrap();
        protocol::write_msg(stream, &heartbeat).await.unwrap();
        // What it read: a welcome whose fields of protocol 1 are all there.
        let read = welcome.clone();
        assert!(testkit::agent::wait_until(Duration::from_secs(30), || {
            node_row(&coord, &node_id)["facts"]["cpus"] == facts["facts"]["cpus"]
        }));
        read
    });
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    for field in ["generation", "heartbeat_ms", "lease_ms"] {
        assert!(welcome[field].is_u64(), "{field} in {welcome}");
    }
    let row = node_row(&coord, &node_id);
    assert_eq!(
        row["protocol"],
        json!({ "kind": "speaks", "version": 1 }),
        "{row:#}"
    );
    assert_eq!(row["facts"]["arch"], facts["facts"]["arch"], "{row:#}");
    let text = testkit::ok(coord.command().arg("nodes"));
    let line = text.lines().find(|l| l.starts_with(&node_id)).unwrap();
    assert!(line.split_whitespace().any(|w| w == "1"), "{text}");
}

#[test]
fn agents_that_share_no_version_are_refused_naming_both_and_nothing_is_spent() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let machine = Machine::new(dir.path(), &coord, "m");
    let versions = |min, max| Versions {
        min: ProtocolVersion(min),
        max: ProtocolVersion(max),
    };
    let stating =
        |up: Up, speaks: Versions| serde_json::to_value(Opening { first: up, speaks }).unwrap();
    let join = Up::Join {
        token: machine.0.join.token.clone(),
        name: None,
        labels: Default::default(),
    };
    // Too old for this coordinator: refused, and the token is not spent by the refusal.
    let too_old = versions(0, 0);
    let refused = machine.ask(&stating(join.clone(), too_old));
    let told: Down = serde_json::from_value(refused.clone()).unwrap();
    let expected = Incompatible {
        agent: too_old,
        coordinator: Versions::SPOKEN,
    };
    assert!(
        matches!(told, Down::Incompatible { versions } if versions == expected),
        "{refused}"
    );
    assert_eq!(
        expected.to_string(),
        format!(
            "the agent speaks protocol 0 and the coordinator {}: upgrade the agent (a coordinator serves agents of its own release and of the one before it)",
            Versions::SPOKEN
        )
    );
    assert!(coord.nodes().is_empty(), "a refused join joins nothing");
    // This release's join, with the same token, is served.
    let joined = machine.ask(&serde_json::to_value(Opening::new(join)).unwrap());
    let Ok(Down::Joined { node_id, speaks }) = serde_json::from_value::<Down>(joined.clone())
    else {
        panic!("{joined}");
    };
    assert_eq!(speaks, Versions::SPOKEN);
    // A hello from an agent newer than this coordinator: refused, and `nodes` says why.
    let hello = |node_id: &NodeId| Up::Hello {
        node_id: node_id.clone(),
    };
    let too_new = versions(
        ProtocolVersion::CURRENT.0 + 1,
        ProtocolVersion::CURRENT.0 + 2,
    );
    let refused = machine.ask(&stating(hello(&node_id), too_new));
    let expected = Incompatible {
        agent: too_new,
        coordinator: Versions::SPOKEN,
    };
    let told: Down = serde_json::from_value(refused.clone()).unwrap();
    assert!(
        matches!(told, Down::Incompatible { versions } if versions == expected),
        "{refused}"
    );
    let row = node_row(&coord, node_id.as_str());
    assert_eq!(row["sessions"], 0, "no session was opened: {row:#}");
    let text = testkit::ok(coord.command().arg("nodes"));
    let line = text
        .lines()
        .find(|l| l.starts_with(node_id.as_str()))
        .unwrap();
    assert!(line.contains(" refused "), "{text}");
    assert!(line.ends_with(&format!("refused: {expected}")), "{text}");
    assert!(expected.to_string().contains("upgrade the coordinator"));
    // The same machine with this release's hello: a session of the current version.
    let welcome = machine.ask(&serde_json::to_value(Opening::new(hello(&node_id))).unwrap());
    let Ok(Down::Welcome { speaks, .. }) = serde_json::from_value::<Down>(welcome.clone()) else {
        panic!("{welcome}");
    };
    assert_eq!(speaks, Versions::SPOKEN);
    let row = node_row(&coord, node_id.as_str());
    assert_eq!(
        row["protocol"],
        json!({ "kind": "speaks", "version": ProtocolVersion::CURRENT.0 }),
        "{row:#}"
    );
    assert_eq!(row["sessions"], 1, "{row:#}");
    // A content connection that shares no version is refused in the answer every release reads.
    let fetch = Up::Fetch {
        node_id: node_id.clone(),
        digest: "sha256:3434343434343434343434343434343434343434343434343434343434343434"
            .parse()
            .unwrap(),
        offset: 0,
        ticket: None,
    };
    let refused = machine.ask(&stating(fetch, too_old));
    assert_eq!(refused["type"], "content_refused", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .starts_with("the agent speaks protocol 0"),
        "{refused}"
    );
}
