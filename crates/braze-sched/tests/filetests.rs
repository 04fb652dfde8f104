//! Golden tests of fusion and lowering: `tests/filetests/sched/*.bz` (see braze-testkit).
//! Each case's graph is optimized by the default pass pipeline, then scheduled; the output
//! is the schedule: buffers, kernels in loop IR, extern steps and outputs.

#[test]
fn sched_filetests() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/filetests/sched");
    braze_testkit::run_filetests(&dir, &|_steps, g| {
        let g = braze_passes::optimize(&g);
        let s = braze_sched::schedule(&g).map_err(|e| e.to_string())?;
        Ok(s.to_string())
    });
}
