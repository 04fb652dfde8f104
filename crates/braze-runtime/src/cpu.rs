//! CPU modules: each translation unit of the graph's C source is compiled once by the system
//! C compiler (`$CC` or `cc`) into a shared library, cached on disk, and loaded into the
//! process; the units compile in parallel. Every kernel
//! has the signature `void k(void** buffers, const int64_t* sizes)`: its own buffers by
//! position (an [`Entry`]'s `params`), the graph's size symbols by id. Identical kernels share
//! one function ([Note: kernel dedup] in braze-codegen).
//!
//! Modules are built with `-march=native`, so the cache key holds the host CPU's identity
//! ([`cpu_id`]): a cache directory shared by machines never hands one code built for another
//! CPU. Before running kernels, [`CpuModule::run`] sets the OpenMP thread count of the calling
//! thread to the caller's (PyTorch's `torch.get_num_threads()`).

use crate::cache::{cache_dir, index_lookup, index_write, key};
use crate::RuntimeError;
pub use braze_codegen::openmp::{Entry, KernelSource};
use std::ffi::c_void;
use std::process::Command;
use std::sync::OnceLock;

type KernelFn = unsafe extern "C" fn(*const *mut c_void, *const i64);
type SetThreadsFn = unsafe extern "C" fn(i32);

/// `-ffp-contract=off`: no fused multiply-add, so results round like eager ATen.
/// `-fno-builtin-sin/cos*` keeps GCC from merging sin and cos into `sincos`, which has no
/// vector variant and so stops vectorization of the whole loop.
pub const CFLAGS: &[&str] = &[
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off", "-fno-builtin-sin", "-fno-builtin-cos", "-fno-builtin-sinf", "-fno-builtin-cosf", "-std=gnu11", "-w",
];

/// Libraries linked after the source: libm, and libmvec (glibc's vector math) on x86-64.
pub const LIBS: &[&str] = if cfg!(all(target_arch = "x86_64", target_os = "linux")) { &["-lmvec", "-lm"] } else { &["-lm"] };

/// One item of a CPU module's runs: a generated kernel (by index into the module's entries)
/// or a library matmul ([Note: CPU matmuls] in `cpu_blas.rs`).
pub enum CpuItem {
    Kernel(usize),
    Matmul(Box<crate::cpu_blas::CpuMatmul>),
}

pub struct CpuModule {
    /// What runs, in plan order: kernels and matmuls.
    items: Vec<CpuItem>,
    _libs: Vec<libloading::Library>,
    /// Each kernel's function and the buffer ids it is handed, in parameter order.
    fns: Vec<KernelFn>,
    params: Vec<Vec<u32>>,
    /// The most parameters a kernel has.
    max_params: usize,
    /// Addresses of each unit's `braze_oob` flag (a C `int`): set by a kernel that read an
    /// out-of-range index.
    oob: Vec<usize>,
    /// The OpenMP runtime's `omp_set_num_threads`, as the units resolve it.
    set_threads: Option<SetThreadsFn>,
    /// The shared libraries the kernels are in.
    pub paths: Vec<std::path::PathBuf>,
    /// True when every kernel came from the disk cache.
    pub cached: bool,
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// The compiler's `--version` text (part of the cache key), read once per process.
fn compiler_id() -> Result<&'static str, RuntimeError> {
    static ID: OnceLock<Result<String, String>> = OnceLock::new();
    ID.get_or_init(|| {
        Command::new(compiler())
            .arg("--version")
            .output()
            .map_err(|e| format!("no C compiler `{}`: {e}", compiler()))
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
    })
    .as_deref()
    .map_err(|e| RuntimeError::Environment(e.clone()))
}

/// The host CPU as `-march=native` sees it (part of the cache key), read once per process:
/// the target flags the compiler driver expands `-march=native` into (`cc -### ...`: the
/// architecture, every `-m` feature flag, cache sizes, tuning), which is exactly what decides
/// the generated code; `/proc/cpuinfo`'s model name and flags where the driver says nothing.
pub fn cpu_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let mut id = String::new();
        if let Ok(o) = Command::new(compiler()).args(["-march=native", "-###", "-x", "c", "-c", "/dev/null", "-o", "/dev/null"]).output() {
            // GCC prints the cc1 command line (`"-march=rocketlake" -mavx2 -mno-sse4a ...
            // --param "l1-cache-size=48" ... "-mtune=rocketlake"`), Clang `-target-cpu X
            // -target-feature +avx2 ...`; temporary file names are left out.
            let text = String::from_utf8_lossy(&o.stderr);
            let mut prev = "";
            for tok in text.split_whitespace().map(|t| t.trim_matches('"')) {
                let keep = tok.starts_with("-m") || tok.contains("cache-") || matches!(prev, "-target-cpu" | "-target-feature" | "-tune-cpu");
                if keep {
                    id.push_str(tok);
                    id.push(' ');
                }
                prev = tok;
            }
        }
        if !id.contains("-march=") && !id.contains('+') {
            if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
                for key in ["model name", "flags", "Features", "CPU part"] {
                    if let Some(l) = info.lines().find(|l| l.starts_with(key)) {
                        id.push_str(l);
                        id.push('\n');
                    }
                }
            }
        }
        id
    })
}

/// Compiles one translation unit into the cache (or finds it there): its path, and whether
/// it was cached.
fn build(source: &str, version: &str) -> Result<(std::path::PathBuf, bool), RuntimeError> {
    let cc = compiler();
    let flags = format!("{} {}", CFLAGS.join(" "), LIBS.join(" "));
    let k = key(&[source, compiler_id()?, cpu_id(), &cc, &flags, version]);
    let dir = cache_dir().join("cpu");
    std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::Environment(format!("cache dir {}: {e}", dir.display())))?;
    let so = dir.join(format!("{k}.so"));
    if so.exists() {
        return Ok((so, true));
    }
    let src = dir.join(format!("{k}.c"));
    std::fs::write(&src, source).map_err(|e| RuntimeError::Environment(e.to_string()))?;
    let tmp = dir.join(format!("{k}.{}.tmp.so", std::process::id()));
    let out = Command::new(&cc)
        .args(CFLAGS)
        .arg(&src)
        .arg("-o")
        .arg(&tmp)
        .args(LIBS)
        .output()
        .map_err(|e| RuntimeError::Environment(format!("cannot run `{cc}`: {e}")))?;
    if !out.status.success() {
        return Err(RuntimeError::Compile(format!("{} failed on {}:\n{}", cc, src.display(), String::from_utf8_lossy(&out.stderr))));
    }
    std::fs::rename(&tmp, &so).map_err(|e| RuntimeError::Environment(e.to_string()))?;
    Ok((so, false))
}

/// Kernels compiled by the C compiler in this process (cache hits not counted).
static KERNELS_COMPILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many kernels the C compiler has compiled in this process ([Note: per-kernel cache]).
pub fn kernels_compiled() -> usize {
    KERNELS_COMPILED.load(std::sync::atomic::Ordering::Relaxed)
}

impl CpuModule {
    /// [Note: per-kernel cache] Loads a graph's distinct kernels, compiling only those the
    /// disk cache does not hold. Each kernel is cached on its own: an index entry
    /// (`cpu/k/<hash>`, the hash of its canonical text, the prelude, the compiler, the host
    /// CPU, the flags and braze's version) names the library holding it and its symbol
    /// there, whichever graph's unit that library was built from. The kernels not found are
    /// compiled as units (braze-codegen's [Note: units], sized by their number) in parallel,
    /// and indexed. A graph that shares most kernels with one compiled before (the same
    /// model with another depth, a recompile after a guard failed) compiles only the rest.
    /// `uses[i]` is kernel `i`'s entry, naming its distinct kernel.
    pub fn load_kernels(distinct: &[KernelSource], uses: &[Entry], version: &str) -> Result<CpuModule, RuntimeError> {
        let cc = compiler();
        let flags = format!("{} {}", CFLAGS.join(" "), LIBS.join(" "));
        let base = [braze_codegen::openmp::prelude(), compiler_id()?, cpu_id(), &cc, &flags, version];
        let dir = cache_dir().join("cpu");
        let kdir = dir.join("k");
        std::fs::create_dir_all(&kdir).map_err(|e| RuntimeError::Environment(format!("cache dir {}: {e}", kdir.display())))?;
        let hashes: Vec<String> = distinct.iter().map(|k| key(&[&[k.key.as_str()], &base[..]].concat())).collect();
        // (library, symbol) per distinct kernel, from the index where it is there.
        let mut found: Vec<Option<(std::path::PathBuf, String)>> = hashes.iter().map(|h| index_lookup(&dir, h).map(|(lib, sym)| (dir.join(lib), sym))).collect();
        let misses: Vec<usize> = (0..distinct.len()).filter(|&k| found[k].is_none()).collect();
        KERNELS_COMPILED.fetch_add(misses.len(), std::sync::atomic::Ordering::Relaxed);
        let sizes: Vec<usize> = misses.iter().map(|&k| distinct[k].text.len()).collect();
        let units: Vec<(String, Vec<usize>)> = braze_codegen::units::balanced(&sizes, braze_codegen::units::MIN_KERNELS_PER_UNIT)
            .into_iter()
            .map(|pos| {
                let ks: Vec<usize> = pos.into_iter().map(|p| misses[p]).collect();
                (braze_codegen::openmp::module_source(ks.iter().map(|&k| &distinct[k])), ks)
            })
            .collect();
        let built = crate::parallel_map(units.len(), |u| build(&units[u].0, version)).into_iter().collect::<Result<Vec<_>, _>>()?;
        for ((so, _), (_, ks)) in built.iter().zip(&units) {
            let lib = so.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default();
            for &k in ks {
                index_write(&dir, &hashes[k], &lib, &distinct[k].name);
                found[k] = Some((so.clone(), distinct[k].name.clone()));
            }
        }
        // Each library once, then each distinct kernel's function in it.
        let mut libs: Vec<libloading::Library> = Vec::new();
        let mut paths: Vec<std::path::PathBuf> = Vec::new();
        let mut kfns = Vec::with_capacity(distinct.len());
        for f in &found {
            let (so, sym) = f.as_ref().ok_or_else(|| RuntimeError::Compile("a kernel neither cached nor compiled".into()))?;
            let li = match paths.iter().position(|p| p == so) {
                Some(i) => i,
                None => {
                    // SAFETY: braze's own generated code, compiled from the source its index
                    // entry was hashed from; loading it runs no initializers of ours.
                    libs.push(unsafe { libloading::Library::new(so) }.map_err(|e| RuntimeError::Environment(format!("cannot load {}: {e}", so.display())))?);
                    paths.push(so.clone());
                    libs.len() - 1
                }
            };
            // SAFETY: every kernel is emitted with exactly the `KernelFn` signature.
            let f: libloading::Symbol<KernelFn> = unsafe { libs[li].get(sym.as_bytes()) }.map_err(|e| RuntimeError::Compile(format!("kernel {sym} missing in {}: {e}", so.display())))?;
            kfns.push(*f);
        }
        let mut fns = Vec::with_capacity(uses.len());
        for e in uses {
            fns.push(*kfns.get(e.distinct).ok_or_else(|| RuntimeError::Compile(format!("kernel {} has no function", e.name)))?);
        }
        let params: Vec<Vec<u32>> = uses.iter().map(|e| e.params.clone()).collect();
        let max_params = params.iter().map(Vec::len).max().unwrap_or(0);
        // SAFETY: `braze_oob` is an `int` defined by the generated prelude of each unit.
        let oob = libs.iter().filter_map(|l| unsafe { l.get::<*mut i32>(b"braze_oob") }.ok().map(|s| *s as usize)).collect();
        // SAFETY: `omp_set_num_threads(int)` of the OpenMP runtime the units link (-fopenmp).
        let set_threads = libs.iter().find_map(|l| unsafe { l.get::<SetThreadsFn>(b"omp_set_num_threads") }.ok().map(|s| *s));
        let items = (0..fns.len()).map(CpuItem::Kernel).collect();
        Ok(CpuModule { items, _libs: libs, fns, params, max_params, oob, set_threads, paths, cached: misses.is_empty() })
    }

    /// The module's items in plan order, in place of one item per kernel (the default).
    pub fn with_items(mut self, items: Vec<CpuItem>) -> Result<CpuModule, RuntimeError> {
        if items.iter().any(|i| matches!(i, CpuItem::Kernel(k) if *k >= self.fns.len())) {
            return Err(RuntimeError::Compile("a kernel item past the module's kernels".into()));
        }
        self.items = items;
        Ok(self)
    }

    /// The number of items (kernels and matmuls).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Runs items `lo..hi` in order, kernels on `threads` OpenMP threads when `threads > 0`.
    ///
    /// The count is the calling thread's OpenMP setting (an ICV of the OpenMP runtime, per
    /// thread), so it is set on every call: PyTorch may have changed it, or (when PyTorch
    /// ships its own OpenMP runtime, or this thread never ran a PyTorch op) never set it in
    /// the runtime the kernels use. `omp_set_num_threads` only stores an int.
    ///
    /// # Safety
    /// `buffers[b]` must point to memory laid out as the schedule's buffer `b` for every
    /// buffer the kernels touch, and `sizes` must hold every size symbol they use.
    pub unsafe fn run(&self, lo: usize, hi: usize, buffers: &[usize], sizes: &[i64], threads: i32) -> Result<(), RuntimeError> {
        if let (true, Some(set)) = (threads > 0, self.set_threads) {
            // SAFETY: `omp_set_num_threads(int)`, called with a positive count.
            unsafe { set(threads) };
        }
        let mut args: Vec<*mut c_void> = Vec::with_capacity(self.max_params);
        for item in &self.items[lo..hi] {
            let k = match item {
                CpuItem::Kernel(k) => *k,
                CpuItem::Matmul(m) => {
                    // SAFETY: guaranteed by the caller (see above).
                    unsafe { m.run(buffers, sizes) }?;
                    continue;
                }
            };
            let (f, params) = (&self.fns[k], &self.params[k]);
            args.clear();
            for &b in params {
                let p = *buffers.get(b as usize).ok_or_else(|| RuntimeError::Launch(format!("buffer {b} has no pointer")))?;
                args.push(p as *mut c_void);
            }
            // SAFETY: guaranteed by the caller (see above).
            unsafe { f(args.as_ptr(), sizes.as_ptr()) };
            for &addr in &self.oob {
                // SAFETY: an aligned C `int` that lives as long as the library.
                let flag = unsafe { &*(addr as *const std::sync::atomic::AtomicI32) };
                if flag.swap(0, std::sync::atomic::Ordering::Relaxed) != 0 {
                    return Err(RuntimeError::OutOfRange("index out of range in a gather, index_select or embedding".into()));
                }
            }
        }
        Ok(())
    }
}
