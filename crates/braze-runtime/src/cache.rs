//! The on-disk cache of compiled modules: `$BRAZE_CACHE_DIR` or `$XDG_CACHE_HOME/braze` or
//! `~/.cache/braze`. An entry's name is the hash of everything that decides its content:
//! source, compiler identity, flags and braze's version.

use std::path::PathBuf;

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("BRAZE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("braze")
}

/// The cache key of a module.
pub fn key(parts: &[&str]) -> String {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update(&[0]);
    }
    h.finalize().to_hex()[..32].to_string()
}

/// The per-kernel index entry `<dir>/k/<hash>` ([Note: per-kernel cache] in cpu.rs,
/// [Note: per-kernel CUDA cache] in cuda.rs): the file in `dir` holding the kernel (a
/// library or a cubin) and its symbol there; None when there is no entry or its file is gone.
pub fn index_lookup(dir: &std::path::Path, hash: &str) -> Option<(String, String)> {
    let text = std::fs::read_to_string(dir.join("k").join(hash)).ok()?;
    let (file, sym) = text.split_once('\n')?;
    dir.join(file).exists().then(|| (file.to_string(), sym.trim().to_string()))
}

/// Writes the index entry of `hash`: kernel `sym` is in `file` (in `dir`). Written to a
/// temporary name and renamed, so a reader never sees half an entry; a failed write only
/// costs a later compile.
pub fn index_write(dir: &std::path::Path, hash: &str, file: &str, sym: &str) {
    let kdir = dir.join("k");
    let tmp = kdir.join(format!("{hash}.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, format!("{file}\n{sym}\n")).is_ok() {
        let _ = std::fs::rename(&tmp, kdir.join(hash));
    }
}
