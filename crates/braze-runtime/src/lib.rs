//! # braze-runtime: compiling, caching, loading and running kernels
//!
//! `cpu.rs` builds a graph's C module with the system C compiler (one invocation per
//! translation unit, in parallel), caches each unit on disk (`cache.rs`) and runs its kernels in-process.

/// Resolves C entry point `$name` of library `$lib` into a struct field of the matching
/// function-pointer type; a missing symbol is an `Err(String)` of the enclosing closure.
macro_rules! sym {
    ($lib:expr, $name:literal) => {
        // SAFETY: the symbol has the C signature declared in the struct field it fills.
        *unsafe { $lib.get($name) }.map_err(|e| format!("{}: {e}", String::from_utf8_lossy($name)))?
    };
}

/// Loads a shared library by path or name.
fn open_library(path: &str) -> Result<libloading::Library, String> {
    // SAFETY: loading NVIDIA's libraries runs their initializers, which is what they are for.
    unsafe { libloading::Library::new(path) }.map_err(|e| format!("cannot load {path}: {e}"))
}

/// The library `cell` holds once its `init` ran: the loaded entry points, or why loading
/// failed; an error naming `what` before any `init`.
fn loaded<'a, T>(cell: &'a std::sync::OnceLock<Result<T, String>>, what: &str) -> Result<&'a T, RuntimeError> {
    match cell.get() {
        Some(Ok(l)) => Ok(l),
        Some(Err(e)) => Err(RuntimeError::Environment(e.clone())),
        None => Err(RuntimeError::Environment(format!("{what} not loaded"))),
    }
}

/// `f(0), ..., f(n-1)` on up to as many threads as the machine has cores (the compiler
/// invocations of a module's units, see braze-codegen's [Note: units]); results in order.
pub fn parallel_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    parallel_map_sparing(0, n, f)
}

/// `parallel_map` leaving `spare` of the machine's cores to other work (at least one thread).
/// Items are taken in order, so the longest put first finish first.
pub fn parallel_map_sparing<T: Send>(spare: usize, n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let cores = std::thread::available_parallelism().map(|p| p.get()).unwrap_or(1);
    let threads = cores.saturating_sub(spare).max(1).min(n);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let slots = std::sync::Mutex::new(&mut out);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                slots.lock().unwrap()[i] = Some(r);
            });
        }
    });
    out.into_iter().map(|r| r.expect("every item ran")).collect()
}

pub mod cache;
pub mod choices;
pub mod cpu;
pub mod cpu_blas;
pub mod cublaslt;
pub mod cuda;
pub mod cudnn;
pub mod matmul;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The generated source did not compile: a braze bug.
    #[error("kernel compilation failed: {0}")]
    Compile(String),
    /// A kernel launch failed; the message names the kernel.
    #[error("{0}")]
    Launch(String),
    /// Something missing from the machine (no C compiler, unwritable cache).
    #[error("environment: {0}")]
    Environment(String),
    /// A kernel read an index out of range (raised as eager raises it: IndexError).
    #[error("{0}")]
    OutOfRange(String),
}
