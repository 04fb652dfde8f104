//! Golden tests of passes in text IR: `tests/filetests/passes/*.bz` (see braze-testkit).

#[test]
fn pass_filetests() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/filetests/passes");
    braze_testkit::run_filetests(&dir, &|steps, mut g| {
        for name in steps {
            let pass = braze_passes::pass_by_name(name).ok_or(format!("unknown pass {name}"))?;
            g = pass(&g);
            let errs = braze_ir::verify::verify(&g);
            if !errs.is_empty() {
                return Err(format!("verifier after {name}: {errs:?}"));
            }
        }
        Ok(g.to_string())
    });
}
