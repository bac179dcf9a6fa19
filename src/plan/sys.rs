//! The few operating-system calls the probes need that std does not offer, as safe wrappers:
//! free space (`statvfs`), the mlock limit (`getrlimit`), page-cache advice (`posix_fadvise`),
//! and removing a probe file when the process is interrupted (a SIGINT/SIGTERM/SIGHUP handler).
//!
//! Owns: every `unsafe` block of `plan/` except the CUDA driver calls (probe_gpu.rs).
//! Does not own: what the probes measure. Invariant: each wrapper checks the call's result and
//! turns failure into an `io::Error`; the signal handler calls only async-signal-safe functions.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
}

/// Bytes an unprivileged user may still write on the filesystem holding `p`.
// The casts are no-ops on 64-bit Linux but not on every target libc describes.
#[allow(clippy::unnecessary_cast)]
pub fn free_bytes(p: &Path) -> io::Result<u64> {
    let c = c_path(p)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a writable statvfs
    // the kernel fills; we read it only when the call reports success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised the whole struct (and it was zeroed before).
    let st = unsafe { st.assume_init() };
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// RLIMIT_MEMLOCK's soft limit in bytes; `None` when unlimited.
#[allow(clippy::unnecessary_cast)]
pub fn memlock_limit() -> io::Result<Option<u64>> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if r.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(r.rlim_cur as u64)
    })
}

/// What `advise` tells the kernel about a file's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Default read-ahead.
    Normal,
    /// Drop the file's clean, unmapped pages from the page cache now.
    DontNeed,
}

impl Advice {
    pub fn name(self) -> &'static str {
        match self {
            Advice::Normal => "POSIX_FADV_NORMAL",
            Advice::DontNeed => "POSIX_FADV_DONTNEED",
        }
    }
}

/// `posix_fadvise` over the whole of `f`.
pub fn advise(f: &File, advice: Advice) -> io::Result<()> {
    let a = match advice {
        Advice::Normal => libc::POSIX_FADV_NORMAL,
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
    };
    // SAFETY: the descriptor is open for the lifetime of `f`; the call only reads its arguments.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, a) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// The path the signal handler removes (a leaked `CString`), or null.
static DOOMED: AtomicPtr<libc::c_char> = AtomicPtr::new(std::ptr::null_mut());
/// The handlers in place before ours, restored when the guard goes.
static PREVIOUS: Mutex<Vec<(libc::c_int, libc::sigaction)>> = Mutex::new(Vec::new());
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

extern "C" fn remove_and_die(sig: libc::c_int) {
    let p = DOOMED.swap(std::ptr::null_mut(), Ordering::SeqCst);
    // SAFETY: unlink, signal and raise are async-signal-safe. `p`, when not null, came from
    // `CString::into_raw` and is never freed while stored in DOOMED (the guard swaps it out
    // before freeing it, and the swap above took it from the guard).
    unsafe {
        if !p.is_null() {
            libc::unlink(p);
        }
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// While alive, SIGINT, SIGTERM and SIGHUP remove `path` before the process dies of them.
/// One at a time per process (a second guard replaces the first's path).
pub struct RemoveOnSignal {
    path: *mut libc::c_char,
}

impl RemoveOnSignal {
    pub fn new(path: &Path) -> io::Result<RemoveOnSignal> {
        let c = c_path(path)?.into_raw();
        let old = DOOMED.swap(c, Ordering::SeqCst);
        if !old.is_null() {
            // SAFETY: `old` came from `CString::into_raw` and is no longer reachable by the handler.
            drop(unsafe { CString::from_raw(old) });
        }
        let mut prev = PREVIOUS.lock().unwrap_or_else(|e| e.into_inner());
        if prev.is_empty() {
            for sig in SIGNALS {
                // SAFETY: a zeroed sigaction is a valid "default, no flags, empty mask" value; we
                // set the handler to a plain `extern "C" fn(c_int)` (no SA_SIGINFO), and
                // `sigaction` reads `act` and writes `old` only during the call.
                unsafe {
                    let mut act: libc::sigaction = std::mem::zeroed();
                    act.sa_sigaction = remove_and_die as *const () as libc::sighandler_t;
                    libc::sigemptyset(&mut act.sa_mask);
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(sig, &act, &mut old) == 0 {
                        prev.push((sig, old));
                    }
                }
            }
        }
        Ok(RemoveOnSignal { path: c })
    }
}

impl Drop for RemoveOnSignal {
    fn drop(&mut self) {
        if DOOMED
            .compare_exchange(
                self.path,
                std::ptr::null_mut(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        {
            // SAFETY: we took our pointer back out of DOOMED, so the handler can no longer see
            // it; it came from `CString::into_raw` in `new`.
            drop(unsafe { CString::from_raw(self.path) });
            let mut prev = PREVIOUS.lock().unwrap_or_else(|e| e.into_inner());
            for (sig, old) in prev.drain(..) {
                // SAFETY: `old` is the action the kernel gave us for `sig`; reinstalling it is
                // what the process had before.
                unsafe {
                    libc::sigaction(sig, &old, std::ptr::null_mut());
                }
            }
        }
    }
}

/// Whether a process with this id exists (for removing probe files that a killed run left).
pub fn process_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Share of all cores' time spent busy (not idle, not waiting for IO) over `window`, from
/// `/proc/stat`'s `cpu` line sampled at both ends; `None` where it cannot be read.
pub fn cpu_busy(window: std::time::Duration) -> Option<f64> {
    fn sample() -> Option<(u64, u64)> {
        let text = std::fs::read_to_string("/proc/stat").ok()?;
        let line = text.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal ...
        let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
        let total: u64 = v.iter().take(8).sum();
        Some((idle, total))
    }
    let (i0, t0) = sample()?;
    std::thread::sleep(window);
    let (i1, t1) = sample()?;
    let dt = t1.saturating_sub(t0);
    (dt > 0).then(|| 1.0 - i1.saturating_sub(i0) as f64 / dt as f64)
}
