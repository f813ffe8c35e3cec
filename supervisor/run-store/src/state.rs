//! A run's state as any reader computes it: final from `result.json`, else `starting`/`running`
//! while someone holds the run's lock (`running` once the supervisor wrote `supervisor.json`),
//! else `lost`. So no run is left hanging.
use crate::layout::{OWNER_FILE, RESULT_FILE};
use crate::record::{FinalState, Owner, RunResult, SCHEMA};
use crate::{Error, RunId, Store, describe_io, lock};
use std::fmt;
use std::fs::{self, File};
use std::io;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Starting,
    Running,
    Finished,
    Failed,
    Lost,
}

impl State {
    pub fn is_final(self) -> bool {
        matches!(self, State::Finished | State::Failed | State::Lost)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Finished => "finished",
            State::Failed => "failed",
            State::Lost => "lost",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug)]
pub struct RunStatus {
    pub id: RunId,
    pub state: State,
    /// The live owner while `starting` or `running`.
    pub owner: Option<Owner>,
    /// The record once `finished` or `failed`.
    pub result: Option<RunResult>,
}

impl Store {
    /// The state of one run.
    pub fn status(&self, id: &RunId) -> Result<RunStatus, Error> {
        let dir = self.run_dir(id);
        let folder = match File::open(&dir) {
            Ok(folder) => folder,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(unknown(self, id)),
            Err(e) => return Err(read_error(&dir, &e)),
        };
        match folder.metadata() {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(unknown(self, id)),
            Err(e) => return Err(read_error(&dir, &e)),
        }
        let status = |state, owner, result| RunStatus {
            id: id.clone(),
            state,
            owner,
            result,
        };
        if let Some(result) = read_result(&dir, id)? {
            return Ok(final_status(status, result));
        }
        let held = lock::is_held(&folder).map_err(|e| read_error(&dir, &e))?;
        let (exists, owner) = read_owner(&dir)?;
        // The owner file appears once the program was exec'd and becomes result.json at the
        // end (it may not parse while the record is written over it); the result comes before
        // the lock is let go. Either may have happened since the first look.
        if !(held && exists)
            && let Some(result) = read_result(&dir, id)?
        {
            return Ok(final_status(status, result));
        }
        let state = match (held, exists) {
            (true, true) => State::Running,
            (true, false) => State::Starting,
            (false, _) => State::Lost,
        };
        Ok(status(state, owner, None))
    }

    /// Every run in the store, sorted by id.
    pub fn list(&self) -> Result<Vec<RunStatus>, Error> {
        let runs = self.runs_dir();
        let entries = match fs::read_dir(&runs) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(read_error(&runs, &e)),
        };
        let mut ids: Vec<RunId> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| RunId::parse(e.file_name().to_str()?).ok())
            .collect();
        ids.sort();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            match self.status(&id) {
                Ok(s) => out.push(s),
                // Retention removed it while we listed.
                Err(Error::UnknownRun { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

fn final_status(
    status: impl Fn(State, Option<Owner>, Option<RunResult>) -> RunStatus,
    result: RunResult,
) -> RunStatus {
    let state = match result.state {
        FinalState::Finished => State::Finished,
        FinalState::Failed => State::Failed,
    };
    status(state, None, Some(result))
}

fn unknown(store: &Store, id: &RunId) -> Error {
    Error::UnknownRun {
        id: id.to_string(),
        runs: store.runs_dir(),
    }
}

fn read_error(path: &Path, e: &io::Error) -> Error {
    Error::Read {
        path: path.to_path_buf(),
        reason: describe_io(e),
    }
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, Error> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(read_error(path, &e)),
    }
}

/// The run's result, refusing one that is unreadable, of another schema or of another run.
pub fn read_result(dir: &Path, id: &RunId) -> Result<Option<RunResult>, Error> {
    let path = dir.join(RESULT_FILE);
    let Some(bytes) = read_optional(&path)? else {
        return Ok(None);
    };
    let corrupt = |reason: String| Error::Corrupt {
        path: path.clone(),
        reason,
    };
    let result: RunResult = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if result.schema != SCHEMA {
        return Err(corrupt(format!("schema {} is not {SCHEMA}", result.schema)));
    }
    if result.run != id.as_str() {
        return Err(corrupt(format!("it records run {:?}", result.run)));
    }
    Ok(Some(result))
}

/// Whether the run's owner file exists, and the owner it names if it parses (it may not: being
/// written over by the record, or never made durable before a crash).
fn read_owner(dir: &Path) -> Result<(bool, Option<Owner>), Error> {
    let Some(bytes) = read_optional(&dir.join(OWNER_FILE))? else {
        return Ok((false, None));
    };
    let owner = serde_json::from_slice::<Owner>(&bytes)
        .ok()
        .filter(|o| o.schema == SCHEMA);
    Ok((true, owner))
}

impl Owner {
    /// This process as the owner of a run whose program has `program_pid`.
    pub fn for_self(program_pid: u32) -> io::Result<Owner> {
        let pid = std::process::id();
        // Through task/<tid>/: qemu-user fakes /proc/<own pid>/stat but passes this through.
        let start_time = stat_start_time(&format!("/proc/{pid}/task/{pid}/stat"))
            .ok_or_else(|| io::Error::other("cannot read this process's start time"))?;
        Ok(Owner {
            schema: SCHEMA,
            pid,
            start_time,
            boot_id: boot_id()?,
            program_pid,
        })
    }

    /// The owner process still exists: same boot, same pid, same start time, not a zombie.
    pub fn is_alive(&self) -> bool {
        boot_id().is_ok_and(|b| b == self.boot_id)
            && process_start_time(self.pid) == Some(self.start_time)
    }
}

/// The kernel's id for this boot.
pub fn boot_id() -> io::Result<String> {
    Ok(fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// A live (non-zombie) process's start time in clock ticks since boot.
pub fn process_start_time(pid: u32) -> Option<u64> {
    stat_start_time(&format!("/proc/{pid}/stat"))
}

fn stat_start_time(path: &str) -> Option<u64> {
    let stat = fs::read_to_string(path).ok()?;
    // The command name may hold spaces and parentheses; the fields start after the last ')'.
    let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `state` was field 3; starttime is field 22.
    fields.nth(18)?.parse().ok()
}
