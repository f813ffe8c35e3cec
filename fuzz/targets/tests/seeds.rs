//! The recorder of the seeds made from the crates' own values and encoders: the protocol's
//! messages as `write_msg` frames them, certificates as `mint_cert` makes them, the agent's
//! records as its store and identity write them. The other seeds are real data captured from
//! real peers (docs/fuzzing.md says how). Run it by hand after a format change:
//! `cargo test -p fuzz-targets --test seeds -- --ignored`.
use fleet_agent::state::{Launch, Store};
use fleet_proto::facts::{Accelerator, Facts, MeasuredLink};
use fleet_proto::joinfile::Secret;
use fleet_proto::protocol::{
    Command, Down, MAX_UNIDENTIFIED_FRAME, MintedRead, Opening, Refusal, RefusalClass, Reply,
    StartRun, Up, write_msg,
};
use fleet_proto::run::{
    Event, Gpus, ImageRef, Outcome, OutputEnd, RegistryAuth, Resources, RunOptions, RunReport,
    RunState, Workload,
};
use fleet_proto::version::Versions;
use fleet_proto::{Bytes, Digest, NodeId, OpId, RunId, UploadId};
use fuzz_targets::support::block_on;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../corpus")
        .join(target);
    std::fs::create_dir_all(&dir).expect("a corpus folder");
    dir
}

fn frames_of(msgs: &[&dyn erased::Frame]) -> Vec<u8> {
    let mut wire = Vec::new();
    for m in msgs {
        m.write(&mut wire);
    }
    wire
}

/// Frames of messages of different types in one stream.
mod erased {
    pub trait Frame {
        fn write(&self, wire: &mut Vec<u8>);
    }
    impl<T: serde::Serialize> Frame for T {
        fn write(&self, wire: &mut Vec<u8>) {
            fuzz_targets::support::block_on(fleet_proto::protocol::write_msg(wire, self))
                .expect("a message frames");
        }
    }
}

fn digest(byte: &str) -> Digest {
    Digest::parse(&format!("sha256:{}", byte.repeat(32))).expect("a digest")
}

fn run_id(s: &str) -> RunId {
    RunId::parse(s).expect("a run id")
}

const TOKEN: &str = "fleet1_DHLF2MeoY4-5kdlEWvlEr03cE8W5eYzlRCdnJTxeQqQ";

fn start() -> StartRun {
    StartRun {
        run_id: run_id("train-42"),
        workload: Workload::Image(
            ImageRef::parse(&format!("registry.test:5000/ml/train@{}", digest("ab")))
                .expect("an image"),
        ),
        registry_auth: Some(RegistryAuth {
            username: "ci".into(),
            password: "s3cr?t>".into(),
        }),
        options: RunOptions {
            argv: vec![Bytes(b"--epochs=3".to_vec()), Bytes(vec![0xff, 0x00, 0x41])],
            timeout_ms: Some(3_600_000),
            output_limit: Some(1 << 20),
            env: vec![("LANG".into(), "C.UTF-8".into())],
            inputs: vec![("data.csv".into(), digest("cd"))],
            resources: Resources {
                cpu_millis: Some(2500),
                memory_bytes: Some(8 << 30),
                gpus: Gpus::Ids(vec!["0".into(), "GPU-8f3a".into()]),
                pids: Some(512),
            },
        },
    }
}

fn outcome() -> Outcome {
    Outcome {
        exit_code: Some(3),
        signal: None,
        timed_out: false,
        stopped: false,
        oom_killed: Some(false),
        stdout: Some(OutputEnd {
            bytes: 10,
            kept: 10,
            truncated: false,
            sha256: Digest::of(b"to-stdout\n"),
            last: Bytes(b"to-stdout\n".to_vec()),
        }),
        stderr: Some(OutputEnd {
            bytes: 3000,
            kept: 1024,
            truncated: true,
            sha256: digest("ef"),
            last: Bytes(vec![0xc3, 0x28, b'\n']),
        }),
        started_at: Some("2026-12-03T10:22:40.891383067Z".into()),
        ended_at: Some("2026-12-03T10:22:41.912000000Z".into()),
    }
}

fn event(id: u64) -> Event {
    Event {
        id,
        run_id: run_id("train-42"),
        state: RunState::Finished,
        report: RunReport {
            outcome: Some(outcome()),
            error: None,
            detail: serde_json::json!({"container": "c2f02af295a1", "engine_state": "exited", "engine": "20.10.24 (API 1.41)"}),
        },
        at_unix_ms: 1_796_293_361_000,
    }
}

fn facts() -> Facts {
    Facts {
        arch: "x86_64".into(),
        cpus: 16,
        memory_bytes: 128 << 30,
        disk_free_bytes: 64 << 30,
        kernel: "6.1.0-18-amd64".into(),
        os: "Debian GNU/Linux 12 (bookworm)".into(),
        agent_version: "0.1.0".into(),
        accelerators: vec![Accelerator {
            index: 0,
            name: "NVIDIA H200".into(),
            uuid: "GPU-8f3a".into(),
            memory_mib: 143_771,
            driver: "550.54.15".into(),
            vendor: Default::default(),
            arch: None,
        }],
        max_runs: Some(16),
        measured_link: Some(MeasuredLink {
            bytes_per_s: 118_000_000,
            age_ms: 1500,
            valid_for_ms: 3_598_500,
            confidence: 0.8,
            basis: "whole_copy".into(),
        }),
        release: None,
        engine: None,
        content: None,
    }
}

fn replies() -> Vec<Up> {
    let op = |s: &str| OpId::new(s);
    vec![
        Up::Result {
            op: op("op-1"),
            answer: Ok(Reply::Staged {
                digest: digest("ab"),
            }),
        },
        Up::Result {
            op: op("op-2"),
            answer: Ok(Reply::Started {
                run_id: run_id("train-42"),
                already: false,
            }),
        },
        Up::Result {
            op: op("op-3"),
            answer: Ok(Reply::Stopped {
                run_id: run_id("train-42"),
            }),
        },
        Up::Result {
            op: op("op-4"),
            answer: Ok(Reply::Status {
                run_id: run_id("train-42"),
                state: RunState::Finished,
                report: event(1).report,
            }),
        },
        Up::Result {
            op: op("op-5"),
            answer: Ok(Reply::Collected {
                digest: digest("12"),
                size: 7,
            }),
        },
        Up::Result {
            op: op("op-6"),
            answer: Ok(Reply::FactsSent),
        },
        Up::Result {
            op: op("op-7"),
            answer: Ok(Reply::Replicated {
                digest: digest("34"),
                size: 1 << 30,
                copy_ms: 9100,
                bytes_per_s: Some(118_000_000),
            }),
        },
        Up::Result {
            op: op("op-8"),
            answer: Err(Refusal::new(
                RefusalClass::PathEscapes,
                "path \"../x\" leaves the run folder",
            )),
        },
        Up::Result {
            op: op("op-9"),
            answer: Err(Refusal::new(
                RefusalClass::Fenced,
                "generation 3 superseded by 4",
            )),
        },
    ]
}

fn commands() -> Vec<Command> {
    vec![
        Command::Stage {
            digest: digest("ab"),
        },
        Command::Start(start()),
        Command::Stop {
            run_id: run_id("train-42"),
        },
        Command::Status {
            run_id: run_id("train-42"),
        },
        Command::Collect {
            run_id: run_id("train-42"),
            path: "out/result.txt".into(),
            upload: UploadId::new("up-7"),
            max_bytes: Some(1 << 20),
        },
        Command::Facts,
        Command::Replicate {
            digest: digest("34"),
            read: Some(MintedRead::Ticket {
                ticket: "t-0a1b2c".into(),
            }),
        },
        Command::Replicate {
            digest: digest("34"),
            read: Some(MintedRead::Url {
                url: "https://objects.test/b/34?X-Amz-Signature=abc".into(),
                expires_in_ms: 600_000,
            }),
        },
    ]
}

fn record_frames() {
    let dir = corpus("frames");
    let node = || NodeId::new("n-7f3a");
    let join = Up::Join {
        token: Secret(TOKEN.into()),
        name: Some("edge-7".into()),
        labels: BTreeMap::from([
            ("zone".into(), "eu-1".into()),
            ("gpu".into(), "a100".into()),
        ]),
    };
    let joined = Down::Joined {
        node_id: node(),
        speaks: Versions::SPOKEN,
    };
    let join = Opening::new(join);
    std::fs::write(dir.join("join-then-joined"), frames_of(&[&join, &joined])).expect("write");
    let mut session: Vec<Box<dyn erased::Frame>> = vec![
        Box::new(Opening::new(Up::Hello { node_id: node() })),
        Box::new(Up::Facts { facts: facts() }),
        Box::new(Up::Heartbeat),
        Box::new(Up::Event { event: event(41) }),
    ];
    for r in replies() {
        session.push(Box::new(r));
    }
    let refs: Vec<&dyn erased::Frame> = session.iter().map(|b| b.as_ref()).collect();
    std::fs::write(dir.join("hello-session-up"), frames_of(&refs)).expect("write");
    let fetch = Opening::new(Up::Fetch {
        node_id: node(),
        digest: digest("ab"),
        offset: 4096,
        ticket: Some("t-0a1b2c".into()),
    });
    let content = Down::Content { size: 1 << 20 };
    std::fs::write(
        dir.join("fetch-then-content"),
        frames_of(&[&fetch, &content]),
    )
    .expect("write");
    let upload = Opening::new(Up::Upload {
        node_id: node(),
        upload: UploadId::new("up-7"),
        size: 7,
    });
    let from = Down::UploadFrom { offset: 0 };
    let sent = Up::Sent {
        digest: digest("12"),
    };
    let stored = Down::Stored {
        digest: digest("12"),
    };
    std::fs::write(
        dir.join("upload-sent-stored"),
        frames_of(&[&upload, &from, &sent, &stored]),
    )
    .expect("write");
    let relay = Opening::new(Up::Relay {
        node_id: node(),
        command: Command::Start(start()),
    });
    let relayed = Down::Relayed {
        answer: Ok(Reply::Started {
            run_id: run_id("train-42"),
            already: true,
        }),
    };
    std::fs::write(
        dir.join("relay-then-relayed"),
        frames_of(&[&relay, &relayed]),
    )
    .expect("write");
    let copy = Opening::new(Up::Copy {
        digest: digest("34"),
        offset: 0,
    });
    let refused = Down::ContentRefused {
        message: "sha256:34.. is not in this coordinator's blob store".into(),
    };
    std::fs::write(dir.join("copy-then-refused"), frames_of(&[&copy, &refused])).expect("write");
    let mut down: Vec<Box<dyn erased::Frame>> = vec![Box::new(Down::Welcome {
        generation: 4,
        heartbeat_ms: 5000,
        lease_ms: 15000,
        coordinators: vec!["10.0.0.5:7443".into(), "[2001:db8::1]:7443".into()],
        speaks: Versions::SPOKEN,
    })];
    for (n, command) in commands().into_iter().enumerate() {
        down.push(Box::new(Down::Command {
            op: OpId::new(format!("op-{n}")),
            generation: 4,
            command,
        }));
    }
    down.push(Box::new(Down::Ack { up_to: 41 }));
    let refs: Vec<&dyn erased::Frame> = down.iter().map(|b| b.as_ref()).collect();
    std::fs::write(dir.join("welcome-session-down"), frames_of(&refs)).expect("write");
    // At and past the limits: a length of 2 GiB, a first frame one byte over 16 KiB, a cut body.
    let mut huge = (2u32 << 30).to_be_bytes().to_vec();
    huge.extend_from_slice(b"{\"type\":\"heartbeat\"}");
    std::fs::write(dir.join("limit-2gib-length"), huge).expect("write");
    let mut over = ((MAX_UNIDENTIFIED_FRAME + 1) as u32).to_be_bytes().to_vec();
    over.extend_from_slice(
        format!(
            "{{\"type\":\"hello\",\"node_id\":\"{}\"}}",
            "n".repeat(MAX_UNIDENTIFIED_FRAME - 29)
        )
        .as_bytes(),
    );
    std::fs::write(dir.join("limit-first-frame-over-16k"), over).expect("write");
    let mut cut = frames_of(&[&Up::Heartbeat]);
    cut.extend_from_slice(&200u32.to_be_bytes());
    cut.extend_from_slice(b"{\"type\":\"event\",\"event\":{\"id\":1");
    std::fs::write(dir.join("limit-cut-body"), cut).expect("write");
    let mut malformed = Vec::new();
    block_on(write_msg(&mut malformed, &serde_json::json!({"type": "command", "op": "op-x", "generation": 4, "command": {"kind": "start", "run_id": "../x"}}))).expect("frames");
    std::fs::write(dir.join("malformed-command-keeps-op"), malformed).expect("write");
}

fn record_joinfile() {
    let dir = corpus("joinfile");
    let seed = [7u8; 32];
    let mut pkcs8 = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    pkcs8.extend_from_slice(&seed);
    let key = rcgen::KeyPair::try_from(pkcs8.as_slice()).expect("a key");
    let cert = fleet_proto::pin::mint_cert(&key, std::time::Duration::from_secs(24 * 3600))
        .expect("a certificate");
    let mut c = b"c".to_vec();
    c.extend_from_slice(&cert);
    std::fs::write(dir.join("c-session-certificate"), c).expect("write");
    let mut d = b"d".to_vec();
    d.extend_from_slice(&seed);
    d.push(24);
    std::fs::write(dir.join("d-mint-seed"), d).expect("write");
    let other = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("a P-256 key");
    let params = rcgen::CertificateParams::new(vec!["fleet".into()]).expect("params");
    let p256 = params.self_signed(&other).expect("a certificate");
    let mut c = b"c".to_vec();
    c.extend_from_slice(p256.der());
    std::fs::write(dir.join("c-certificate-not-ed25519"), c).expect("write");
}

fn record_node_records() {
    use redb::ReadableTable;
    let dir = corpus("node_records");
    let state = tempfile::tempdir().expect("a state folder");
    let store = Store::open(state.path()).expect("a store");
    let s = start();
    store
        .claim_run(&as_run_id("train-42"), "op-2")
        .expect("claim");
    store
        .track_launch(&Launch::of("op-2", &s), &[digest("cd")])
        .expect("track");
    store
        .record_answer(
            "op-2",
            &Ok(Reply::Started {
                run_id: run_id("train-42"),
                already: false,
            }),
        )
        .expect("answer");
    store
        .track_run(&as_run_id("train-43"), &Workload::Program(digest("ab")))
        .expect("track");
    store
        .transition(
            &as_run_id("train-43"),
            RunState::Running,
            RunReport::default(),
        )
        .expect("running");
    store
        .transition(&as_run_id("train-43"), RunState::Finished, event(1).report)
        .expect("finished");
    store
        .record_answer(
            "op-3",
            &Err(Refusal::new(
                RefusalClass::UnknownRun,
                "run r9 is not known",
            )),
        )
        .expect("answer");
    store.check_generation(4).expect("generation");
    drop(store);
    let file = state.path().join(fleet_agent::state::FILE_NAME);
    {
        let db = redb::Database::open(&file).expect("the store file");
        let tx = db.begin_read().expect("a read");
        let runs = tx
            .open_table(redb::TableDefinition::<&str, &[u8]>::new("runs"))
            .expect("runs");
        for entry in runs.iter().expect("runs") {
            let (k, v) = entry.expect("a run");
            let mut seed = b"a".to_vec();
            seed.extend_from_slice(v.value());
            std::fs::write(dir.join(format!("a-run-record-{}", k.value())), seed).expect("write");
        }
        let events = tx
            .open_table(redb::TableDefinition::<u64, &[u8]>::new("events"))
            .expect("events");
        for entry in events.iter().expect("events") {
            let (k, v) = entry.expect("an event");
            let mut seed = b"b".to_vec();
            seed.extend_from_slice(v.value());
            std::fs::write(dir.join(format!("b-event-{}", k.value())), seed).expect("write");
        }
        let ops = tx
            .open_table(redb::TableDefinition::<&str, &[u8]>::new("ops"))
            .expect("ops");
        for entry in ops.iter().expect("ops") {
            let (k, v) = entry.expect("an op");
            let mut seed = b"c".to_vec();
            seed.extend_from_slice(v.value());
            std::fs::write(
                dir.join(format!("c-op-record-{}", k.value().replace(':', "-"))),
                seed,
            )
            .expect("write");
        }
    }
    // A store file torn after its first 16 KiB (a whole one is megabytes: too large a seed).
    let mut g = b"g".to_vec();
    let whole = std::fs::read(&file).expect("the store file");
    g.extend_from_slice(&whole[..whole.len().min(16 << 10)]);
    std::fs::write(dir.join("g-agent-redb-torn"), g).expect("write");
    // The identity: a membership record and a node key as the agent writes them.
    let id_dir = tempfile::tempdir().expect("an identity folder");
    let id = fleet_agent::identity::load_or_create(id_dir.path()).expect("a key");
    let membership = fleet_agent::identity::Membership {
        node_id: NodeId::new("n-7f3a"),
        address: "10.0.0.5:7443".into(),
        alternates: vec!["10.0.0.6:7443".into()],
        coordinator_key: fleet_proto::pin::PinnedKey::parse(&fleet_proto::pin::key_text(
            id.public_key(),
        ))
        .expect("a key"),
        name: Some("edge-7".into()),
        joined_at_ms: 1_796_293_000_000,
        release_roots: Vec::new(),
    };
    fleet_agent::identity::save_membership(id_dir.path(), &membership).expect("save");
    let mut d = b"d".to_vec();
    d.extend_from_slice(
        &std::fs::read(id_dir.path().join(fleet_agent::identity::MEMBERSHIP_FILE)).expect("read"),
    );
    std::fs::write(dir.join("d-membership"), d).expect("write");
    let mut e = b"e".to_vec();
    e.extend_from_slice(
        &std::fs::read(id_dir.path().join(fleet_agent::identity::KEY_FILE)).expect("read"),
    );
    std::fs::write(dir.join("e-node-key"), e).expect("write");
}

#[test]
#[ignore = "writes fuzz/corpus: run by hand after a format change"]
fn record() {
    record_frames();
    record_joinfile();
    record_node_records();
}

/// A run id the seeds name.
fn as_run_id(s: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(s).unwrap()
}
