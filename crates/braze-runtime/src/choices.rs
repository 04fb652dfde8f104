//! Tuning choices remembered across processes.
//!
//! [Note: remembered choices] What timing picked at compile time (a cuBLASLt algorithm, the
//! index of a cuDNN plan among the heuristic's) is kept in memory for the process and written
//! to `<cache dir>/tune/<library>-<scope hash>`, one line `<key hash> <value>` per choice.
//! The scope names everything that makes a choice valid and right: the library and its
//! version, the device's name and architecture. A later process with the same scope reads the
//! file once and reuses each choice instead of timing again, so a warm cache's first call
//! pays no tuning. Lines are appended with one write each (whole lines, the last for a key
//! wins); a file that cannot be read or written only costs a later timing.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

/// The choices of one library, by scope and key.
pub struct Choices {
    library: &'static str,
    /// Where the files are: the cache directory's `tune` folder unless a test names another.
    dir: Option<PathBuf>,
    tables: Mutex<HashMap<String, HashMap<String, String>>>,
}

impl Choices {
    pub fn new(library: &'static str) -> Choices {
        Choices { library, dir: None, tables: Mutex::new(HashMap::new()) }
    }

    #[cfg(test)]
    fn in_dir(library: &'static str, dir: PathBuf) -> Choices {
        Choices { library, dir: Some(dir), tables: Mutex::new(HashMap::new()) }
    }

    fn file(&self, scope: &str) -> PathBuf {
        let dir = self.dir.clone().unwrap_or_else(|| crate::cache::cache_dir().join("tune"));
        dir.join(format!("{}-{}", self.library, crate::cache::key(&[scope])))
    }

    /// The choice for `key` in `scope`, from this process or an earlier one.
    pub fn get(&self, scope: &str, key: &str) -> Option<String> {
        let mut tables = self.tables.lock().unwrap();
        self.table(&mut tables, scope).get(&crate::cache::key(&[key])).cloned()
    }

    /// The choices of `scope`, read from its file the first time.
    fn table<'a>(&self, tables: &'a mut HashMap<String, HashMap<String, String>>, scope: &str) -> &'a mut HashMap<String, String> {
        tables.entry(scope.to_string()).or_insert_with(|| read(&self.file(scope)))
    }

    /// Remembers `value` for `key` in `scope`, here and on disk.
    pub fn put(&self, scope: &str, key: &str, value: &str) {
        let hash = crate::cache::key(&[key]);
        let mut tables = self.tables.lock().unwrap();
        let table = self.table(&mut tables, scope);
        if table.get(&hash).map(String::as_str) == Some(value) {
            return;
        }
        table.insert(hash.clone(), value.to_string());
        let line = format!("{hash} {value}\n");
        let file = self.file(scope);
        let _ = file.parent().map(std::fs::create_dir_all);
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&file) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// What a choice made by `library` (its name and version) on device `ordinal` is valid for.
pub fn scope(library: &str, version: usize, ordinal: i32) -> Result<String, crate::RuntimeError> {
    Ok(format!("{library} {version} on {}", crate::cuda::device_scope(ordinal)?))
}

/// The choices in `file` (none where it is missing or unreadable); malformed lines are skipped.
fn read(file: &std::path::Path) -> HashMap<String, String> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, v)| k.len() == 32 && !v.is_empty())
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_survive_a_new_table_and_stay_apart_by_scope() {
        let dir = std::env::temp_dir().join(format!("braze-choices-{}", std::process::id()));
        let a = Choices::in_dir("testlib", dir.clone());
        assert_eq!(a.get("dev 1", "matmul 64x64"), None);
        a.put("dev 1", "matmul 64x64", "3");
        a.put("dev 1", "matmul 64x64", "5");
        a.put("dev 2", "matmul 64x64", "7");
        assert_eq!(a.get("dev 1", "matmul 64x64"), Some("5".into()));
        let b = Choices::in_dir("testlib", dir.clone());
        assert_eq!(b.get("dev 1", "matmul 64x64"), Some("5".into()), "the last line for a key wins");
        assert_eq!(b.get("dev 2", "matmul 64x64"), Some("7".into()));
        assert_eq!(b.get("dev 1", "matmul 64x128"), None);
        assert_eq!(Choices::in_dir("otherlib", dir.clone()).get("dev 1", "matmul 64x64"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
