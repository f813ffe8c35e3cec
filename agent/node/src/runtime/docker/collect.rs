//! `collect` out of a container: the path is checked one component at a time (no `..`, no
//! absolute path, no symbolic link anywhere on the way, as the process runtime's `openat` walk
//! does), its size is refused past the limit before a byte moves, then the engine's archive of
//! the file is streamed through a tar reader into the sink, hashed on the way.
use super::{DockerRuntime, RUN_DIR, container_name, describe, status_of};
use crate::runtime::{Collected, RuntimeError};
use bollard::query_parameters::{ContainerArchiveInfoOptions, DownloadFromContainerOptions};
use fleet_proto::RunId;
use futures_util::StreamExt;
use sha2::Digest as _;
use std::io::Read;

/// Go's `os.FileMode` bits the engine reports, other than permissions.
const MODE_SYMLINK: u32 = 1 << 27;
const MODE_NOT_REGULAR: u32 =
    (1 << 31) | MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19);

pub(super) fn collect(
    rt: &DockerRuntime,
    run_id: &RunId,
    path: &str,
    max_bytes: u64,
    sink: &mut dyn std::io::Write,
) -> Result<Collected, RuntimeError> {
    let escapes = || RuntimeError::PathEscapes {
        run_id: run_id.clone(),
        path: path.to_string(),
    };
    let refused = |reason: String| RuntimeError::Refused {
        run_id: run_id.clone(),
        reason,
    };
    let parts: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if path.starts_with('/') || parts.contains(&"..") {
        return Err(escapes());
    }
    if parts.is_empty() {
        return Err(refused(format!(
            "collect path {path:?} names no file; name a file inside the run folder"
        )));
    }
    let name = container_name(run_id);
    let full = format!("{RUN_DIR}/{}", parts.join("/"));
    let size = rt.rt().block_on(async {
        rt.inspect(run_id)
            .await?
            .ok_or_else(|| RuntimeError::UnknownRun {
                run_id: run_id.clone(),
            })?;
        let mut at = RUN_DIR.to_string();
        let mut mode_size = (0, 0);
        for part in &parts {
            at = format!("{at}/{part}");
            let options = ContainerArchiveInfoOptions { path: at.clone() };
            let stat = match rt
                .docker
                .get_container_archive_info(&name, Some(options))
                .await
            {
                Ok(stat) => stat,
                Err(e) if status_of(&e) == Some(404) => {
                    return Err(refused(format!(
                        "{path} is not in the run folder; name a file the run wrote"
                    )));
                }
                Err(e) => return Err(rt.engine_error(run_id, "read the run folder", e)),
            };
            if stat.file_mode & MODE_SYMLINK != 0 {
                return Err(escapes());
            }
            mode_size = (stat.file_mode, stat.size);
        }
        if mode_size.0 & MODE_NOT_REGULAR != 0 {
            return Err(refused(format!(
                "{path} is not a regular file; name a file inside the run folder"
            )));
        }
        Ok(u64::try_from(mode_size.1).unwrap_or(0))
    })?;
    let too_large = |size| RuntimeError::TooLarge {
        run_id: run_id.clone(),
        path: path.to_string(),
        size,
        limit: max_bytes,
    };
    if size > max_bytes {
        return Err(too_large(size));
    }
    // The engine streams a tar of the one file; a bounded channel carries it to this thread.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<u8>, String>>(8);
    let mut download = rt
        .docker
        .download_from_container(&name, Some(DownloadFromContainerOptions { path: full }));
    rt.rt().spawn(async move {
        while let Some(chunk) = download.next().await {
            let chunk = chunk.map(|c| c.to_vec()).map_err(|e| describe(&e));
            if tx.send(chunk).is_err() {
                break;
            }
        }
    });
    let failed = |e: std::io::Error| refused(format!("cannot read the collected {path}: {e}"));
    let mut archive = tar::Archive::new(ChannelReader {
        rx,
        chunk: Vec::new(),
        at: 0,
    });
    let mut entries = archive.entries().map_err(failed)?;
    let mut entry = entries
        .next()
        .ok_or_else(|| refused(format!("the engine sent no file for {path}")))?
        .map_err(failed)?;
    if entry.header().entry_type() != tar::EntryType::Regular {
        return Err(escapes());
    }
    let size = entry.size();
    if size > max_bytes {
        return Err(too_large(size));
    }
    let mut hash = sha2::Sha256::new();
    let mut buf = vec![0; 64 * 1024];
    let mut written = 0u64;
    loop {
        let n = entry.read(&mut buf).map_err(failed)?;
        if n == 0 {
            break;
        }
        written += n as u64;
        hash.update(&buf[..n]);
        sink.write_all(&buf[..n])
            .map_err(|e| refused(format!("cannot send the collected {path}: {e}")))?;
    }
    // A cut archive ends the entry early without an error from the tar reader.
    if written != size {
        return Err(refused(format!(
            "the engine's archive of {path} ended after {written} of its {size} bytes; collect it again"
        )));
    }
    let digest = format!("sha256:{}", hex::encode(hash.finalize()));
    Ok(Collected {
        // Cannot fail: the digest was made above from the bytes' SHA-256.
        digest: fleet_proto::Digest::parse(&digest).expect("a sha256 digest"),
        size,
    })
}

/// Reads the chunks a task sends, in order; an error chunk is an I/O error.
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Result<Vec<u8>, String>>,
    chunk: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.rx.recv() {
                Ok(Ok(chunk)) => (self.chunk, self.at) = (chunk, 0),
                Ok(Err(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}
