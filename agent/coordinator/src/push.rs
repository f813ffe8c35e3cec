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

/// Imports `source` into `blobs` (the blob store of the data folder `data`) and pushes it to
/// each of `targets` as it goes; returns its digest and size. Each push that failed is named on
/// stderr, in one line.
pub fn import_copying(
    data: &Path,
    blobs: &Blobs,
    source: &Path,
    targets: &[String],
) -> std::io::Result<(Digest, u64)> {
    let key = match targets.is_empty() {
        true => None,
        false => fleet_key(data),
    };
    let Some(key) = key else {
        return blobs.import(source);
    };
    let mut file = std::fs::File::open(source)?;
    let size = file.metadata()?.len();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut senders, mut pushes) = (Vec::new(), tokio::task::JoinSet::new());
    let key = Arc::new(key);
    for address in targets {
        let (sender, pieces) = mpsc::channel(PIECES_AHEAD);
        senders.push(sender);
        let (key, address) = (key.clone(), address.clone());
        pushes.spawn_on(
            async move {
                let pushed = peer::push(&key, &address, size, pieces).await;
                pushed.map_err(|e| format!("pushing a copy to {address} failed: {e}"))
            },
            runtime.handle(),
        );
    }
    std::thread::scope(|scope| {
        let reading = scope.spawn(move || {
            let imported = blobs.import_passing(&mut file, |bytes| {
                let piece = Piece::Bytes(Arc::from(bytes));
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
        let failed = runtime.block_on(async {
            let mut failed = Vec::new();
            while let Some(pushed) = pushes.join_next().await {
                match pushed {
                    Ok(Err(line)) => failed.push(line),
                    Err(e) => failed.push(format!("a push did not complete: {e}")),
                    Ok(Ok(_)) => {}
                }
            }
            failed
        });
        // Cannot fail: the import's thread does not panic.
        let imported = reading.join().expect("the import's thread ends")?;
        for line in failed {
            eprintln!("{line}; the serving coordinator copies it by digest instead");
        }
        Ok(imported)
    })
}

/// The fleet's key from the data folder, to prove the push comes from the fleet; None where it
/// cannot be read (the copy is then made by digest).
fn fleet_key(data: &Path) -> Option<KeyPair> {
    let pem = std::fs::read_to_string(data.join(KEY_FILE)).ok()?;
    KeyPair::from_pem(&pem).ok()
}
