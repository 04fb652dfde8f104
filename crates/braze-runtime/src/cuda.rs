//! CUDA modules: a graph's CUDA C source is compiled by NVRTC to a cubin for the device's
//! architecture (one program per graph), cached on disk, loaded into the device's primary
//! context (the one PyTorch uses) and launched on PyTorch's current stream.
//!
//! NVRTC and the driver are loaded at run time from paths the caller gives (PyTorch's own
//! NVIDIA wheels, found by the Python side), so no CUDA toolkit is needed to build or run,
//! and no second copy of a library PyTorch already mapped is loaded. Only the dozen entry
//! points braze uses are resolved. NVRTC works without a GPU, which is how CI checks that
//! every generated kernel compiles.

pub mod graph_patch;
pub mod kernel_tune;
pub mod nvrtc_workers;
pub mod relayout;

use crate::cache::{cache_dir, key};
use crate::RuntimeError;
use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

type NvrtcProgram = *mut c_void;
type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuModule = *mut c_void;
type CuFunction = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;
type CuGraph = *mut c_void;
type CuGraphExec = *mut c_void;

/// `CUlaunchAttribute`: an attribute id, padding to 8 bytes, and a 64-byte value union.
#[repr(C)]
struct CuLaunchAttribute {
    id: c_int,
    pad: c_int,
    value: [u64; 8],
}

/// `CUlaunchConfig` for `cuLaunchKernelEx`.
#[repr(C)]
struct CuLaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_bytes: c_uint,
    stream: CuStream,
    attrs: *mut CuLaunchAttribute,
    num_attrs: c_uint,
}

/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`.
const PROGRAMMATIC_STREAM_SERIALIZATION: c_int = 6;

struct Nvrtc {
    _lib: Library,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(*mut NvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int,
    compile: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
}

struct Driver {
    _lib: Library,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_get: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_set: unsafe extern "C" fn(CuContext) -> CuResult,
    load: unsafe extern "C" fn(*mut CuModule, *const c_void) -> CuResult,
    get_fn: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    memset_d8: unsafe extern "C" fn(u64, u8, usize) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    event_create: unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    event_sync: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_elapsed: unsafe extern "C" fn(*mut f32, CuEvent, CuEvent) -> CuResult,
    event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    begin_capture: unsafe extern "C" fn(CuStream, c_int) -> CuResult,
    end_capture: unsafe extern "C" fn(CuStream, *mut CuGraph) -> CuResult,
    is_capturing: unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult,
    graph_instantiate: unsafe extern "C" fn(*mut CuGraphExec, CuGraph, u64) -> CuResult,
    graph_destroy: unsafe extern "C" fn(CuGraph) -> CuResult,
    graph_exec_destroy: unsafe extern "C" fn(CuGraphExec) -> CuResult,
    graph_launch: unsafe extern "C" fn(CuGraphExec, CuStream) -> CuResult,
    launch: unsafe extern "C" fn(CuFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CuStream, *mut *mut c_void, *mut *mut c_void) -> CuResult,
    launch_ex: unsafe extern "C" fn(*const CuLaunchConfig, CuFunction, *mut *mut c_void, *mut *mut c_void) -> CuResult,
    error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

use crate::open_library as open;

/// Loads NVRTC from `path` (and its builtins library, which it finds by bare name, from
/// `builtins` when given). Later calls return the first result.
pub fn init_nvrtc(path: &str, builtins: Option<&str>) -> Result<(), RuntimeError> {
    let r = NVRTC.get_or_init(|| {
        let _b = builtins.map(open).transpose()?.map(std::mem::ManuallyDrop::new);
        let lib = open(path)?;
        Ok(Nvrtc {
            version: sym!(lib, b"nvrtcVersion"),
            create: sym!(lib, b"nvrtcCreateProgram"),
            compile: sym!(lib, b"nvrtcCompileProgram"),
            log_size: sym!(lib, b"nvrtcGetProgramLogSize"),
            log: sym!(lib, b"nvrtcGetProgramLog"),
            cubin_size: sym!(lib, b"nvrtcGetCUBINSize"),
            cubin: sym!(lib, b"nvrtcGetCUBIN"),
            destroy: sym!(lib, b"nvrtcDestroyProgram"),
            _lib: lib,
        })
    });
    r.as_ref().map(|_| ()).map_err(|e| RuntimeError::Environment(e.clone()))
}

/// Loads the CUDA driver (`libcuda.so.1`, already mapped by PyTorch) and initializes it.
pub fn init_driver(path: &str) -> Result<(), RuntimeError> {
    let r = DRIVER.get_or_init(|| {
        let lib = open(path)?;
        let d = Driver {
            init: sym!(lib, b"cuInit"),
            device_get: sym!(lib, b"cuDeviceGet"),
            attribute: sym!(lib, b"cuDeviceGetAttribute"),
            name: sym!(lib, b"cuDeviceGetName"),
            retain: sym!(lib, b"cuDevicePrimaryCtxRetain"),
            ctx_get: sym!(lib, b"cuCtxGetCurrent"),
            ctx_set: sym!(lib, b"cuCtxSetCurrent"),
            load: sym!(lib, b"cuModuleLoadData"),
            get_fn: sym!(lib, b"cuModuleGetFunction"),
            launch: sym!(lib, b"cuLaunchKernel"),
            launch_ex: sym!(lib, b"cuLaunchKernelEx"),
            mem_alloc: sym!(lib, b"cuMemAlloc_v2"),
            mem_free: sym!(lib, b"cuMemFree_v2"),
            memset_d8: sym!(lib, b"cuMemsetD8_v2"),
            stream_create: sym!(lib, b"cuStreamCreate"),
            stream_destroy: sym!(lib, b"cuStreamDestroy_v2"),
            event_create: sym!(lib, b"cuEventCreate"),
            event_record: sym!(lib, b"cuEventRecord"),
            event_sync: sym!(lib, b"cuEventSynchronize"),
            event_elapsed: sym!(lib, b"cuEventElapsedTime"),
            event_destroy: sym!(lib, b"cuEventDestroy_v2"),
            begin_capture: sym!(lib, b"cuStreamBeginCapture_v2"),
            end_capture: sym!(lib, b"cuStreamEndCapture"),
            is_capturing: sym!(lib, b"cuStreamIsCapturing"),
            graph_instantiate: sym!(lib, b"cuGraphInstantiateWithFlags"),
            graph_destroy: sym!(lib, b"cuGraphDestroy"),
            graph_exec_destroy: sym!(lib, b"cuGraphExecDestroy"),
            graph_launch: sym!(lib, b"cuGraphLaunch"),
            error_string: sym!(lib, b"cuGetErrorString"),
            _lib: lib,
        };
        // SAFETY: cuInit(0) is the documented first call.
        let rc = unsafe { (d.init)(0) };
        if rc != 0 {
            return Err(format!("cuInit failed ({rc})"));
        }
        Ok(d)
    });
    r.as_ref().map(|_| ()).map_err(|e| RuntimeError::Environment(e.clone()))
}

fn nvrtc() -> Result<&'static Nvrtc, RuntimeError> {
    crate::loaded(&NVRTC, "NVRTC")
}

fn driver() -> Result<&'static Driver, RuntimeError> {
    crate::loaded(&DRIVER, "CUDA driver")
}

/// Every kernel function braze has loaded (graphs' kernels, their scalar fallbacks, the
/// relayouts): their parameters are plain values braze chose ([Note: patched inputs]).
fn braze_functions() -> &'static std::sync::Mutex<std::collections::HashSet<usize>> {
    static F: OnceLock<std::sync::Mutex<std::collections::HashSet<usize>>> = OnceLock::new();
    F.get_or_init(Default::default)
}

/// `cuModuleGetFunction`, the function remembered as braze's.
///
/// # Safety
/// `module` is a loaded module.
unsafe fn get_function(d: &Driver, module: CuModule, name: &str) -> Result<CuFunction, RuntimeError> {
    let c = CString::new(name).map_err(|_| RuntimeError::Compile(format!("kernel name {name:?}")))?;
    let mut f: CuFunction = std::ptr::null_mut();
    // SAFETY: the caller's module; an out-pointer to a local.
    check(d, unsafe { (d.get_fn)(&mut f, module, c.as_ptr()) }, &format!("kernel {name}"))?;
    braze_functions().lock().unwrap_or_else(|e| e.into_inner()).insert(f as usize);
    Ok(f)
}

fn is_braze_function(f: CuFunction) -> bool {
    braze_functions().lock().unwrap_or_else(|e| e.into_inner()).contains(&(f as usize))
}

fn check(d: &Driver, rc: CuResult, what: &str) -> Result<(), RuntimeError> {
    if rc == 0 {
        return Ok(());
    }
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string.
    unsafe { (d.error_string)(rc, &mut s) };
    let msg = if s.is_null() { format!("error {rc}") } else { unsafe { CStr::from_ptr(s) }.to_string_lossy().to_string() };
    Err(RuntimeError::Launch(format!("{what}: {msg}")))
}

/// Makes device `ordinal`'s primary context (retained) current on this thread; returns it and
/// the context that was current before.
///
/// # Safety
/// Driver calls only; the caller decides whether to restore the previous context.
unsafe fn make_primary_current(d: &Driver, ordinal: i32) -> Result<(CuContext, CuContext), RuntimeError> {
    let mut dev: CuDevice = 0;
    let mut ctx: CuContext = std::ptr::null_mut();
    let mut prev: CuContext = std::ptr::null_mut();
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        check(d, (d.device_get)(&mut dev, ordinal), "cuDeviceGet")?;
        check(d, (d.retain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        check(d, (d.ctx_get)(&mut prev), "cuCtxGetCurrent")?;
        check(d, (d.ctx_set)(ctx), "cuCtxSetCurrent")?;
    }
    Ok((ctx, prev))
}

/// `f()` with device `ordinal`'s primary context current on this thread (the one PyTorch
/// uses), the thread's previous context restored after.
pub(crate) fn on_device<T>(ordinal: i32, f: impl FnOnce() -> T) -> Result<T, RuntimeError> {
    let d = driver()?;
    // SAFETY: driver calls only; the previous context is restored.
    unsafe {
        let (_, prev) = make_primary_current(d, ordinal)?;
        let r = f();
        (d.ctx_set)(prev);
        Ok(r)
    }
}

/// Makes `ctx` current on this thread if none is (a thread PyTorch never used CUDA on).
///
/// # Safety
/// Driver calls only.
unsafe fn ensure_current(d: &Driver, ctx: CuContext) -> Result<(), RuntimeError> {
    let mut cur: CuContext = std::ptr::null_mut();
    // SAFETY: plain driver calls with an out-pointer to a local.
    unsafe {
        (d.ctx_get)(&mut cur);
        if cur.is_null() {
            check(d, (d.ctx_set)(ctx), "cuCtxSetCurrent")?;
        }
    }
    Ok(())
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32), RuntimeError> {
    let n = nvrtc()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { (n.version)(&mut a, &mut b) };
    Ok((a, b))
}

/// NVRTC options: full-precision math (no fast-math), as ATen's kernels compute.
/// NVRTC's options. Most of a kernel's compile is NVRTC's optimizer, not ptxas (PTX alone
/// takes as long); `--Ofast-compile=mid` cut the NVRTC stage by a third to two thirds but
/// made braze's kernels 1.5-2.2x slower on the H100 (`max`: 10x), so it is not used.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()]
}

/// Compiles CUDA C `source` to a cubin for `arch` (e.g. `sm_90`), through the disk cache.
pub fn compile_cubin(source: &str, arch: &str, version: &str) -> Result<(Vec<u8>, bool), RuntimeError> {
    compile_cubin_file(source, arch, version).map(|(_, cubin, cached)| (cubin, cached))
}

/// `compile_cubin`, with the cubin's file name in the cache directory's `cuda/`.
fn compile_cubin_file(source: &str, arch: &str, version: &str) -> Result<(String, Vec<u8>, bool), RuntimeError> {
    let (va, vb) = nvrtc_version()?;
    let opts = nvrtc_options(arch);
    let k = key(&[source, arch, &format!("nvrtc{va}.{vb}"), &opts.join(" "), version]);
    let file = format!("{k}.cubin");
    let dir = cache_dir().join("cuda");
    let path = dir.join(&file);
    if let Ok(bytes) = std::fs::read(&path) {
        return Ok((file, bytes, true));
    }
    let cubin = nvrtc_build(source, &opts, arch)?;
    let _ = std::fs::create_dir_all(&dir);
    let tmp = dir.join(format!("{k}.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, &cubin).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
    Ok((file, cubin, false))
}

/// Kernels NVRTC compiled in this process (graph kernels, not cache hits; scalar fallbacks
/// not counted).
static KERNELS_COMPILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many graph kernels NVRTC has compiled in this process ([Note: per-kernel CUDA cache]).
pub fn kernels_compiled() -> usize {
    KERNELS_COMPILED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The cubins holding a graph's distinct kernels, where each kernel is in them (cubin index,
/// function name), and whether none was compiled.
pub struct PlacedKernels {
    pub cubins: Vec<Vec<u8>>,
    pub places: Vec<(usize, String)>,
    pub cached: bool,
}

/// [Note: per-kernel CUDA cache] A graph's distinct kernels are found in the disk cache one
/// by one, as the CPU's are ([Note: per-kernel cache] in cpu.rs): an index entry
/// `cuda/k/<hash>` (the hash of the kernel's canonical text, the prelude, the architecture,
/// NVRTC's version and options, and braze's version) names the cubin holding it and its
/// function there, whichever graph's unit that cubin was built from. Only the kernels not
/// found are compiled, as units balanced by source length (braze-codegen's [Note: units]),
/// in parallel, and indexed. A graph that shares most kernels with one compiled before (the
/// same model at another depth, a recompile after a guard failed) compiles only the rest;
/// with units cached whole, one kernel more or less shifted every later unit's contents and
/// recompiled them all. Cache writes that fail only cost a later compile.
/// `spare` cores are left to other work (the libraries' plans built beside the compile).
pub fn compile_kernels(kernels: &[braze_codegen::cuda::CudaKernel], arch: &str, version: &str, spare: usize) -> Result<PlacedKernels, RuntimeError> {
    let (va, vb) = nvrtc_version()?;
    let opts = nvrtc_options(arch).join(" ");
    let nvrtc = format!("nvrtc{va}.{vb}");
    let prelude = braze_codegen::cuda::prelude();
    let dir = cache_dir().join("cuda");
    let _ = std::fs::create_dir_all(dir.join("k"));
    let hashes: Vec<String> = kernels.iter().map(|k| key(&[&k.key, prelude, arch, &nvrtc, &opts, version])).collect();
    let mut found: Vec<Option<(String, String)>> = hashes.iter().map(|h| crate::cache::index_lookup(&dir, h)).collect();
    let misses: Vec<usize> = (0..kernels.len()).filter(|&k| found[k].is_none()).collect();
    let sizes: Vec<usize> = misses.iter().map(|&k| kernels[k].text.len()).collect();
    let units: Vec<(String, Vec<usize>)> = braze_codegen::units::balanced(&sizes, braze_codegen::units::MIN_KERNELS_PER_NVRTC_UNIT)
        .into_iter()
        .map(|pos| {
            let ks: Vec<usize> = pos.into_iter().map(|p| misses[p]).collect();
            (braze_codegen::cuda::module_source(ks.iter().map(|&k| &kernels[k])), ks)
        })
        .collect();
    let built = crate::parallel_map_sparing(spare, units.len(), |u| compile_cubin_file(&units[u].0, arch, version)).into_iter().collect::<Result<Vec<_>, _>>()?;
    let compiled: usize = built.iter().zip(&units).filter(|((_, _, cached), _)| !cached).map(|(_, (_, ks))| ks.len()).sum();
    KERNELS_COMPILED.fetch_add(compiled, std::sync::atomic::Ordering::Relaxed);
    let mut bytes_of: HashMap<String, Vec<u8>> = HashMap::new();
    for ((file, cubin, _), (_, ks)) in built.into_iter().zip(&units) {
        for &k in ks {
            crate::cache::index_write(&dir, &hashes[k], &file, &kernels[k].name);
            found[k] = Some((file.clone(), kernels[k].name.clone()));
        }
        bytes_of.insert(file, cubin);
    }
    // Each cubin once, then each kernel's place in them.
    let mut index_of: HashMap<String, usize> = HashMap::new();
    let mut cubins = Vec::new();
    let mut places = Vec::with_capacity(kernels.len());
    for f in found {
        let (file, sym) = f.expect("every kernel found or built");
        let i = match index_of.get(&file) {
            Some(&i) => i,
            None => {
                let bytes = match bytes_of.remove(&file) {
                    Some(b) => b,
                    None => std::fs::read(dir.join(&file)).map_err(|e| RuntimeError::Environment(format!("cached cubin {file}: {e}")))?,
                };
                cubins.push(bytes);
                index_of.insert(file, cubins.len() - 1);
                cubins.len() - 1
            }
        };
        places.push((i, sym));
    }
    Ok(PlacedKernels { cubins, places, cached: misses.is_empty() })
}

/// Compiles each translation unit (braze-codegen's [Note: units]) through the disk cache, in
/// parallel: the cubins, and whether every one came from the cache.
pub fn compile_cubins(units: &[String], arch: &str, version: &str) -> Result<(Vec<Vec<u8>>, bool), RuntimeError> {
    let built = crate::parallel_map(units.len(), |u| compile_cubin(&units[u], arch, version)).into_iter().collect::<Result<Vec<_>, _>>()?;
    let cached = built.iter().all(|(_, c)| *c);
    Ok((built.into_iter().map(|(c, _)| c).collect(), cached))
}

/// Compiles a one-line kernel so that NVRTC's first-use cost (about a quarter of a second:
/// its compiler libraries load and initialize) is paid ahead of the first real compile.
/// Also builds the relayout kernels' cubin (a disk-cache hit after the first process).
pub fn warm_up(arch: &str) -> Result<(), RuntimeError> {
    nvrtc_build_here(WARM_UP_KERNEL, &nvrtc_options(arch))?.map_err(RuntimeError::Compile)?;
    compile_cubin(relayout::SOURCE, arch, env!("CARGO_PKG_VERSION")).map(|_| ())
}

/// The kernel whose compile pays NVRTC's first-use cost in a process.
const WARM_UP_KERNEL: &str = "extern \"C\" __global__ void braze_warm_up() {}";

/// One NVRTC compilation (no cache), on a worker process where there are some ([Note: NVRTC
/// worker processes]), else here.
fn nvrtc_build(source: &str, opts: &[String], arch: &str) -> Result<Vec<u8>, RuntimeError> {
    let built = match nvrtc_workers::compile(source, opts) {
        Some(r) => r,
        None => nvrtc_build_here(source, opts)?,
    };
    built.map_err(|log| RuntimeError::Compile(format!("NVRTC failed for {arch}:\n{log}")))
}

/// One NVRTC compilation in this process: the cubin, or NVRTC's log when the source does not
/// compile.
fn nvrtc_build_here(source: &str, opts: &[String]) -> Result<Result<Vec<u8>, String>, RuntimeError> {
    let n = nvrtc()?;
    let src = CString::new(source).map_err(|_| RuntimeError::Compile("NUL in source".into()))?;
    let name = CString::new("braze.cu").unwrap();
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).unwrap()).collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC API used as documented; every pointer outlives the calls.
    unsafe {
        if (n.create)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) != 0 {
            return Err(RuntimeError::Compile("nvrtcCreateProgram failed".into()));
        }
        let rc = (n.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
        if rc != 0 {
            let mut sz = 0usize;
            (n.log_size)(prog, &mut sz);
            let mut buf = vec![0u8; sz.max(1)];
            (n.log)(prog, buf.as_mut_ptr() as *mut c_char);
            (n.destroy)(&mut prog);
            return Ok(Err(String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()));
        }
        let mut sz = 0usize;
        (n.cubin_size)(prog, &mut sz);
        let mut cubin = vec![0u8; sz];
        (n.cubin)(prog, cubin.as_mut_ptr() as *mut c_char);
        (n.destroy)(&mut prog);
        Ok(Ok(cubin))
    }
}

/// A worker process's life ([Note: NVRTC worker processes]): NVRTC loaded from `path` and
/// warmed up, then requests on stdin answered on stdout until stdin closes.
pub fn serve_nvrtc_requests(path: &str, builtins: Option<&str>) -> Result<(), RuntimeError> {
    init_nvrtc(path, builtins)?;
    nvrtc_build_here(WARM_UP_KERNEL, &[])?.map_err(RuntimeError::Compile)?;
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    nvrtc_workers::serve(&mut input, &mut output, |src, opts| match nvrtc_build_here(src, opts) {
        Ok(r) => r,
        Err(e) => Err(e.to_string()),
    })
    .map_err(|e| RuntimeError::Environment(format!("NVRTC worker: {e}")))
}

/// The `sm_XY` name of device `ordinal`, and its multiprocessor count.
pub fn device_info(ordinal: i32) -> Result<(String, i32), RuntimeError> {
    let d = driver()?;
    let mut dev: CuDevice = 0;
    // SAFETY: plain driver queries.
    unsafe {
        check(d, (d.device_get)(&mut dev, ordinal), "cuDeviceGet")?;
        let (mut major, mut minor, mut sms) = (0, 0, 0);
        check(d, (d.attribute)(&mut major, 75, dev), "compute capability")?;
        check(d, (d.attribute)(&mut minor, 76, dev), "compute capability")?;
        check(d, (d.attribute)(&mut sms, 16, dev), "multiprocessor count")?;
        Ok((format!("sm_{major}{minor}"), sms))
    }
}

/// [Note: programmatic launch] On Hopper and newer GPUs braze's kernels launch with
/// programmatic dependent launch (`cuLaunchKernelEx` with programmatic stream serialization):
/// the GPU may start a kernel before the one ahead of it in the stream has finished. Each
/// kernel's first statement (`bz_entry` in braze-codegen's prelude) waits for its predecessor
/// to finish and its writes to be visible (`griddepcontrol.wait`), then allows its own
/// successor to launch (`griddepcontrol.launch_dependents`): a kernel's launch and block
/// scheduling overlap the kernel before it instead of following it. Nothing is read or
/// written before the wait, so the order of effects is the stream's; as the predecessor
/// finished only after its own wait, every earlier kernel has finished too. Library kernels
/// (cuBLASLt, cuDNN, ATen) launch as before; a braze kernel after one waits for it the same
/// way. Captured into a CUDA graph, such launches become programmatic edges. The code
/// generated for older architectures has no wait, and they launch plainly.
fn hopper_or_newer(arch: &str) -> bool {
    arch.strip_prefix("sm_").and_then(|v| v.parse::<u32>().ok()).is_some_and(|v| v >= 90)
}

/// What a tuning choice made on device `ordinal` is valid for ([Note: remembered choices]):
/// the device's name, architecture and multiprocessor count.
pub fn device_scope(ordinal: i32) -> Result<String, RuntimeError> {
    let d = driver()?;
    let (arch, sms) = device_info(ordinal)?;
    let mut dev: CuDevice = 0;
    let mut name = [0 as c_char; 256];
    // SAFETY: plain driver queries into a buffer of the length passed.
    unsafe {
        check(d, (d.device_get)(&mut dev, ordinal), "cuDeviceGet")?;
        check(d, (d.name)(name.as_mut_ptr(), name.len() as c_int, dev), "cuDeviceGetName")?;
    }
    // SAFETY: the driver wrote a NUL-terminated string into `name`.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    Ok(format!("{name} {arch} {sms}"))
}

/// Timings `time_candidates` has run in this process.
static TIMINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many pieces of work (a matmul's algorithms, a convolution's plans) this process has
/// timed ([Note: remembered choices]: a choice found in memory or on disk is not timed again).
pub fn timings() -> usize {
    TIMINGS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Enqueues candidate `i` over the tuning buffers on a stream: `(i, buffers, stream)`.
pub type CandidateRun<'a> = dyn FnMut(usize, &[usize], usize) -> Result<(), RuntimeError> + 'a;

/// Bytes every tuning buffer is filled with: each float element a small finite value
/// (0x3c3c is about 0.0115 in bf16, 0x3c3c3c3c about 0.0115 in f32).
pub const FILL_FLOAT: u8 = 0x3c;

/// Times `candidates` ways of doing one piece of GPU work and returns each one's seconds per
/// run (infinite where a run failed). `run(i, buffers, stream)` enqueues candidate `i` on
/// `stream` over fresh device buffers, one per `(bytes, fill byte)` of `buffers` (integer
/// buffers that hold indices are filled with zeros, so every index is in range), private to
/// the tuning: nothing PyTorch has in flight is touched. Used at compile time on device
/// `ordinal` to pick among cuBLASLt's algorithms, cuDNN's plans and braze's own kernel
/// configurations. Each candidate runs often enough to take about `TIMED` seconds (at least
/// `REPS` times), so that microsecond kernels are not timed at the events' resolution.
pub fn time_candidates(
    ordinal: i32,
    buffers: &[(usize, u8)],
    candidates: usize,
    run: &mut CandidateRun,
) -> Result<Vec<f64>, RuntimeError> {
    const WARM: usize = 2;
    const REPS: usize = 5;
    const MAX_REPS: usize = 200;
    const TIMED: f64 = 200e-6;
    let d = driver()?;
    TIMINGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut bufs: Vec<u64> = Vec::new();
    let mut stream: CuStream = std::ptr::null_mut();
    let mut ev: [CuEvent; 2] = [std::ptr::null_mut(); 2];
    let mut prev: CuContext = std::ptr::null_mut();
    // SAFETY: driver API as documented; everything created here is destroyed before return,
    // and the thread's current context is restored.
    let result = unsafe {
        (|| -> Result<Vec<f64>, RuntimeError> {
            prev = make_primary_current(d, ordinal)?.1;
            for &(n, fill) in buffers {
                let mut p: u64 = 0;
                check(d, (d.mem_alloc)(&mut p, n.max(256)), "cuMemAlloc (tuning)")?;
                bufs.push(p);
                check(d, (d.memset_d8)(p, fill, n.max(256)), "cuMemsetD8 (tuning)")?;
            }
            check(d, (d.stream_create)(&mut stream, 1), "cuStreamCreate")?;
            for e in ev.iter_mut() {
                check(d, (d.event_create)(e, 0), "cuEventCreate")?;
            }
            let ptrs: Vec<usize> = bufs.iter().map(|&p| p as usize).collect();
            let mut times = Vec::with_capacity(candidates);
            for i in 0..candidates {
                let mut go = || -> Result<f64, RuntimeError> {
                    for _ in 0..WARM {
                        run(i, &ptrs, stream as usize)?;
                    }
                    let timed = |reps: usize, run: &mut CandidateRun| -> Result<f64, RuntimeError> {
                        check(d, (d.event_record)(ev[0], stream), "cuEventRecord")?;
                        for _ in 0..reps {
                            run(i, &ptrs, stream as usize)?;
                        }
                        check(d, (d.event_record)(ev[1], stream), "cuEventRecord")?;
                        check(d, (d.event_sync)(ev[1]), "cuEventSynchronize")?;
                        let mut ms = 0f32;
                        check(d, (d.event_elapsed)(&mut ms, ev[0], ev[1]), "cuEventElapsedTime")?;
                        Ok(ms as f64 * 1e-3 / reps as f64)
                    };
                    let first = timed(REPS, run)?;
                    let reps = ((TIMED / first.max(1e-9)).ceil() as usize).clamp(REPS, MAX_REPS);
                    if reps == REPS { Ok(first) } else { timed(reps, run) }
                };
                times.push(go().unwrap_or(f64::INFINITY));
            }
            Ok(times)
        })()
    };
    // SAFETY: the stream is drained before its buffers are freed.
    unsafe {
        if !ev[1].is_null() {
            (d.event_record)(ev[1], stream);
            (d.event_sync)(ev[1]);
        }
        for e in ev {
            if !e.is_null() {
                (d.event_destroy)(e);
            }
        }
        if !stream.is_null() {
            (d.stream_destroy)(stream);
        }
        for p in bufs {
            (d.mem_free)(p);
        }
        if !prev.is_null() {
            (d.ctx_set)(prev);
        }
    }
    result
}

/// What a kernel takes and how it is launched, as the CUDA emitter described it.
pub use braze_codegen::cuda::Launch as LaunchSpec;

/// One thing a CUDA module runs, in order: a generated kernel, a library matmul or a library
/// convolution.
pub enum Item {
    Kernel(usize),
    Matmul(Box<crate::cublaslt::Prepared>),
    Conv(Box<crate::cudnn::Prepared>),
}

pub struct CudaModule {
    _modules: Vec<CuModule>,
    ctx: CuContext,
    fns: Vec<CuFunction>,
    /// Scalar fallbacks compiled so far, by kernel ([Note: lazy scalar fallback] in
    /// braze-codegen), with their modules.
    fallbacks: std::sync::Mutex<(HashMap<usize, CuFunction>, Vec<CuModule>)>,
    /// The device's `sm_XY` and the cache version, for compiling fallbacks.
    arch: String,
    version: String,
    pub specs: Vec<LaunchSpec>,
    pub items: Vec<Item>,
    pub cached: bool,
    /// Whether runs may be captured and replayed as CUDA graphs (option `cuda_graphs`; the
    /// environment's `BRAZE_CUDA_GRAPHS=0` turns replay off everywhere).
    pub replay: bool,
    graphs: std::sync::Mutex<Replays>,
    /// Runs launched as a captured graph (for tests and stats).
    pub replays: std::sync::atomic::AtomicUsize,
    /// A small zeroed allocation in the module's context that stands for an empty buffer
    /// ([Note: empty buffers] in braze-driver).
    pub scratch: usize,
    /// Whether kernels launch with programmatic dependent launch ([Note: programmatic
    /// launch]): the device is Hopper or newer, and option `programmatic_launch` is on.
    pub programmatic: bool,
}

/// [Note: replay] A run of items whose buffer pointers and sizes are exactly those of one of
/// the latest runs of the same items is captured once into a CUDA graph; from then on a run with
/// those pointers launches the graph (one launch instead of one per kernel and matmul). In a
/// training or inference loop PyTorch's caching allocator hands out the same blocks every
/// iteration, so the steady state replays. Pointers are compared on every call, so a replay
/// touches exactly the memory the plain launches would. Off with `BRAZE_CUDA_GRAPHS=0`, and
/// never while the caller's stream is itself being captured.
#[derive(Default)]
struct Replays {
    /// Per run of items (`lo..hi`): a graph's runs are recorded and replayed independently.
    runs: HashMap<(usize, usize), RunReplays>,
    /// Capture failed once: run plainly from then on.
    off: bool,
    /// The private stream captures are recorded on.
    stream: usize,
}

/// The replay state of one run of items.
#[derive(Default)]
struct RunReplays {
    /// Keys of the latest plain runs: a key seen again is captured (a loop whose outputs
    /// alternate between two buffer sets, the previous step's still alive, repeats every
    /// other call).
    recent: Vec<Vec<u64>>,
    /// Captured runs by key, most recent last.
    execs: Vec<(Vec<u64>, usize)>,
}

/// How many captured pointer sets a run keeps (a loop that alternates between a few sets,
/// e.g. gradients kept across steps, still replays).
const MAX_REPLAYS: usize = 4;

/// Process-wide counts of runs of two or more items ([Note: replay]): (launched as a
/// captured graph, captured, launched item by item), for benchmarks that ask whether a loop
/// settles into replays (FSDP's all-gathered parameters may move between steps).
static RUN_COUNTS: [std::sync::atomic::AtomicUsize; 3] = [const { std::sync::atomic::AtomicUsize::new(0) }; 3];

pub fn run_counts() -> (usize, usize, usize) {
    let n = |i: usize| RUN_COUNTS[i].load(std::sync::atomic::Ordering::Relaxed);
    (n(0), n(1), n(2))
}

fn count_run(kind: usize) {
    RUN_COUNTS[kind].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

fn replay_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("BRAZE_CUDA_GRAPHS").map(|v| v != "0").unwrap_or(true))
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let Ok(d) = driver() else { return };
        let r = self.graphs.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: executables in flight are freed by the driver when they complete.
        unsafe {
            for (_, e) in r.runs.drain().flat_map(|(_, run)| run.execs) {
                (d.graph_exec_destroy)(e as CuGraphExec);
            }
            if r.stream != 0 {
                (d.stream_destroy)(r.stream as CuStream);
            }
            if self.scratch != 0 {
                (d.mem_free)(self.scratch as u64);
            }
        }
    }
}

/// Bytes of a module's empty-buffer stand-in: one element of any dtype, aligned as the
/// widest vector load.
pub const SCRATCH_BYTES: usize = 256;

/// The library workspace: one device allocation for the process, used by cuBLASLt's matmuls
/// and cuDNN's convolutions (runs are serial on one stream).
fn workspace() -> Result<usize, RuntimeError> {
    static WS: OnceLock<Result<usize, String>> = OnceLock::new();
    let d = driver()?;
    WS.get_or_init(|| {
        let mut p: u64 = 0;
        // SAFETY: allocates device memory in the current context.
        let rc = unsafe { (d.mem_alloc)(&mut p, crate::cublaslt::WORKSPACE) };
        if rc != 0 { Err(format!("cuMemAlloc of the matmul workspace failed ({rc})")) } else { Ok(p as usize) }
    })
    .clone()
    .map_err(RuntimeError::Environment)
}

// SAFETY: CUDA module and function handles may be used from any thread once the context is
// current there (run() makes it current).
unsafe impl Send for CudaModule {}
unsafe impl Sync for CudaModule {}

impl CudaModule {
    /// Loads the cubins of a graph's units into device `ordinal`'s primary context and
    /// resolves the kernels: `specs` in order, each in the cubin of its unit (identical
    /// kernels name one function, [Note: kernel dedup] in braze-codegen).
    pub fn load(cubins: &[Vec<u8>], ordinal: i32, specs: Vec<LaunchSpec>, items: Vec<Item>, cached: bool, version: &str) -> Result<CudaModule, RuntimeError> {
        let (arch, _) = device_info(ordinal)?;
        let programmatic = hopper_or_newer(&arch);
        let d = driver()?;
        let mut modules: Vec<CuModule> = Vec::with_capacity(cubins.len());
        // SAFETY: driver API used as documented; each cubin outlives cuModuleLoadData.
        unsafe {
            let (ctx, _) = make_primary_current(d, ordinal)?;
            for cubin in cubins {
                let mut module: CuModule = std::ptr::null_mut();
                check(d, (d.load)(&mut module, cubin.as_ptr() as *const c_void), "cuModuleLoadData")?;
                modules.push(module);
            }
            let mut fns = Vec::new();
            for s in &specs {
                let module = *modules.get(s.unit).ok_or_else(|| RuntimeError::Compile(format!("kernel {} has no unit", s.name)))?;
                fns.push(get_function(d, module, &s.name)?);
            }
            let mut scratch: u64 = 0;
            check(d, (d.mem_alloc)(&mut scratch, SCRATCH_BYTES), "cuMemAlloc (empty-buffer stand-in)")?;
            check(d, (d.memset_d8)(scratch, 0, SCRATCH_BYTES), "cuMemsetD8 (empty-buffer stand-in)")?;
            Ok(CudaModule {
                _modules: modules,
                ctx,
                fns,
                fallbacks: Default::default(),
                arch,
                version: version.to_string(),
                specs,
                items,
                cached,
                replay: true,
                graphs: Default::default(),
                replays: Default::default(),
                scratch: scratch as usize,
                programmatic,
            })
        }
    }

    /// Runs items `lo..hi` (kernels and matmuls) on `stream`, replaying a captured CUDA graph
    /// when this run's pointers were seen before ([Note: replay]). `used` lists the buffer
    /// ids the items touch: the pointers that key a replay.
    pub fn run_items(&self, lo: usize, hi: usize, used: &[u32], ptrs: &[usize], syms: &[i64], stream: usize) -> Result<(), RuntimeError> {
        match self.replayable(lo, hi, used, ptrs, syms, stream) {
            Some(exec) => {
                let d = driver()?;
                self.replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                count_run(0);
                // SAFETY: the graph was captured from these items with exactly these pointers.
                unsafe { check(d, (d.graph_launch)(exec as CuGraphExec, stream as CuStream), "cuGraphLaunch") }
            }
            None => {
                if hi - lo >= 2 {
                    count_run(2);
                }
                self.launch_items(lo, hi, ptrs, syms, stream)
            }
        }
    }

    /// The captured graph to launch for this run (capturing it now if its pointers were seen
    /// in one of the latest runs), or None to launch the items one by one.
    fn replayable(&self, lo: usize, hi: usize, used: &[u32], ptrs: &[usize], syms: &[i64], stream: usize) -> Option<usize> {
        if hi - lo < 2 || !self.replay || !replay_enabled() {
            return None;
        }
        let d = driver().ok()?;
        let mut r = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if r.off {
            return None;
        }
        let mut capturing: c_int = 0;
        // SAFETY: a query on the caller's stream (an error, e.g. the legacy stream during
        // another stream's global capture, counts as capturing).
        let rc = unsafe { (d.is_capturing)(stream as CuStream, &mut capturing) };
        if rc != 0 || capturing != 0 {
            return None;
        }
        let mut key: Vec<u64> = Vec::with_capacity(2 + used.len() + syms.len());
        key.extend([lo as u64, hi as u64]);
        key.extend(used.iter().map(|&b| ptrs[b as usize] as u64));
        key.extend(syms.iter().map(|&s| s as u64));
        let run = r.runs.entry((lo, hi)).or_default();
        if let Some((_, exec)) = run.execs.iter().find(|(k, _)| *k == key) {
            return Some(*exec);
        }
        match run.recent.iter().position(|k| *k == key) {
            Some(i) => {
                run.recent.remove(i);
            }
            None => {
                if run.recent.len() == MAX_REPLAYS {
                    run.recent.remove(0);
                }
                run.recent.push(key);
                return None;
            }
        }
        count_run(1);
        let Ok(exec) = self.capture(&mut r, lo, hi, ptrs, syms) else {
            r.off = true;
            return None;
        };
        let run = r.runs.entry((lo, hi)).or_default();
        if run.execs.len() == MAX_REPLAYS {
            let (_, old) = run.execs.remove(0);
            // SAFETY: freed by the driver once any launch of it completes.
            unsafe { (d.graph_exec_destroy)(old as CuGraphExec) };
        }
        run.execs.push((key, exec));
        Some(exec)
    }

    /// Records items `lo..hi` on the module's private stream into an executable graph.
    fn capture(&self, r: &mut Replays, lo: usize, hi: usize, ptrs: &[usize], syms: &[i64]) -> Result<usize, RuntimeError> {
        let d = driver()?;
        // SAFETY: capture on a stream only this module uses; the capture is always ended.
        unsafe {
            if r.stream == 0 {
                let mut s: CuStream = std::ptr::null_mut();
                check(d, (d.stream_create)(&mut s, 1), "cuStreamCreate")?;
                r.stream = s as usize;
            }
            let s = r.stream as CuStream;
            // Thread-local mode: other threads' allocations do not invalidate this capture.
            check(d, (d.begin_capture)(s, 1), "cuStreamBeginCapture")?;
            let launched = self.launch_items(lo, hi, ptrs, syms, r.stream);
            let mut graph: CuGraph = std::ptr::null_mut();
            let ended = check(d, (d.end_capture)(s, &mut graph), "cuStreamEndCapture");
            launched?;
            ended?;
            let mut exec: CuGraphExec = std::ptr::null_mut();
            let inst = check(d, (d.graph_instantiate)(&mut exec, graph, 0), "cuGraphInstantiate");
            (d.graph_destroy)(graph);
            inst?;
            Ok(exec as usize)
        }
    }

    /// Launches items `lo..hi` one by one on `stream`.
    fn launch_items(&self, lo: usize, hi: usize, ptrs: &[usize], syms: &[i64], stream: usize) -> Result<(), RuntimeError> {
        for it in &self.items[lo..hi] {
            match it {
                Item::Kernel(k) => self.run(*k, *k + 1, ptrs, syms, stream)?,
                Item::Matmul(m) => {
                    let ws = workspace()?;
                    m.run(ptrs, stream, ws)?
                }
                Item::Conv(c) => c.run(ptrs, stream, workspace()?)?,
            }
        }
        Ok(())
    }

    /// Kernel `k`'s scalar fallback, compiled (through the disk cache) and loaded on first use
    /// ([Note: lazy scalar fallback]).
    fn fallback(&self, k: usize) -> Result<CuFunction, RuntimeError> {
        let mut g = self.fallbacks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&f) = g.0.get(&k) {
            return Ok(f);
        }
        let fb = self.specs[k].fallback.as_ref().ok_or_else(|| RuntimeError::Compile(format!("kernel {} has no fallback", self.specs[k].name)))?;
        let (cubin, _) = compile_cubin(&fb.source, &self.arch, &self.version)?;
        let d = driver()?;
        // SAFETY: driver API used as documented; the cubin outlives cuModuleLoadData.
        unsafe {
            ensure_current(d, self.ctx)?;
            let mut module: CuModule = std::ptr::null_mut();
            check(d, (d.load)(&mut module, cubin.as_ptr() as *const c_void), "cuModuleLoadData")?;
            g.1.push(module);
            let f = get_function(d, module, &fb.name)?;
            g.0.insert(k, f);
            Ok(f)
        }
    }

    /// Launches kernels `lo..hi` on `stream` with buffer pointers by id and size symbols.
    pub fn run(&self, lo: usize, hi: usize, ptrs: &[usize], syms: &[i64], stream: usize) -> Result<(), RuntimeError> {
        let d = driver()?;
        // SAFETY: launches with exactly the parameters each kernel was generated with; the
        // caller passes valid device pointers for every buffer the kernels touch.
        unsafe {
            ensure_current(d, self.ctx)?;
            for k in lo..hi {
                let s = &self.specs[k];
                let mut vals: Vec<u64> = Vec::with_capacity(s.bufs.len() + s.syms.len());
                for &b in &s.bufs {
                    vals.push(ptrs[b as usize] as u64);
                }
                for &y in &s.syms {
                    vals.push(syms[y as usize] as u64);
                }
                let mut params: Vec<*mut c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
                let n = s.work.eval_syms(syms).unwrap_or(0).max(0) as u64;
                let blocks = s.blocks(n) as c_uint;
                if n == 0 {
                    continue;
                }
                let f = if s.misaligned(ptrs) { self.fallback(k)? } else { self.fns[k] };
                let rc = if self.programmatic {
                    let mut attr = CuLaunchAttribute { id: PROGRAMMATIC_STREAM_SERIALIZATION, pad: 0, value: [1, 0, 0, 0, 0, 0, 0, 0] };
                    let cfg = CuLaunchConfig { grid: [blocks, 1, 1], block: [s.block, s.block_y, 1], shared_bytes: 0, stream: stream as CuStream, attrs: &mut attr, num_attrs: 1 };
                    (d.launch_ex)(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut())
                } else {
                    (d.launch)(f, blocks, 1, 1, s.block, s.block_y, 1, 0, stream as CuStream, params.as_mut_ptr(), std::ptr::null_mut())
                };
                if rc != 0 {
                    check(d, rc, &format!("launch of {}", s.name))?;
                }
            }
        }
        Ok(())
    }
}
