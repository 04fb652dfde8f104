//! Golden tests of passes in text IR: `tests/filetests/passes/*.bz`.
//!
//! A file holds cases separated by `// -----`. Each case opens with a `///` line saying what
//! it proves, then `// run: pass1, pass2`, the input graph, and `// expect:` followed by the
//! expected printed graph, each line prefixed with `// `. `BLESS=1` rewrites expectations.

use std::path::PathBuf;

fn run_case(case: &str) -> Result<String, String> {
    let run = case
        .lines()
        .find_map(|l| l.trim().strip_prefix("// run:"))
        .ok_or("case has no `// run:` line")?;
    let input: String = case.split("// expect:").next().unwrap().to_string();
    let mut g = braze_ir::parse::parse_graph(&input).map_err(|e| e.to_string())?;
    for name in run.split(',').map(|s| s.trim()) {
        let pass = braze_passes::pass_by_name(name).ok_or(format!("unknown pass {name}"))?;
        g = pass(&g);
        let errs = braze_ir::verify::verify(&g);
        if !errs.is_empty() {
            return Err(format!("verifier after {name}: {errs:?}"));
        }
    }
    Ok(g.to_string())
}

#[test]
fn pass_filetests() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/filetests/passes");
    let bless = std::env::var("BLESS").is_ok();
    let mut failures = Vec::new();
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("bz") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut new_cases = Vec::new();
        for case in text.split("// -----\n") {
            count += 1;
            assert!(case.trim_start().starts_with("///"), "{}: case must open with a `///` sentence", path.display());
            let got = match run_case(case) {
                Ok(g) => g,
                Err(e) => {
                    failures.push(format!("{}: {e}", path.display()));
                    new_cases.push(case.to_string());
                    continue;
                }
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
                failures.push(format!("{}:\n--- expected\n{expected}+++ got\n{got}", path.display()));
            }
            let head = case.split("// expect:\n").next().unwrap();
            let body: String = got.lines().map(|l| format!("// {l}\n")).collect();
            new_cases.push(format!("{head}// expect:\n{body}"));
        }
        if bless {
            std::fs::write(&path, new_cases.join("// -----\n")).unwrap();
        }
    }
    assert!(count > 0, "no filetests found in {}", dir.display());
    if !bless {
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
