//! The checks a node runs on itself when the coordinator asks (`fleet-coordinator check`): its
//! engine reaches the registry and reads a manifest, content written to its store reads back
//! whole, its disk has room, its engine answers. Each is one row; none changes what the node
//! holds. The coordinator adds the session and clock rows, which it alone can judge.
use crate::runtime::Runtime;
use fleet_content::Blobs;
use fleet_proto::Digest;
use fleet_proto::check::{CheckName, CheckRequest, CheckRow, Verdict};
use std::io::Read;
use std::path::Path;

/// Bytes written and read back by the store check.
const PROBE_BYTES: usize = 64 << 10;

/// Runs every check `request` asks for, in order.
pub fn run(
    request: &CheckRequest,
    runtime: &dyn Runtime,
    content: &Blobs,
    run_store: &Path,
) -> Vec<CheckRow> {
    let registry = match &request.registry {
        Some(image) => CheckRow::of(
            CheckName::Registry,
            runtime
                .read_manifest(image)
                .map(|digest| format!("{image}: manifest {digest} read through the engine")),
        ),
        None => CheckRow::new(CheckName::Registry, Verdict::Skipped, "no --registry given"),
    };
    let engine = match runtime.engine() {
        Some(e) if e.reachable => CheckRow::new(
            CheckName::Engine,
            Verdict::Pass,
            format!(
                "{} {} (API {})",
                e.name,
                e.version.unwrap_or_default(),
                e.api_version.unwrap_or_default()
            ),
        ),
        Some(e) => CheckRow::new(
            CheckName::Engine,
            Verdict::Fail,
            e.error
                .unwrap_or_else(|| "the engine does not answer".into()),
        ),
        None => CheckRow::new(
            CheckName::Engine,
            Verdict::Fail,
            "this agent drives no engine",
        ),
    };
    vec![
        registry,
        CheckRow::of(CheckName::Store, store_reads_back(content)),
        CheckRow::of(
            CheckName::Disk,
            disk_has_room(run_store, request.min_disk_bytes),
        ),
        engine,
    ]
}

/// Writes random bytes into the content store as a blob, reads them back, removes them.
fn store_reads_back(content: &Blobs) -> Result<String, String> {
    let mut probe = vec![0u8; PROBE_BYTES];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut probe);
    let at = content.root().display();
    let (digest, _) = content
        .import_from(&mut probe.as_slice())
        .map_err(|e| format!("cannot write to the content store {at}: {e}"))?;
    let path = content.path(&digest);
    let read = std::fs::File::open(&path).and_then(|f| {
        let mut back = Vec::with_capacity(PROBE_BYTES);
        f.take(PROBE_BYTES as u64 + 1).read_to_end(&mut back)?;
        Ok(back)
    });
    let _ = std::fs::remove_file(&path);
    match read {
        Ok(back) if Digest::of(&back) == Digest::of(&probe) => Ok(format!(
            "{} KiB written to {at} and read back whole",
            PROBE_BYTES >> 10
        )),
        Ok(_) => Err(format!(
            "what was written to the content store {at} read back different: check the disk"
        )),
        Err(e) => Err(format!("cannot read back from the content store {at}: {e}")),
    }
}

fn disk_has_room(run_store: &Path, min_bytes: u64) -> Result<String, String> {
    let free = crate::facts::disk_free(run_store)
        .ok_or_else(|| format!("cannot read the free disk under {}", run_store.display()))?;
    let (gib, want) = (free as f64 / GIB, min_bytes as f64 / GIB);
    match free >= min_bytes {
        true => Ok(format!("{gib:.1} GiB free under {}", run_store.display())),
        false => Err(format!(
            "{gib:.2} GiB free under {}, less than the {want:.1} GiB asked for: free some space",
            run_store.display()
        )),
    }
}

const GIB: f64 = (1u64 << 30) as f64;
