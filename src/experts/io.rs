//! `ReadPool`: reader threads that fill caller-owned memory from the model's files.
//!
//! Owns the open files (O_DIRECT, buffered with `POSIX_FADV_RANDOM`, or a `MADV_RANDOM`
//! mapping), the reader threads (created once), two job queues (demand reads first, then
//! speculative prefetch reads, which `promote` moves to the demand queue once they are needed)
//! and a completion queue (preallocated `VecDeque`s under one mutex: no allocation per read in
//! steady state). `SLUICE_READER_NICE` gives the readers another niceness (`reader_nice`).
//! Does not
//! decide what to read or where (the cache does) and does not own the destination memory.
//! Invariant: every submitted job yields exactly one `Completion` unless `cancel` took it back
//! before a reader did (and said so in its count); `Ok(n)` means at least the
//! job's `need` bytes are in place, anything else is an error naming the file and offset; a
//! destination is written only between its job's submission and its completion.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{ExpertError, Slab, ALIGN};

/// How expert bytes are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// O_DIRECT `pread` of `ALIGN`-widened windows into aligned memory (no page cache).
    Direct,
    /// Plain `pread` through the page cache, read-ahead off (`POSIX_FADV_RANDOM`).
    Buffered,
    /// `memcpy` out of a `MADV_RANDOM` mapping of each file.
    Mmap,
}

impl IoMode {
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Direct => "direct",
            IoMode::Buffered => "buffered",
            IoMode::Mmap => "mmap",
        }
    }
}

impl fmt::Display for IoMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> Result<IoMode, String> {
        match s {
            "direct" => Ok(IoMode::Direct),
            "buffered" => Ok(IoMode::Buffered),
            "mmap" => Ok(IoMode::Mmap),
            _ => Err(format!(
                "unknown IO mode `{s}` (expected direct, buffered or mmap)"
            )),
        }
    }
}

/// One read: bytes `[offset, offset + len)` of file `file` into `dst`. At least `need` bytes
/// must arrive; the rest of the window may lie past the end of the file (the last O_DIRECT
/// window of a file whose size is not a multiple of `ALIGN`). In direct mode `offset`, `len`
/// and `dst` must be `ALIGN`-aligned. `tag` comes back in the completion.
#[derive(Clone, Copy, Debug)]
pub struct ReadJob {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub need: usize,
    pub dst: *mut u8,
    pub tag: u64,
}

// SAFETY: `dst` is only written by the one reader thread that takes the job; the submitter
// promised (see `ReadPool::submit`) that nobody else touches that memory until completion.
unsafe impl Send for ReadJob {}

/// A finished job: bytes read (the whole window where the file had it), or why not.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub result: Result<u64, ExpertError>,
}

struct OpenFile {
    path: PathBuf,
    file: File,
    map: Option<memmap2::Mmap>,
}

#[derive(Default)]
struct Queues {
    jobs: VecDeque<ReadJob>,
    /// Prefetch reads: taken only when `jobs` is empty.
    low: VecDeque<ReadJob>,
    done: VecDeque<Completion>,
    /// Submitted jobs whose completion has not been taken by `wait`.
    outstanding: usize,
    /// Jobs submitted and not yet finished by a reader.
    in_flight: usize,
    busy_since: Option<Instant>,
    busy: Duration,
    bytes: u64,
    /// Jobs finished, and the sum of their read times (taken by a reader to read done): over
    /// `busy`, the mean number of reads in flight.
    reads: u64,
    read_time: Duration,
    shutdown: bool,
    /// Readers that have started running.
    started: usize,
}

struct Shared {
    q: Mutex<Queues>,
    work: Condvar,
    done: Condvar,
    files: Vec<OpenFile>,
    mode: IoMode,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        // A reader never panics while holding the lock; if one did, the queues are still
        // consistent (every mutation is a single push/pop), so poisoning is ignored.
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A fixed set of reader threads over a model's files.
pub struct ReadPool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    note: Option<String>,
}

impl ReadPool {
    /// Opens every file for `mode` and starts `threads` readers. `queue_capacity` preallocates
    /// the job and completion queues (the most jobs expected in flight at once). When O_DIRECT
    /// is refused (tmpfs, some network file systems: EINVAL), falls back to buffered reads and
    /// says so in `note()`.
    pub fn new(
        paths: &[PathBuf],
        mode: IoMode,
        threads: usize,
        queue_capacity: usize,
    ) -> Result<ReadPool, ExpertError> {
        if threads == 0 {
            return Err(ExpertError::Config(
                "--io-threads must be at least 1".into(),
            ));
        }
        let (files, mode, note) = match open_all(paths, mode) {
            Ok(files) => (files, mode, None),
            Err(OpenErr::NoDirect(note)) => {
                let files = open_all(paths, IoMode::Buffered).map_err(|e| match e {
                    OpenErr::Other(e) => e,
                    OpenErr::NoDirect(n) => ExpertError::Config(n),
                })?;
                (files, IoMode::Buffered, Some(note))
            }
            Err(OpenErr::Other(e)) => return Err(e),
        };
        let q = Queues {
            jobs: VecDeque::with_capacity(queue_capacity),
            low: VecDeque::with_capacity(queue_capacity),
            done: VecDeque::with_capacity(queue_capacity),
            ..Queues::default()
        };
        let shared = Arc::new(Shared {
            q: Mutex::new(q),
            work: Condvar::new(),
            done: Condvar::new(),
            files,
            mode,
        });
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let s = Arc::clone(&shared);
            match std::thread::Builder::new()
                .name(format!("sluice-read-{i}"))
                .spawn(move || reader(&s))
            {
                Ok(h) => handles.push(h),
                Err(e) => {
                    shared.lock().shutdown = true;
                    shared.work.notify_all();
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(ExpertError::io(
                        std::path::Path::new("reader thread"),
                        "spawn",
                        e,
                    ));
                }
            }
        }
        // Every reader is running (its start-up allocations done) before `new` returns.
        let mut q = shared.lock();
        while q.started < threads {
            q = shared.done.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        drop(q);
        Ok(ReadPool {
            shared,
            threads: handles,
            note,
        })
    }

    /// The mode in effect (buffered after an O_DIRECT fallback).
    pub fn mode(&self) -> IoMode {
        self.shared.mode
    }

    /// One line to show the user when the requested mode was not available.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    pub fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Queues `jobs` for the readers.
    ///
    /// # Safety
    /// Each job's `dst` must be valid for writes of `len` bytes (aligned as the mode requires),
    /// not read or written by anyone else, and kept alive until that job's completion has been
    /// returned by `wait` (or the pool dropped).
    pub unsafe fn submit(&self, jobs: &[ReadJob]) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.enqueue(jobs, false) }
    }

    /// Queues speculative `jobs` behind every demand read: a reader takes one only when no
    /// `submit`ted job waits. `promote` moves them forward once they are needed.
    ///
    /// # Safety
    /// As `submit`.
    pub unsafe fn submit_low(&self, jobs: &[ReadJob]) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.enqueue(jobs, true) }
    }

    /// # Safety
    /// As `submit`.
    unsafe fn enqueue(&self, jobs: &[ReadJob], low: bool) {
        if jobs.is_empty() {
            return;
        }
        let mut q = self.shared.lock();
        if q.in_flight == 0 {
            q.busy_since = Some(Instant::now());
        }
        q.in_flight += jobs.len();
        q.outstanding += jobs.len();
        if low {
            q.low.extend(jobs.iter().copied());
        } else {
            q.jobs.extend(jobs.iter().copied());
        }
        drop(q);
        if jobs.len() == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
    }

    /// Moves the queued speculative jobs tagged `tag` behind the demand reads (jobs already
    /// taken by a reader are unaffected). Returns how many moved.
    pub fn promote(&self, tag: u64) -> usize {
        let mut guard = self.shared.lock();
        let q = &mut *guard;
        let mut moved = 0;
        let jobs = &mut q.jobs;
        q.low.retain(|j| {
            if j.tag == tag {
                jobs.push_back(*j);
                moved += 1;
                false
            } else {
                true
            }
        });
        moved
    }

    /// The next completion, blocking until one is there; `None` when no job is outstanding.
    pub fn wait(&self) -> Option<Completion> {
        let mut q = self.shared.lock();
        loop {
            if let Some(c) = q.done.pop_front() {
                q.outstanding -= 1;
                return Some(c);
            }
            if q.outstanding == 0 {
                return None;
            }
            q = self.shared.done.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Takes back the queued speculative jobs tagged `tag` that no reader has started; they
    /// will have no completion. Returns how many (jobs being read are unaffected).
    pub fn cancel(&self, tag: u64) -> usize {
        let mut q = self.shared.lock();
        let before = q.low.len();
        q.low.retain(|j| j.tag != tag);
        let n = before - q.low.len();
        q.in_flight -= n;
        q.outstanding -= n;
        if n > 0 && q.in_flight == 0 {
            if let Some(t) = q.busy_since.take() {
                q.busy += t.elapsed();
            }
        }
        drop(q);
        if n > 0 {
            // A `wait` blocked on nothing outstanding must see it.
            self.shared.done.notify_all();
        }
        n
    }

    /// Jobs submitted whose completion `wait` has not returned yet.
    pub fn outstanding(&self) -> usize {
        self.shared.lock().outstanding
    }

    /// Total bytes the readers have placed (whole windows, alignment included).
    pub fn bytes_read(&self) -> u64 {
        self.shared.lock().bytes
    }

    /// (jobs finished, seconds summed over their reads): with `busy_secs`, the mean number of
    /// reads in flight while the pool was busy; with `bytes_read`, the mean read size.
    pub fn read_totals(&self) -> (u64, f64) {
        let q = self.shared.lock();
        (q.reads, q.read_time.as_secs_f64())
    }

    /// Wall time during which at least one job was queued or being read.
    pub fn busy_secs(&self) -> f64 {
        let q = self.shared.lock();
        let live = q
            .busy_since
            .filter(|_| q.in_flight > 0)
            .map_or(Duration::ZERO, |t| t.elapsed());
        (q.busy + live).as_secs_f64()
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        {
            let mut q = self.shared.lock();
            q.shutdown = true;
            // Queued jobs are dropped unread; the ones being read finish before the join.
            let dropped = q.jobs.len() + q.low.len();
            q.jobs.clear();
            q.low.clear();
            q.in_flight -= dropped;
            q.outstanding -= dropped;
        }
        self.shared.work.notify_all();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

enum OpenErr {
    /// O_DIRECT refused; the one-line note says for which file and why.
    NoDirect(String),
    Other(ExpertError),
}

fn open_all(paths: &[PathBuf], mode: IoMode) -> Result<Vec<OpenFile>, OpenErr> {
    paths.iter().map(|p| open_one(p, mode)).collect()
}

fn no_direct(path: &std::path::Path, err: std::io::Error) -> OpenErr {
    OpenErr::NoDirect(format!(
        "note: O_DIRECT is not supported for {} ({err}); using buffered reads",
        path.display()
    ))
}

fn open_one(path: &std::path::Path, mode: IoMode) -> Result<OpenFile, OpenErr> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    if mode == IoMode::Direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if mode == IoMode::Direct && e.raw_os_error() == Some(libc::EINVAL) => {
            return Err(no_direct(path, e))
        }
        Err(e) => return Err(OpenErr::Other(ExpertError::io(path, "open", e))),
    };
    let mut map = None;
    match mode {
        IoMode::Direct => {
            // Some file systems accept the flag and refuse the reads: probe one block.
            let (probe, _) = Slab::new(ALIGN, false).map_err(OpenErr::Other)?;
            // SAFETY: `probe` is ALIGN bytes of aligned memory owned here.
            let buf = unsafe { std::slice::from_raw_parts_mut(probe.as_ptr(), ALIGN as usize) };
            if let Err(e) = file.read_at(buf, 0) {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    return Err(no_direct(path, e));
                }
                return Err(OpenErr::Other(ExpertError::io(path, "read", e)));
            }
        }
        IoMode::Buffered => {
            // SAFETY: plain syscall on an fd we own; advice only, failure is harmless.
            unsafe {
                libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
            }
        }
        IoMode::Mmap => {
            // SAFETY: the mapping is only copied from, after checking the file's current size
            // (`copy_from_map`); a truncation racing that copy can still raise SIGBUS, which is
            // inherent to reading a file through a mapping.
            let m = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| OpenErr::Other(ExpertError::io(path, "map", e)))?;
            let _ = m.advise(memmap2::Advice::Random);
            map = Some(m);
        }
    }
    Ok(OpenFile {
        path: path.to_path_buf(),
        file,
        map,
    })
}

/// The niceness readers ask for (`SLUICE_READER_NICE`, default 0 = unchanged): a reader needs a
/// core only between one read's end and the next one's start, and compute threads holding every
/// core can delay that; but a reader that preempts them delays the compute instead. On the
/// shared 2-vCPU VM, -10 won one series (decode 1.12x) and lost the next (0.78x, the compute time
/// grew): off until a quiet machine decides (docs/PERFORMANCE.md, session 28). Lowering niceness
/// needs CAP_SYS_NICE (or RLIMIT_NICE): refused, the readers keep the default.
fn reader_nice() -> i32 {
    std::env::var("SLUICE_READER_NICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn reader(s: &Shared) {
    let nice = reader_nice();
    if nice != 0 {
        // SAFETY: plain syscalls on this thread's own id; failure leaves the niceness as is.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        }
    }
    s.lock().started += 1;
    s.done.notify_all();
    loop {
        let job = {
            let mut q = s.lock();
            loop {
                if q.shutdown {
                    return;
                }
                if let Some(j) = q.jobs.pop_front().or_else(|| q.low.pop_front()) {
                    break j;
                }
                q = s.work.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let t0 = Instant::now();
        let result = match s.files.get(job.file) {
            Some(f) => read_job(f, s.mode, &job),
            None => Err(ExpertError::Request(format!(
                "read job names file {} of {}",
                job.file,
                s.files.len()
            ))),
        };
        let took = t0.elapsed();
        let mut q = s.lock();
        if let Ok(n) = result {
            q.bytes += n;
        }
        q.reads += 1;
        q.read_time += took;
        q.in_flight -= 1;
        if q.in_flight == 0 {
            if let Some(t) = q.busy_since.take() {
                q.busy += t.elapsed();
            }
        }
        q.done.push_back(Completion {
            tag: job.tag,
            result,
        });
        drop(q);
        s.done.notify_one();
    }
}

fn read_job(f: &OpenFile, mode: IoMode, job: &ReadJob) -> Result<u64, ExpertError> {
    if let Some(map) = &f.map {
        return copy_from_map(f, map, job);
    }
    let short = |got: usize| ExpertError::ShortRead {
        path: f.path.clone(),
        offset: job.offset,
        wanted: job.need as u64,
        got: got as u64,
    };
    let fd = f.file.as_raw_fd();
    let mut got = 0usize;
    while got < job.need {
        let off = job.offset + got as u64;
        // SAFETY: `dst` is valid for `len` bytes and ours until completion (submit's contract);
        // `got < need <= len`, so the destination stays inside the job's window.
        let r = unsafe {
            libc::pread(
                fd,
                job.dst.add(got).cast(),
                job.len - got,
                off as libc::off_t,
            )
        };
        if r < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(ExpertError::Read {
                path: f.path.clone(),
                offset: off,
                len: (job.len - got) as u64,
                err,
            });
        }
        if r == 0 {
            return Err(short(got));
        }
        got += r as usize;
        // O_DIRECT stops short only at the end of the file; a further read at an unaligned
        // offset would fail with EINVAL, so an unaligned count below `need` is a short file.
        if mode == IoMode::Direct && got < job.need && !(got as u64).is_multiple_of(ALIGN) {
            return Err(short(got));
        }
    }
    Ok(got as u64)
}

fn copy_from_map(f: &OpenFile, map: &memmap2::Mmap, job: &ReadJob) -> Result<u64, ExpertError> {
    let size = f
        .file
        .metadata()
        .map_err(|e| ExpertError::io(&f.path, "stat", e))?
        .len()
        .min(map.len() as u64);
    let avail = size.saturating_sub(job.offset).min(job.len as u64);
    if avail < job.need as u64 {
        return Err(ExpertError::ShortRead {
            path: f.path.clone(),
            offset: job.offset,
            wanted: job.need as u64,
            got: avail,
        });
    }
    let start = job.offset as usize;
    let src = &map[start..start + avail as usize];
    // SAFETY: `dst` is valid for `len >= avail` bytes and ours until completion (submit's
    // contract); it does not overlap the file mapping.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), job.dst, src.len()) };
    Ok(avail)
}

/// Lock the pages of already-mapped, resident weight bytes (dense tensors) in memory, so
/// streaming experts cannot push them out. Returns the bytes locked, or why not (the caller
/// warns once; streaming works either way).
pub fn lock_resident(ranges: &[&[u8]]) -> Result<u64, String> {
    let page = 4096usize;
    let mut locked = 0u64;
    for r in ranges {
        if r.is_empty() {
            continue;
        }
        let start = r.as_ptr() as usize & !(page - 1);
        let end = (r.as_ptr() as usize + r.len()).next_multiple_of(page);
        // SAFETY: [start, end) covers only pages of a live read-only mapping that `r` borrows
        // (rounded to page bounds within the same mapping); mlock does not change their contents.
        let rc = unsafe { libc::mlock(start as *const libc::c_void, end - start) };
        if rc != 0 {
            return Err(format!("mlock of resident weights refused after {} MB ({}): they stay in the page cache, unpinned", locked >> 20, std::io::Error::last_os_error()));
        }
        locked += (end - start) as u64;
    }
    Ok(locked)
}

/// `MADV_RANDOM` on the pages of mapped bytes read a small piece at a time (the token-embedding
/// table where experts stream: one row per token): a page fault then reads that page, not the
/// device's read-ahead window around it (8 MB on some disks), and the memory it takes stays
/// the pages touched. Advice only: returns why it was refused, and reads work either way.
pub fn advise_random(bytes: &[u8]) -> Result<(), String> {
    if bytes.is_empty() {
        return Ok(());
    }
    let page = 4096usize;
    let start = bytes.as_ptr() as usize & !(page - 1);
    let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(page);
    // SAFETY: [start, end) covers only pages of a live read-only mapping that `bytes` borrows;
    // MADV_RANDOM changes read-ahead, never contents.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_RANDOM) };
    if rc != 0 {
        return Err(format!(
            "madvise(MADV_RANDOM) of the embedding table refused ({}): its rows fault in with read-ahead",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
