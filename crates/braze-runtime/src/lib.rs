//! # braze-runtime: compiling, caching, loading and running kernels
//!
//! `cpu.rs` builds a graph's C module with the system C compiler (one invocation per graph),
//! caches it on disk (`cache.rs`) and runs its kernels in-process.

pub mod cache;
pub mod cpu;
pub mod cublaslt;
pub mod cuda;

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
}
