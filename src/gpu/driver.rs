//! The CUDA driver API, thinly: a context on device 0, the kernels module, two streams, device
//! buffers, events and pinned host memory. Every call's result is checked and turned into a
//! `GpuError` naming the call.
//!
//! Owns: every `unsafe` driver call of the crate. Does not own: what the buffers mean.
//! Invariant: the context is made current on the calling thread by every public entry point
//! that launches or copies (`Gpu::bind`), so callers may use any thread.

use super::GpuError;
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// The PTX of `kernels.cu` (see scripts/build-ptx.py), NUL-terminated for `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

fn check(r: cu::CUresult, what: &str) -> Result<(), GpuError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
    unsafe { cu::cuGetErrorString(r, &mut s) };
    let msg = if s.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null results of cuGetErrorString are NUL-terminated static strings.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    };
    Err(GpuError::Driver(format!("{what}: {msg}")))
}

/// A launch argument: the driver reads `size_of` the parameter from each pointer, so every
/// argument is stored in a u64 slot (little-endian: 4-byte parameters read the low half).
#[derive(Clone, Copy)]
pub struct Arg(u64);

impl From<u64> for Arg {
    fn from(v: u64) -> Arg {
        Arg(v)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Arg {
        Arg(v as u64)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Arg {
        Arg(v as u32 as u64)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg(v.to_bits() as u64)
    }
}

/// Device memory: one allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    /// Address of byte `off`.
    pub fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }
    /// Address of f32 element `i`.
    pub fn f(&self, i: usize) -> u64 {
        self.ptr + 4 * i as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once; errors at teardown are moot.
            unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Page-locked host memory from cuMemHostAlloc (portable, not write-combined), freed on drop.
pub struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; access goes through &/&mut self.
unsafe impl Send for PinnedBuf {}

impl PinnedBuf {
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` bytes for the life of self and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared borrow.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The buffer as f32 values (whole values only).
    pub fn f32s(&self) -> &[f32] {
        // SAFETY: cuMemHostAlloc memory is page-aligned, valid for `len` bytes, and every bit
        // pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), self.len / 4) }
    }
    pub fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as `f32s`, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<f32>(), self.len / 4) }
    }
    pub fn i32s_mut(&mut self) -> &mut [i32] {
        // SAFETY: as `f32s`: aligned, and every bit pattern is an i32; uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<i32>(), self.len / 4) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
        unsafe { cu::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// A CUDA event (timing enabled).
pub struct Event(pub cu::CUevent);

// SAFETY: CUDA events are usable from any thread with the context current.
unsafe impl Send for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        unsafe { cu::cuEventDestroy_v2(self.0) };
    }
}

/// A kernel of the loaded module (and its index in `Gpu::names`, for the profile; and whether
/// it is launched with programmatic dependent launch, `pdl_kernel`).
#[derive(Clone, Copy, PartialEq)]
pub struct Kernel(cu::CUfunction, u32, bool);

/// The kernels that begin with `pdl_wait()` (kernels.cu: nothing an earlier kernel wrote is read,
/// and nothing is written, before it), so they may be launched with programmatic dependent
/// launch: the decode step's kernels. Their blocks start while the kernel before them finishes,
/// prefetch their weight rows to L2, and wait on the device instead of behind a full launch
/// gap. On by default (`SLUICE_GPU_PDL=0` turns it off): measured on the H200 in sessions 29 and
/// 32, tg128 +1-3 % and +3-7 %, logits byte for byte the same (docs/PERFORMANCE.md).
fn pdl_kernel(name: &str) -> bool {
    matches!(
        name,
        "add_rmsnorm_q8"
            | "add_rmsnorm_q8_w"
            | "qk_rope_store"
            | "attention_split_merge"
            | "attention_group_split_merge"
            | "router_route_jobs"
    ) || ["mmq_", "mmq3_", "moe_gate_up_q_", "moe_down_qs"]
        .iter()
        .any(|p| name.starts_with(p))
        || (name.starts_with("mmq2_") && name.ends_with("_t1"))
}

/// Per-kernel GPU times (`SLUICE_GPU_PROFILE=FILE`): every compute launch is bracketed by two
/// events and waited for, so the figures are each kernel's own time with no overlap (and the
/// run is slower than an unprofiled one). Written to FILE (appended) when the `Gpu` drops.
struct KProf {
    path: String,
    events: (Event, Event),
    /// (kernel, grid, block) -> (launches, milliseconds).
    times: std::collections::HashMap<LaunchShape, (u64, f64)>,
}

/// Per-kernel times inside a replayed decode graph (`SLUICE_GPU_PROFILE_GRAPH=FILE`): while the
/// graph is captured, an event-record node goes before every compute launch and one after the
/// last, so every replay times each kernel as it runs in the graph (from the end of the node
/// before it: its launch gap included, no host in between). Graphs stay on; written to FILE
/// (appended) when the `Gpu` drops.
struct GProf {
    path: String,
    capturing: bool,
    events: Vec<Event>,
    /// The captured launches in order.
    shapes: Vec<LaunchShape>,
    replays: u64,
    /// (kernel, grid, block) -> (launches, milliseconds), over all replays.
    times: std::collections::HashMap<LaunchShape, (u64, f64)>,
}

/// A kernel's index in `Gpu::names`, its grid and its block size.
type LaunchShape = (u32, (u32, u32, u32), u32);

/// The two streams: kernels run on `Compute`, expert copies on `Copy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Compute,
    Copy,
}

pub struct Gpu {
    ctx: cu::CUcontext,
    module: cu::CUmodule,
    compute: cu::CUstream,
    copy: cu::CUstream,
    pub name: String,
    pub total_mem: usize,
    pub sm_count: i32,
    names: std::sync::Mutex<Vec<String>>,
    /// Programmatic dependent launch for the `pdl_kernel`s (on unless `SLUICE_GPU_PDL=0`; off
    /// while profiling, whose per-launch events would serialize them anyway).
    pdl: bool,
    prof: Option<std::sync::Mutex<KProf>>,
    gprof: Option<std::sync::Mutex<GProf>>,
}

// SAFETY: the handles are process-wide driver objects; every entry point binds the context.
unsafe impl Send for Gpu {}
// SAFETY: as above; shared use only reads the handles.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device 0: driver library, context, module (PTX JIT-compiled by the driver), tables,
    /// and a compute and a copy stream.
    pub fn open() -> Result<Gpu, GpuError> {
        // SAFETY: probing for the shared library only loads it.
        if !unsafe { cu::is_culib_present() } {
            return Err(GpuError::NoDriver(
                "no CUDA driver library (libcuda.so) on this machine".into(),
            ));
        }
        // SAFETY: plain driver calls with valid out-pointers; each result is checked.
        unsafe {
            check(cu::cuInit(0), "cuInit")?;
            let mut n = 0;
            check(cu::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
            if n < 1 {
                return Err(GpuError::NoDriver("the CUDA driver sees no GPU".into()));
            }
            let mut dev = 0;
            check(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                cu::cuDeviceGetName(name.as_mut_ptr(), 255, dev),
                "cuDeviceGetName",
            )?;
            let name = std::ffi::CStr::from_ptr(name.as_ptr())
                .to_string_lossy()
                .into_owned();
            let mut total = 0usize;
            check(cu::cuDeviceTotalMem_v2(&mut total, dev), "cuDeviceTotalMem")?;
            let mut sm_count = 0;
            check(
                cu::cuDeviceGetAttribute(
                    &mut sm_count,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
                "cuDeviceGetAttribute",
            )?;
            let mut ctx = std::ptr::null_mut();
            check(
                cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut module = std::ptr::null_mut();
            check(
                cu::cuModuleLoadData(&mut module, PTX.as_ptr().cast()),
                "cuModuleLoadData (JIT of kernels.ptx)",
            )?;
            let mut compute = std::ptr::null_mut();
            let mut copy = std::ptr::null_mut();
            let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            check(cu::cuStreamCreate(&mut compute, flags), "cuStreamCreate")?;
            check(cu::cuStreamCreate(&mut copy, flags), "cuStreamCreate")?;
            let mut gpu = Gpu {
                ctx,
                module,
                compute,
                copy,
                name,
                total_mem: total,
                sm_count,
                names: std::sync::Mutex::new(Vec::new()),
                pdl: std::env::var("SLUICE_GPU_PDL").map_or(true, |v| v != "0"),
                prof: None,
                gprof: None,
            };
            gpu.fill_tables()?;
            if let Some(path) = std::env::var("SLUICE_GPU_PROFILE")
                .ok()
                .filter(|p| !p.is_empty())
            {
                let events = (gpu.event()?, gpu.event()?);
                gpu.prof = Some(std::sync::Mutex::new(KProf {
                    path,
                    events,
                    times: Default::default(),
                }));
            }
            if let Some(path) = std::env::var("SLUICE_GPU_PROFILE_GRAPH")
                .ok()
                .filter(|p| !p.is_empty())
            {
                gpu.gprof = Some(std::sync::Mutex::new(GProf {
                    path,
                    capturing: false,
                    events: Vec::new(),
                    shapes: Vec::new(),
                    replays: 0,
                    times: Default::default(),
                }));
            }
            if gpu.prof.is_some() || gpu.gprof.is_some() {
                gpu.pdl = false;
            }
            if gpu.pdl {
                gpu.set_global("pdl_on", &1i32.to_le_bytes())?;
            }
            // A one-token step's job list by the routing warp alone (kernels_fused.cu
            // `route_jobs_block`; the same list): opt-in until it has run on a device.
            if std::env::var("SLUICE_GPU_JOBS1").is_ok_and(|v| v == "1") {
                gpu.set_global("jobs1_on", &1i32.to_le_bytes())?;
            }
            Ok(gpu)
        }
    }

    fn raw(&self, s: Stream) -> cu::CUstream {
        match s {
            Stream::Compute => self.compute,
            Stream::Copy => self.copy,
        }
    }

    /// Makes the context current on this thread.
    pub fn bind(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context, alive as long as self.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Writes `bytes` into the module's global (or constant) `name`, whose size must match.
    fn set_global(&self, name: &str, bytes: &[u8]) -> Result<(), GpuError> {
        let cname = std::ffi::CString::new(name).map_err(|_| GpuError::Driver(name.into()))?;
        let (mut ptr, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the module is loaded.
        unsafe {
            check(
                cu::cuModuleGetGlobal_v2(&mut ptr, &mut size, self.module, cname.as_ptr()),
                &format!("cuModuleGetGlobal({name})"),
            )?;
        }
        if size != bytes.len() {
            return Err(GpuError::Driver(format!(
                "global {name}: {size} bytes on the device, {} on the host",
                bytes.len()
            )));
        }
        // SAFETY: `ptr` is the global's device address, valid for `size` bytes.
        unsafe {
            check(
                cu::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), size),
                "cuMemcpyHtoD(global)",
            )
        }
    }

    fn fill_tables(&self) -> Result<(), GpuError> {
        use crate::kernels::iq4_nl::KVALUES;
        use crate::kernels::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ3S_GRID, IQ3XXS_GRID};
        use crate::kernels::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS, MXFP4_KVALUES};
        fn le64(t: &[u64]) -> Vec<u8> {
            t.iter().flat_map(|g| g.to_le_bytes()).collect()
        }
        fn le32(t: &[u32]) -> Vec<u8> {
            t.iter().flat_map(|g| g.to_le_bytes()).collect()
        }
        let grid = le64(&IQ2XXS_GRID);
        let mx: Vec<u8> = MXFP4_KVALUES.iter().map(|&v| v as u8).collect();
        let nl: Vec<u8> = KVALUES.iter().map(|&v| v as u8).collect();
        // kernels_quants.cu's grids and codebook: the CPU kernels' own tables.
        let (g2xs, g2s, g1s) = (le64(&IQ2XS_GRID), le64(&IQ2S_GRID), le64(&IQ1S_GRID));
        let (g3xxs, g3s) = (le32(&IQ3XXS_GRID), le32(&IQ3S_GRID));
        for (name, bytes) in [
            ("iq2xxs_grid", &grid[..]),
            ("ksigns_iq2xs", &KSIGNS_IQ2XS[..]),
            ("mxfp4_values", &mx[..]),
            ("iq2xs_grid", &g2xs[..]),
            ("iq2s_grid", &g2s[..]),
            ("iq3xxs_grid", &g3xxs[..]),
            ("iq3s_grid", &g3s[..]),
            ("iq1s_grid", &g1s[..]),
            ("iq4nl_values", &nl[..]),
        ] {
            let cname = std::ffi::CString::new(name).map_err(|_| GpuError::Driver(name.into()))?;
            let (mut ptr, mut size) = (0u64, 0usize);
            // SAFETY: valid out-pointers; the module is loaded.
            unsafe {
                check(
                    cu::cuModuleGetGlobal_v2(&mut ptr, &mut size, self.module, cname.as_ptr()),
                    &format!("cuModuleGetGlobal({name})"),
                )?;
            }
            if size != bytes.len() {
                return Err(GpuError::Driver(format!(
                    "table {name}: {size} bytes on the device, {} on the host",
                    bytes.len()
                )));
            }
            // SAFETY: `ptr` is the global's device address, valid for `size` bytes.
            unsafe {
                check(
                    cu::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), size),
                    "cuMemcpyHtoD(table)",
                )?;
            }
        }
        Ok(())
    }

    pub fn function(&self, name: &str) -> Result<Kernel, GpuError> {
        let cname = std::ffi::CString::new(name).map_err(|_| GpuError::Driver(name.into()))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: valid out-pointer and NUL-terminated name; the module is loaded.
        unsafe {
            check(
                cu::cuModuleGetFunction(&mut f, self.module, cname.as_ptr()),
                &format!("kernel {name}"),
            )?;
        }
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        names.push(name.to_string());
        Ok(Kernel(f, (names.len() - 1) as u32, pdl_kernel(name)))
    }

    /// Whether launches are profiled (`SLUICE_GPU_PROFILE`; graphs are then not captured).
    pub fn profiling(&self) -> bool {
        self.prof.is_some()
    }

    /// Launches `f` on `stream` with `args` (each stored in a u64 slot, see `Arg`).
    pub fn launch(
        &self,
        f: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        shmem: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let mut slots = [0u64; 32];
        let mut ptrs = [std::ptr::null_mut::<c_void>(); 32];
        if args.len() > slots.len() {
            return Err(GpuError::Driver("too many kernel arguments".into()));
        }
        for (i, a) in args.iter().enumerate() {
            slots[i] = a.0;
        }
        for (p, s) in ptrs.iter_mut().zip(slots.iter_mut()) {
            *p = (s as *mut u64).cast();
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        if stream == Stream::Compute {
            self.gprof_node(Some((f.1, grid, block)))?;
        }
        let prof = self
            .prof
            .as_ref()
            .filter(|_| stream == Stream::Compute)
            .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(p) = &prof {
            self.record(&p.events.0, stream)?;
        }
        if f.2 && self.pdl && stream == Stream::Compute {
            // SAFETY: a zeroed attribute value is a valid union (plain integers).
            let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = cu::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shmem,
                hStream: self.raw(stream),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as cuLaunchKernel's below; `cfg` and `attr` outlive the call. The kernel
            // begins with pdl_wait() (`pdl_kernel`), so starting it early is safe.
            unsafe {
                check(
                    cu::cuLaunchKernelEx(&cfg, f.0, ptrs.as_mut_ptr(), std::ptr::null_mut()),
                    "cuLaunchKernelEx",
                )?;
            }
        } else {
            // SAFETY: `f` is a kernel of the loaded module whose parameters match `args` (the
            // wrappers in gpu/ops.rs pass them in the kernel's order and widths); the slots
            // outlive the call, which copies the parameter values.
            unsafe {
                check(
                    cu::cuLaunchKernel(
                        f.0,
                        grid.0,
                        grid.1,
                        grid.2,
                        block,
                        1,
                        1,
                        shmem,
                        self.raw(stream),
                        ptrs.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                    "cuLaunchKernel",
                )?;
            }
        }
        if let Some(mut p) = prof {
            self.record(&p.events.1, stream)?;
            // SAFETY: a recorded event of this context.
            check(
                unsafe { cu::cuEventSynchronize(p.events.1 .0) },
                "cuEventSynchronize",
            )?;
            let ms = self.elapsed_ms(&p.events.0, &p.events.1)? as f64;
            let t = p.times.entry((f.1, grid, block)).or_insert((0, 0.0));
            t.0 += 1;
            t.1 += ms;
        }
        Ok(())
    }

    /// While a graph is captured with `SLUICE_GPU_PROFILE_GRAPH`: an event-record node on the
    /// compute stream, before the launch `shape` (None: after the last launch).
    fn gprof_node(&self, shape: Option<LaunchShape>) -> Result<(), GpuError> {
        let Some(g) = &self.gprof else { return Ok(()) };
        let mut g = g.lock().unwrap_or_else(|e| e.into_inner());
        if !g.capturing {
            return Ok(());
        }
        let e = self.event()?;
        // SAFETY: an event and a stream of this context; EXTERNAL makes the captured record a
        // graph node that each replay records.
        check(
            unsafe {
                cu::cuEventRecordWithFlags(
                    e.0,
                    self.compute,
                    cu::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            },
            "cuEventRecordWithFlags",
        )?;
        g.events.push(e);
        match shape {
            Some(s) => g.shapes.push(s),
            None => g.capturing = false,
        }
        Ok(())
    }

    /// Ends the profiled capture's timed part here (what is captured after it is not timed).
    pub fn profile_capture_end(&self) -> Result<(), GpuError> {
        self.gprof_node(None)
    }

    /// After a replay of the profiled graph has completed (the stream synced): adds each
    /// kernel's time in it.
    pub fn profile_replay(&self) -> Result<(), GpuError> {
        let Some(g) = &self.gprof else { return Ok(()) };
        let mut g = g.lock().unwrap_or_else(|e| e.into_inner());
        if g.capturing || g.events.len() != g.shapes.len() + 1 {
            return Ok(());
        }
        let mut ms = Vec::with_capacity(g.shapes.len());
        for k in 0..g.shapes.len() {
            ms.push(self.elapsed_ms(&g.events[k], &g.events[k + 1])? as f64);
        }
        for (k, t) in ms.into_iter().enumerate() {
            let s = g.shapes[k];
            let e = g.times.entry(s).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += t;
        }
        g.replays += 1;
        Ok(())
    }

    /// The profile's table (kernel, grid, block, launches, total and mean time), slowest total
    /// first.
    fn write_profile(&self) {
        if let Some(g) = &self.gprof {
            let g = g.lock().unwrap_or_else(|e| e.into_inner());
            let header = format!(
                "# graph replay profile (pid {}): {} replays of {} launches\n",
                std::process::id(),
                g.replays,
                g.shapes.len()
            );
            self.write_table(&g.path, header, &g.times, g.replays.max(1));
        }
        let Some(p) = &self.prof else { return };
        let p = p.lock().unwrap_or_else(|e| e.into_inner());
        self.write_table(&p.path, String::new(), &p.times, 0);
    }

    /// Appends a profile table to `path`; `per` > 0 adds a per-replay column (us per replay).
    fn write_table(
        &self,
        path: &str,
        header: String,
        times: &std::collections::HashMap<LaunchShape, (u64, f64)>,
        per: u64,
    ) {
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = times.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut out = header;
        out.push_str(&format!(
            "# kernel profile (pid {}): {total:.3} ms in all\n",
            std::process::id()
        ));
        out.push_str("kernel\tgrid\tblock\tlaunches\ttotal_ms\tmean_us");
        out.push_str(if per > 0 { "\tus_per_replay\n" } else { "\n" });
        for ((k, g, b), (c, ms)) in rows {
            let name = names.get(*k as usize).map_or("?", |s| s.as_str());
            out.push_str(&format!(
                "{name}\t{}x{}x{}\t{b}\t{c}\t{ms:.3}\t{:.2}",
                g.0,
                g.1,
                g.2,
                1e3 * ms / *c as f64
            ));
            if per > 0 {
                out.push_str(&format!("\t{:.2}", 1e3 * ms / per as f64));
            }
            out.push('\n');
        }
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(out.as_bytes());
        }
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf, GpuError> {
        if bytes == 0 {
            return Ok(DevBuf { ptr: 0, bytes: 0 });
        }
        let mut ptr = 0u64;
        // SAFETY: valid out-pointer.
        unsafe {
            check(
                cu::cuMemAlloc_v2(&mut ptr, bytes),
                &format!("cuMemAlloc({:.2} GB)", bytes as f64 / 1e9),
            )?;
        }
        Ok(DevBuf { ptr, bytes })
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        unsafe { check(cu::cuMemGetInfo_v2(&mut free, &mut total), "cuMemGetInfo")? };
        Ok((free, total))
    }

    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuf, GpuError> {
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer; PORTABLE only (not write-combined: the host also reads it).
        unsafe {
            check(
                cu::cuMemHostAlloc(&mut p, bytes.max(1), cu::CU_MEMHOSTALLOC_PORTABLE),
                &format!("cuMemHostAlloc({:.2} GB)", bytes as f64 / 1e9),
            )?;
        }
        Ok(PinnedBuf {
            ptr: p.cast(),
            len: bytes,
        })
    }

    /// Page-locks and maps host memory the driver did not allocate.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay allocated until `unregister(ptr)`.
    pub unsafe fn register(&self, ptr: *const u8, len: usize) -> Result<(), GpuError> {
        // SAFETY: per the caller's contract; the driver only pins the range.
        unsafe {
            check(
                cu::cuMemHostRegister_v2(ptr as *mut c_void, len, cu::CU_MEMHOSTREGISTER_PORTABLE),
                "cuMemHostRegister",
            )
        }
    }

    /// Undoes `register(ptr, ..)`.
    ///
    /// # Safety
    /// `ptr` must have been registered and no copy from it may still be in flight.
    pub unsafe fn unregister(&self, ptr: *const u8) -> Result<(), GpuError> {
        // SAFETY: per the caller's contract.
        unsafe {
            check(
                cu::cuMemHostUnregister(ptr as *mut c_void),
                "cuMemHostUnregister",
            )
        }
    }

    /// Synchronous host -> device copy (setup only): complete when it returns. A pageable
    /// cuMemcpyHtoD returns once the bytes are staged, before the DMA lands, and our streams
    /// are non-blocking (they do not wait for it): without the context sync a kernel launched
    /// next may read the old bytes (seen as zero outputs on the device, tests/gpu_types.rs).
    pub fn upload(&self, dst: u64, src: &[u8]) -> Result<(), GpuError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is device memory of at least src.len() bytes (callers allocate it so).
        unsafe {
            check(
                cu::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()),
                "cuMemcpyHtoD",
            )?;
            check(cu::cuCtxSynchronize(), "cuCtxSynchronize")
        }
    }

    /// Asynchronous host -> device copy on `stream`.
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unmodified until the copy completes on `stream`, and
    /// `dst` must be device memory of at least `len` bytes.
    pub unsafe fn upload_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: per the caller's contract.
        unsafe {
            check(
                cu::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw(stream)),
                "cuMemcpyHtoDAsync",
            )
        }
    }

    /// Asynchronous device -> host copy on `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay valid and otherwise untouched until the copy completes.
    pub unsafe fn download_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: Stream,
    ) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: per the caller's contract.
        unsafe {
            check(
                cu::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw(stream)),
                "cuMemcpyDtoHAsync",
            )
        }
    }

    /// Asynchronous device -> device copy on `stream` (both ranges inside live allocations).
    pub fn copy_d2d(&self, dst: u64, src: u64, len: usize, stream: Stream) -> Result<(), GpuError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: device addresses from this crate's allocations; the driver checks ranges.
        unsafe {
            check(
                cu::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw(stream)),
                "cuMemcpyDtoDAsync",
            )
        }
    }

    /// Starts recording `stream`'s work into a graph instead of running it (relaxed mode: other
    /// threads' driver calls are unaffected).
    pub fn begin_capture(&self, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: a stream of this context, not already capturing (callers pair this with
        // `end_capture` on every path).
        check(
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    self.raw(stream),
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            },
            "cuStreamBeginCapture",
        )?;
        if let (Some(g), Stream::Compute) = (&self.gprof, stream) {
            let mut g = g.lock().unwrap_or_else(|e| e.into_inner());
            g.capturing = true;
            g.events.clear();
            g.shapes.clear();
        }
        Ok(())
    }

    /// Ends the capture begun on `stream` and instantiates the recorded graph.
    pub fn end_capture(&self, stream: Stream) -> Result<Graph, GpuError> {
        if stream == Stream::Compute {
            self.gprof_node(None)?;
        }
        let mut graph = std::ptr::null_mut();
        // SAFETY: `stream` is capturing (begin_capture); the out-pointer is valid.
        check(
            unsafe { cu::cuStreamEndCapture(self.raw(stream), &mut graph) },
            "cuStreamEndCapture",
        )?;
        let mut exec = std::ptr::null_mut();
        // SAFETY: `graph` was just made by the capture; the out-pointer is valid.
        let r = check(
            unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiate",
        );
        if let Err(e) = r {
            // SAFETY: the graph is ours and unused.
            unsafe { cu::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(Graph { graph, exec })
    }

    /// Replays `g` on `stream`.
    pub fn launch_graph(&self, g: &Graph, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: an instantiated graph of this context; what it reads and writes (device
        // buffers, pinned host buffers) lives as long as the state that owns the graph.
        check(
            unsafe { cu::cuGraphLaunch(g.exec, self.raw(stream)) },
            "cuGraphLaunch",
        )
    }

    pub fn sync(&self, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: a stream of this context.
        check(
            unsafe { cu::cuStreamSynchronize(self.raw(stream)) },
            "cuStreamSynchronize",
        )
    }

    pub fn event(&self) -> Result<Event, GpuError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe {
            check(
                cu::cuEventCreate(&mut e, cu::CUevent_flags::CU_EVENT_DEFAULT as u32),
                "cuEventCreate",
            )?;
        }
        Ok(Event(e))
    }

    pub fn record(&self, e: &Event, stream: Stream) -> Result<(), GpuError> {
        // SAFETY: an event and a stream of this context.
        check(
            unsafe { cu::cuEventRecord(e.0, self.raw(stream)) },
            "cuEventRecord",
        )
    }

    /// Work queued on `stream` after this call waits for `e`.
    pub fn wait(&self, stream: Stream, e: &Event) -> Result<(), GpuError> {
        // SAFETY: an event and a stream of this context.
        check(
            unsafe { cu::cuStreamWaitEvent(self.raw(stream), e.0, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Milliseconds between two completed events.
    pub fn elapsed_ms(&self, a: &Event, b: &Event) -> Result<f32, GpuError> {
        let mut ms = 0f32;
        // SAFETY: both events recorded and completed (callers synchronize first).
        check(
            unsafe { cu::cuEventElapsedTime(&mut ms, a.0, b.0) },
            "cuEventElapsedTime",
        )?;
        Ok(ms)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.write_profile();
        // SAFETY: handles created in `open`, destroyed once; errors at teardown are moot.
        unsafe {
            cu::cuCtxSetCurrent(self.ctx);
            cu::cuStreamSynchronize(self.compute);
            cu::cuStreamSynchronize(self.copy);
            cu::cuStreamDestroy_v2(self.compute);
            cu::cuStreamDestroy_v2(self.copy);
            cu::cuModuleUnload(self.module);
        }
    }
}

/// A captured and instantiated CUDA graph, destroyed on drop.
pub struct Graph {
    graph: cu::CUgraph,
    exec: cu::CUgraphExec,
}

// SAFETY: graph handles are usable from any thread with the context current.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: made by end_capture, destroyed once; errors at teardown are moot.
        unsafe {
            cu::cuGraphExecDestroy(self.exec);
            cu::cuGraphDestroy(self.graph);
        }
    }
}

/// Whether a CUDA driver library can be loaded (no device is touched).
pub fn present() -> bool {
    // SAFETY: probing only loads and unloads the shared library.
    unsafe { cu::is_culib_present() }
}

/// Pinned host -> device copy ceiling: GB/s of one `bytes` copy from cuMemHostAlloc memory,
/// the best of `reps` (after one warm-up copy).
pub fn pinned_h2d_gbps(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64, GpuError> {
    gpu.bind()?;
    let mut host = gpu.alloc_pinned(bytes)?;
    host.as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let dev = gpu.alloc(bytes)?;
    let (a, b) = (gpu.event()?, gpu.event()?);
    let mut best = 0f64;
    for _ in 0..reps.max(1) + 1 {
        gpu.record(&a, Stream::Copy)?;
        // SAFETY: `host` lives until after the sync below; `dev` holds `bytes`.
        unsafe { gpu.upload_async(dev.ptr, host.as_slice().as_ptr(), bytes, Stream::Copy)? };
        gpu.record(&b, Stream::Copy)?;
        gpu.sync(Stream::Copy)?;
        let ms = gpu.elapsed_ms(&a, &b)? as f64;
        if ms > 0.0 {
            best = best.max(bytes as f64 / (ms * 1e-3) / 1e9);
        }
    }
    Ok(best)
}
