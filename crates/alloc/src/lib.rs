//! tollgate's global allocator: mimalloc, with plain `mi_malloc` for the layouts that need no
//! more alignment than any mimalloc block has.
//!
//! Hand-written over the `mimalloc` crate because its `MiMalloc` sends every allocation to
//! `mi_malloc_aligned`, whose generic aligned path (for blocks over 1 KB, such as hyper's read
//! buffers and boxed futures) over-allocates and aligns by hand; `mi_malloc` is cheaper for
//! them (docs/performance.md has the measurement). This is the fix proposed upstream (`purpleprotocol/mimalloc_rust#170`, open): a layout whose alignment is
//! at most 16 and divides its size is served by `mi_malloc`, whose blocks of such sizes are
//! aligned to it. The pointer is still checked, and a misaligned one (which mimalloc does not
//! produce) is freed and asked for again through the aligned call, so the guarantee `GlobalAlloc`
//! owes does not rest on mimalloc's size classes.

#![no_std]

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use libmimalloc_sys as mi;

/// Alignment of every mimalloc block of a size that is a multiple of it (`MI_MAX_ALIGN_SIZE`).
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator; see the crate's documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

/// `layout` can be served by the plain calls.
#[inline]
fn is_plain(align: usize, size: usize) -> bool {
    align <= PLAIN_ALIGN && size.is_multiple_of(align)
}

#[inline]
fn is_aligned(p: *mut c_void, align: usize) -> bool {
    (p as usize) & (align - 1) == 0
}

/// A block for `layout` from `plain` (`mi_malloc` or `mi_zalloc`) when that is aligned enough,
/// else from `aligned` (their `_aligned` forms).
///
/// # Safety
/// `layout.align()` is a power of two (as `Layout` guarantees); the pair is a matching one.
#[inline]
unsafe fn allocate(
    layout: Layout,
    plain: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    let (size, align) = (layout.size(), layout.align());
    if is_plain(align, size) {
        // SAFETY: plain C call; any size is accepted.
        let p = unsafe { plain(size) };
        if is_aligned(p, align) {
            return p.cast();
        }
        // SAFETY: `p` came from mimalloc and is not used again.
        unsafe { mi::mi_free(p) };
    }
    // SAFETY: `align` is a power of two, as the caller guarantees.
    unsafe { aligned(size, align) }.cast()
}

/// Hand the memory this thread's heap holds free back to the OS now, without waiting for
/// mimalloc's purge delay, including blocks of this thread that other threads freed.
///
/// mimalloc otherwise returns free pages only once they have been free for its purge delay, and
/// only when the owning thread next frees a page of its own: a thread that went idle after
/// freeing much keeps that memory. This walks the thread's heap: call it rarely (tollgate
/// calls it after a sweep forgot many buckets), on each thread that may hold such memory.
pub fn collect() {
    // SAFETY: takes no pointer; any thread may collect its own heap at any time.
    unsafe { mi::mi_collect(true) };
}

/// Keep this process's memory in 4 KiB pages: no transparent huge pages, on Linux, for any
/// mapping, mimalloc's arenas included (`PR_SET_THP_DISABLE`). Call it first in `main`.
///
/// mimalloc asks for huge pages on its arenas (`MADV_HUGEPAGE`), so on the many systems whose
/// THP setting is `madvise` or `always` a thread's few live blocks hold whole 2 MiB pages:
/// the idle proxy then holds 21 MB instead of 12, and 77 MB instead of 58 at 640 streams in
/// flight (docs/performance.md), at the same throughput. Where the kernel refuses (no such
/// flag), memory stays as it was: nothing else depends on it.
pub fn without_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: `prctl` with integer arguments only; it changes a flag of this process.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

// SAFETY: every method returns either null or a block from mimalloc of at least the layout's
// size, aligned to its alignment (checked for the plain calls), and `dealloc` frees only what
// these methods returned; mimalloc's `mi_free` takes blocks from any of its allocation calls.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: a `Layout`'s alignment is a power of two; the pair matches.
        unsafe { allocate(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: a `Layout`'s alignment is a power of two; the pair matches.
        unsafe { allocate(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a block this allocator returned.
        unsafe { mi::mi_free(ptr.cast()) };
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        if is_plain(align, new_size) {
            // SAFETY: the caller passes a block this allocator returned, still live.
            let p = unsafe { mi::mi_realloc(ptr.cast(), new_size) };
            if is_aligned(p, align) {
                return p.cast();
            }
            // `mi_realloc` moved the contents and freed the old block; move them once more to
            // a block aligned as the layout asks.
            // SAFETY: `p` holds `min(old, new_size)` bytes of the old contents.
            let q = unsafe { mi::mi_malloc_aligned(new_size, align) };
            if !q.is_null() {
                let kept = layout.size().min(new_size);
                // SAFETY: both blocks are live, distinct and at least `kept` bytes long.
                unsafe { core::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), kept) };
            }
            // SAFETY: `p` came from `mi_realloc` and is not used again.
            unsafe { mi::mi_free(p) };
            return q.cast();
        }
        // SAFETY: the caller passes a live block of this allocator; `align` is a power of two.
        unsafe { mi::mi_realloc_aligned(ptr.cast(), new_size, align) }.cast()
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    #[test]
    fn every_block_is_aligned_as_asked_and_keeps_its_contents() {
        let a = Allocator;
        let mut sizes: Vec<usize> = (1..=300).collect();
        sizes.extend([1000, 1024, 1025, 2329, 4096, 8192, 8193, 70_000, 1 << 20]);
        for &size in &sizes {
            for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
                let Ok(layout) = Layout::from_size_align(size, align) else {
                    continue;
                };
                // SAFETY: a non-zero size; every block is freed once, with its layout.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size}, align {align}");
                    p.write_bytes(0xA5, size);
                    let grown = size * 3 + 7;
                    let q = a.realloc(p, layout, grown);
                    assert_eq!(q as usize % align, 0, "realloc to {grown}, align {align}");
                    assert!((0..size).all(|i| *q.add(i) == 0xA5));
                    a.dealloc(q, Layout::from_size_align(grown, align).unwrap());
                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0);
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }

    #[test]
    fn blocks_stay_usable_across_a_collect() {
        let a = Allocator;
        let small = Layout::from_size_align(64, 8).unwrap();
        let page = Layout::from_size_align(4096, 16).unwrap();
        // SAFETY: non-zero sizes; every block is written within its size and freed once, with
        // its layout.
        unsafe {
            let kept: Vec<*mut u8> = (0..1000).map(|_| a.alloc(small)).collect();
            let mark = |i: usize| (i % 251).to_le_bytes()[0];
            for (i, &p) in kept.iter().enumerate() {
                p.write_bytes(mark(i), 64);
            }
            let freed: Vec<*mut u8> = (0..10_000).map(|_| a.alloc(page)).collect();
            for &p in &freed {
                p.write_bytes(0x5A, 4096);
                a.dealloc(p, page);
            }
            collect();
            for (i, &p) in kept.iter().enumerate() {
                assert!((0..64).all(|j| *p.add(j) == mark(i)), "block {i} changed");
                a.dealloc(p, small);
            }
            let again: Vec<*mut u8> = (0..10_000).map(|_| a.alloc_zeroed(page)).collect();
            for &p in &again {
                assert!((0..4096).all(|j| *p.add(j) == 0));
                a.dealloc(p, page);
            }
        }
    }
}
