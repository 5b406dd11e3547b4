//! `Recycler`: a front for an allocator that keeps the last freed blocks of 256 bytes to 128
//! KiB and gives each again for the same size and alignment.
//!
//! A decoding step runs about a thousand nodes, most of which allocate an output tensor of the
//! size the same node allocated at the step before, and free their inputs. In wasm the system
//! allocator is dlmalloc, and tract asks for tensors 16-byte aligned, which dlmalloc serves
//! through `memalign` (a larger chunk, split) and its bins of large chunks: about 2% of a q4
//! step in a V8 profile. The wasm package (`wasm`, without atomics: one thread) takes this
//! front as its global allocator; it holds at most [`SLOTS`] blocks (4 MiB) it does not hand
//! back, and blocks outside its sizes go straight through.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::{Cell, UnsafeCell};

/// How many freed blocks are kept.
pub const SLOTS: usize = 32;
/// The sizes kept, in bytes: smaller blocks are cheap for dlmalloc, larger ones rare.
const SIZES: std::ops::RangeInclusive<usize> = 256..=128 * 1024;

/// A kept block: its address (null when the slot is empty) and its layout's size and
/// alignment.
#[derive(Clone, Copy)]
struct Slot {
    ptr: *mut u8,
    size: usize,
    align: usize,
}

const EMPTY: Slot = Slot {
    ptr: std::ptr::null_mut(),
    size: 0,
    align: 0,
};

/// The front (see the module's documentation) over `inner`, which allocates and frees every
/// block. Not for several threads: its slots are plain cells.
pub struct Recycler<A> {
    inner: A,
    slots: UnsafeCell<[Slot; SLOTS]>,
    /// The slot a freed block replaces when every slot is taken (round robin).
    next: Cell<usize>,
}

// SAFETY: a wasm module without atomics runs one thread, so the cells are never shared.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl<A: Sync> Sync for Recycler<A> {}

impl<A> Recycler<A> {
    pub const fn new(inner: A) -> Recycler<A> {
        Recycler {
            inner,
            slots: UnsafeCell::new([EMPTY; SLOTS]),
            next: Cell::new(0),
        }
    }

    /// A kept block of this layout, taken out of its slot.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        if !SIZES.contains(&layout.size()) {
            return None;
        }
        // SAFETY: one thread (see `Sync`); no reference to the slots outlives this call.
        let slots = unsafe { &mut *self.slots.get() };
        let slot = slots
            .iter_mut()
            .find(|s| !s.ptr.is_null() && s.size == layout.size() && s.align == layout.align())?;
        Some(std::mem::replace(slot, EMPTY).ptr)
    }
}

unsafe impl<A: GlobalAlloc> GlobalAlloc for Recycler<A> {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(ptr) => ptr,
            // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
            None => unsafe { self.inner.alloc(layout) },
        }
    }

    #[inline(never)]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match self.take(layout) {
            Some(ptr) => {
                // SAFETY: the block holds `layout.size()` bytes.
                unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
                ptr
            }
            // SAFETY: as in `alloc`.
            None => unsafe { self.inner.alloc_zeroed(layout) },
        }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !SIZES.contains(&layout.size()) {
            // SAFETY: `ptr` came from `inner` with this layout.
            return unsafe { self.inner.dealloc(ptr, layout) };
        }
        let block = Slot {
            ptr,
            size: layout.size(),
            align: layout.align(),
        };
        // SAFETY: as in `take`.
        let slots = unsafe { &mut *self.slots.get() };
        if let Some(slot) = slots.iter_mut().find(|s| s.ptr.is_null()) {
            *slot = block;
            return;
        }
        let at = self.next.get();
        self.next.set((at + 1) % SLOTS);
        let old = std::mem::replace(&mut slots[at], block);
        // SAFETY: every kept block came from `inner` with the layout kept beside it.
        unsafe {
            let layout = Layout::from_size_align_unchecked(old.size, old.align);
            self.inner.dealloc(old.ptr, layout)
        }
    }

    #[inline(never)]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: every block came from `inner` (a kept one too), with `layout`.
        unsafe { self.inner.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;

    /// `System`, counting the blocks it holds.
    #[derive(Default)]
    struct Counting(Cell<isize>);

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            self.0.set(self.0.get() + 1);
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            self.0.set(self.0.get() - 1);
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    /// A freed block comes back for its size and alignment only, zeroed when asked; sizes
    /// outside the kept range go straight through; with every slot taken a kept block is
    /// freed in turn for the new one, so the front never holds more than `SLOTS`.
    #[test]
    fn keeps_freed_blocks_for_their_layout() {
        let r = Recycler::new(Counting::default());
        let layout = Layout::from_size_align(1000, 16).unwrap();
        unsafe {
            let p = r.alloc(layout);
            p.write_bytes(7, 1000);
            r.dealloc(p, layout);
            assert_eq!(r.inner.0.get(), 1, "kept");
            for other in [(1000, 8), (1004, 16)] {
                let other = Layout::from_size_align(other.0, other.1).unwrap();
                let q = r.alloc(other);
                assert_ne!(q, p);
                r.dealloc(q, other);
            }
            let again = r.alloc_zeroed(layout);
            assert_eq!(again, p);
            assert!(std::slice::from_raw_parts(again, 1000)
                .iter()
                .all(|&b| b == 0));
            r.dealloc(again, layout);
            // Small and large blocks are not kept.
            for size in [255, 128 * 1024 + 1] {
                let l = Layout::from_size_align(size, 16).unwrap();
                let before = r.inner.0.get();
                let q = r.alloc(l);
                r.dealloc(q, l);
                assert_eq!(r.inner.0.get(), before, "size {size}");
            }
            // More freed blocks than slots.
            let many: Vec<_> = (0..SLOTS + 5)
                .map(|i| {
                    let l = Layout::from_size_align(256 + 64 * i, 16).unwrap();
                    (r.alloc(l), l)
                })
                .collect();
            for &(q, l) in &many {
                r.dealloc(q, l);
            }
            assert_eq!(r.inner.0.get(), SLOTS as isize);
            // The newest blocks are the ones kept.
            let (last, l) = many[many.len() - 1];
            assert_eq!(r.alloc(l), last);
            r.dealloc(last, l);
        }
    }
}
