//! Read faults in memory-mapped model files: a file truncated (or its disk failing) while
//! mapped makes the next touch of the lost pages raise SIGBUS. Without a handler the process
//! dies with no message; with this one it prints one line naming the file and the offset and
//! exits with status 1, as any other bad-input error.
//!
//! Owns: the SIGBUS handler and the table of mapped regions it consults. Does not own: the
//! maps themselves (files.rs registers each one it makes and unregisters it on drop).
//! Invariant: the handler only reads atomics and calls async-signal-safe functions (`write`,
//! `_exit`, `signal`, `raise`); a SIGBUS outside every registered map keeps its default action.

use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// Maps tracked at once (model files of a process: shards of one or two models).
const SLOTS: usize = 256;

struct Region {
    start: AtomicUsize,
    len: AtomicUsize,
    /// The file's path, leaked (a few hundred bytes per map, for the life of the process).
    path: AtomicPtr<u8>,
    path_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Region = Region {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    path: AtomicPtr::new(std::ptr::null_mut()),
    path_len: AtomicUsize::new(0),
};
static REGIONS: [Region; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// Track the map `[start, start + len)` of the file at `path`. Returns its slot (for
/// `unregister`), or `None` when the table is full (the fault then kills with no message, as
/// before this module).
pub(crate) fn register(start: *const u8, len: usize, path: &Path) -> Option<usize> {
    INSTALL.call_once(install);
    let name: &'static mut [u8] =
        Box::leak(path.display().to_string().into_bytes().into_boxed_slice());
    for (i, r) in REGIONS.iter().enumerate() {
        if r.start
            .compare_exchange(0, start as usize, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            r.path_len.store(name.len(), Ordering::SeqCst);
            r.path.store(name.as_mut_ptr(), Ordering::SeqCst);
            r.len.store(len, Ordering::SeqCst);
            return Some(i);
        }
    }
    None
}

/// Stop tracking the map in `slot` (its memory is about to be unmapped).
pub(crate) fn unregister(slot: usize) {
    if let Some(r) = REGIONS.get(slot) {
        r.len.store(0, Ordering::SeqCst);
        r.start.store(0, Ordering::SeqCst);
    }
}

fn install() {
    // SAFETY: `sigaction` with a zeroed struct, an empty mask and a handler of the
    // SA_SIGINFO signature; the handler is async-signal-safe (see `on_sigbus`).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

/// Decimal digits of `v` into `buf`; returns the used tail.
fn digits(mut v: usize, buf: &mut [u8; 24]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
    }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler; `si_addr` is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for r in &REGIONS {
        let start = r.start.load(Ordering::SeqCst);
        let len = r.len.load(Ordering::SeqCst);
        if start == 0 || addr < start || addr - start >= len {
            continue;
        }
        let path = r.path.load(Ordering::SeqCst);
        let path_len = r.path_len.load(Ordering::SeqCst);
        let mut num = [0u8; 24];
        let parts: [&[u8]; 5] = [
            b"sluice: error: ",
            // SAFETY: `path`/`path_len` are a leaked, never-freed byte slice (`register`).
            unsafe { std::slice::from_raw_parts(path, path_len) },
            b": cannot read byte ",
            digits(addr - start, &mut num),
            b" of the memory-mapped file (SIGBUS): it was truncated or its disk failed while sluice ran\n",
        ];
        for p in parts {
            // SAFETY: write(2) of a valid buffer to stderr; async-signal-safe.
            unsafe { libc::write(2, p.as_ptr().cast(), p.len()) };
        }
        // SAFETY: _exit is async-signal-safe and ends the process at once.
        unsafe { libc::_exit(1) };
    }
    // Not one of ours: the default action (terminate with SIGBUS).
    // SAFETY: signal + raise are async-signal-safe.
    unsafe {
        libc::signal(libc::SIGBUS, libc::SIG_DFL);
        libc::raise(libc::SIGBUS);
    }
}
