//! `Slab`: one large page-aligned anonymous mapping, split by its owner into fixed slots.
//!
//! Owns the memory and its lifetime; does not know what the bytes mean. Allocated once,
//! mlocked when the system allows (a note says when not), freed only on drop.
//! Invariant: `ptr` is `ALIGN`-aligned and valid for `len` bytes for the whole life of the slab.

use std::ptr::NonNull;

use super::{ExpertError, ALIGN};

pub struct Slab {
    ptr: NonNull<u8>,
    len: usize,
    locked: bool,
}

// SAFETY: the slab is plain memory; who may touch which bytes when is the owner's protocol
// (the cache hands slots to reader threads and to the caller, never to both at once).
unsafe impl Send for Slab {}
// SAFETY: as above; `&Slab` only exposes the base pointer and length.
unsafe impl Sync for Slab {}

impl Slab {
    /// Maps `len` bytes (rounded up to `ALIGN`) of zeroed anonymous memory and tries to mlock
    /// them. Returns the slab and, when mlock was refused, a one-line note saying so.
    pub fn new(len: u64, lock: bool) -> Result<(Slab, Option<String>), ExpertError> {
        let bytes = len.div_ceil(ALIGN) * ALIGN;
        let Ok(size) = usize::try_from(bytes) else {
            return Err(ExpertError::Alloc {
                bytes,
                err: std::io::Error::other("larger than the address space"),
            });
        };
        if size == 0 {
            return Ok((
                Slab {
                    ptr: NonNull::dangling(),
                    len: 0,
                    locked: false,
                },
                None,
            ));
        }
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(ExpertError::Alloc {
                bytes,
                err: std::io::Error::last_os_error(),
            });
        }
        let Some(ptr) = NonNull::new(p.cast::<u8>()) else {
            return Err(ExpertError::Alloc {
                bytes,
                err: std::io::Error::other("mmap returned null"),
            });
        };
        let mut slab = Slab {
            ptr,
            len: size,
            locked: false,
        };
        let mut note = None;
        if lock {
            // SAFETY: the range is exactly the mapping made above.
            if unsafe { libc::mlock(p, size) } == 0 {
                slab.locked = true;
            } else {
                let err = std::io::Error::last_os_error();
                note = Some(format!(
                    "note: cannot mlock {:.2} GB of expert cache ({err}); it may be swapped out (raise `ulimit -l`)",
                    bytes as f64 / 1e9
                ));
            }
        }
        Ok((slab, note))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn locked(&self) -> bool {
        self.locked
    }

    /// Base pointer. Writes through it are the owner's responsibility (see the cache's protocol).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping exactly the mapping `new` made; no slot outlives the slab
            // (ExpertBytes borrow the cache that owns it, reader threads are joined first).
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            }
        }
    }
}
