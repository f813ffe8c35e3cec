//! `status`, `wait` and `list`: a run's state, a one-line summary, and the ends of its output.
use crate::supervise::LAST_BYTES;
use crate::sys;
use anyhow::Result;
use run_store::Bytes;
use run_store::layout::{STDERR_FILE, STDOUT_FILE};
use run_store::record::StreamRecord;
use run_store::{RunId, RunStatus, State, Store, lock};
use serde_json::{Value, json};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::Duration;

/// How long `wait` pauses before looking again when the run's lock could not be waited on.
const RECHECK_AFTER_ERROR: Duration = Duration::from_millis(10);

pub fn status(store: &Store, run: &str) -> Result<RunStatus> {
    Ok(store.status(&RunId::parse(run)?)?)
}

pub fn print_status(store: &Store, run: &str, json: bool) -> Result<()> {
    let s = status(store, run)?;
    let dir = store.run_dir(&s.id);
    let ends = |file: &str, record: Option<&StreamRecord>| {
        let (first, tail) = file_ends(&dir.join(file));
        // Past the limit the file lacks the true end; the record has it.
        (first, record.map_or(tail, |r| r.last.clone()))
    };
    let result = s.result.as_ref();
    let out = ends(STDOUT_FILE, result.and_then(|r| r.stdout.as_ref()));
    let err = ends(STDERR_FILE, result.and_then(|r| r.stderr.as_ref()));
    if json {
        let mut v = status_json(&s);
        v["stdout"] = json!({"first": out.0, "last": out.1});
        v["stderr"] = json!({"first": err.0, "last": err.1});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("run {}: {}", s.id, summary(&s));
    for (name, (first, last), record) in [
        ("stdout", out, result.and_then(|r| r.stdout.as_ref())),
        ("stderr", err, result.and_then(|r| r.stderr.as_ref())),
    ] {
        match record {
            Some(r) if r.truncated => {
                println!("{name}: {} bytes, {} kept, {}", r.bytes, r.kept, r.sha256)
            }
            Some(r) => println!("{name}: {} bytes, {}", r.bytes, r.sha256),
            None => println!("{name}:"),
        }
        if !first.0.is_empty() {
            println!("  first: {}", first.0.escape_ascii());
            println!("  last:  {}", last.0.escape_ascii());
        }
    }
    Ok(())
}

pub fn wait(store: &Store, run: &str, json: bool) -> Result<()> {
    wait_final(store, run)?;
    print_status(store, run, json)
}

/// Blocks until the run is final: a run that is not holds its lock, so this sleeps on the lock
/// until its supervisor lets go (its result is durable, or it died) and then looks again.
pub fn wait_final(store: &Store, run: &str) -> Result<RunStatus> {
    let id = RunId::parse(run)?;
    loop {
        let s = store.status(&id)?;
        if s.state.is_final() {
            return Ok(s);
        }
        if lock::wait_released(&store.run_dir(&id)).is_err() {
            // Removed meanwhile, or unreadable: the next status says which.
            std::thread::sleep(RECHECK_AFTER_ERROR);
        }
    }
}

pub fn list(store: &Store, json: bool) -> Result<()> {
    let runs = store.list()?;
    if json {
        let v: Vec<Value> = runs.iter().map(status_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for s in &runs {
            println!("{}\t{}\t{}", s.id, s.state, summary(s));
        }
    }
    Ok(())
}

fn status_json(s: &RunStatus) -> Value {
    json!({
        "run": s.id.as_str(),
        "state": s.state.as_str(),
        "owner": s.owner,
        "result": s.result,
    })
}

/// One line: how the run stands or how it ended.
pub fn summary(s: &RunStatus) -> String {
    match (s.state, &s.result, &s.owner) {
        (State::Finished, Some(r), _) => {
            let mut line = match (r.exit_code, r.signal) {
                (Some(code), _) => format!("finished, exit code {code}"),
                (_, Some(sig)) => format!("finished, killed by {}", sys::signal_name(sig)),
                _ => "finished".to_string(),
            };
            if r.timed_out {
                let t = r.timeout_s.unwrap_or_default();
                line.push_str(&format!(", timed out after {t}s"));
            }
            if r.stopped {
                line.push_str(", stopped");
            }
            line.push_str(&format!(", in {:.3}s", r.duration_s));
            line
        }
        (State::Failed, Some(r), _) => match &r.failure {
            Some(f) => format!("failed at {}: {}", f.step.as_str(), f.reason),
            None => "failed".to_string(),
        },
        (State::Running, _, Some(o)) => format!("running, pid {}", o.program_pid),
        (State::Lost, _, _) => "lost: its supervisor is gone and it left no result".to_string(),
        (state, _, _) => state.to_string(),
    }
}

/// The first and last bytes of a file (what it holds so far).
fn file_ends(path: &Path) -> (Bytes, Bytes) {
    let Ok(mut file) = File::open(path) else {
        return (Bytes::default(), Bytes::default());
    };
    let mut first = vec![0u8; LAST_BYTES];
    let n = read_up_to(&mut file, &mut first);
    first.truncate(n);
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut last = Vec::new();
    if len > LAST_BYTES as u64 && file.seek(SeekFrom::Start(len - LAST_BYTES as u64)).is_ok() {
        last = vec![0u8; LAST_BYTES];
        let n = read_up_to(&mut file, &mut last);
        last.truncate(n);
    } else {
        last.clone_from(&first);
    }
    (Bytes(first), Bytes(last))
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    n
}
