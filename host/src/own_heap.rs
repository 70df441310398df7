//! headroom's own Rust allocations, which a hard cap must never refuse.
//!
//! `--hard-limit` (Python: `hard_limit=True`) caps the process with RLIMIT_DATA so that a
//! tensor allocation past the budget fails with an error the run catches. The cap is
//! process-wide, and Rust aborts on a failed allocation: while training holds the cap
//! full, the sampler's reading, the logger's record, the checkpoint writer's buffer or a
//! message would end the run with SIGABRT instead of the give-up it was meant to make.
//!
//! RLIMIT_DATA counts private writable mappings only (the kernel's `is_data_mapping`:
//! the brk heap, malloc's arenas and its mmaps); shared mappings are not data. So
//! [`OwnHeap`], the global allocator of the binary and of the Python extension, asks the
//! system allocator first, as any program does, and when that fails serves the request
//! from shared anonymous pages, which the cap does not count. libtorch allocates through
//! malloc directly, never through this allocator: its allocations still meet the cap,
//! which is the point of the cap.
//!
//! The spare pages live in one address range reserved at first use (`PROT_NONE`, which
//! is not data either), so telling a spare block from a malloc block is a range check.
//! Blocks up to [`SMALL_MAX`] come from per-size free lists carved out of 1 MiB chunks;
//! larger ones get pages of their own, returned to the kernel when freed. The shared
//! pages are not inherited by a forked child (`MADV_DONTFORK`), so a child cannot write
//! into the parent's blocks.
use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// The global allocator: the system's, and spare shared pages where the system refuses.
pub struct OwnHeap;

// SAFETY: every block handed out is either the system allocator's (and goes back to it)
// or lies inside the spare range (and goes back to `Spare`); `owns` tells them apart.
unsafe impl GlobalAlloc for OwnHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            return p;
        }
        spare_alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            return p;
        }
        let p = spare_alloc(layout);
        if !p.is_null() {
            // A reused spare block holds what its last owner wrote.
            ptr::write_bytes(p, 0, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if owns(p) {
            spare_free(p, layout);
        } else {
            System.dealloc(p, layout);
        }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !owns(p) {
            let q = System.realloc(p, layout, new_size);
            if !q.is_null() {
                return q;
            }
        }
        // A spare block, or a system block the system cannot grow: move it (the system
        // is asked first, so a block leaves the spare pages once memory is back).
        let new = Layout::from_size_align_unchecked(new_size, layout.align());
        let q = self.alloc(new);
        if !q.is_null() {
            ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
            self.dealloc(p, layout);
        }
        q
    }
}

/// Bytes the spare pages hold for live blocks now, and the blocks served since start:
/// what the cap would have refused (the tests read them).
pub fn spare_usage() -> SpareUsage {
    SpareUsage {
        live_bytes: LIVE_BYTES.load(Ordering::Relaxed),
        served: SERVED.load(Ordering::Relaxed),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpareUsage {
    pub live_bytes: u64,
    pub served: u64,
}

/// Reserves the spare range now (a hard cap's set-up calls it, so that the first refused
/// allocation does not have to). Never fails a run: without a range the allocator only
/// loses its fallback, as before.
pub fn reserve() {
    let mut s = lock();
    s.ensure_range();
}

/// The largest block kept on a size class's free list; larger blocks get their own pages.
pub const SMALL_MAX: usize = 64 << 10;
const MIN_CLASS: usize = 16;
const CLASSES: usize = (SMALL_MAX / MIN_CLASS).trailing_zeros() as usize + 1;
const CHUNK: usize = 1 << 20;

/// The kernel's page size (4 KiB on x86-64, up to 64 KiB on some arm64 kernels).
fn page() -> usize {
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf only reads a constant of the system.
            let p = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
                n if n > 0 => n as usize,
                _ => 4096,
            };
            PAGE.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

static BASE: AtomicUsize = AtomicUsize::new(0);
static LEN: AtomicUsize = AtomicUsize::new(0);
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static SERVED: AtomicU64 = AtomicU64::new(0);
static SPARE: Mutex<Spare> = Mutex::new(Spare {
    base: 0,
    len: 0,
    next: 0,
    free: [0; CLASSES],
    carve: 0,
    carve_end: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Spare> {
    // Nothing inside the lock panics; a poisoned lock would still hold a sound state.
    SPARE.lock().unwrap_or_else(|p| p.into_inner())
}

fn owns(p: *mut u8) -> bool {
    let base = BASE.load(Ordering::Acquire);
    base != 0 && (p as usize).wrapping_sub(base) < LEN.load(Ordering::Acquire)
}

unsafe fn spare_alloc(layout: Layout) -> *mut u8 {
    let p = lock().alloc(layout);
    if !p.is_null() {
        LIVE_BYTES.fetch_add(Spare::footprint(layout) as u64, Ordering::Relaxed);
        SERVED.fetch_add(1, Ordering::Relaxed);
    }
    p
}

unsafe fn spare_free(p: *mut u8, layout: Layout) {
    lock().free(p, layout);
    LIVE_BYTES.fetch_sub(Spare::footprint(layout) as u64, Ordering::Relaxed);
}

/// The spare range: `[base, base + len)`, handed out from `next` up (never reused as
/// address space: a run that lives on spare pages for terabytes has other problems).
struct Spare {
    base: usize,
    len: usize,
    next: usize,
    /// Per size class (16 B << k), the first free block; each free block holds the next.
    free: [usize; CLASSES],
    /// The chunk small blocks are being carved from.
    carve: usize,
    carve_end: usize,
}

/// Which size class a small layout falls in, if it is small.
fn class_of(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(MIN_CLASS);
    if size > SMALL_MAX || layout.align() > page() {
        return None;
    }
    Some((size.next_power_of_two() / MIN_CLASS).trailing_zeros() as usize)
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Spare {
    /// Bytes a block of `layout` takes in the spare range.
    fn footprint(layout: Layout) -> usize {
        match class_of(layout) {
            Some(c) => MIN_CLASS << c,
            None => round_up(layout.size().max(1), page()),
        }
    }

    fn ensure_range(&mut self) -> bool {
        if self.base != 0 {
            return true;
        }
        // Address space only: PROT_NONE is not data, and nothing is touched.
        for len in [1usize << 40, 1 << 36, 1 << 32, 1 << 28] {
            // SAFETY: a fresh anonymous reservation that nothing else refers to.
            let p = unsafe {
                libc::mmap(
                    ptr::null_mut(),
                    len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                self.base = p as usize;
                self.len = len;
                LEN.store(len, Ordering::Release);
                BASE.store(self.base, Ordering::Release);
                return true;
            }
        }
        false
    }

    /// Maps `len` bytes of shared pages at `base + next`, aligned to `align`.
    fn map(&mut self, len: usize, align: usize) -> *mut u8 {
        if !self.ensure_range() {
            return ptr::null_mut();
        }
        let at = round_up(self.next, align.max(page()));
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return ptr::null_mut();
        }
        let addr = (self.base + at) as *mut libc::c_void;
        // SAFETY: MAP_FIXED over our own reservation, which nothing else uses.
        let p = unsafe {
            libc::mmap(
                addr,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return ptr::null_mut();
        }
        // SAFETY: advice on pages we just mapped. A failure only leaves them inheritable.
        unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) };
        self.next = at + len;
        p.cast()
    }

    /// Gives pages back to the kernel and keeps their addresses reserved.
    fn unmap(&mut self, p: *mut u8, len: usize) {
        // SAFETY: MAP_FIXED over pages of our range that no live block uses.
        unsafe {
            libc::mmap(
                p.cast(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
    }

    unsafe fn alloc(&mut self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout) else {
            return self.map(round_up(layout.size().max(1), page()), layout.align());
        };
        let head = self.free[c];
        if head != 0 {
            self.free[c] = *(head as *const usize);
            return head as *mut u8;
        }
        let size = MIN_CLASS << c;
        if self.carve + size > self.carve_end {
            let chunk = self.map(CHUNK.max(page()), page());
            if chunk.is_null() {
                return chunk;
            }
            self.carve = chunk as usize;
            self.carve_end = self.carve + CHUNK.max(page());
        }
        // Blocks of a class are carved at multiples of their size from a page-aligned
        // chunk, so each is aligned to its size (up to a page).
        let p = round_up(self.carve, size.min(page()));
        if p + size > self.carve_end {
            self.carve = self.carve_end;
            return self.alloc(layout);
        }
        self.carve = p + size;
        p as *mut u8
    }

    unsafe fn free(&mut self, p: *mut u8, layout: Layout) {
        match class_of(layout) {
            Some(c) => {
                *(p as *mut usize) = self.free[c];
                self.free[c] = p as usize;
            }
            None => self.unmap(p, round_up(layout.size().max(1), page())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_cover_every_small_layout_with_its_alignment() {
        let l = |s, a| Layout::from_size_align(s, a).unwrap();
        assert_eq!(class_of(l(1, 1)), Some(0));
        assert_eq!(class_of(l(16, 8)), Some(0));
        assert_eq!(class_of(l(17, 8)), Some(1));
        assert_eq!(class_of(l(8, 64)), Some(2));
        assert_eq!(class_of(l(SMALL_MAX, 8)), Some(CLASSES - 1));
        assert_eq!(class_of(l(SMALL_MAX + 1, 8)), None);
        assert_eq!(class_of(l(64, 2 * page())), None);
        assert_eq!(Spare::footprint(l(100, 8)), 128);
        assert_eq!(Spare::footprint(l(SMALL_MAX + 1, 8)), SMALL_MAX + page());
    }
}
