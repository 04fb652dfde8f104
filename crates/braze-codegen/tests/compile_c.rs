//! Every kernel of the sched filetests compiles with the system C compiler, and a fused
//! pointwise kernel computes what a plain Rust loop computes.

use braze_sched::schedule;

fn graphs() -> Vec<braze_ir::Graph> {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/filetests/sched");
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        for case in text.split("// -----\n") {
            let head = case.split("// expect:").next().unwrap();
            out.push(braze_passes::optimize(&braze_ir::parse::parse_graph(head).unwrap()));
        }
    }
    out
}

#[test]
fn filetest_kernels_compile() {
    for g in graphs() {
        let s = schedule(&g).unwrap();
        let src = braze_codegen::openmp::emit_module(&s.kernels).unwrap();
        let names: Vec<String> = s.kernels.iter().map(|k| k.name.clone()).collect();
        if let Err(e) = braze_runtime::cpu::CpuModule::load(&src, &names, "test") {
            panic!("{e}\n{src}");
        }
    }
}

#[test]
fn fused_pointwise_runs() {
    let g = braze_ir::parse::parse_graph(
        "graph g {
  %0 = input index=0 strides=[7, 1] : f32[5, 7]
  %1 = input index=1 strides=[1] : f32[7]
  %2 = mul %0, %1 : f32[5, 7]
  %3 = sin %2 : f32[5, 7]
  %4 = sum dims=[1] keepdim=false %3 : f32[5]
  return %3, %4
}",
    )
    .unwrap();
    let s = schedule(&braze_passes::optimize(&g)).unwrap();
    let src = braze_codegen::openmp::emit_module(&s.kernels).unwrap();
    let names: Vec<String> = s.kernels.iter().map(|k| k.name.clone()).collect();
    let m = braze_runtime::cpu::CpuModule::load(&src, &names, "test").unwrap();
    let x: Vec<f32> = (0..35).map(|i| (i as f32 * 0.37).cos() * 3.0).collect();
    let w: Vec<f32> = (0..7).map(|i| 0.5 + i as f32 * 0.25).collect();
    let mut y = vec![f32::NAN; 35];
    let mut r = vec![f32::NAN; 5];
    let mut ptrs = vec![0usize; s.buffers.len()];
    ptrs[0] = x.as_ptr() as usize;
    ptrs[1] = w.as_ptr() as usize;
    ptrs[s.outputs[0].buf as usize] = y.as_mut_ptr() as usize;
    ptrs[s.outputs[1].buf as usize] = r.as_mut_ptr() as usize;
    // SAFETY: every buffer is sized as the schedule says.
    unsafe { m.run(0, m.len(), &ptrs, &[], 0) }.expect("kernels run");
    for i in 0..5 {
        let mut acc = 0f32;
        for j in 0..7 {
            let v = (x[i * 7 + j] * w[j]).sin();
            assert!((y[i * 7 + j] - v).abs() < 1e-5);
            acc += v;
        }
        assert!((r[i] - acc).abs() < 1e-4, "{} vs {acc}", r[i]);
    }
}
