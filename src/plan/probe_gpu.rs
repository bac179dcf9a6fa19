//! GPUs through the CUDA driver API, loaded at run time: `dlopen("libcuda.so.1")` and `dlsym`
//! of the few entry points needed, so sluice has no CUDA build dependency and runs unchanged on
//! machines without one. Reports each device's name and memory, and for device 0 the
//! host-to-device copy bandwidth from pinned (`cuMemAllocHost`) and from pageable memory.
//!
//! Owns: every `unsafe` CUDA call in sluice so far (each with its SAFETY comment), and the
//! function-pointer signatures, written from the driver API's documented C prototypes.
//! Does not own: any GPU compute. Invariant: everything allocated is freed and the primary
//! context is released before `probe` returns, on every path; a missing driver or a failing call
//! is a `note`, never an error.

use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::time::Instant;

/// What CUDA says about this machine's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// The driver library, when it loaded.
    pub driver: Option<String>,
    /// CUDA version the driver supports (`cuDriverGetVersion`), e.g. "12.4".
    pub driver_version: Option<String>,
    pub devices: Vec<GpuDevice>,
    /// Host-to-device copies into device 0.
    pub h2d: Option<CopyRate>,
    /// Why there are no devices, or why a figure is missing.
    pub note: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuDevice {
    pub index: usize,
    pub name: String,
    pub vram_bytes: u64,
}

/// `copies` synchronous `cuMemcpyHtoD` of `bytes` each, timed together.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CopyRate {
    pub device: usize,
    pub bytes: u64,
    pub copies: usize,
    /// From page-locked memory (`cuMemAllocHost`), GB/s (1e9).
    pub pinned_gbps: f64,
    /// From ordinary (pageable) memory, GB/s, for contrast.
    pub pageable_gbps: Option<f64>,
}

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

/// The entry points used, as the driver API declares them (cuda.h).
struct Driver {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_alloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(CuDevicePtr, *const c_void, usize) -> CuResult,
    get_error_name: Option<unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>,
}

const LIB: &str = "libcuda.so.1";

/// Look up `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be an `extern "C"` function-pointer type matching the symbol's C prototype.
unsafe fn sym<F: Copy>(lib: *mut c_void, name: &str) -> Option<F> {
    let cname = std::ffi::CString::new(name).ok()?;
    // SAFETY: `lib` is a handle from dlopen that is never closed; `cname` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, cname.as_ptr()) };
    if p.is_null() || std::mem::size_of::<F>() != std::mem::size_of::<*mut c_void>() {
        return None;
    }
    // SAFETY: `p` is a non-null function address of the same size as `F`; the caller promises
    // `F` is that function's exact signature.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Driver {
    fn load() -> Result<Driver, String> {
        let name = std::ffi::CString::new(LIB).map_err(|e| e.to_string())?;
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life
        // (never dlclose'd: the CUDA driver does not support being unloaded).
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(format!("{LIB} not found (no NVIDIA driver)"));
        }
        macro_rules! need {
            ($n:literal) => {
                // SAFETY: the field's type is the documented prototype of this entry point.
                unsafe { sym(lib, $n) }.ok_or_else(|| format!("{LIB} lacks {}", $n))?
            };
        }
        Ok(Driver {
            init: need!("cuInit"),
            driver_get_version: need!("cuDriverGetVersion"),
            device_get_count: need!("cuDeviceGetCount"),
            device_get: need!("cuDeviceGet"),
            device_get_name: need!("cuDeviceGetName"),
            device_total_mem: need!("cuDeviceTotalMem_v2"),
            primary_ctx_retain: need!("cuDevicePrimaryCtxRetain"),
            // SAFETY: both names have the prototype `CUresult (CUdevice)`.
            primary_ctx_release: unsafe { sym(lib, "cuDevicePrimaryCtxRelease_v2") }
                .or_else(|| unsafe { sym(lib, "cuDevicePrimaryCtxRelease") })
                .ok_or_else(|| format!("{LIB} lacks cuDevicePrimaryCtxRelease"))?,
            ctx_set_current: need!("cuCtxSetCurrent"),
            ctx_synchronize: need!("cuCtxSynchronize"),
            mem_alloc_host: need!("cuMemAllocHost_v2"),
            mem_free_host: need!("cuMemFreeHost"),
            mem_alloc: need!("cuMemAlloc_v2"),
            mem_free: need!("cuMemFree_v2"),
            memcpy_htod: need!("cuMemcpyHtoD_v2"),
            // SAFETY: documented prototype `CUresult (CUresult, const char **)`.
            get_error_name: unsafe { sym(lib, "cuGetErrorName") },
        })
    }

    /// `what: CUDA_ERROR_...` for a failed call.
    fn check(&self, what: &str, r: CuResult) -> Result<(), String> {
        if r == 0 {
            return Ok(());
        }
        let mut p: *const c_char = std::ptr::null();
        let name = match self.get_error_name {
            // SAFETY: `p` is a valid out-pointer; on success the driver points it at a static
            // NUL-terminated string.
            Some(f) if unsafe { f(r, &mut p) } == 0 && !p.is_null() => {
                // SAFETY: see above: a static C string owned by the driver.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
            _ => format!("error {r}"),
        };
        Err(format!("{what}: {name}"))
    }
}

/// Ask the driver; never fails (what went wrong lands in `note`).
pub fn probe() -> GpuInfo {
    let mut info = GpuInfo::default();
    let d = match Driver::load() {
        Ok(d) => d,
        Err(m) => {
            info.note = Some(m);
            return info;
        }
    };
    info.driver = Some(LIB.to_string());
    if let Err(m) = devices(&d, &mut info) {
        info.note = Some(m);
        return info;
    }
    if !info.devices.is_empty() {
        match copy_rate(&d, 0, 64 << 20, 10) {
            Ok(r) => info.h2d = Some(r),
            Err(m) => info.note = Some(format!("host-to-device copies not measured: {m}")),
        }
    }
    info
}

fn devices(d: &Driver, info: &mut GpuInfo) -> Result<(), String> {
    // SAFETY: cuInit takes flags (must be 0) and may be called more than once.
    d.check("cuInit", unsafe { (d.init)(0) })?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a valid out-pointer.
    if unsafe { (d.driver_get_version)(&mut v) } == 0 {
        info.driver_version = Some(format!("{}.{}", v / 1000, (v % 1000) / 10));
    }
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    d.check("cuDeviceGetCount", unsafe { (d.device_get_count)(&mut n) })?;
    for i in 0..n.max(0) {
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer; `i` < the device count.
        d.check("cuDeviceGet", unsafe { (d.device_get)(&mut dev, i) })?;
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds `name.len()` bytes and the driver writes a NUL-terminated
        // string of at most that length.
        d.check("cuDeviceGetName", unsafe {
            (d.device_get_name)(name.as_mut_ptr(), name.len() as c_int, dev)
        })?;
        let mut mem: usize = 0;
        // SAFETY: `mem` is a valid out-pointer.
        d.check("cuDeviceTotalMem", unsafe {
            (d.device_total_mem)(&mut mem, dev)
        })?;
        name[name.len() - 1] = 0;
        // SAFETY: the buffer is NUL-terminated (its last byte forced to 0 above).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .trim()
            .to_string();
        info.devices.push(GpuDevice {
            index: i as usize,
            name,
            vram_bytes: mem as u64,
        });
    }
    if n == 0 {
        info.note = Some("the driver reports no CUDA device".into());
    }
    Ok(())
}

/// Owns the primary context and the buffers of one copy measurement; frees them on drop.
struct CopySetup<'a> {
    d: &'a Driver,
    dev: CuDevice,
    host: *mut c_void,
    device: CuDevicePtr,
}

impl Drop for CopySetup<'_> {
    fn drop(&mut self) {
        // SAFETY: each pointer is either null/0 (never allocated) or came from the matching
        // allocation call in this context, and is freed exactly once here; the context was
        // retained in `copy_rate` before any allocation and is released last.
        unsafe {
            if !self.host.is_null() {
                (self.d.mem_free_host)(self.host);
            }
            if self.device != 0 {
                (self.d.mem_free)(self.device);
            }
            (self.d.primary_ctx_release)(self.dev);
        }
    }
}

/// Time `copies` copies of `bytes` from `src` into the device buffer, GB/s.
fn time_copies(
    s: &CopySetup<'_>,
    src: *const c_void,
    bytes: usize,
    copies: usize,
) -> Result<f64, String> {
    let d = s.d;
    // SAFETY: `src` points to at least `bytes` readable bytes (the caller's buffer) and the
    // device buffer holds `bytes`; the current context owns both.
    d.check("cuMemcpyHtoD", unsafe {
        (d.memcpy_htod)(s.device, src, bytes)
    })?;
    // SAFETY: no arguments; waits for the context's work.
    d.check("cuCtxSynchronize", unsafe { (d.ctx_synchronize)() })?;
    let t = Instant::now();
    for _ in 0..copies {
        // SAFETY: as above.
        d.check("cuMemcpyHtoD", unsafe {
            (d.memcpy_htod)(s.device, src, bytes)
        })?;
    }
    // SAFETY: as above.
    d.check("cuCtxSynchronize", unsafe { (d.ctx_synchronize)() })?;
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok(super::sig6((bytes * copies) as f64 / secs / 1e9))
}

fn copy_rate(d: &Driver, index: usize, bytes: usize, copies: usize) -> Result<CopyRate, String> {
    let mut dev: CuDevice = 0;
    // SAFETY: valid out-pointer; `index` is below the device count.
    d.check("cuDeviceGet", unsafe {
        (d.device_get)(&mut dev, index as c_int)
    })?;
    let mut ctx: CuContext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; balanced by the release in `CopySetup::drop`.
    d.check("cuDevicePrimaryCtxRetain", unsafe {
        (d.primary_ctx_retain)(&mut ctx, dev)
    })?;
    let mut s = CopySetup {
        d,
        dev,
        host: std::ptr::null_mut(),
        device: 0,
    };
    // SAFETY: `ctx` is the primary context just retained.
    d.check("cuCtxSetCurrent", unsafe { (d.ctx_set_current)(ctx) })?;
    // SAFETY: valid out-pointers; the buffers are freed in `CopySetup::drop`.
    d.check("cuMemAllocHost", unsafe {
        (d.mem_alloc_host)(&mut s.host, bytes)
    })?;
    d.check("cuMemAlloc", unsafe { (d.mem_alloc)(&mut s.device, bytes) })?;
    // SAFETY: `s.host` is a fresh allocation of `bytes` bytes that nothing else references.
    unsafe { std::ptr::write_bytes(s.host as *mut u8, 0x5a, bytes) };
    let pinned = time_copies(&s, s.host, bytes, copies)?;
    let pageable = vec![0x5au8; bytes];
    let pageable_gbps = time_copies(&s, pageable.as_ptr() as *const c_void, bytes, copies).ok();
    Ok(CopyRate {
        device: index,
        bytes: bytes as u64,
        copies,
        pinned_gbps: pinned,
        pageable_gbps,
    })
}
