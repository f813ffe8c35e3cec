//! Frames of each released protocol version, kept as they were recorded (`tests/frames/`), so a
//! change that breaks an agent or a coordinator of an older release fails here: every frame an
//! older peer sends is still read, and every frame this release writes to it still carries what
//! that peer reads (it ignores fields it does not know, never a field it needs).
use fleet_proto::protocol::{Down, Opening, Up};
use fleet_proto::version::{ProtocolVersion, Versions};
use serde_json::Value;

/// The messages that open a connection, read as an [`Opening`].
const FIRST: &[&str] = &["join", "hello", "fetch", "upload", "copy", "hold", "relay"];

fn frames(version: u32, direction: &str) -> Vec<Value> {
    let path = format!(
        "{}/tests/frames/protocol-{version}/{direction}.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let frames: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(frames.len() >= 20, "{path} holds {} frames", frames.len());
    frames
}

/// Every field of `old`, with its value, is in `new` (which may carry more).
fn carries(new: &Value, old: &Value) -> bool {
    match (new, old) {
        (Value::Object(n), Value::Object(o)) => o
            .iter()
            .all(|(k, v)| n.get(k).is_some_and(|nv| carries(nv, v))),
        (Value::Array(n), Value::Array(o)) => {
            n.len() == o.len() && n.iter().zip(o).all(|(a, b)| carries(a, b))
        }
        _ => new == old,
    }
}

#[test]
fn every_frame_an_agent_of_protocol_1_sends_is_read_and_spoken() {
    let mut opened = 0;
    for frame in frames(1, "up") {
        let kind = frame["type"].as_str().unwrap().to_string();
        let read = if FIRST.contains(&kind.as_str()) {
            let opening: Opening = serde_json::from_value(frame.clone())
                .unwrap_or_else(|e| panic!("{kind}: {e}: {frame}"));
            assert_eq!(opening.speaks, Versions::UNSTATED, "{frame}");
            let spoken = Versions::SPOKEN.common(opening.speaks);
            assert_eq!(spoken, Some(ProtocolVersion::FIRST), "{frame}");
            opened += 1;
            serde_json::to_value(&opening.first).unwrap()
        } else {
            let up: Up = serde_json::from_value(frame.clone())
                .unwrap_or_else(|e| panic!("{kind}: {e}: {frame}"));
            serde_json::to_value(&up).unwrap()
        };
        assert!(
            carries(&read, &frame),
            "{kind} read as {read}, recorded as {frame}"
        );
    }
    assert_eq!(opened, FIRST.len());
}

#[test]
fn every_frame_a_coordinator_writes_still_carries_what_an_agent_of_protocol_1_reads() {
    for frame in frames(1, "down") {
        let down: Down =
            serde_json::from_value(frame.clone()).unwrap_or_else(|e| panic!("{e}: {frame}"));
        let written = serde_json::to_value(&down).unwrap();
        assert!(
            carries(&written, &frame),
            "written as {written}, recorded as {frame}"
        );
    }
}

#[test]
fn a_first_message_of_this_release_states_its_versions_beside_its_own_fields() {
    let hello = Opening::new(Up::Hello {
        node_id: fleet_proto::NodeId::new("n-1"),
    });
    let text = serde_json::to_string(&hello).unwrap();
    assert_eq!(
        text,
        format!(
            r#"{{"type":"hello","node_id":"n-1","speaks":{{"min":{},"max":{}}}}}"#,
            Versions::SPOKEN.min,
            Versions::SPOKEN.max
        )
    );
    // A coordinator of release 0.1.0 reads it as the hello it knows, the new field ignored.
    let old: Up = serde_json::from_str(&text).unwrap();
    assert!(matches!(old, Up::Hello { .. }));
    let back: Opening = serde_json::from_str(&text).unwrap();
    assert_eq!(back.speaks, Versions::SPOKEN);
}
