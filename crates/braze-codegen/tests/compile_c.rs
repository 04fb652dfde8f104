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
        let (distinct, entries) = braze_codegen::openmp::emit_kernels(&s.kernels).unwrap();
        if let Err(e) = braze_runtime::cpu::CpuModule::load_kernels(&distinct, &entries, "test") {
            panic!("{e}\n{}", braze_codegen::openmp::module_source(&distinct));
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
    let (distinct, entries) = braze_codegen::openmp::emit_kernels(&s.kernels).unwrap();
    let m = braze_runtime::cpu::CpuModule::load_kernels(&distinct, &entries, "test").unwrap();
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

/// [Note: kernel dedup]: two identical softmaxes separated by an extern call (a library op,
/// as the matmuls between a transformer's layers are) are emitted once; the second calls the
/// first one's function with its own buffers, and both compute what a plain loop does.
#[test]
fn identical_kernels_share_a_function() {
    let g = braze_ir::parse::parse_graph(
        "graph g {
  %0 = input index=0 strides=[16, 1] : f32[6, 16]
  %1 = amax dims=[1] keepdim=true %0 : f32[6, 1]
  %2 = sub %0, %1 : f32[6, 16]
  %3 = exp %2 : f32[6, 16]
  %4 = sum dims=[1] keepdim=true %3 : f32[6, 1]
  %5 = div %3, %4 : f32[6, 16]
  %6 = extern target=\"aten.neg.default\" outputs=1 %5
  %7 = extern_out index=0 strides=[16, 1] %6 : f32[6, 16]
  %8 = amax dims=[1] keepdim=true %7 : f32[6, 1]
  %9 = sub %7, %8 : f32[6, 16]
  %10 = exp %9 : f32[6, 16]
  %11 = sum dims=[1] keepdim=true %10 : f32[6, 1]
  %12 = div %10, %11 : f32[6, 16]
  return %12
}",
    )
    .unwrap();
    let s = schedule(&braze_passes::optimize(&g)).unwrap();
    let (distinct, entries) = braze_codegen::openmp::emit_kernels(&s.kernels).unwrap();
    let src = braze_codegen::openmp::module_source(&distinct);
    assert_eq!(entries.len(), 2, "{src}");
    assert_eq!((entries[0].distinct, entries[1].distinct, distinct.len()), (0, 0, 1), "{src}");
    assert_eq!(entries[0].name, entries[1].name, "{src}");
    assert_ne!(entries[0].params, entries[1].params);
    assert_eq!(src.matches("void braze_").count(), 1, "{src}");
    let m = braze_runtime::cpu::CpuModule::load_kernels(&distinct, &entries, "test").unwrap();
    let x: Vec<f32> = (0..96).map(|i| (i as f32 * 0.37).cos() * 3.0).collect();
    let mut bufs: Vec<Vec<f32>> = s.buffers.iter().map(|_| vec![f32::NAN; 96]).collect();
    let mut ptrs: Vec<usize> = bufs.iter_mut().map(|t| t.as_mut_ptr() as usize).collect();
    ptrs[0] = x.as_ptr() as usize;
    let ext = entries[1].params[0] as usize; // the extern's result, read by the second kernel
    // SAFETY: every buffer holds the 96 elements the schedule's largest buffer needs.
    unsafe { m.run(0, 1, &ptrs, &[], 0) }.expect("first kernel runs");
    let mid: Vec<f32> = bufs[entries[0].params[1] as usize].iter().map(|v| -v).collect();
    bufs[ext].copy_from_slice(&mid);
    // SAFETY: as above.
    unsafe { m.run(1, 2, &ptrs, &[], 0) }.expect("second kernel runs");
    let softmax = |v: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; 96];
        for r in 0..6 {
            let row = &v[r * 16..(r + 1) * 16];
            let mx = row.iter().cloned().fold(f32::MIN, f32::max);
            let sum: f32 = row.iter().map(|a| (a - mx).exp()).sum();
            for c in 0..16 {
                out[r * 16 + c] = (row[c] - mx).exp() / sum;
            }
        }
        out
    };
    let first = softmax(&x);
    let want = softmax(&first.iter().map(|v| -v).collect::<Vec<_>>());
    for (a, b) in bufs[s.outputs[0].buf as usize].iter().zip(&want) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

/// A column kernel of two passes (column sums, then a pointwise pass reading them, as in
/// BatchNorm's backward in channels_last) over 70 columns: two chunks of the column emitter,
/// values of each column carried between the passes in arrays; computes what a loop does.
#[test]
fn multi_pass_column_kernel_runs() {
    let g = braze_ir::parse::parse_graph(
        "graph g {
  %0 = input index=0 strides=[70, 1] : f32[50, 70]
  %1 = input index=1 strides=[70, 1] : f32[50, 70]
  %2 = sum dims=[0] keepdim=true %0 : f32[1, 70]
  %3 = mul %0, %1 : f32[50, 70]
  %4 = sum dims=[0] keepdim=true %3 : f32[1, 70]
  %5 = mul %2, %4 : f32[1, 70]
  %6 = sub %0, %5 : f32[50, 70]
  return %6, %2
}",
    )
    .unwrap();
    let s = schedule(&braze_passes::optimize(&g)).unwrap();
    assert!(s.kernels.iter().any(|k| k.column && k.passes.len() > 1), "{s}");
    let (distinct, entries) = braze_codegen::openmp::emit_kernels(&s.kernels).unwrap();
    let src = braze_codegen::openmp::module_source(&distinct);
    let m = braze_runtime::cpu::CpuModule::load_kernels(&distinct, &entries, "test").unwrap();
    let x: Vec<f32> = (0..3500).map(|i| ((i * 37 % 101) as f32) * 0.01 - 0.5).collect();
    let y: Vec<f32> = (0..3500).map(|i| ((i * 53 % 89) as f32) * 0.02 - 0.9).collect();
    let mut bufs: Vec<Vec<f32>> = s.buffers.iter().map(|_| vec![f32::NAN; 3500]).collect();
    let mut ptrs: Vec<usize> = bufs.iter_mut().map(|t| t.as_mut_ptr() as usize).collect();
    ptrs[0] = x.as_ptr() as usize;
    ptrs[1] = y.as_ptr() as usize;
    // SAFETY: every buffer holds the 3500 elements the largest one needs.
    unsafe { m.run(0, m.len(), &ptrs, &[], 0) }.expect("kernels run");
    let (out, sums) = (&bufs[s.outputs[0].buf as usize], &bufs[s.outputs[1].buf as usize]);
    for c in 0..70 {
        let sx: f32 = (0..50).map(|r| x[r * 70 + c]).sum();
        let sxy: f32 = (0..50).map(|r| x[r * 70 + c] * y[r * 70 + c]).sum();
        assert!((sums[c] - sx).abs() < 1e-3, "column {c}: {} vs {sx}", sums[c]);
        for r in 0..50 {
            let want = x[r * 70 + c] - sx * sxy;
            let got = out[r * 70 + c];
            assert!((got - want).abs() < 1e-3 * want.abs().max(1.0), "({r}, {c}): {got} vs {want}\n{src}");
        }
    }
}

/// [Note: kernel configurations]: each filetest kernel's candidates start with the heuristic's
/// configuration, emitted exactly as `emit_kernel` emits the kernel (so default mode's code
/// and cache keys do not depend on max-autotune), read back from their remembered text, and
/// emit distinct code.
#[test]
fn kernel_configurations() {
    use braze_codegen::cuda::{candidates, emit_candidates, emit_kernel, Config, Gpu};
    let mut several = 0;
    for g in graphs() {
        let s = schedule(&g).unwrap();
        for k in &s.kernels {
            let cs = candidates(k);
            assert_eq!(cs[0], Config::heuristic(k));
            for c in &cs {
                assert_eq!(Config::from_text(&c.to_text()), Some(*c), "{}", c.to_text());
            }
            let emitted = emit_candidates(k, Gpu::new("sm_90", 132)).unwrap();
            let mut plain = String::new();
            let launch = emit_kernel(k, Gpu::new("sm_90", 132), &mut plain).unwrap();
            let first = &emitted[0];
            assert_eq!(first.kernel.text.replace(&format!("{}_c0", k.name), &k.name), plain);
            assert_eq!((first.launch.block, first.launch.block_y, first.launch.per_block, first.launch.cap), (launch.block, launch.block_y, launch.per_block, launch.cap));
            let mut keys: Vec<&str> = emitted.iter().map(|c| c.kernel.key.as_str()).collect();
            keys.sort();
            keys.dedup();
            assert_eq!(keys.len(), emitted.len());
            several += (emitted.len() > 1) as usize;
        }
    }
    assert!(several > 10, "{several} kernels with several configurations");
    assert_eq!(Config::from_text("t256 g0 w1 c8x64"), None);
    assert_eq!(Config::from_text("t100 g0 w1 c8x64 v8 u0"), None);
}
