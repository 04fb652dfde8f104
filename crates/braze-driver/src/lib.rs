//! # braze-driver: the compile pipeline of one graph
//!
//! `compile` runs the stages in order — verify, passes (and per-target passes), schedule,
//! code generation, the compiler (cc or NVRTC, cuBLASLt preparation) — timing each, and
//! returns the [`Plan`] the Python runtime follows and the loaded [`Module`]. The Python
//! binding (braze-py) only converts these to Python objects.

use braze_ir::{Expr, Graph, Op};
use braze_runtime::cpu::{CpuItem, CpuModule};
use braze_runtime::matmul::{MatmulExprs, MatmulSpec, OperandExprs};
use braze_runtime::cuda::{CudaModule, Item};
use braze_runtime::RuntimeError;
use braze_sched::{Access, BufKind, Step};
use std::collections::HashSet;
use std::time::Instant;

/// Why a graph could not be compiled or run.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// braze does not handle this graph; it runs eagerly.
    #[error("{0}")]
    Unsupported(String),
    /// A braze bug (an invariant broken, generated code that does not compile).
    #[error("{0}")]
    Internal(String),
    /// The machine lacks something (C compiler, NVRTC, driver, cache dir).
    #[error("{0}")]
    Environment(String),
    /// A kernel or library call failed at run time; the message names it.
    #[error("{0}")]
    Launch(String),
    /// A kernel read an index out of range.
    #[error("{0}")]
    OutOfRange(String),
}

impl From<RuntimeError> for DriverError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Compile(m) => DriverError::Internal(m),
            RuntimeError::Environment(m) => DriverError::Environment(m),
            RuntimeError::Launch(m) => DriverError::Launch(m),
            RuntimeError::OutOfRange(m) => DriverError::OutOfRange(m),
        }
    }
}

fn unsupported(e: impl ToString) -> DriverError {
    DriverError::Unsupported(e.to_string())
}

/// Where a graph's kernels run.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    Cpu,
    Cuda(i32),
}

impl Target {
    /// `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Target, DriverError> {
        match s {
            "cpu" => Ok(Target::Cpu),
            "cuda" => Ok(Target::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Target::Cuda)
                .ok_or_else(|| unsupported(format!("device {s}"))),
        }
    }
}

/// The loaded kernels of a graph.
pub enum Module {
    Cpu(CpuModule),
    Cuda(CudaModule),
}

impl Module {
    /// Runs `items` (`lo..hi`) with buffer pointers by id (`used`: the ids the items touch, the
    /// only entries of `ptrs` read), size symbols, and, for CUDA, PyTorch's current stream;
    /// CPU kernels run on `threads` OpenMP threads (PyTorch's `torch.get_num_threads()`; 0
    /// leaves the setting alone).
    ///
    /// # Safety
    /// Every pointer in `used` must address memory laid out as the plan's buffer of that id.
    pub unsafe fn run(&self, items: std::ops::Range<usize>, used: &[u32], ptrs: &[usize], syms: &[i64], stream: usize, threads: i32) -> Result<(), DriverError> {
        let (lo, hi) = (items.start, items.end);
        match self {
            Module::Cpu(m) => {
                if hi > m.len() || lo > hi {
                    return Err(DriverError::Internal("kernel range out of bounds".into()));
                }
                // SAFETY: guaranteed by the caller.
                Ok(unsafe { m.run(lo, hi, ptrs, syms, threads) }?)
            }
            Module::Cuda(m) => {
                if hi > m.items.len() || lo > hi {
                    return Err(DriverError::Internal("kernel range out of bounds".into()));
                }
                Ok(m.run_items(lo, hi, used, ptrs, syms, stream)?)
            }
        }
    }
}

/// One buffer of the plan: (kind, input index or -1, dtype, shape expr ids, stride expr ids).
pub type BufferRow = (String, i64, String, Vec<usize>, Vec<usize>);
/// One step of the plan: ("kernels", lo, hi, "", [], []) or ("extern", node, 0, target,
/// args, outs).
pub type StepRow = (String, u32, u32, String, Vec<AccessT>, Vec<u32>);

/// A compiled graph's plan: what the Python runtime follows, and what the logs show.
/// Sizes, strides and offsets are ids into `exprs`, evaluated per call for dynamic shapes.
#[derive(Clone, Debug)]
pub struct Plan {
    pub exprs: Vec<Expr>,
    pub graph_before: String,
    pub graph_after: String,
    pub schedule: String,
    pub source: String,
    /// The CUDA source checked with NVRTC for a CPU graph (`check_cuda`), else empty.
    pub cuda_source: String,
    pub fusion_log: Vec<String>,
    /// (name, roots) per kernel.
    pub kernels: Vec<(String, Vec<String>)>,
    pub buffers: Vec<BufferRow>,
    pub steps: Vec<StepRow>,
    pub frees: Vec<Vec<u32>>,
    /// Temp buffers first written by each step (allocated just before it).
    pub allocs: Vec<Vec<u32>>,
    /// The buffers each step's kernels and matmuls touch (empty for extern steps): the only
    /// pointers a run reads, and the key of its CUDA-graph replay.
    pub step_bufs: Vec<Vec<u32>>,
    /// Byte offset of each buffer in the per-call arena, or -1 (see [Note: arena]).
    pub arena_offsets: Vec<i64>,
    /// The arena's windows ([Note: arena windows]): (first plan step, last plan step, bytes).
    pub arena_windows: Vec<(u32, u32, i64)>,
    /// The largest window: the most arena bytes live at once.
    pub arena_bytes: i64,
    pub outputs: Vec<AccessT>,
    /// Length of the size-symbol array kernels read (`S[n]` is `sN`).
    pub num_syms: usize,
    /// The size symbols the plan mentions; the runtime must find each among the inputs.
    pub syms: Vec<u32>,
    /// (stage, seconds).
    pub times: Vec<(String, f64)>,
    pub cached: bool,
}

/// (buffer, None) or (buffer, (size ids, stride ids, offset id)).
pub type AccessT = (u32, Option<(Vec<usize>, Vec<usize>, usize)>);

/// Distinct expressions in first-use order, with their ids (hashed: a graph has thousands).
struct ExprTable(Vec<Expr>, std::collections::HashMap<Expr, usize>);

impl ExprTable {
    fn id(&mut self, e: &Expr) -> usize {
        if let Some(&i) = self.1.get(e) {
            return i;
        }
        self.0.push(e.clone());
        self.1.insert(e.clone(), self.0.len() - 1);
        self.0.len() - 1
    }
    fn ids(&mut self, v: &[Expr]) -> Vec<usize> {
        v.iter().map(|e| self.id(e)).collect()
    }
    fn access(&mut self, a: &Access) -> AccessT {
        (a.buf, a.view.as_ref().map(|v| (self.ids(&v.sizes), self.ids(&v.strides), self.id(&v.offset))))
    }
}

/// A matmul step as the matrix libraries take it, its sizes as expressions.
fn matmul_exprs(g: &Graph, sched: &braze_sched::Schedule, step: &Step) -> Result<MatmulExprs, DriverError> {
    let Step::Matmul { node, a, b, bias, residual, out } = step else { return Err(DriverError::Internal("not a matmul step".into())) };
    let (node, out, bias, residual) = (*node, *out, bias.as_ref(), residual.as_ref());
    let operand = |x: &Access| -> OperandExprs {
        let buf = &sched.buffers[x.buf as usize];
        let (sizes, strides, offset) = match &x.view {
            Some(v) => (v.sizes.clone(), v.strides.clone(), v.offset.clone()),
            None => (buf.shape.clone(), buf.strides.clone(), Expr::zero()),
        };
        let r = sizes.len();
        OperandExprs {
            buf: x.buf,
            offset,
            rows: sizes[r - 2].clone(),
            cols: sizes[r - 1].clone(),
            rs: strides[r - 2].clone(),
            cs: strides[r - 1].clone(),
            batch_stride: if r == 3 { strides[0].clone() } else { Expr::zero() },
        }
    };
    let Op::Matmul { epilogue, tf32, .. } = g.node(node).op else { return Err(DriverError::Internal("not a matmul".into())) };
    let ty = g.ty(node);
    if ty.rank() > 3 {
        return Err(unsupported("matmul of rank > 3"));
    }
    let bias = match bias {
        Some(x) => {
            let off = x.view.as_ref().map(|v| v.offset.clone()).unwrap_or_else(Expr::zero);
            let unit = x.view.as_ref().map(|v| v.strides[0].is_const(1)).unwrap_or(true);
            if !unit {
                return Err(unsupported("strided matmul bias"));
            }
            Some((x.buf, off))
        }
        None => None,
    };
    Ok(MatmulExprs {
        name: format!("braze_matmul_{}", node.0),
        a: operand(a),
        b: operand(b),
        bias,
        residual: residual.map(operand),
        out,
        batch: if ty.rank() == 3 { ty.shape[0].clone() } else { Expr::one() },
        dtype: ty.dtype,
        tf32,
        epilogue,
    })
}

/// A matmul step with static sizes, as cuBLASLt takes it.
fn matmul_spec(g: &Graph, sched: &braze_sched::Schedule, step: &Step) -> Result<MatmulSpec, DriverError> {
    matmul_exprs(g, sched, step)?.eval(&[]).ok_or_else(|| unsupported("matmul with symbolic sizes"))
}

/// Per-graph choices of the user's options (`braze.compile(..., options=...)`).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Replay runs of kernels and matmuls as captured CUDA graphs when their pointers repeat.
    pub cuda_graphs: bool,
    /// Time cuBLASLt's candidate algorithms for large matmuls at compile time.
    pub matmul_tune: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { cuda_graphs: true, matmul_tune: true }
    }
}

pub fn compile(g: Graph, target: Target, check_cuda: bool, check_arch: &str) -> Result<(Plan, Option<Module>), DriverError> {
    compile_with(g, target, check_cuda, check_arch, Options::default())
}

pub fn compile_with(g: Graph, target: Target, check_cuda: bool, check_arch: &str, opts: Options) -> Result<(Plan, Option<Module>), DriverError> {
    let mut times = Vec::new();
    let mut t = Instant::now();
    let mut lap = |name: &str, times: &mut Vec<(String, f64)>| {
        times.push((name.to_string(), t.elapsed().as_secs_f64()));
        t = Instant::now();
    };
    let errs = braze_ir::verify::verify(&g);
    if !errs.is_empty() {
        return Err(unsupported(format!("imported graph is invalid: {}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))));
    }
    let graph_before = g.to_string();
    let mut opt = braze_passes::optimize(&g);
    if let Target::Cuda(ordinal) = target {
        // Few long rows would leave most of the GPU idle: split them (per-target stage).
        let (_, sms) = braze_runtime::cuda::device_info(ordinal).map_err(DriverError::from)?;
        opt = braze_passes::split_reductions::split_reductions(&opt, 2 * sms as i64);
        // cuBLASLt's fast kernels need aligned matrices (per-target stage).
        opt = braze_passes::pad_matmuls::pad_matmuls(&opt);
    } else {
        // Convolutions of CPU inference graphs ask for channels_last inputs that are often
        // channels_last already (per-target stage: not yet measured on the GPU).
        opt = braze_passes::elide_layouts::elide_layouts(&opt);
        if let Some(blocks) = std::env::var("BRAZE_SPLIT_REDUCTIONS_CPU").ok().and_then(|v| v.parse::<i64>().ok()) {
            // A test hook: the GPU's split on the CPU, so the CPU suite checks its numerics.
            opt = braze_passes::split_reductions::split_reductions(&opt, blocks);
        }
    }
    let errs = braze_ir::verify::verify(&opt);
    if !errs.is_empty() {
        return Err(DriverError::Internal(format!("verifier after passes: {errs:?}")));
    }
    lap("passes", &mut times);
    let sched = braze_sched::schedule(&opt).map_err(unsupported)?;
    lap("schedule", &mut times);
    let names: Vec<String> = sched.kernels.iter().map(|k| k.name.clone()).collect();
    let version = env!("CARGO_PKG_VERSION");
    // Several translation units of distinct kernels, compiled in parallel and cached each on
    // its own (braze-codegen's [Note: units] and [Note: kernel dedup]).
    let mut cuda_source = String::new();
    let (source, module) = match target {
        Target::Cpu => {
            // Kernels and matmuls ([Note: CPU matmuls]) in plan order.
            let mut items = Vec::new();
            for st in &sched.steps {
                match st {
                    Step::Kernel(k) => items.push(CpuItem::Kernel(*k)),
                    Step::Matmul { .. } => items.push(CpuItem::Matmul(Box::new(braze_runtime::cpu_blas::prepare(matmul_exprs(&opt, &sched, st)?).map_err(DriverError::from)?))),
                    Step::Extern { .. } => {}
                }
            }
            let (distinct, entries) = braze_codegen::openmp::emit_kernels(&sched.kernels).map_err(unsupported)?;
            if check_cuda && !names.is_empty() {
                let (cu, _) = braze_codegen::cuda::emit_units(&sched.kernels, 132, None).map_err(unsupported)?;
                braze_runtime::cuda::compile_cubins(&cu, check_arch, version).map_err(DriverError::from)?;
                cuda_source = cu.concat();
            }
            lap("codegen", &mut times);
            let m = if items.is_empty() {
                None
            } else {
                Some(Module::Cpu(CpuModule::load_kernels(&distinct, &entries, version).and_then(|m| m.with_items(items)).map_err(DriverError::from)?))
            };
            lap("cc", &mut times);
            (braze_codegen::openmp::module_source(&distinct), m)
        }
        Target::Cuda(ordinal) => {
            let (arch, sms) = braze_runtime::cuda::device_info(ordinal).map_err(DriverError::from)?;
            let (units, launches) = braze_codegen::cuda::emit_units(&sched.kernels, sms as u32, None).map_err(unsupported)?;
            lap("codegen", &mut times);
            let mut items = Vec::new();
            for st in &sched.steps {
                match st {
                    Step::Kernel(k) => items.push(Item::Kernel(*k)),
                    Step::Matmul { .. } => {
                        let spec = matmul_spec(&opt, &sched, st)?;
                        items.push(Item::Matmul(Box::new(braze_runtime::cublaslt::prepare(spec, opts.matmul_tune.then_some(ordinal)).map_err(DriverError::from)?)))
                    }
                    Step::Extern { .. } => {}
                }
            }
            lap("cublaslt", &mut times);
            let m = if items.is_empty() {
                None
            } else {
                let (cubins, cached) = if names.is_empty() { (Vec::new(), false) } else { braze_runtime::cuda::compile_cubins(&units, &arch, version).map_err(DriverError::from)? };
                lap("nvrtc", &mut times);
                let mut cm = CudaModule::load(&cubins, ordinal, launches, items, cached).map_err(DriverError::from)?;
                cm.replay = opts.cuda_graphs;
                Some(Module::Cuda(cm))
            };
            lap("load", &mut times);
            (if units.is_empty() { braze_codegen::cuda::emit_module(&[], sms as u32).map_err(unsupported)?.0 } else { units.concat() }, m)
        }
    };
    let cached = match &module {
        Some(Module::Cpu(m)) => m.cached,
        Some(Module::Cuda(m)) => m.cached,
        None => false,
    };
    let mut tab = ExprTable(Vec::new(), Default::default());
    let mut syms = Vec::new();
    for n in &opt.nodes {
        if let Some(t) = &n.ty {
            for e in &t.shape {
                e.syms(&mut syms);
            }
        }
    }
    for k in &sched.kernels {
        syms.extend(k.syms());
    }
    let buffers = sched
        .buffers
        .iter()
        .map(|b| {
            let (kind, idx) = match b.kind {
                BufKind::Input(i) => ("input", i as i64),
                BufKind::ExternOut => ("extern", -1),
                BufKind::Temp => ("temp", -1),
            };
            (kind.to_string(), idx, b.dtype.name().to_string(), tab.ids(&b.shape), tab.ids(&b.strides))
        })
        .collect();
    let mut arena_offsets = vec![-1i64; sched.buffers.len()];
    let mut arena_windows = Vec::new();
    {
        let mut external = vec![false; sched.buffers.len()];
        for a in &sched.outputs {
            external[a.buf as usize] = true;
        }
        for st in &sched.steps {
            if let Step::Extern { args, outs, .. } = st {
                for a in args {
                    external[a.buf as usize] = true;
                }
                for &o in outs.iter().filter(|&&o| o != braze_sched::schedule::UNUSED) {
                    external[o as usize] = true;
                }
            }
        }
        let mut members = Vec::new();
        for (b, buf) in sched.buffers.iter().enumerate() {
            let bytes = buf.shape.iter().map(|e| e.as_const()).product::<Option<i64>>().map(|n| n * buf.dtype.size() as i64);
            if let (BufKind::Temp, false, Some(bytes)) = (&buf.kind, external[b], bytes) {
                members.push((b, (bytes.max(1) + 255) / 256 * 256));
            }
        }
        let (first, last) = lifetimes(&sched);
        // A member no kernel touches (none is expected) stays in the first window.
        let span = |b: usize| if first[b] == usize::MAX { (0, 0) } else { (first[b], last[b]) };
        for (lo, hi, group) in arena_window_groups(sched.steps.len(), &members, span) {
            let (offsets, total) = arena_layout(&first, &last, &group);
            for ((b, _), off) in group.iter().zip(offsets) {
                arena_offsets[*b] = off;
            }
            arena_windows.push((lo, hi, total));
        }
    }
    // A window's first step starts a run of its own: a run's kernels see one arena.
    let window_starts: HashSet<usize> = arena_windows.iter().skip(1).map(|w| w.0).collect();
    // Consecutive kernels and matmuls ("items") become one step: one call into Rust runs
    // them all. Item i is sched step item_steps[i].
    let mut steps = Vec::new();
    let mut frees: Vec<Vec<u32>> = Vec::new();
    let mut item_writes: Vec<Vec<u32>> = Vec::new();
    let mut step_bufs: Vec<Vec<u32>> = Vec::new();
    let mut plan_step_of: Vec<usize> = Vec::with_capacity(sched.steps.len());
    for (s, st) in sched.steps.iter().enumerate() {
        let touched: Vec<u32> = match st {
            Step::Kernel(k) => sched.kernels[*k].bufs.iter().map(|b| b.id).collect(),
            Step::Matmul { out, .. } => st.matmul_operands().map(|x| x.buf).chain([*out]).collect(),
            Step::Extern { .. } => Vec::new(),
        };
        let writes = match st {
            Step::Kernel(k) => Some(sched.kernels[*k].bufs.iter().filter(|b| b.written).map(|b| b.id).collect::<Vec<_>>()),
            Step::Matmul { out, .. } => Some(vec![*out]),
            Step::Extern { .. } => None,
        };
        if let Some(w) = writes {
            let i = item_writes.len() as u32;
            item_writes.push(w);
            match steps.last_mut() {
                Some((kind, _, hi, _, _, _)) if kind == "kernels" && *hi == i && !window_starts.contains(&s) => {
                    *hi = i + 1;
                    frees.last_mut().unwrap().extend(sched.frees[s].iter().copied());
                    step_bufs.last_mut().unwrap().extend(touched);
                }
                _ => {
                    steps.push(("kernels".to_string(), i, i + 1, String::new(), vec![], vec![]));
                    frees.push(sched.frees[s].clone());
                    step_bufs.push(touched);
                }
            }
        } else if let Step::Extern { node, target, args, outs } = st {
            let a = args.iter().map(|x| tab.access(x)).collect();
            steps.push(("extern".to_string(), node.0, 0, target.clone(), a, outs.clone()));
            frees.push(sched.frees[s].clone());
            step_bufs.push(Vec::new());
        }
        plan_step_of.push(steps.len().saturating_sub(1));
    }
    for b in &mut step_bufs {
        b.sort_unstable();
        b.dedup();
    }
    let outputs = sched.outputs.iter().map(|a| tab.access(a)).collect();
    // [Note: arena] Temp buffers that only kernels and matmuls touch (not outputs, not extern
    // operands or results) and have static sizes live in one allocation per window of steps
    // ([Note: arena windows]), at fixed 256-byte aligned offsets: one allocator call instead
    // of one per buffer. Offsets are assigned by lifetime (`arena_layout`), so buffers that
    // are never live together share.
    let arena_windows: Vec<(u32, u32, i64)> = arena_windows.into_iter().map(|(lo, hi, n)| (plan_step_of[lo] as u32, plan_step_of[hi] as u32, n)).collect();
    let arena_bytes = arena_windows.iter().map(|w| w.2).max().unwrap_or(0);
    let mut allocs: Vec<Vec<u32>> = vec![Vec::new(); steps.len()];
    let mut seen = vec![false; sched.buffers.len()];
    for (s, st) in steps.iter().enumerate() {
        if st.0 == "kernels" {
            for i in st.1..st.2 {
                for &b in &item_writes[i as usize] {
                    if !seen[b as usize] && sched.buffers[b as usize].kind == BufKind::Temp && arena_offsets[b as usize] < 0 {
                        seen[b as usize] = true;
                        allocs[s].push(b);
                    }
                }
            }
        }
    }
    // Every symbol an expression of the plan or a CPU matmul reads, also those only in a
    // stride or offset (a saved tensor's stride `s59*s94` where no shape holds s94): the
    // runtime resolves exactly these from the inputs.
    for e in &tab.0 {
        e.syms(&mut syms);
    }
    for v in sched.steps.iter().flat_map(Step::matmul_operands).filter_map(|x| x.view.as_ref()) {
        for e in v.sizes.iter().chain(&v.strides).chain([&v.offset]) {
            e.syms(&mut syms);
        }
    }
    syms.sort();
    syms.dedup();
    let num_syms = syms.last().map(|m| *m as usize + 1).unwrap_or(0);
    let plan = Plan {
        allocs,
        step_bufs,
        arena_offsets,
        arena_windows,
        arena_bytes,
        graph_before,
        graph_after: opt.to_string(),
        schedule: sched.to_string(),
        source,
        cuda_source,
        fusion_log: sched.log.clone(),
        kernels: sched.kernels.iter().map(|k| (k.name.clone(), k.roots.clone())).collect(),
        buffers,
        steps,
        frees,
        outputs,
        num_syms,
        syms,
        times,
        cached,
        exprs: tab.0,
    };
    Ok((plan, module))
}


/// [Note: arena] offsets by lifetime. Each arena buffer lives from the first step that
/// writes it to the last step that reads it; two buffers share bytes only when one's last
/// reader runs strictly before the other's first writer (a kernel that reads one and writes
/// the other never sees them alias). Buffers are placed largest first at the lowest offset
/// free of every placed buffer whose lifetime overlaps (greedy by size), so the arena is
/// sized by the peak of live bytes rather than their sum. Steps run in order on one stream,
/// so reuse needs no synchronization. Returns the offsets (in `members` order) and the size.
fn arena_layout(first: &[usize], last: &[usize], members: &[(usize, i64)]) -> (Vec<i64>, i64) {
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(members[i].1), first[members[i].0]));
    let mut placed: Vec<(usize, i64, i64)> = Vec::new(); // (member, offset, bytes)
    let mut offsets = vec![0i64; members.len()];
    let mut total = 0i64;
    for i in order {
        let (b, bytes) = members[i];
        let overlaps = |j: usize| {
            let c = members[j].0;
            !(last[b] < first[c] || last[c] < first[b])
        };
        let mut busy: Vec<(i64, i64)> = placed.iter().filter(|p| overlaps(p.0)).map(|p| (p.1, p.1 + p.2)).collect();
        busy.sort_unstable();
        let mut off = 0i64;
        for (lo, hi) in busy {
            if off + bytes <= lo {
                break;
            }
            off = off.max(hi);
        }
        offsets[i] = off;
        total = total.max(off + bytes);
        placed.push((i, off, bytes));
    }
    (offsets, total)
}

/// The first and last schedule step that touches each buffer through a kernel or matmul
/// (`usize::MAX`, 0 for a buffer none touches).
fn lifetimes(sched: &braze_sched::Schedule) -> (Vec<usize>, Vec<usize>) {
    let n = sched.buffers.len();
    let (mut first, mut last) = (vec![usize::MAX; n], vec![0usize; n]);
    let mut touch = |b: usize, s: usize| {
        first[b] = first[b].min(s);
        last[b] = last[b].max(s);
    };
    for (s, st) in sched.steps.iter().enumerate() {
        match st {
            Step::Kernel(k) => sched.kernels[*k].bufs.iter().for_each(|b| touch(b.id as usize, s)),
            Step::Matmul { out, .. } => {
                for x in st.matmul_operands() {
                    touch(x.buf as usize, s);
                }
                touch(*out as usize, s);
            }
            Step::Extern { .. } => {}
        }
    }
    (first, last)
}

/// An arena window: (first step, last step, members as (buffer, bytes)).
type Window = (usize, usize, Vec<(usize, i64)>);

/// Below this many bytes an arena is one window: splitting it saves less than it costs.
const ARENA_WINDOW_MIN: i64 = 8 << 20;
/// A window boundary may fall where the arena bytes live across it are at most this
/// fraction (1/n) of the most the window has had live at once.
const ARENA_WINDOW_CROSSING: i64 = 3;

/// [Note: arena windows] One arena for the whole call is alive for the whole call: its peak
/// (say one transformer layer's intermediates) adds to what is allocated elsewhere at any
/// other time (the logits at the end, the weight gradients of a backward). So the plan's
/// steps are cut into windows, each with its own arena, allocated at the window's first
/// step and dropped after its last. A cut falls between steps where few arena bytes are live
/// (at most 1/`ARENA_WINDOW_CROSSING` of the window's peak so far: after an MLP's hidden
/// activations die, where only the residual stream crosses), once the window holds
/// `ARENA_WINDOW_MIN` bytes of buffers (fewer cuts, fewer allocations per call); a buffer
/// live across a cut leaves the arena and is allocated by itself, like any other temp. Returns (first plan step, last plan step,
/// members) per window; `span` gives a member's first and last plan step.
fn arena_window_groups(n_steps: usize, members: &[(usize, i64)], span: impl Fn(usize) -> (usize, usize)) -> Vec<Window> {
    let spans: Vec<(usize, usize)> = members.iter().map(|&(b, _)| span(b)).collect();
    let whole = |group: Vec<(usize, i64)>, spans: &[(usize, usize)]| {
        let lo = spans.iter().map(|s| s.0).min().unwrap_or(0);
        let hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
        if group.is_empty() { vec![] } else { vec![(lo, hi, group)] }
    };
    if members.iter().map(|m| m.1).sum::<i64>() < ARENA_WINDOW_MIN || n_steps < 2 {
        return whole(members.to_vec(), &spans);
    }
    // Bytes of the members live across the boundary before step t: first < t <= last.
    let mut crossing = vec![0i64; n_steps + 2];
    for (m, &(f, l)) in members.iter().zip(&spans) {
        if l > f {
            crossing[f + 1] += m.1;
            crossing[l + 1] -= m.1;
        }
    }
    // Bytes of the members whose first step is t.
    let mut born = vec![0i64; n_steps + 1];
    for (m, &(f, _)) in members.iter().zip(&spans) {
        born[f] += m.1;
    }
    let mut cuts = Vec::new();
    let (mut live, mut held, mut peak) = (0i64, 0i64, 0i64);
    for t in 1..n_steps {
        live += crossing[t];
        held += born[t - 1];
        // Live at step t - 1: what crosses into it and what it makes.
        peak = peak.max(live + born[t - 1]);
        if held >= ARENA_WINDOW_MIN && live * ARENA_WINDOW_CROSSING <= peak {
            cuts.push(t);
            (held, peak) = (0, live);
        }
    }
    if cuts.is_empty() {
        return whole(members.to_vec(), &spans);
    }
    // Window k spans plan steps [bounds[k], bounds[k + 1]).
    let mut bounds = vec![0usize];
    bounds.extend(cuts);
    bounds.push(n_steps);
    let mut groups: Vec<Window> = (0..bounds.len() - 1).map(|_| (usize::MAX, 0, Vec::new())).collect();
    for (m, &(f, l)) in members.iter().zip(&spans) {
        let k = bounds.partition_point(|&b| b <= f) - 1;
        if l < bounds[k + 1] {
            let g = &mut groups[k];
            g.0 = g.0.min(f);
            g.1 = g.1.max(l);
            g.2.push(*m);
        }
    }
    groups.retain(|g| !g.2.is_empty());
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows are disjoint in steps, every member lies inside its window, and the members
    /// left out are exactly those live across a cut.
    fn check(n: usize, members: &[(usize, i64)], spans: &[(usize, usize)]) -> Vec<Window> {
        let ws = arena_window_groups(n, members, |b| spans[b]);
        for w in ws.windows(2) {
            assert!(w[0].1 < w[1].0, "windows overlap: {ws:?}");
        }
        for (lo, hi, g) in &ws {
            for (b, _) in g {
                assert!(*lo <= spans[*b].0 && spans[*b].1 <= *hi);
            }
        }
        ws
    }

    #[test]
    fn small_arenas_stay_one_window() {
        let members: Vec<(usize, i64)> = (0..6).map(|b| (b, 1 << 20)).collect();
        let spans: Vec<(usize, usize)> = (0..6).map(|b| (b, b + 1)).collect();
        let ws = check(8, &members, &spans);
        assert_eq!(ws.len(), 1);
        assert_eq!(ws[0].2.len(), 6);
    }

    #[test]
    fn layers_get_their_own_windows() {
        // Four "layers" of three steps; each layer's two buffers live inside it, and one
        // residual buffer per layer crosses into the next.
        let mut members = Vec::new();
        let mut spans = Vec::new();
        for l in 0..4 {
            for i in 0..2 {
                members.push((spans.len(), 16 << 20));
                spans.push((3 * l + i, 3 * l + i + 1));
            }
            members.push((spans.len(), 1 << 20));
            spans.push((3 * l + 2, 3 * l + 4));
        }
        let ws = check(14, &members, &spans);
        assert!(ws.len() >= 3, "{ws:?}");
        // Cuts fall between layers: every layer-local buffer stays in an arena.
        let kept: usize = ws.iter().flat_map(|w| &w.2).filter(|m| m.1 == 16 << 20).count();
        assert_eq!(kept, 8, "{ws:?}");
    }
}
