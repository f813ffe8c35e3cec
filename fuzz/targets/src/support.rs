//! What every target shares: an executor for reads from memory, an allocation meter, a scratch
//! folder, and the split of one input into a selector and sections.
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::task::{Context, Poll, Waker};

/// Runs a future that never waits on anything but memory (a read from a `&[u8]`, a write to a
/// `Vec`) to its end on this thread.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000 {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
    }
    panic!("a read from memory did not finish")
}

/// The system allocator, counting the bytes live on each thread and their peak, so a target can
/// check that what a decoder holds grows with the bytes that arrived, not with what they claim.
pub struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    // try_with: an allocation while the thread's locals are torn down is not counted.
    let _ = LIVE.try_with(|live| {
        let now = live.get().wrapping_add(delta);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call goes to the system allocator unchanged; only counters are kept beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for alloc.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for alloc.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for alloc.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Runs `f` and returns its result with the most bytes it held allocated at once on this
/// thread, above what was live when it began.
pub fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, peak.saturating_sub(start).max(0) as usize)
}

/// A folder of this thread's own for the files a target writes (on `/dev/shm` when there is
/// one: no disk), removed when the thread ends.
pub fn scratch() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = {
            let shm = Path::new("/dev/shm");
            let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
            tempfile::Builder::new()
                .prefix("fuzz-targets.")
                .tempdir_in(base)
                .expect("a scratch folder")
        };
    }
    DIR.with(|d| d.path().to_path_buf())
}

/// A fresh empty folder under [`scratch`] named `name`, removing what an earlier input left.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot clear {}: {e}", dir.display()),
    }
    std::fs::create_dir_all(&dir).expect("a fresh folder");
    dir
}

/// The decoder an input is for, chosen by its first byte (`a` is 0, `b` 1, ...: seeds stay
/// readable), and the rest of the input.
pub fn select(data: &[u8], decoders: u8) -> Option<(u8, &[u8])> {
    let (first, rest) = data.split_first()?;
    Some((first.wrapping_sub(b'a') % decoders, rest))
}

/// The first `N - 1` pieces of `data` up to each `sep`, and the rest as the last; missing ones
/// are empty.
pub fn sections<'a, const N: usize>(data: &'a [u8], sep: &[u8]) -> [&'a [u8]; N] {
    let mut out = [&data[..0]; N];
    let mut rest = data;
    for slot in out.iter_mut().take(N - 1) {
        match rest.windows(sep.len()).position(|w| w == sep) {
            Some(at) => {
                *slot = &rest[..at];
                rest = &rest[at + sep.len()..];
            }
            None => {
                *slot = rest;
                rest = &rest[rest.len()..];
            }
        }
    }
    out[N - 1] = rest;
    out
}

/// Serializes to a JSON value; every type fed here serializes.
pub fn value<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("a decoded value serializes")
}

/// `text` holds no line break: one error, one line.
pub fn one_line(text: &str) -> bool {
    !text.contains(['\n', '\r'])
}
