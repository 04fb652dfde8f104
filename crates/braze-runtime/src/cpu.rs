//! CPU modules: each translation unit of the graph's C source is compiled once by the system
//! C compiler (`$CC` or `cc`) into a shared library, cached on disk, and loaded into the
//! process; the units compile in parallel. Every kernel
//! has the signature `void k(void** buffers, const int64_t* sizes)`.

use crate::cache::{cache_dir, key};
use crate::RuntimeError;
use std::ffi::c_void;
use std::process::Command;
use std::sync::OnceLock;

type KernelFn = unsafe extern "C" fn(*const *mut c_void, *const i64);

/// `-ffp-contract=off`: no fused multiply-add, so results round like eager ATen.
/// `-fno-builtin-sin/cos*` keeps GCC from merging sin and cos into `sincos`, which has no
/// vector variant and so stops vectorization of the whole loop.
pub const CFLAGS: &[&str] = &[
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off", "-fno-builtin-sin", "-fno-builtin-cos", "-fno-builtin-sinf", "-fno-builtin-cosf", "-std=gnu11", "-w",
];

/// Libraries linked after the source: libm, and libmvec (glibc's vector math) on x86-64.
pub const LIBS: &[&str] = if cfg!(all(target_arch = "x86_64", target_os = "linux")) { &["-lmvec", "-lm"] } else { &["-lm"] };

pub struct CpuModule {
    _libs: Vec<libloading::Library>,
    fns: Vec<KernelFn>,
    /// Addresses of each unit's `braze_oob` flag (a C `int`): set by a kernel that read an
    /// out-of-range index.
    oob: Vec<usize>,
    /// The shared library of each unit.
    pub paths: Vec<std::path::PathBuf>,
    /// True when every unit came from the disk cache.
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

/// Compiles one translation unit into the cache (or finds it there): its path, and whether
/// it was cached.
fn build(source: &str, version: &str) -> Result<(std::path::PathBuf, bool), RuntimeError> {
    let cc = compiler();
    let flags = format!("{} {}", CFLAGS.join(" "), LIBS.join(" "));
    let k = key(&[source, compiler_id()?, &cc, &flags, version]);
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

impl CpuModule {
    /// Compiles (or finds in the cache) `source` and resolves the kernels `names`.
    pub fn load(source: &str, names: &[String], version: &str) -> Result<CpuModule, RuntimeError> {
        Self::load_units(&[source.to_string()], &[names.to_vec()], version)
    }

    /// Compiles (or finds in the cache) each translation unit, in parallel, and resolves the
    /// kernels `names[u]` of unit `u`; kernels are numbered in unit order.
    pub fn load_units(units: &[String], names: &[Vec<String>], version: &str) -> Result<CpuModule, RuntimeError> {
        let built = crate::parallel_map(units.len(), |u| build(&units[u], version)).into_iter().collect::<Result<Vec<_>, _>>()?;
        let mut libs = Vec::with_capacity(built.len());
        let mut fns = Vec::new();
        for ((so, _), names) in built.iter().zip(names) {
            // SAFETY: the library is braze's own generated code, compiled just now or earlier
            // from the same source; loading it runs no initializers of ours.
            let lib = unsafe { libloading::Library::new(so) }.map_err(|e| RuntimeError::Environment(format!("cannot load {}: {e}", so.display())))?;
            for n in names {
                // SAFETY: every kernel is emitted with exactly the `KernelFn` signature.
                let f: libloading::Symbol<KernelFn> = unsafe { lib.get(n.as_bytes()) }.map_err(|e| RuntimeError::Compile(format!("kernel {n} missing: {e}")))?;
                fns.push(*f);
            }
            libs.push(lib);
        }
        let cached = built.iter().all(|(_, c)| *c);
        // SAFETY: `braze_oob` is an `int` defined by the generated prelude of each unit.
        let oob = libs.iter().filter_map(|l| unsafe { l.get::<*mut i32>(b"braze_oob") }.ok().map(|s| *s as usize)).collect();
        Ok(CpuModule { _libs: libs, fns, oob, paths: built.into_iter().map(|(p, _)| p).collect(), cached })
    }

    pub fn len(&self) -> usize {
        self.fns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fns.is_empty()
    }

    /// Runs kernels `lo..hi` in order.
    ///
    /// # Safety
    /// `buffers[b]` must point to memory laid out as the schedule's buffer `b` for every
    /// buffer the kernels touch, and `sizes` must hold every size symbol they use.
    pub unsafe fn run(&self, lo: usize, hi: usize, buffers: &[usize], sizes: &[i64]) -> Result<(), RuntimeError> {
        for f in &self.fns[lo..hi] {
            // SAFETY: guaranteed by the caller (see above).
            unsafe { f(buffers.as_ptr() as *const *mut c_void, sizes.as_ptr()) };
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
