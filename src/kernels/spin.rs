//! A spinning thread gang for decode's short parallel regions (`SpinPool`).
//!
//! Owns: worker threads that wait for the next region by spinning, then yielding, then parking,
//! and a `run(n, task)` that hands task indices out one at a time to the caller and every worker.
//! Does not own: what the tasks compute, or long regions (prefill keeps rayon's work stealing).
//!
//! Why: a decode step of a MoE model is ~8 parallel regions per layer, each only tens of
//! microseconds long at 16 threads. A rayon region pays the splitting of its range into stolen
//! jobs and, after the workers have gone to sleep, a futex wake per worker (a system call that a
//! sandboxed kernel such as gVisor makes slow). Here a region is one atomic publish; workers
//! that are still spinning see it within a few hundred nanoseconds (what llama.cpp's thread
//! pool does between the operations of its graph).
//!
//! Invariant: `run` returns only after every task has finished, and no worker touches the task
//! closure after that: a worker calls it only for an index it claimed by a compare-and-swap on
//! the (region, task count, index) word, and a claimed index is a task the caller is still
//! waiting for. The count is in that word, not beside it: a worker that saw a region late could
//! otherwise read the next region's (larger) count, see the finished region's index still below
//! it and claim a task that does not exist (a task run twice, and the next region's `done`
//! counted one ahead: found on a 16-core host, `every_task_runs_once_per_region`).
//! Results cannot depend on which thread ran a task (the callers' tasks write disjoint outputs).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins (`spin_loop`) before it starts yielding its core.
const SPIN: Duration = Duration::from_micros(100);
/// How long an idle worker keeps yielding before it parks (decode's regions come every few
/// microseconds; between tokens, sampling and the next token's first operations take longer).
const YIELD: Duration = Duration::from_millis(2);

type Task<'t> = &'t (dyn Fn(usize) + Sync);

struct Shared {
    /// Region number (high 32 bits), its task count (bits 16..32) and the next unclaimed task
    /// index (low 16 bits): `claim_word`.
    next: AtomicU64,
    /// Tasks of the current region finished.
    done: AtomicUsize,
    /// A task panicked in this region (the caller panics once all have finished).
    panicked: AtomicBool,
    /// The region's task closure (a fat pointer, as two words), written by the caller between
    /// regions; atomics so that a worker reading them late reads a stale value, never a torn
    /// one it could use (see the module's invariant).
    job: [AtomicUsize; 2],
    /// The last published region number (low 32 bits); workers wait for it to change.
    region: AtomicU64,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

/// A gang of `threads - 1` spinning workers; the thread calling `try_run` is the last member.
pub struct SpinPool {
    shared: Arc<Shared>,
    threads: usize,
    /// Held for a whole region: one region at a time (another caller falls back).
    busy: AtomicBool,
}

impl SpinPool {
    fn new(threads: usize) -> SpinPool {
        let shared = Arc::new(Shared {
            next: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            job: Default::default(),
            region: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 1..threads {
            let s = shared.clone();
            // A worker that cannot start only makes the gang smaller: tasks are claimed, not
            // assigned, so the caller runs whatever nobody else takes.
            let _ = std::thread::Builder::new()
                .name(format!("sluice-spin-{i}"))
                .spawn(move || worker(&s));
        }
        SpinPool {
            shared,
            threads,
            busy: AtomicBool::new(false),
        }
    }

    /// The process's gang of `threads` threads (made on first use, never freed), or `None` when
    /// `threads` < 2, when `threads` == 2 (unless `SLUICE_SPIN=1`), or when `SLUICE_SPIN=0`
    /// turns the gangs off (for A/B runs against rayon).
    ///
    /// Why not at 2 threads: on the 2-vCPU AMD EPYC dev machine, decode (tg128, 8-layer
    /// Qwen3-30B-A3B shape) ran 66.35 tok/s on rayon against 62.5 with the gang (session 28;
    /// session 27: 66.1 vs 64.4), prefill 228.8 vs 235.4 (docs/PERFORMANCE.md, issue 16): the
    /// helper spinning through decode's serial parts costs more than rayon's wake-ups there.
    pub fn get(threads: usize) -> Option<&'static SpinPool> {
        static MODE: OnceLock<Option<bool>> = OnceLock::new();
        static POOLS: Mutex<Vec<&'static SpinPool>> = Mutex::new(Vec::new());
        // None: the default; Some(false): SLUICE_SPIN=0; Some(true): SLUICE_SPIN=1.
        let mode = *MODE.get_or_init(|| std::env::var("SLUICE_SPIN").ok().map(|v| v != "0"));
        let on = match mode {
            None => threads > 2,
            Some(on) => on && threads >= 2,
        };
        if !on {
            return None;
        }
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.iter().find(|p| p.threads == threads) {
            return Some(p);
        }
        let p: &'static SpinPool = Box::leak(Box::new(SpinPool::new(threads)));
        pools.push(p);
        Some(p)
    }

    /// Threads that run a region (the caller included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `task(i)` for every i in 0..n across the gang and the calling thread; returns when
    /// all have finished. Returns false without running anything when another region holds the
    /// gang (a nested or concurrent call) or `n` > `MAX_TASKS` (65535): the caller then runs
    /// the tasks some other way.
    pub fn try_run(&self, n: usize, task: &(dyn Fn(usize) + Sync)) -> bool {
        if n == 0 {
            return true;
        }
        if n > MAX_TASKS
            || self
                .busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return false;
        }
        let s = &*self.shared;
        // SAFETY: a fat reference is two words; they are turned back into the same reference
        // (`job_of`) only while this call waits for its tasks (module invariant).
        let words: [usize; 2] = unsafe { std::mem::transmute::<Task<'_>, [usize; 2]>(task) };
        let region = s.region.load(Ordering::Relaxed).wrapping_add(1) & 0xFFFF_FFFF;
        s.job[0].store(words[0], Ordering::Relaxed);
        s.job[1].store(words[1], Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.next.store(claim_word(region, n, 0), Ordering::Release);
        s.region.store(region, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        claim_all(s, region, words);
        let mut w = Backoff::new();
        while s.done.load(Ordering::Acquire) < n {
            w.snooze();
        }
        let panicked = s.panicked.swap(false, Ordering::Relaxed);
        self.busy.store(false, Ordering::Release);
        if panicked {
            panic!("a task of a spin-pool region panicked");
        }
        true
    }
}

/// Most tasks in one region (a larger `try_run` is refused: the caller uses rayon).
const MAX_TASKS: usize = 0xFFFF;

/// The claim word of task `i` of `region`, which has `n` tasks.
fn claim_word(region: u64, n: usize, i: usize) -> u64 {
    (region << 32) | ((n as u64) << 16) | i as u64
}

/// Claim and run tasks of `region` until none is left (or the region is over). `words`: the
/// region's task closure as `try_run` stored it, turned back into a reference only once a task
/// has been claimed (then they are the live closure's: module invariant).
fn claim_all(s: &Shared, region: u64, words: [usize; 2]) {
    let mut cur = s.next.load(Ordering::Acquire);
    loop {
        let (n, i) = ((cur >> 16) & 0xFFFF, cur & 0xFFFF);
        if cur >> 32 != region || i >= n {
            return;
        }
        match s
            .next
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: a task of `region` is claimed, so `try_run` is still waiting and
                // `words` are its live closure (module invariant).
                let task = unsafe { std::mem::transmute::<[usize; 2], Task<'_>>(words) };
                if catch_unwind(AssertUnwindSafe(|| task(i as usize))).is_err() {
                    s.panicked.store(true, Ordering::Relaxed);
                }
                s.done.fetch_add(1, Ordering::Release);
                cur = s.next.load(Ordering::Acquire);
            }
            Err(now) => cur = now,
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = s.region.load(Ordering::Acquire);
    loop {
        let mut w = Backoff::new();
        let region = loop {
            let r = s.region.load(Ordering::Acquire);
            if r != seen {
                break r;
            }
            if w.waited() > YIELD {
                let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.region.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                w = Backoff::new();
            } else {
                w.snooze();
            }
        };
        seen = region;
        let words = [
            s.job[0].load(Ordering::Relaxed),
            s.job[1].load(Ordering::Relaxed),
        ];
        // If the region has moved on since these were read they may be stale or torn; then no
        // claim succeeds and they are never used.
        claim_all(s, region, words);
    }
}

/// Spin, then yield: waiting without a system call while the wait is short.
struct Backoff {
    start: Option<Instant>,
    spins: u32,
    waited: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            start: None,
            spins: 0,
            waited: Duration::ZERO,
        }
    }

    /// Time since the wait began, as of the last clock reading.
    fn waited(&self) -> Duration {
        self.waited
    }

    fn snooze(&mut self) {
        self.spins = self.spins.wrapping_add(1);
        // Read the clock every 256 spins, and every 8 yields (a yield is a system call).
        let every = if self.waited < SPIN { 256 } else { 8 };
        if self.spins.is_multiple_of(every) {
            self.waited = self.start.get_or_insert_with(Instant::now).elapsed();
        }
        if self.waited < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SpinPool;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_per_region() {
        // More workers than cores, so that some see a region late (the case that once let a
        // worker claim a task of a finished region under the next region's count).
        let g = SpinPool::new(6);
        let hits: Vec<AtomicUsize> = (0..257).map(|_| AtomicUsize::new(0)).collect();
        let rounds = 20_000;
        for round in 0..rounds {
            let n = 1 + round % 257;
            assert!(g.try_run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }));
        }
        for (i, h) in hits.iter().enumerate() {
            let want = (0..rounds).filter(|r| 1 + r % 257 > i).count();
            assert_eq!(h.load(Ordering::Relaxed), want, "task {i}");
        }
    }

    #[test]
    fn a_region_of_too_many_tasks_is_refused() {
        let g = SpinPool::new(2);
        assert!(!g.try_run(super::MAX_TASKS + 1, &|_| {}));
        let c = AtomicUsize::new(0);
        assert!(g.try_run(super::MAX_TASKS, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(c.load(Ordering::Relaxed), super::MAX_TASKS);
    }

    #[test]
    fn a_nested_region_is_refused_and_the_gang_stays_usable() {
        let g = SpinPool::new(3);
        let refused = AtomicUsize::new(0);
        assert!(g.try_run(8, &|_| {
            if !g.try_run(2, &|_| {}) {
                refused.fetch_add(1, Ordering::Relaxed);
            }
        }));
        assert_eq!(refused.load(Ordering::Relaxed), 8);
        let c = AtomicUsize::new(0);
        assert!(g.try_run(5, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(c.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_once_all_tasks_end() {
        let g = SpinPool::new(3);
        let c = AtomicUsize::new(0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            g.try_run(16, &|i| {
                c.fetch_add(1, Ordering::Relaxed);
                assert!(i != 7, "task 7");
            })
        }));
        assert!(r.is_err());
        assert_eq!(c.load(Ordering::Relaxed), 16);
        assert!(g.try_run(4, &|_| {}));
    }

    #[test]
    fn workers_park_and_wake() {
        let g = SpinPool::new(3);
        assert!(g.try_run(4, &|_| {}));
        std::thread::sleep(super::YIELD * 3);
        let c = AtomicUsize::new(0);
        assert!(g.try_run(64, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(c.load(Ordering::Relaxed), 64);
    }
}
