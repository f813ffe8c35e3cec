//! An operator command's import that copies while it reads: the file is read once, and each
//! piece is written to this data folder's blob store and sent to the coordinators that are to
//! hold a copy ([`Up::Push`](fleet_proto::protocol::Up::Push)), so the fleet's second copy
//! costs little more than the import itself. A push that fails loses nothing: the serving
//! coordinator then has the copy made by digest before the command is recorded, as it always
//! checks.
use crate::KEY_FILE;
use crate::peer::{self, Piece};
use fleet_content::Blobs;
use fleet_proto::Digest;
use rcgen::KeyPair;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Pieces read ahead of the slowest push: memory stays at a few chunks whatever the size.
const PIECES_AHEAD: usize = 8;

pub use crate::peer::CopyTargets;

/// Imports `source` into `blobs` (the blob store of the data folder `data`) and pushes it to
/// the first of `targets` that take the connection as it goes; returns its digest and size.
/// Each push that failed is named on stderr, in one line.
pub fn import_copying(
    data: &Path,
    blobs: &Blobs,
    source: &Path,
    targets: &CopyTargets,
) -> std::io::Result<(Digest, u64)> {
    let key = match targets.wanted {
        0 => None,
        _ => fleet_key(data),
    };
    let Some(key) = key else {
        return blobs.import(source);
    };
    let mut file = std::fs::File::open(source)?;
    let size = file.metadata()?.len();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut failed = Vec::new();
    // Opened before a byte is read: a coordinator that went away is passed by for the next.
    let links = runtime.block_on(async {
        let mut links = Vec::new();
        for address in &targets.peers {
            if links.len() == targets.wanted {
                break;
            }
            match peer::open_push(&key, address, size).await {
                Ok(link) => links.push(link),
                Err(e) => failed.push(format!("pushing a copy to {address} failed: {e}")),
            }
        }
        links
    });
    if links.len() == targets.wanted {
        for line in failed.drain(..) {
            eprintln!("{line}; the copy went to the next coordinator");
        }
    }
    let (mut senders, mut pushes) = (Vec::new(), tokio::task::JoinSet::new());
    for link in links {
        let (sender, pieces) = mpsc::channel(PIECES_AHEAD);
        senders.push(sender);
        pushes.spawn_on(
            async move {
                let address = link.address().to_string();
                let pushed = link.push(pieces).await;
                pushed.map_err(|e| format!("pushing a copy to {address} failed: {e}"))
            },
            runtime.handle(),
        );
    }
    std::thread::scope(|scope| {
        let reading = scope.spawn(move || {
            let mut recycled = Recycled::default();
            let imported = blobs.import_passing(&mut file, |bytes| {
                let piece = Piece::Bytes(recycled.holding(bytes));
                // A push that stopped has dropped its end: it is left out from then on.
                senders.retain(|sender| sender.blocking_send(piece.clone()).is_ok());
            });
            if let Ok((digest, _)) = &imported {
                for sender in &senders {
                    let _ = sender.blocking_send(Piece::Hashed(*digest));
                }
            }
            imported
        });
        runtime.block_on(async {
            while let Some(pushed) = pushes.join_next().await {
                match pushed {
                    Ok(Err(line)) => failed.push(line),
                    Err(e) => failed.push(format!("a push did not complete: {e}")),
                    Ok(Ok(_)) => {}
                }
            }
        });
        // Cannot fail: the import's thread does not panic.
        let imported = reading.join().expect("the import's thread ends")?;
        for line in failed {
            eprintln!("{line}; the serving coordinator has the copy made by digest instead");
        }
        Ok(imported)
    })
}

/// The pieces sent lately, each filled again once every push has let go of it: a fresh piece
/// each time cost a map, its pages' faults and an unmap.
#[derive(Default)]
struct Recycled {
    sent: std::collections::VecDeque<Arc<Vec<u8>>>,
}

impl Recycled {
    /// A piece holding a copy of `bytes`.
    fn holding(&mut self, bytes: &[u8]) -> Arc<Vec<u8>> {
        let oldest_free = self.sent.front().is_some_and(|p| Arc::strong_count(p) == 1);
        let mut piece = match oldest_free {
            true => self.sent.pop_front().expect("looked at above"),
            false => Arc::default(),
        };
        let buf = Arc::get_mut(&mut piece).expect("no push holds it");
        buf.clear();
        buf.extend_from_slice(bytes);
        // Pieces the pushes hold longer than that are left to them.
        if self.sent.len() > PIECES_AHEAD + 2 {
            self.sent.pop_front();
        }
        self.sent.push_back(piece.clone());
        piece
    }
}

/// The fleet's key from the data folder, to prove the push comes from the fleet; None where it
/// cannot be read (the copy is then made by digest).
fn fleet_key(data: &Path) -> Option<KeyPair> {
    let pem = std::fs::read_to_string(data.join(KEY_FILE)).ok()?;
    KeyPair::from_pem(&pem).ok()
}
