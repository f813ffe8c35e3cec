//! The supervisor's exit statuses: one per refusal a caller acts on differently, so callers
//! (the agent, a hub over SSH) classify a failure by its status, never by its wording.
//! `docs/supervisor.md` documents each; the message stays one line for people.
use std::io;

/// Why a command failed, as its exit status. Status 0 is success; any status not listed here
/// (a signal, a crash) reads as [`Refusal::Other`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Anything else: bad arguments, an unreadable file, a program that failed to start.
    Other,
    /// The run id names no run in the store (`status`, `wait`, `stop`, `collect`).
    UnknownRun,
    /// `start` of a run id that was already started: the claim is held by an earlier start.
    RunExists,
    /// `start` of a program digest that was never staged in this store.
    NotStaged,
    /// `collect` of a path that leaves the run folder (`..`, absolute, or through a symlink).
    PathEscapes,
    /// The store's disk (or its inodes, or a quota) is full.
    DiskFull,
}

impl Refusal {
    pub const ALL: [Refusal; 6] = [
        Refusal::Other,
        Refusal::UnknownRun,
        Refusal::RunExists,
        Refusal::NotStaged,
        Refusal::PathEscapes,
        Refusal::DiskFull,
    ];

    /// The exit status. 2 is left out on purpose: shells and argument parsers use it loosely.
    pub const fn code(self) -> i32 {
        match self {
            Refusal::Other => 1,
            Refusal::UnknownRun => 3,
            Refusal::RunExists => 4,
            Refusal::NotStaged => 5,
            Refusal::PathEscapes => 6,
            Refusal::DiskFull => 7,
        }
    }

    /// The refusal an exit status stands for; `None` for success.
    pub fn from_code(code: Option<i32>) -> Option<Refusal> {
        match code {
            Some(0) => None,
            Some(code) => Some(
                Refusal::ALL
                    .into_iter()
                    .find(|r| r.code() == code)
                    .unwrap_or(Refusal::Other),
            ),
            None => Some(Refusal::Other),
        }
    }

    /// What to do, appended to a line about an I/O error of this class.
    pub fn advice(self) -> &'static str {
        match self {
            Refusal::DiskFull => "; free space on that disk and retry",
            _ => "",
        }
    }

    /// `DiskFull` for an I/O error saying the disk, its inodes or a quota ran out.
    pub fn of_io(e: &io::Error) -> Refusal {
        match e.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => Refusal::DiskFull,
            _ => Refusal::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Refusal;

    #[test]
    fn every_code_is_distinct_and_round_trips() {
        for r in Refusal::ALL {
            assert_eq!(Refusal::from_code(Some(r.code())), Some(r));
            let same = Refusal::ALL.iter().filter(|o| o.code() == r.code()).count();
            assert_eq!(same, 1, "{r:?}");
        }
        assert_eq!(Refusal::from_code(Some(0)), None);
        assert_eq!(Refusal::from_code(Some(42)), Some(Refusal::Other));
        assert_eq!(Refusal::from_code(None), Some(Refusal::Other));
    }

    #[test]
    fn a_full_disk_or_quota_is_disk_full() {
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = std::io::Error::from_raw_os_error(errno);
            assert_eq!(Refusal::of_io(&e), Refusal::DiskFull);
        }
        let e = std::io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(Refusal::of_io(&e), Refusal::Other);
    }
}
