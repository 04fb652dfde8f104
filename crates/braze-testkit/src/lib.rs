//! The filetest runner. A `.bz` file holds cases separated by `// -----`. Each case opens
//! with a `///` sentence saying what it proves, then `// run: step1, step2`, the input graph,
//! and `// expect:` followed by the expected output, each line prefixed with `// `.
//! `BLESS=1` rewrites the expectations; a failure prints expected and actual output.

use braze_ir::Graph;
use std::path::Path;

/// What a filetest runs: `(steps, graph)` to the text output, or an error.
pub type Runner<'a> = &'a dyn Fn(&[&str], Graph) -> Result<String, String>;

/// Runs every case in every `.bz` file of `dir`; `run(steps, graph)` produces the output.
pub fn run_filetests(dir: &Path, run: Runner) {
    let bless = std::env::var("BLESS").is_ok();
    let mut failures = Vec::new();
    let mut count = 0;
    let mut paths: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    for path in paths {
        if path.extension().and_then(|e| e.to_str()) != Some("bz") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut new_cases = Vec::new();
        for case in text.split("// -----\n") {
            count += 1;
            assert!(case.trim_start().starts_with("///"), "{}: each case must open with a `///` sentence", path.display());
            let head = case.split("// expect:\n").next().unwrap();
            let steps: Vec<&str> = case
                .lines()
                .find_map(|l| l.trim().strip_prefix("// run:"))
                .map(|r| r.split(',').map(|s| s.trim()).collect())
                .unwrap_or_default();
            let got = braze_ir::parse::parse_graph(head).map_err(|e| e.to_string()).and_then(|g| run(&steps, g));
            let got = match got {
                Ok(s) => s,
                Err(e) => format!("error: {e}\n"),
            };
            let expected: String = case
                .split("// expect:\n")
                .nth(1)
                .unwrap_or("")
                .lines()
                .map(|l| l.strip_prefix("// ").unwrap_or(l.strip_prefix("//").unwrap_or(l)))
                .map(|l| format!("{l}\n"))
                .collect();
            if expected.trim() != got.trim() {
                failures.push(format!("{}: {}\n--- expected\n{expected}+++ got\n{got}", path.display(), head.lines().next().unwrap_or("")));
            }
            let body: String = got.lines().map(|l| if l.is_empty() { "//\n".to_string() } else { format!("// {l}\n") }).collect();
            new_cases.push(format!("{head}// expect:\n{body}"));
        }
        if bless {
            std::fs::write(&path, new_cases.join("// -----\n")).unwrap();
        }
    }
    assert!(count > 0, "no filetests in {}", dir.display());
    if !bless {
        assert!(failures.is_empty(), "{} filetest(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
}
