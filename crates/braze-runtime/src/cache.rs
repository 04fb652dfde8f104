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
