//! `ExpertCache`: routed experts in a fixed set of slots — a pinned tier loaded at start and an
//! evictable tier per layer (LRU or decayed hotness) filled on demand by a `ReadPool`.
//!
//! Owns the slot memory (one `Slab`, allocated once, never reallocated), which expert is in
//! which slot, the usage counts of this run and the hit/miss/IO figures. Does not pick experts
//! (the router does) or split a too-large request into waves (the caller does).
//!
//! Protocol, one wave at a time: `begin(layer, experts)` records the selections and issues the
//! reads of every miss at once; `next_ready` hands out each expert as soon as its bytes are in
//! memory (hits first); `end` releases the wave's slots for eviction.
//! Speculation, at any time: `prefetch(layer, experts)` starts low-priority reads of predicted
//! experts into free evictable slots of `layer` (never a slot of the open wave, never one being
//! read). A later `begin` naming such an expert takes its slot over — waiting for the reads
//! already in flight, never reading it twice; `begin` takes back the queued reads of the
//! layer's prefetches it does not name; a failed prefetch read only empties its slot (the
//! request that needs the expert reads it again and reports its own error).
//! Invariant: a slot handed out by `next_ready` is neither evicted nor written until `end`, and
//! `end` takes `&mut self`, so the borrow checker proves no `ExpertBytes` outlives its wave; a
//! slot whose reads are in flight is never evicted or handed out (whoever started them).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use super::io::Completion;
use super::policy::{self, Hotness, Policy, SlotMeta, EMPTY};
use super::store::ExpertPlan;
use super::{
    ExpertError, ExpertStore, IoMode, ReadJob, ReadPool, Slab, TraceWriter, UsageStats, ALIGN,
};

/// How the cache is built.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Evictable slots per MoE layer (clamped to the layer's unpinned experts). See
    /// `ExpertStore::slots_per_layer_for_budget` to derive it from a byte budget.
    pub slots_per_layer: usize,
    /// (layer, expert) pairs held for the whole run, loaded by `ExpertCache::new`.
    pub pinned: Vec<(usize, usize)>,
    pub policy: Policy,
    pub io: IoMode,
    pub io_threads: usize,
    /// Largest single read, bytes (a multiple of 4096); bigger windows are split so several
    /// readers share one expert.
    pub read_chunk: u64,
    /// Try to mlock the slot memory (a note says when the system refuses).
    pub mlock: bool,
    /// Write every `begin` as a route-trace line to this file (`sluice cache-sim` replays it).
    pub trace: Option<PathBuf>,
    /// The forward pass predicts the next layer's experts and calls `prefetch` (the cache itself
    /// only reports this flag; `prefetch` works either way).
    pub prefetch: bool,
}

impl CacheConfig {
    /// `slots_per_layer` evictable slots, nothing pinned, LRU, O_DIRECT, 4 readers, 1 MiB reads.
    pub fn new(slots_per_layer: usize) -> CacheConfig {
        CacheConfig {
            slots_per_layer,
            pinned: Vec::new(),
            policy: Policy::Lru,
            io: IoMode::Direct,
            io_threads: 4,
            read_chunk: 1 << 20,
            mlock: true,
            trace: None,
            prefetch: false,
        }
    }
}

/// Figures since the cache was built (the pinned tier's initial load is counted apart).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheStats {
    /// Experts requested that were in the pinned tier.
    pub hits_pin: u64,
    /// Experts requested that were in the evictable tier.
    pub hits_lru: u64,
    /// Experts requested that were not in memory before their layer asked for them (had to be
    /// read; includes those whose read `prefetch` had started: see `prefetch_used`).
    pub misses: u64,
    /// Bytes read for misses (whole aligned windows in direct mode).
    pub bytes_read: u64,
    /// Wall time with at least one miss read outstanding.
    pub read_secs: f64,
    /// Reads issued (each a window of at most `read_chunk` bytes) and the seconds summed over
    /// them: `read_sum_secs / read_secs` is the mean number of reads in flight while reading.
    pub reads: u64,
    pub read_sum_secs: f64,
    /// Time the caller spent blocked in `next_ready`.
    pub wait_secs: f64,
    /// `tick_token` calls.
    pub tokens: u64,
    /// `begin` calls (one per MoE layer of a forward): lines of the route log.
    pub waves: u64,
    /// Bytes and wall time of loading the pinned tier in `new`.
    pub pin_load_bytes: u64,
    pub pin_load_secs: f64,
    /// Experts named by `prefetch` calls (the predictions, cached ones included).
    pub predicted: u64,
    /// Predicted experts that the next request for their layer named.
    pub predicted_used: u64,
    /// Experts whose reads `prefetch` started.
    pub prefetched: u64,
    /// Misses whose read `prefetch` had started (served early, or at least started early).
    pub prefetch_used: u64,
}

impl CacheStats {
    /// The figures accumulated since `before`, an earlier snapshot of the same cache (the
    /// pinned tier's load, done once in `new`, is kept as is).
    pub fn since(&self, before: &CacheStats) -> CacheStats {
        CacheStats {
            hits_pin: self.hits_pin.saturating_sub(before.hits_pin),
            hits_lru: self.hits_lru.saturating_sub(before.hits_lru),
            misses: self.misses.saturating_sub(before.misses),
            bytes_read: self.bytes_read.saturating_sub(before.bytes_read),
            read_secs: (self.read_secs - before.read_secs).max(0.0),
            reads: self.reads.saturating_sub(before.reads),
            read_sum_secs: (self.read_sum_secs - before.read_sum_secs).max(0.0),
            wait_secs: (self.wait_secs - before.wait_secs).max(0.0),
            tokens: self.tokens.saturating_sub(before.tokens),
            predicted: self.predicted.saturating_sub(before.predicted),
            predicted_used: self.predicted_used.saturating_sub(before.predicted_used),
            prefetched: self.prefetched.saturating_sub(before.prefetched),
            prefetch_used: self.prefetch_used.saturating_sub(before.prefetch_used),
            waves: self.waves.saturating_sub(before.waves),
            ..*self
        }
    }

    /// Share of predicted experts that were then requested (0 without predictions).
    pub fn prefetch_precision(&self) -> f64 {
        self.predicted_used as f64 / self.predicted.max(1) as f64
    }

    /// Share of misses whose read prefetch had started (0 without misses).
    pub fn prefetch_recall(&self) -> f64 {
        self.prefetch_used as f64 / self.misses.max(1) as f64
    }

    pub fn requests(&self) -> u64 {
        self.hits_pin + self.hits_lru + self.misses
    }

    /// Fraction of requested experts already in memory (0 when nothing was requested).
    pub fn hit_rate(&self) -> f64 {
        let r = self.requests();
        if r == 0 {
            0.0
        } else {
            (self.hits_pin + self.hits_lru) as f64 / r as f64
        }
    }
}

/// One expert's bytes, exactly the bytes of its three ranges in the files.
#[derive(Clone, Copy, Debug)]
pub struct ExpertBytes<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Where {
    Absent,
    Pinned(u32),
    /// Global slot index (pinned slots first, then each layer's evictable slots).
    Slot(u32),
}

struct Wave {
    layer: usize,
    /// Slots of this wave whose reads have not all completed.
    loading: usize,
    /// A read error met while `begin` waited for a slot, for `next_ready` to report.
    err: Option<ExpertError>,
}

/// Who waits for the reads of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// The open wave (counted in its `loading`).
    Wave,
    /// Nobody yet: a prefetch. The slot stays busy until its reads are in.
    Prefetch,
}

struct State {
    place: Vec<Vec<Where>>,
    /// Evictable slots of each layer; global index = `layer_base[layer] + i`.
    slots: Vec<Vec<SlotMeta>>,
    /// Reads outstanding per global slot, and whether one of them failed.
    pending: Vec<u32>,
    failed: Vec<bool>,
    /// Per global slot: who waits for its reads.
    owner: Vec<Owner>,
    /// Per global slot: filled by `prefetch` and not requested since.
    fresh: Vec<bool>,
    /// Per global slot: its bytes were checked against `ExpertCache::verify` since they were
    /// read (reset whenever the slot is refilled).
    checked: Vec<bool>,
    /// Layer of each global slot (`u32::MAX` for pinned slots).
    slot_layer: Vec<u32>,
    /// `[layer][expert]`: clock of the last `prefetch` call that predicted it (0: none since
    /// it was last requested). It counts for a request only while it is `pred_clock[layer]`.
    predicted: Vec<Vec<u64>>,
    /// Per layer: clock of its last `prefetch` call (its prediction in force).
    pred_clock: Vec<u64>,
    /// Slots a `prefetch` call holds busy while it chooses victims.
    held: Vec<usize>,
    hot: Hotness,
    usage: UsageStats,
    clock: u64,
    /// Marks for duplicate detection in `begin` (value = clock of the request that saw it).
    seen: Vec<u64>,
    wave: Option<Wave>,
    /// Experts of the open wave in memory and not yet handed out: (expert, global slot).
    ready: VecDeque<(usize, usize)>,
    jobs: Vec<ReadJob>,
    stats: CacheStats,
    /// The pool's busy seconds spent loading the pinned tier (excluded from `read_secs`), and
    /// its reads (excluded from `reads`, `read_sum_secs`).
    pin_busy_secs: f64,
    pin_reads: (u64, f64),
    trace: Option<TraceWriter>,
    /// The run's requests in memory, for the bound `route_log` replays: per `begin`, its
    /// token, layer, count and experts; capacity `ROUTE_LOG_WORDS`, reserved once (recording
    /// stops, and `log_full` is set, rather than grow it).
    log: Vec<u32>,
    log_full: bool,
    experts_per_layer: Vec<usize>,
}

/// Words of the in-memory route log (16 MiB of address space, touched only as it fills: about
/// 3,000 tokens of a 48-layer top-8 model).
const ROUTE_LOG_WORDS: usize = 1 << 22;

pub struct ExpertCache {
    // Field order is drop order: the pool joins its readers before the slab is unmapped.
    pool: ReadPool,
    slab: Slab,
    store: ExpertStore,
    slot_bytes: u64,
    layer_base: Vec<usize>,
    n_pinned: usize,
    pinned_per_layer: Vec<usize>,
    policy: Policy,
    read_chunk: u64,
    prefetch: bool,
    notes: Vec<String>,
    /// `--verify-experts`: every expert read is checked against these hashes.
    verify: Option<super::ExpertHashes>,
    state: Mutex<State>,
}

impl ExpertCache {
    /// Allocates every slot, opens the files, loads the pinned experts (reads errors surface
    /// here) and returns a cache ready for `begin`.
    pub fn new(store: ExpertStore, cfg: CacheConfig) -> Result<ExpertCache, ExpertError> {
        if cfg.read_chunk == 0 || !cfg.read_chunk.is_multiple_of(ALIGN) {
            return Err(ExpertError::Config(format!(
                "read chunk {} is not a positive multiple of {ALIGN}",
                cfg.read_chunk
            )));
        }
        if let Policy::Hotness { halve_every: 0 } = cfg.policy {
            return Err(ExpertError::Config(
                "hotness policy needs halve_every >= 1 token".into(),
            ));
        }
        store.check_files()?;
        let n_layers = store.n_layers();
        let experts_per_layer: Vec<usize> = (0..n_layers).map(|l| store.n_experts(l)).collect();

        let mut place: Vec<Vec<Where>> = experts_per_layer
            .iter()
            .map(|&n| vec![Where::Absent; n])
            .collect();
        let mut pinned_per_layer = vec![0usize; n_layers];
        for (i, &(l, e)) in cfg.pinned.iter().enumerate() {
            let slot = place.get_mut(l).and_then(|p| p.get_mut(e)).ok_or_else(|| {
                ExpertError::Config(format!("pinned expert {e} of layer {l} does not exist"))
            })?;
            if *slot != Where::Absent {
                return Err(ExpertError::Config(format!(
                    "expert {e} of layer {l} is pinned twice"
                )));
            }
            *slot = Where::Pinned(i as u32);
            pinned_per_layer[l] += 1;
        }
        let n_pinned = cfg.pinned.len();
        let caps: Vec<usize> = (0..n_layers)
            .map(|l| {
                cfg.slots_per_layer
                    .min(experts_per_layer[l] - pinned_per_layer[l])
            })
            .collect();
        let mut layer_base = Vec::with_capacity(n_layers);
        let mut n_slots = n_pinned;
        for &c in &caps {
            layer_base.push(n_slots);
            n_slots += c;
        }
        let slot_bytes = store.slot_bytes();
        let total = (n_slots as u64).checked_mul(slot_bytes).ok_or_else(|| {
            ExpertError::Config(format!("{n_slots} slots of {slot_bytes} bytes overflow"))
        })?;
        let (slab, lock_note) = Slab::new(total, cfg.mlock)?;

        let max_cap = caps.iter().copied().max().unwrap_or(0);
        let max_jobs = max_jobs_per_expert(&store, cfg.read_chunk);
        let pool = ReadPool::new(
            store.paths(),
            cfg.io,
            cfg.io_threads,
            (2 * max_cap * max_jobs).max(16),
        )?;
        let notes: Vec<String> = pool
            .note()
            .map(str::to_string)
            .into_iter()
            .chain(lock_note)
            .collect();
        let trace = match &cfg.trace {
            Some(p) => Some(TraceWriter::create(p, &experts_per_layer)?),
            None => None,
        };
        let halve = match cfg.policy {
            Policy::Hotness { halve_every } => halve_every,
            Policy::Lru => 0,
        };
        let state = State {
            place,
            slots: caps.iter().map(|&c| vec![SlotMeta::default(); c]).collect(),
            pending: vec![0; n_slots],
            failed: vec![false; n_slots],
            owner: vec![Owner::Wave; n_slots],
            fresh: vec![false; n_slots],
            checked: vec![false; n_slots],
            slot_layer: (0..n_slots)
                .map(|g| {
                    if g < n_pinned {
                        u32::MAX
                    } else {
                        layer_base.partition_point(|&b| b <= g).saturating_sub(1) as u32
                    }
                })
                .collect(),
            predicted: experts_per_layer.iter().map(|&n| vec![0; n]).collect(),
            pred_clock: vec![0; n_layers],
            held: Vec::with_capacity(max_cap),
            hot: Hotness::new(&experts_per_layer, halve),
            usage: UsageStats::new(&experts_per_layer),
            clock: 0,
            seen: vec![0; experts_per_layer.iter().copied().max().unwrap_or(0)],
            wave: None,
            ready: VecDeque::with_capacity(experts_per_layer.iter().copied().max().unwrap_or(0)),
            jobs: Vec::with_capacity(max_cap * max_jobs),
            stats: CacheStats::default(),
            pin_busy_secs: 0.0,
            pin_reads: (0, 0.0),
            trace,
            log: Vec::with_capacity(ROUTE_LOG_WORDS),
            log_full: false,
            experts_per_layer: experts_per_layer.clone(),
        };
        let mut cache = ExpertCache {
            pool,
            slab,
            store,
            slot_bytes,
            layer_base,
            n_pinned,
            pinned_per_layer,
            policy: cfg.policy,
            read_chunk: cfg.read_chunk,
            prefetch: cfg.prefetch,
            notes,
            verify: None,
            state: Mutex::new(state),
        };
        cache.load_pinned(&cfg.pinned)?;
        Ok(cache)
    }

    fn load_pinned(&mut self, pinned: &[(usize, usize)]) -> Result<(), ExpertError> {
        let t0 = Instant::now();
        let b0 = self.pool.bytes_read();
        let mut jobs = Vec::new();
        // In batches, so the queues stay near their preallocated size.
        for start in (0..pinned.len()).step_by(256) {
            jobs.clear();
            for (i, &(l, e)) in pinned.iter().enumerate().skip(start).take(256) {
                if let Some(plan) = self.store.plan(l, e) {
                    push_jobs(
                        &mut jobs,
                        plan,
                        self.slot_ptr(i),
                        i,
                        self.pool.mode(),
                        self.read_chunk,
                    );
                }
            }
            // SAFETY: each job writes inside its own pinned slot (distinct per pair, in the slab
            // that outlives the pool's readers); nothing reads those slots until every
            // completion is taken just below.
            unsafe { self.pool.submit(&jobs) };
            let mut first_err = None;
            while let Some(c) = self.pool.wait() {
                if let (Err(e), None) = (c.result, &first_err) {
                    first_err = Some(e);
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        st.stats.pin_load_bytes = self.pool.bytes_read() - b0;
        st.stats.pin_load_secs = t0.elapsed().as_secs_f64();
        st.pin_busy_secs = self.pool.busy_secs();
        st.pin_reads = self.pool.read_totals();
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation completes before any call that could panic; poisoning carries no news.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot_ptr(&self, global: usize) -> *mut u8 {
        // SAFETY: `global < n_slots`, so the offset lies inside the slab (n_slots * slot_bytes).
        unsafe { self.slab.as_ptr().add(global * self.slot_bytes as usize) }
    }

    fn bytes_of(&self, layer: usize, expert: usize, global: usize) -> ExpertBytes<'_> {
        let empty = ExpertBytes {
            gate: &[],
            up: &[],
            down: &[],
        };
        let Some(plan) = self.store.plan(layer, expert) else {
            return empty;
        };
        let base = self.slot_ptr(global);
        let part = |i: usize| {
            let (off, len) = plan.parts()[i];
            if len == 0 {
                return &[][..];
            }
            // SAFETY: the plan keeps every part inside `slot_len <= slot_bytes` of its slot; the
            // slot is busy (pinned, or handed out in the open wave) so no reader writes it and no
            // eviction reuses it until `end(&mut self)`, which cannot run while this borrow lives.
            unsafe { std::slice::from_raw_parts(base.add(off as usize), len as usize) }
        };
        ExpertBytes {
            gate: part(0),
            up: part(1),
            down: part(2),
        }
    }

    /// Starts a wave for `layer`: records the selections, hands out hits first and issues the
    /// reads of every miss at once. `experts` must be distinct and hold at most
    /// `slots(layer)` experts outside the pinned tier. An expert whose prefetch read is still
    /// in flight joins the wave as a miss already being read.
    pub fn begin(&self, layer: usize, experts: &[usize]) -> Result<(), ExpertError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        if let Some(w) = &st.wave {
            return Err(ExpertError::Request(format!(
                "begin(layer {layer}) while the wave of layer {} is open: call end() first",
                w.layer
            )));
        }
        let Some(place) = st.place.get(layer) else {
            return Err(ExpertError::Request(format!(
                "layer {layer} out of range ({} layers)",
                st.place.len()
            )));
        };
        // A fresh clock value per call (failed ones too): it also marks `seen` for this call.
        st.clock += 1;
        let clock = st.clock;
        let mut unpinned = 0;
        for &e in experts {
            let Some(w) = place.get(e) else {
                return Err(ExpertError::Request(format!(
                    "expert {e} out of range: layer {layer} has {}",
                    place.len()
                )));
            };
            if st.seen[e] == clock {
                return Err(ExpertError::Request(format!(
                    "expert {e} named twice in one request for layer {layer}"
                )));
            }
            st.seen[e] = clock;
            if !matches!(w, Where::Pinned(_)) {
                unpinned += 1;
            }
        }
        let cap = st.slots[layer].len();
        if unpinned > cap {
            return Err(ExpertError::Request(format!(
                "layer {layer}: {unpinned} unpinned experts requested at once, {cap} slots: split the request into waves"
            )));
        }
        if let Some(t) = &mut st.trace {
            t.record(st.stats.tokens, layer, experts)?;
        }
        st.stats.waves += 1;
        if !st.log_full && st.log.len() + 3 + experts.len() <= st.log.capacity() {
            let token = st.stats.tokens as u32;
            st.log.extend([token, layer as u32, experts.len() as u32]);
            st.log.extend(experts.iter().map(|&e| e as u32));
        } else {
            st.log_full = true;
        }
        // From here on the wave is open: completions of its slots are booked against it.
        st.wave = Some(Wave {
            layer,
            loading: 0,
            err: None,
        });
        st.ready.clear();
        // Pass 1: hits and prefetched experts (marked busy so pass 2 cannot evict them).
        for &e in experts {
            st.usage.record(layer, e);
            if matches!(self.policy, Policy::Hotness { .. }) {
                st.hot.record(layer, e);
            }
            if st.predicted[layer][e] != 0 && st.predicted[layer][e] == st.pred_clock[layer] {
                st.stats.predicted_used += 1;
            }
            st.predicted[layer][e] = 0;
            match st.place[layer][e] {
                Where::Pinned(i) => {
                    st.stats.hits_pin += 1;
                    st.ready.push_back((e, i as usize));
                }
                Where::Slot(g) => {
                    let g = g as usize;
                    if st.pending[g] > 0 && st.failed[g] {
                        // A prefetch that failed (or was cut short) and is still draining: let
                        // it empty the slot, then pass 2 reads the expert as a plain miss.
                        self.abandon(st, layer, g);
                        while st.pending[g] > 0 {
                            self.book_next(st)?;
                        }
                        continue;
                    }
                    if st.fresh[g] {
                        st.fresh[g] = false;
                        st.stats.misses += 1;
                        st.stats.prefetch_used += 1;
                    } else {
                        st.stats.hits_lru += 1;
                    }
                    let m = &mut st.slots[layer][g - self.layer_base[layer]];
                    m.busy = true;
                    m.last_use = clock;
                    if st.pending[g] > 0 {
                        // A prefetch still reading: this wave waits for it, ahead of other
                        // speculation.
                        st.owner[g] = Owner::Wave;
                        if let Some(w) = st.wave.as_mut() {
                            w.loading += 1;
                        }
                        self.pool.promote(g as u64);
                    } else {
                        st.ready.push_back((e, g));
                    }
                }
                Where::Absent => {}
            }
        }
        // Prefetches of this layer that this request does not name were mispredicted: their
        // reads not started yet are taken back (a later wave of the same layer may read them
        // again; results do not depend on it).
        let base = self.layer_base[layer];
        for g in base..base + cap {
            if st.pending[g] > 0 && st.owner[g] == Owner::Prefetch {
                self.abandon(st, layer, g);
            }
        }
        // Pass 2: misses take a victim slot each and queue their reads.
        st.jobs.clear();
        for &e in experts {
            if st.place[layer][e] != Where::Absent {
                continue;
            }
            st.stats.misses += 1;
            let i = self.victim_or_wait(st, layer)?;
            let g = self.layer_base[layer] + i;
            self.evict(st, layer, i);
            st.slots[layer][i] = SlotMeta {
                expert: e as u32,
                last_use: clock,
                busy: true,
            };
            st.place[layer][e] = Where::Slot(g as u32);
            st.owner[g] = Owner::Wave;
            let n = self.push_expert_jobs(st, layer, e, g);
            if n == 0 {
                st.ready.push_back((e, g));
            } else if let Some(w) = st.wave.as_mut() {
                w.loading += 1;
            }
        }
        // SAFETY: every job writes inside the slot of a miss just marked busy in this wave;
        // those slots are not handed out before all their completions are taken, and the pool
        // is joined before the slab is unmapped.
        unsafe { self.pool.submit(&st.jobs) };
        st.jobs.clear();
        Ok(())
    }

    /// A victim slot of `layer` for a miss of the open wave. When every slot that is not in
    /// the wave is still being prefetched, submits the wave's queued reads, moves those
    /// prefetches ahead and books completions until one slot frees (a wave holds at most the
    /// layer's slots, so some slot outside it is being read and will complete).
    fn victim_or_wait(&self, st: &mut State, layer: usize) -> Result<usize, ExpertError> {
        loop {
            if let Some(i) = policy::victim(self.policy, &st.slots[layer], &st.hot, layer) {
                return Ok(i);
            }
            // SAFETY: as in `begin`: these jobs write only into slots of this wave's misses.
            unsafe { self.pool.submit(&st.jobs) };
            st.jobs.clear();
            let base = self.layer_base[layer];
            for i in 0..st.slots[layer].len() {
                if st.pending[base + i] > 0 && st.owner[base + i] == Owner::Prefetch {
                    self.pool.promote((base + i) as u64);
                }
            }
            self.book_next(st)?;
        }
    }

    /// Inside `begin`: waits for one completion and books it (an expert of the open wave that
    /// lands is queued for `next_ready`, and so is a read error of the wave).
    fn book_next(&self, st: &mut State) -> Result<(), ExpertError> {
        let t0 = Instant::now();
        let c = self.pool.wait();
        st.stats.wait_secs += t0.elapsed().as_secs_f64();
        let Some(c) = c else {
            return Err(ExpertError::Request(
                "a slot waits for reads the pool does not have".into(),
            ));
        };
        match book(st, &self.layer_base, c) {
            Ok(Some(done)) => st.ready.push_back(done),
            Ok(None) => {}
            Err(err) => {
                if let Some(w) = st.wave.as_mut() {
                    w.err.get_or_insert(err);
                }
            }
        }
        Ok(())
    }

    /// Gives up the prefetch in global slot `g` of `layer` (its reads pending): its queued
    /// reads are taken back; the slot empties now if none is being read, else when the last
    /// one lands (marked failed, so it is never handed out or kept).
    fn abandon(&self, st: &mut State, layer: usize, g: usize) {
        let n = self.pool.cancel(g as u64) as u32;
        st.pending[g] = st.pending[g].saturating_sub(n);
        if st.pending[g] == 0 {
            let i = g - self.layer_base[layer];
            let e = st.slots[layer][i].expert;
            if e != EMPTY {
                st.place[layer][e as usize] = Where::Absent;
            }
            st.slots[layer][i] = SlotMeta::default();
            st.fresh[g] = false;
            st.failed[g] = false;
        } else if n > 0 {
            st.failed[g] = true;
        }
    }

    /// Empties evictable slot `i` of `layer` (not busy) for reuse.
    fn evict(&self, st: &mut State, layer: usize, i: usize) {
        let old = st.slots[layer][i].expert;
        if old != EMPTY {
            st.place[layer][old as usize] = Where::Absent;
        }
        let g = self.layer_base[layer] + i;
        st.fresh[g] = false;
        st.failed[g] = false;
    }

    /// Queues (in `st.jobs`) the reads of expert `e` of `layer` into global slot `g` and sets
    /// its pending count; returns that count.
    fn push_expert_jobs(&self, st: &mut State, layer: usize, e: usize, g: usize) -> usize {
        let before = st.jobs.len();
        if let Some(plan) = self.store.plan(layer, e) {
            push_jobs(
                &mut st.jobs,
                plan,
                self.slot_ptr(g),
                g,
                self.pool.mode(),
                self.read_chunk,
            );
        }
        let n = st.jobs.len() - before;
        st.pending[g] = n as u32;
        st.failed[g] = false;
        st.checked[g] = false;
        n
    }

    /// Check every expert read from now on against `hashes` (`--verify-experts`).
    pub fn set_verify(&mut self, hashes: super::ExpertHashes) {
        self.verify = Some(hashes);
    }

    /// Expert `e` of `layer` in global slot `g`, checked against the recorded hash once per
    /// read when verifying. A mismatch drops the expert from the cache and is an error.
    fn hand_out(
        &self,
        st: &mut State,
        layer: usize,
        e: usize,
        g: usize,
    ) -> Result<(usize, ExpertBytes<'_>), ExpertError> {
        let b = self.bytes_of(layer, e, g);
        if let Some(v) = &self.verify {
            if !st.checked[g] {
                if let Err(err) = v.check(layer, e, [b.gate, b.up, b.down]) {
                    if let Some(p) = st.place.get_mut(layer).and_then(|p| p.get_mut(e)) {
                        if !matches!(p, Where::Pinned(_)) {
                            *p = Where::Absent;
                        }
                    }
                    return Err(err);
                }
                st.checked[g] = true;
            }
        }
        Ok((e, b))
    }

    /// Starts reading the predicted `experts` of `layer` (a later `begin` of that layer is
    /// expected to name most of them): each one neither cached nor being read takes a free
    /// evictable slot of the layer — never a slot of the open wave, one being read, or one
    /// holding another predicted expert — and its reads queue behind every demand read. Stops
    /// early when no slot is free. Selection counts and the trace are untouched. Works with or
    /// without an open wave (of any layer). Returns how many experts it started reading.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) -> Result<usize, ExpertError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(place) = st.place.get(layer) else {
            return Err(ExpertError::Request(format!(
                "prefetch: layer {layer} out of range ({} layers)",
                st.place.len()
            )));
        };
        if let Some(&e) = experts.iter().find(|&&e| e >= place.len()) {
            return Err(ExpertError::Request(format!(
                "prefetch: expert {e} out of range: layer {layer} has {}",
                place.len()
            )));
        }
        st.clock += 1;
        let clock = st.clock;
        st.pred_clock[layer] = clock;
        // Pass 1: note the prediction; hold the cached predicted experts against eviction.
        st.held.clear();
        let base = self.layer_base.get(layer).copied().unwrap_or(0);
        for &e in experts {
            if st.predicted[layer][e] == clock {
                continue;
            }
            st.predicted[layer][e] = clock;
            st.stats.predicted += 1;
            if let Where::Slot(g) = st.place[layer][e] {
                let m = &mut st.slots[layer][g as usize - base];
                if !m.busy {
                    m.busy = true;
                    st.held.push(g as usize);
                }
            }
        }
        // Pass 2: the absent ones take free slots.
        st.jobs.clear();
        let mut started = 0;
        for &e in experts {
            if st.place[layer][e] != Where::Absent {
                continue;
            }
            let Some(i) = policy::victim(self.policy, &st.slots[layer], &st.hot, layer) else {
                break;
            };
            let g = base + i;
            self.evict(st, layer, i);
            st.place[layer][e] = Where::Slot(g as u32);
            st.owner[g] = Owner::Prefetch;
            st.fresh[g] = true;
            let n = self.push_expert_jobs(st, layer, e, g);
            st.slots[layer][i] = SlotMeta {
                expert: e as u32,
                last_use: clock,
                busy: n > 0,
            };
            st.stats.prefetched += 1;
            started += 1;
        }
        // SAFETY: every job writes inside a slot just taken for a prefetch and marked busy: no
        // one evicts it or hands it out before all its completions are booked, and the pool is
        // joined before the slab is unmapped.
        unsafe { self.pool.submit_low(&st.jobs) };
        st.jobs.clear();
        for k in 0..st.held.len() {
            let g = st.held[k];
            st.slots[layer][g - base].busy = false;
        }
        Ok(started)
    }

    /// The next expert of the open wave whose bytes are in memory: hits first, then misses in
    /// the order their reads complete. `Ok(None)` when every expert was handed out. A failed
    /// read is returned as its error (its expert is dropped from the cache, never handed out).
    pub fn next_ready(&self) -> Result<Option<(usize, ExpertBytes<'_>)>, ExpertError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(w) = st.wave.as_mut() else {
            return Err(ExpertError::Request("next_ready() without begin()".into()));
        };
        let layer = w.layer;
        if let Some(err) = w.err.take() {
            return Err(err);
        }
        if let Some((e, g)) = st.ready.pop_front() {
            return self.hand_out(st, layer, e, g).map(Some);
        }
        while st.wave.as_ref().is_some_and(|w| w.loading > 0) {
            let t0 = Instant::now();
            let c = self.pool.wait();
            st.stats.wait_secs += t0.elapsed().as_secs_f64();
            let Some(c) = c else {
                return Err(ExpertError::Request(
                    "reads of the open wave vanished from the pool".into(),
                ));
            };
            // Completions of prefetches (of any layer) are booked on the way.
            match book(st, &self.layer_base, c) {
                Ok(Some((e, g))) => return self.hand_out(st, layer, e, g).map(Some),
                Ok(None) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(None)
    }

    /// Closes the wave: waits for any reads still in flight (after an error, or when the caller
    /// stopped early), then makes the wave's slots evictable again. Experts read but not handed
    /// out stay cached; prefetches still reading stay busy. Without an open wave it does nothing.
    pub fn end(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let Some(layer) = st.wave.as_ref().map(|w| w.layer) else {
            return;
        };
        while st.wave.as_ref().is_some_and(|w| w.loading > 0) {
            let Some(c) = self.pool.wait() else { break };
            // Errors were (or would have been) reported by next_ready; the slot is dropped.
            let _ = book(st, &self.layer_base, c);
        }
        let base = self.layer_base[layer];
        for (i, m) in st.slots[layer].iter_mut().enumerate() {
            m.busy = st.pending[base + i] > 0;
        }
        st.ready.clear();
        st.wave = None;
    }

    /// One decoded token passed (the hotness decay clock and the trace's token index).
    pub fn tick_token(&self) {
        let mut st = self.lock();
        st.stats.tokens += 1;
        st.hot.tick();
    }

    pub fn stats(&self) -> CacheStats {
        let st = self.lock();
        let mut s = st.stats;
        s.bytes_read = self.pool.bytes_read() - s.pin_load_bytes;
        s.read_secs = (self.pool.busy_secs() - st.pin_busy_secs).max(0.0);
        let (reads, sum) = self.pool.read_totals();
        s.reads = reads.saturating_sub(st.pin_reads.0);
        s.read_sum_secs = (sum - st.pin_reads.1).max(0.0);
        s
    }

    /// Selection counts of this run (one per expert per `begin`).
    pub fn usage(&self) -> UsageStats {
        self.lock().usage.clone()
    }

    /// This run's requests so far as a route trace (what `--route-trace` would have written),
    /// for replaying against other policies; None when the in-memory log filled up.
    pub fn route_log(&self) -> Option<super::Trace> {
        let st = self.lock();
        if st.log_full {
            return None;
        }
        let (mut lines, mut i) = (Vec::new(), 0);
        while i + 3 <= st.log.len() {
            let n = st.log[i + 2] as usize;
            lines.push(super::trace::TraceLine {
                token: st.log[i] as u64,
                layer: st.log[i + 1] as usize,
                experts: st.log[i + 3..i + 3 + n]
                    .iter()
                    .map(|&e| e as usize)
                    .collect(),
            });
            i += 3 + n;
        }
        Some(super::Trace {
            experts_per_layer: st.experts_per_layer.clone(),
            lines,
        })
    }

    /// (evictable slots per layer, pinned (layer, expert) pairs): the shape a replay of
    /// `route_log` needs to be this cache.
    pub fn shape(&self) -> (usize, Vec<(usize, usize)>) {
        let st = self.lock();
        let slots = st.slots.iter().map(Vec::len).max().unwrap_or(0);
        let pinned = st
            .place
            .iter()
            .enumerate()
            .flat_map(|(l, p)| {
                p.iter()
                    .enumerate()
                    .filter(|(_, w)| matches!(w, Where::Pinned(_)))
                    .map(move |(e, _)| (l, e))
            })
            .collect();
        (slots, pinned)
    }

    /// Flushes the route trace, if one is being written.
    pub fn flush_trace(&self) -> Result<(), ExpertError> {
        match &mut self.lock().trace {
            Some(t) => t.flush(),
            None => Ok(()),
        }
    }

    /// Whether the expert's bytes are in memory now (pinned or evictable tier).
    pub fn is_cached(&self, layer: usize, expert: usize) -> bool {
        let st = self.lock();
        match st.place.get(layer).and_then(|p| p.get(expert)) {
            Some(Where::Pinned(_)) => true,
            Some(Where::Slot(g)) => st.pending[*g as usize] == 0,
            _ => false,
        }
    }

    pub fn is_pinned(&self, layer: usize, expert: usize) -> bool {
        matches!(
            self.lock().place.get(layer).and_then(|p| p.get(expert)),
            Some(Where::Pinned(_))
        )
    }

    /// Evictable slots of `layer` (the most unpinned experts one wave may name).
    pub fn slots(&self, layer: usize) -> usize {
        self.lock().slots.get(layer).map_or(0, Vec::len)
    }

    /// Pinned experts of `layer`.
    pub fn pinned_in(&self, layer: usize) -> usize {
        self.pinned_per_layer.get(layer).copied().unwrap_or(0)
    }

    pub fn n_pinned(&self) -> usize {
        self.n_pinned
    }

    /// One-line notes for the user (O_DIRECT fallback, mlock refused), each said once.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Reader threads of the pool.
    pub fn readers(&self) -> usize {
        self.pool.threads()
    }

    /// The IO mode in effect (buffered after an O_DIRECT fallback).
    pub fn io_mode(&self) -> IoMode {
        self.pool.mode()
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Bytes of slot memory (pinned + evictable).
    pub fn slab_bytes(&self) -> u64 {
        self.slab.len() as u64
    }

    pub fn mlocked(&self) -> bool {
        self.slab.locked()
    }

    /// Counts selections served elsewhere (the GPU's VRAM pool) in the usage statistics, so
    /// `--autopin` sees every selection, not only those that reached this cache.
    pub fn record_usage(&self, layer: usize, experts: &[usize]) {
        let mut st = self.lock();
        for &e in experts {
            st.usage.record(layer, e);
        }
    }

    /// The slab's base and length: every slot's bytes lie inside (the GPU path registers it
    /// once with the driver so copies read it directly).
    pub fn slab_region(&self) -> (*const u8, usize) {
        (self.slab.as_ptr().cast_const(), self.slab.len())
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Whether the forward pass should predict and `prefetch` (`CacheConfig::prefetch`).
    pub fn prefetching(&self) -> bool {
        self.prefetch
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        // Let reads in flight land before the pool and slab go (the pool's own drop joins too;
        // this keeps the order explicit).
        while self.pool.wait().is_some() {}
        if let Some(t) = &mut self
            .state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .trace
        {
            let _ = t.flush();
        }
    }
}

/// Books one completion (of the open wave or of a prefetch, any layer; `layer_base`: each
/// layer's first global evictable slot). Returns the (expert, global slot) it finished if it
/// was the last read of a slot of the open wave whose reads all succeeded; the read's error if
/// it failed for the open wave. A slot with a failed read is emptied when its last read is in,
/// so it is never handed out or kept; a prefetch's error is dropped (the request that needs
/// the expert reads it again; `begin` never takes over a failed prefetch).
fn book(
    st: &mut State,
    layer_base: &[usize],
    c: Completion,
) -> Result<Option<(usize, usize)>, ExpertError> {
    let g = c.tag as usize;
    let Some(&layer) = st.slot_layer.get(g) else {
        return Err(ExpertError::Request(format!(
            "completion for unknown slot {g}"
        )));
    };
    let layer = layer as usize;
    if layer >= layer_base.len() {
        // A pinned slot: only `new` reads those, and it takes its own completions.
        return c.result.map(|_| None);
    }
    let mut err = c.result.err();
    if err.is_some() {
        st.failed[g] = true;
    }
    if st.owner[g] == Owner::Prefetch {
        err = None;
    }
    st.pending[g] = st.pending[g].saturating_sub(1);
    if st.pending[g] > 0 {
        return err.map_or(Ok(None), Err);
    }
    let i = g - layer_base[layer];
    let e = st.slots[layer][i].expert as usize;
    let for_wave = st.owner[g] == Owner::Wave;
    if for_wave {
        if let Some(w) = st.wave.as_mut() {
            w.loading = w.loading.saturating_sub(1);
        }
    }
    if st.failed[g] {
        st.place[layer][e] = Where::Absent;
        st.slots[layer][i] = SlotMeta::default();
        st.failed[g] = false;
        st.fresh[g] = false;
        return err.map_or(Ok(None), Err);
    }
    if for_wave {
        Ok(Some((e, g)))
    } else {
        // A prefetch landed: the slot becomes an ordinary cached expert.
        st.slots[layer][i].busy = false;
        Ok(None)
    }
}

/// Jobs for one expert into the slot at `slot` (global index `tag`), split at `chunk` bytes.
fn push_jobs(
    jobs: &mut Vec<ReadJob>,
    plan: &ExpertPlan,
    slot: *mut u8,
    tag: usize,
    mode: IoMode,
    chunk: u64,
) {
    for r in plan.reads() {
        let (start, end) = if mode == IoMode::Direct {
            (r.aligned_off, r.aligned_end)
        } else {
            (r.data_off, r.data_end)
        };
        let mut c0 = start;
        while c0 < end {
            let c1 = (c0 + chunk).min(end);
            let need = r.data_end.min(c1).saturating_sub(c0);
            jobs.push(ReadJob {
                file: r.file,
                offset: c0,
                len: (c1 - c0) as usize,
                need: need as usize,
                // SAFETY: `c0 - aligned_off < aligned_end - aligned_off`, so the destination
                // stays inside the plan's window, which lies inside the slot.
                dst: unsafe { slot.add((r.slot_off + (c0 - r.aligned_off)) as usize) },
                tag: tag as u64,
            });
            c0 = c1;
        }
    }
}

fn max_jobs_per_expert(store: &ExpertStore, chunk: u64) -> usize {
    let mut most = 1;
    for l in 0..store.n_layers() {
        for e in 0..store.n_experts(l) {
            if let Some(p) = store.plan(l, e) {
                let n: u64 = p
                    .reads()
                    .iter()
                    .map(|r| (r.aligned_end - r.aligned_off).div_ceil(chunk))
                    .sum();
                most = most.max(n as usize);
            }
        }
    }
    most
}

#[cfg(test)]
mod tests {
    #[test]
    fn cache_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::ExpertCache>();
    }
}
