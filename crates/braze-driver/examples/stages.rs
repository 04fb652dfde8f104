//! Times braze's compile stages (passes, schedule, C and CUDA code generation) on a graph
//! in the IR's text form, without compiling the code: `cargo run --release --example stages
//! -- graph.bz [repeats]`. Graph texts come from `BRAZE_LOGS=graph`.
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&args[1]).expect("graph file");
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let g = braze_ir::parse::parse_graph(&text).expect("graph parses");
    let (mut tp, mut ts, mut tc, mut tu) = (0.0, 0.0, 0.0, 0.0);
    let mut kernels = 0;
    for _ in 0..reps {
        let t = Instant::now();
        let opt = braze_passes::optimize(&g);
        tp += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let s = braze_sched::schedule(&opt).expect("schedules");
        ts += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _c = braze_codegen::openmp::emit_module(&s.kernels).expect("C");
        tc += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _u = braze_codegen::cuda::emit_module(&s.kernels, braze_codegen::cuda::Gpu::new("sm_90", 132)).expect("CUDA");
        tu += t.elapsed().as_secs_f64();
        kernels = s.kernels.len();
        if let Ok(path) = std::env::var("BRAZE_STAGES_DUMP") {
            std::fs::write(path, s.to_string()).expect("dump");
        }
    }
    let r = reps as f64;
    println!("nodes={} kernels={} passes={:.4} schedule={:.4} c={:.4} cuda={:.4}", g.nodes.len(), kernels, tp / r, ts / r, tc / r, tu / r);
}
