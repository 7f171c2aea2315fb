//! DECK's memory bound, measured independently of the counter that enforces it.
//!
//! `tests/it/deck.rs` checks `peak_resident_chunks`, which is the `ChunkBudget` counting its
//! own permits: a regression that kept chunk bytes alive outside the budget (buffering a
//! whole checkpoint before writing it, holding every staged chunk until upload) would
//! still report 4. Here a counting global allocator measures the live heap bytes of the
//! whole process while DECK checkpoints a model ~50 chunks large, so the bound is checked
//! on what is actually allocated.
//!
//! This file is its own test binary with a single test, so no other test allocates
//! concurrently and the peak is DECK's (and the idle test harness's).

use ftrec_testkit::model;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ftrec_ckpt::deck::DeckOptions;
use ftrec_ckpt::{Checkpointer, Checkpoints, LocalStore};
use ftrec_model::ModelState;

/// Live heap bytes (as requested by callers) and the most there were since the last reset.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// [`System`] with a running count of live bytes.
struct Counting;

fn grew(bytes: usize) {
    // `fetch_add` returns the value before this allocation, so `now` is a value `LIVE`
    // really held; the peak is the largest such value.
    let now = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every method forwards its arguments unchanged to `System`, which implements
// `GlobalAlloc` soundly, and returns `System`'s result unchanged, so each method meets
// the trait's contract (pointer validity, alignment, size, `dealloc`/`realloc` receiving
// pointers this allocator returned with their layouts) exactly as `System` does: every
// pointer handed out came from `System`, so handing it back to `System` is valid. The
// added bookkeeping only does relaxed atomic arithmetic on two statics: it does not
// allocate (no re-entry into the allocator), cannot panic or unwind (atomic adds wrap,
// they do not overflow-check), and touches no memory the caller owns. Counts change only
// after a successful call (a null return allocated nothing).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract for `layout`; passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by this allocator, i.e. by `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds the rest.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        // On failure the old block stays allocated and nothing changes. A moving realloc
        // briefly holds both blocks; that transient is not counted, which only makes the
        // measured peak lower, never higher (DECK's chunk buffers are allocated at their
        // final size and never reallocated, see `chunk::encode_with_crc`).
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Starts a new measurement; returns the live bytes it starts from.
fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// One large table (dim 64 with Adagrad: 128 floats, 516 bytes a row, so the 4 bytes of
/// a row's id are under 1% of its payload) and a tiny dense part.
fn state() -> ModelState {
    model::adagrad_state(26_000, 64, 11)
}

const CHUNK_BYTES: usize = 256 << 10;

/// DECK's promise, as the README and `deck.rs` state it: at most 4 chunks in memory.
/// Written out rather than taken from `deck::RESIDENT_CHUNKS`, so that raising the
/// constant breaks this test instead of moving its bound.
const PROMISED_CHUNKS: usize = 4;

/// What a checkpoint may add to the heap beyond its chunks and row ids, whatever the
/// model size (measured: about 19 KiB for the ~50-chunk checkpoints here):
/// - the manifest: ~200 bytes per chunk entry and path, and its JSON encoding, for ~50
///   chunks about 20 KiB;
/// - the staging channel's blocks and messages, the scoped writer thread's handle and
///   name, rayon's job bookkeeping, the staged chunks' paths: a few KiB;
/// - the lease, manifest listing and event plumbing of the uploader: a few KiB.
const FIXED_SLACK: usize = 256 << 10;

/// The bound DECK promises for one checkpoint of `rows` rows with chunks of at most
/// `chunk` bytes and a dense file of `dense` bytes:
/// - [`PROMISED_CHUNKS`] chunk buffers (the budget shared by encoder, disk writer and
///   uploader), plus one for the local store's pooled O_DIRECT scratch buffer
///   (`LocalStore::put_part` copies each part through it and keeps it for the next), plus
///   one chunk of headroom for what this list does not itemize, so the test is not
///   flaky: 6 chunks;
/// - the row ids, at most twice (the tracker's list and the per-chunk copies): 8 bytes a
///   row, proportional to rows, not to row bytes (under 2% of them here);
/// - the dense file, twice (its encoding and the upload job's copy);
/// - [`FIXED_SLACK`].
///
/// For the checkpoints here that is about 2.0 MB (7.8 chunks) of 13.4 MB; DECK as built
/// peaks at about 1.17 MB (4.5 chunks), and a pipeline that kept every chunk alive until
/// upload would need all 13.4 MB.
fn bound(chunk: usize, rows: usize, dense: usize) -> usize {
    (PROMISED_CHUNKS + 2) * chunk + 8 * rows + 2 * dense + FIXED_SLACK
}

struct Measured {
    growth: usize,
    bound: usize,
    total: u64,
    chunks: usize,
}

/// Takes one checkpoint and waits for its upload, measuring the heap's peak growth over
/// the whole of it (the copy training waits for and the background upload).
fn measure(
    ck: &mut Checkpointer,
    s: &ModelState,
    step: u64,
    changed_rows: usize,
) -> (ftrec_ckpt::Manifest, Measured) {
    let base = reset_peak();
    let m = ck.checkpoint(s, step, serde_json::Value::Null).unwrap();
    ck.flush().unwrap();
    let growth = peak().saturating_sub(base);
    let chunk = m.chunks.iter().map(|c| c.bytes as usize).max().unwrap();
    let measured = Measured {
        growth,
        bound: bound(chunk, changed_rows, m.dense.bytes as usize),
        total: m.bytes(),
        chunks: m.chunks.len(),
    };
    eprintln!(
        "step {step}: {} chunks of <= {chunk} bytes, {} bytes in all; heap grew by at most {} \
         bytes ({:.1} chunks), bound {}",
        measured.chunks,
        measured.total,
        measured.growth,
        measured.growth as f64 / chunk as f64,
        measured.bound
    );
    (m, measured)
}

fn check(what: &str, m: &Measured) {
    assert!(m.chunks >= 40, "{what}: only {} chunks", m.chunks);
    // The bound must mean something: well under the checkpoint, so that holding it all
    // (or even a fifth of it) in memory would break it.
    assert!(
        (m.bound as u64) < m.total / 5,
        "{what}: bound {} is not well below the checkpoint's {} bytes",
        m.bound,
        m.total
    );
    assert!(
        m.growth <= m.bound,
        "{what}: the heap grew by {} bytes while checkpointing {} bytes in {} chunks; DECK \
         promises at most {} (about {} chunks in memory)",
        m.growth,
        m.total,
        m.chunks,
        m.bound,
        PROMISED_CHUNKS
    );
    // The allocator does see the chunks (a measurement that saw nothing proves nothing).
    assert!(
        m.growth as u64 >= m.total / m.chunks as u64,
        "{what}: the heap grew by only {} bytes; the counting allocator missed the chunks",
        m.growth
    );
}

#[test]
fn staging_memory_stays_within_a_few_chunks_by_the_allocators_count() {
    let dir = tempfile::tempdir().unwrap();
    let staging = tempfile::tempdir().unwrap();
    let checkpoints = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let options = DeckOptions {
        chunk_bytes: CHUNK_BYTES,
        // Merging is not staging (and has its own streaming bound); off, so the window
        // measured holds exactly one checkpoint's copy and upload.
        merge_in_background: false,
        live_factor: 0.0,
        staging_dir: Some(staging.path().to_path_buf()),
        ..DeckOptions::default()
    };
    let mut ck = Checkpointer::deck(checkpoints, 2, options).unwrap();
    let mut s = state();
    let rows = s.tables()[0].rows() + s.tables()[1].rows();

    // A full checkpoint: every row.
    let (full, m) = measure(&mut ck, &s, 1, rows);
    check("full checkpoint", &m);

    // A delta of every row of the large table: its changed rows span ~50 chunks too.
    let stride = s.tables()[0].stride();
    let changed: Vec<u32> = (0..s.tables()[0].rows() as u32).collect();
    for &r in &changed {
        s.set_row(0, r as u64, &vec![r as f32; stride]).unwrap();
    }
    ck.track(0, &changed);
    let (delta, m) = measure(&mut ck, &s, 2, changed.len());
    check("delta", &m);

    // And what was staged is what was saved.
    assert_eq!(
        ck.checkpoints().restore(&full.id).unwrap().0.digest(),
        state().digest()
    );
    assert_eq!(
        ck.checkpoints().restore(&delta.id).unwrap().0.digest(),
        s.digest()
    );
}
