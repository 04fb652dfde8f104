//! # braze-driver: the compile pipeline of one graph
//!
//! `compile` runs the stages in order — verify, passes (and per-target passes), schedule,
//! code generation, the compiler (cc or NVRTC, cuBLASLt preparation) — timing each, and
//! returns the [`Plan`] the Python runtime follows and the loaded [`Module`]. The Python
//! binding (braze-py) only converts these to Python objects.

use braze_ir::{ConvDir, Epilogue, Expr, Graph, Op};
use braze_runtime::cpu::{CpuItem, CpuModule};
use braze_runtime::cudnn::ConvSpec;
use braze_runtime::matmul::{MatmulExprs, MatmulSpec, OperandExprs};
use braze_runtime::cuda::{CudaModule, Item};
use braze_runtime::RuntimeError;
use braze_sched::{Access, BufKind, Step};
use std::collections::HashSet;

mod arena;
mod kernel_tune;
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
        // [Note: empty buffers] A tensor of no elements has no memory (PyTorch gives it a
        // null data pointer), yet a kernel that reads it under a mask (a `cat` whose piece is
        // empty at run time) still loads element 0 of it and discards the value: the load is
        // branch-free. Such buffers are handed a small zeroed block instead of null.
        let patched;
        let ptrs = if used.iter().any(|&b| ptrs.get(b as usize) == Some(&0)) {
            let stand_in = match self {
                Module::Cpu(_) => EMPTY_STAND_IN.0.as_ptr() as usize,
                Module::Cuda(m) => m.scratch,
            };
            let mut p = ptrs.to_vec();
            for &b in used {
                if let Some(x @ 0) = p.get_mut(b as usize) {
                    *x = stand_in;
                }
            }
            patched = p;
            &patched[..]
        } else {
            ptrs
        };
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

/// The host block that stands for an empty buffer ([Note: empty buffers]): one element of
/// any dtype, aligned as the widest vector load. Kernels only read it.
#[repr(C, align(64))]
struct StandIn([u8; 64]);
static EMPTY_STAND_IN: StandIn = StandIn([0; 64]);

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
    /// The buffers matmuls and convolutions read (the libraries' operands, [Note: patched
    /// inputs] in braze-runtime).
    pub library_reads: Vec<u32>,
    /// Byte offset of each buffer in the per-call arena, or -1 (see [Note: arena]).
    pub arena_offsets: Vec<i64>,
    /// Temps whose tensors a CPU plan instance keeps between calls ([Note: kept temps]).
    pub kept_temps: Vec<u32>,
    /// The arena's windows ([Note: arena windows]): (first plan step, last plan step, bytes).
    pub arena_windows: Vec<(u32, u32, i64)>,
    /// The largest window: the most arena bytes live at once.
    pub arena_bytes: i64,
    /// (written buffer, read buffer) outside the arenas: the written one may take the read
    /// one's tensor when it is allocated ([Note: in-place kernels]); the read one dies in
    /// that plan step.
    pub reuse: Vec<(u32, u32)>,
    /// Buffers that share a dying buffer's memory, in arenas or through `reuse`.
    pub in_place: usize,
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
    let Step::Matmul { node, a, b, bias, residual, out, bias_grad } = step else { return Err(DriverError::Internal("not a matmul step".into())) };
    let (node, out, bias, residual, bias_grad) = (*node, *out, bias.as_ref(), residual.as_ref(), *bias_grad);
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
    let Op::Matmul { mut epilogue, tf32, .. } = g.node(node).op else { return Err(DriverError::Internal("not a matmul".into())) };
    if bias_grad.is_none() && matches!(epilogue, Epilogue::BiasGradA | Epilogue::BiasGradB) {
        epilogue = Epilogue::None; // nothing reads the sums
    }
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
        bias_grad,
        batch: if ty.rank() == 3 { ty.shape[0].clone() } else { Expr::one() },
        dtype: ty.dtype,
        tf32,
        epilogue,
    })
}

/// (step, item, bytes) of each convolution whose plan needs a workspace of its own
/// ([Note: convolution workspaces] in braze-sched).
type OwnWorkspaces = Vec<(usize, usize, i64)>;

/// A matmul step with static sizes, as cuBLASLt takes it.
fn matmul_spec(g: &Graph, sched: &braze_sched::Schedule, step: &Step) -> Result<MatmulSpec, DriverError> {
    matmul_exprs(g, sched, step)?.eval(&[]).ok_or_else(|| unsupported("matmul with symbolic sizes"))
}

/// A convolution step as cuDNN takes it ([Note: library convolutions] in braze-runtime): whole
/// buffers with static sizes by role (x, w, y: which are operands and which the result
/// depends on the direction), the filter packed channels_last.
fn conv_spec(g: &Graph, sched: &braze_sched::Schedule, step: &Step) -> Result<ConvSpec, DriverError> {
    let Step::Conv { node, a, b, out, .. } = step else { return Err(DriverError::Internal("not a convolution step".into())) };
    let Op::Conv { dir, stride, padding, dilation, groups, tf32, .. } = &g.node(*node).op else { return Err(DriverError::Internal("not a convolution".into())) };
    if a.view.is_some() || b.view.is_some() {
        return Err(DriverError::Internal("convolution operand is a view".into()));
    }
    let four = |v: &[Expr]| -> Result<[i64; 4], DriverError> {
        let c: Vec<i64> = v.iter().map(Expr::as_const).collect::<Option<_>>().ok_or_else(|| unsupported("convolution with symbolic sizes"))?;
        c.try_into().map_err(|_| DriverError::Internal("convolution operand of rank != 4".into()))
    };
    let role = |buf: u32| -> Result<(u32, [i64; 4], [i64; 4]), DriverError> {
        let b = &sched.buffers[buf as usize];
        Ok((buf, four(&b.shape)?, four(&b.strides)?))
    };
    let (x, w, y) = match dir {
        ConvDir::Forward => (role(a.buf)?, role(b.buf)?, role(*out)?),
        ConvDir::Data => (role(*out)?, role(b.buf)?, role(a.buf)?),
        ConvDir::Filter => (role(a.buf)?, role(*out)?, role(b.buf)?),
    };
    let pair = |v: &[i64]| -> Result<[i64; 2], DriverError> { v.try_into().map_err(|_| DriverError::Internal("convolution parameters of rank != 2".into())) };
    let spec = ConvSpec {
        name: format!("braze_conv_{}", node.0),
        dir: *dir,
        dtype: sched.buffers[a.buf as usize].dtype,
        tf32: *tf32,
        x: x.0,
        x_shape: x.1,
        x_strides: x.2,
        w: w.0,
        w_shape: w.1,
        y: y.0,
        y_shape: y.1,
        y_strides: y.2,
        stride: pair(stride)?,
        padding: pair(padding)?,
        dilation: pair(dilation)?,
        groups: *groups,
    };
    // cuDNN's NHWC filter: packed (O, kH, kW, C) memory; strides of size-1 dims do not matter.
    let (w_strides, packed) = (w.2, spec.w_strides());
    if (0..4).any(|d| spec.w_shape[d] != 1 && w_strides[d] != packed[d]) {
        return Err(DriverError::Internal(format!("convolution filter strides {w_strides:?} are not channels_last")));
    }
    Ok(spec)
}

/// Per-graph choices of the user's options (`braze.compile(..., options=...)`).
#[derive(Clone, Debug)]
pub struct Options {
    /// Replay runs of kernels and matmuls as captured CUDA graphs when their pointers repeat.
    pub cuda_graphs: bool,
    /// Time cuBLASLt's candidate algorithms for large matmuls at compile time.
    pub matmul_tune: bool,
    /// Time the candidate configurations of braze's own kernels at compile time and keep the
    /// fastest ([Note: kernel configurations] in braze-codegen). With a CPU target and
    /// `check_cuda`, every candidate is compiled by NVRTC (the check CI runs).
    pub kernel_tune: bool,
    /// Extern calls (by target key) whose operands may live in arenas ([Note: extern
    /// operands in arenas]): their results are fresh and they have no effect.
    pub arena_externs: HashSet<String>,
    /// Drop `layout` copies of values stored in that order anyway on the GPU too (graphs whose
    /// convolutions run channels_last ask for channels_last inputs the previous one's
    /// BatchNorm and ReLU already produce). Always on for the CPU.
    pub elide_layouts: bool,
    /// [Note: plans without a GPU] For a CUDA target, stop once the plan is made: no device
    /// query (an H100/H200's 132 SMs and sm_90 are assumed), no kernel compile, no library
    /// plans, no module. The plan (steps, buffers, arena windows, frees) is what a GPU would
    /// run, so its memory can be checked on a machine without one
    /// (`braze.plan_memory`); it cannot be run.
    pub plan_only: bool,
    /// Linears' bias gradients as cuBLASLt epilogues of their weight gradients' matmuls
    /// ([Note: bias-gradient epilogues] in braze-passes); off for the second compile of a
    /// graph whose epilogue cuBLASLt refused.
    pub bias_grads: bool,
    /// CUDA, Hopper and newer: kernels launch with programmatic dependent launch
    /// (braze-runtime's [Note: programmatic launch]).
    pub programmatic_launch: bool,
    /// CUDA, Hopper and newer: column kernels over few points run as thread-block clusters
    /// (braze-codegen's [Note: cluster columns]).
    pub column_clusters: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { cuda_graphs: true, matmul_tune: true, kernel_tune: false, arena_externs: HashSet::new(), elide_layouts: false, plan_only: false, bias_grads: true, programmatic_launch: true, column_clusters: true }
    }
}

/// (arch, SM count) of a CUDA device, or of the assumed one for a plan only.
fn cuda_device(ordinal: i32, opts: &Options) -> Result<(String, i32), DriverError> {
    if opts.plan_only {
        return Ok(("sm_90".to_string(), 132));
    }
    braze_runtime::cuda::device_info(ordinal).map_err(DriverError::from)
}

/// Bytes outside the arena that may die inside one run before it ends ([Note: runs cut where
/// memory dies]).
const RUN_FREE_CUT: i64 = 16 << 20;

pub fn compile(g: Graph, target: Target, check_cuda: bool, check_arch: &str) -> Result<(Plan, Option<Module>), DriverError> {
    compile_with(g, target, check_cuda, check_arch, Options::default())
}

/// What cuBLASLt's refusal of a bias-gradient epilogue says: the graph is compiled again
/// without those epilogues.
const BIAS_GRAD_REFUSED: &str = "bias-gradient epilogue refused";

pub fn compile_with(g: Graph, target: Target, check_cuda: bool, check_arch: &str, opts: Options) -> Result<(Plan, Option<Module>), DriverError> {
    match compile_graph(&g, target, check_cuda, check_arch, &opts) {
        Err(DriverError::Environment(m)) if m.starts_with(BIAS_GRAD_REFUSED) => {
            let (mut plan, module) = compile_graph(&g, target, check_cuda, check_arch, &Options { bias_grads: false, ..opts })?;
            plan.schedule = format!("// {m}: compiled without them\n{}", plan.schedule);
            Ok((plan, module))
        }
        r => r,
    }
}

fn compile_graph(g: &Graph, target: Target, check_cuda: bool, check_arch: &str, opts: &Options) -> Result<(Plan, Option<Module>), DriverError> {
    let mut times = Vec::new();
    let mut t = Instant::now();
    let mut lap = |name: &str, times: &mut Vec<(String, f64)>| {
        times.push((name.to_string(), t.elapsed().as_secs_f64()));
        t = Instant::now();
    };
    let errs = braze_ir::verify::verify(g);
    if !errs.is_empty() {
        return Err(unsupported(format!("imported graph is invalid: {}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))));
    }
    let graph_before = g.to_string();
    let mut opt = braze_passes::optimize(g);
    if let Target::Cuda(ordinal) = target {
        // Matmuls too small for a library call become braze's reductions (per-target stage:
        // [Note: small matmuls]).
        opt = braze_passes::small_matmuls::small_matmuls(&opt);
        // Bias gradients in their weight gradients' matmuls (per-target stage; before the
        // split would take the sums apart).
        if opts.bias_grads {
            opt = braze_passes::matmul_bias_grads::matmul_bias_grads(&opt);
        }
        // Few long rows would leave most of the GPU idle: split them (per-target stage).
        let (_, sms) = cuda_device(ordinal, opts)?;
        opt = braze_passes::split_reductions::split_reductions(&opt, 2 * sms as i64);
        // cuBLASLt's fast kernels need aligned matrices (per-target stage).
        opt = braze_passes::pad_matmuls::pad_matmuls(&opt);
        if opts.elide_layouts {
            opt = braze_passes::elide_layouts::elide_layouts(&opt);
        }
    } else {
        // Convolutions of CPU inference graphs ask for channels_last inputs that are often
        // channels_last already (per-target stage: not yet measured on the GPU).
        opt = braze_passes::elide_layouts::elide_layouts(&opt);
        if std::env::var("BRAZE_SMALL_MATMULS_CPU").is_ok_and(|v| v == "1") {
            // A test hook: the GPU's small matmuls on the CPU, so the CPU suite checks their
            // numerics and epilogues ([Note: small matmuls]).
            opt = braze_passes::small_matmuls::small_matmuls(&opt);
        }
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
    let mut sched = braze_sched::schedule(&opt).map_err(unsupported)?;
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
                    Step::Conv { .. } => return Err(unsupported("library convolutions run on the GPU only")),
                    Step::Extern { .. } => {}
                }
            }
            let (distinct, entries) = braze_codegen::openmp::emit_kernels(&sched.kernels).map_err(unsupported)?;
            if check_cuda && !names.is_empty() {
                let mut gpu = braze_codegen::cuda::Gpu::new(check_arch, 132);
                gpu.clusters &= opts.column_clusters;
                let (distinct, launches) = braze_codegen::cuda::emit_kernels(&sched.kernels, gpu).map_err(unsupported)?;
                // The scalar fallbacks too ([Note: lazy scalar fallback]): the GPU compiles one
                // only when a call's pointers are unaligned, so check them here, those of
                // distinct kernels (a deduplicated kernel's is its first copy's up to names).
                let fallbacks: Vec<String> = launches
                    .iter()
                    .zip(&sched.kernels)
                    .filter(|(l, k)| l.name == k.name)
                    .filter_map(|(l, _)| l.fallback.as_ref().map(|f| f.source.clone()))
                    .collect();
                braze_runtime::cuda::compile_kernels(&distinct, check_arch, version, 0).map_err(DriverError::from)?;
                if opts.kernel_tune {
                    let (tunables, _) = kernel_tune::tunables(&sched, gpu);
                    let all: Vec<_> = tunables.into_iter().flat_map(|t| t.candidates).map(|c| c.kernel).collect();
                    braze_runtime::cuda::compile_kernels(&all, check_arch, version, 0).map_err(DriverError::from)?;
                }
                braze_runtime::cuda::compile_cubins(&fallbacks, check_arch, version).map_err(DriverError::from)?;
                cuda_source = braze_codegen::cuda::module_source(&distinct) + &fallbacks.concat();
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
            let (arch, sms) = cuda_device(ordinal, opts)?;
            let mut gpu = braze_codegen::cuda::Gpu::new(&arch, sms as u32);
            gpu.clusters &= opts.column_clusters;
            let configs = if opts.kernel_tune && !opts.plan_only {
                let (tunables, of) = kernel_tune::tunables(&sched, gpu);
                let chosen = braze_runtime::cuda::kernel_tune::choose(&tunables, &arch, version, ordinal).map_err(DriverError::from)?;
                lap("kernel tuning", &mut times);
                kernel_tune::per_kernel(&of, &chosen)
            } else {
                Vec::new()
            };
            let (distinct, mut launches) = braze_codegen::cuda::emit_kernels_with(&sched.kernels, gpu, &configs).map_err(unsupported)?;
            lap("codegen", &mut times);
            let needs_module = !opts.plan_only && sched.steps.iter().any(|st| !matches!(st, Step::Extern { .. }));
            // [Note: NVRTC beside the libraries] The kernels compile on their own threads while
            // the libraries' plans are built (cuBLASLt's algorithm timing and cuDNN's engine
            // builds run on the GPU and inside those libraries): the `nvrtc` stage is what is
            // left of the compile once the plans are ready. One core fewer than the machine's
            // is NVRTC's, so the timing loop's launches are not held up.
            let (items, placed) = std::thread::scope(|scope| {
                let nvrtc = needs_module.then(|| scope.spawn(|| braze_runtime::cuda::compile_kernels(&distinct, &arch, version, 1)));
                let items = (|| -> Result<(Vec<Item>, OwnWorkspaces), DriverError> {
                    let (mut items, mut own) = (Vec::new(), Vec::new());
                    for (s, st) in sched.steps.iter().enumerate().filter(|_| !opts.plan_only) {
                        match st {
                            Step::Kernel(k) => items.push(Item::Kernel(*k)),
                            Step::Matmul { .. } => {
                                let spec = matmul_spec(&opt, &sched, st)?;
                                let grads = spec.bias_grad.is_some().then(|| {
                                    let (a, b) = (&spec.a, &spec.b);
                                    format!("{:?} {}: a {}x{} strides ({}, {}), b {}x{} strides ({}, {})", spec.dtype, spec.epilogue.name(), a.rows, a.cols, a.rs, a.cs, b.rows, b.cols, b.rs, b.cs)
                                });
                                let prepared = braze_runtime::cublaslt::prepare(spec, opts.matmul_tune.then_some(ordinal)).map_err(|e| match e {
                                    // Whatever cuBLASLt says (no algorithm, NOT_SUPPORTED): compiled again without.
                                    e if grads.is_some() => DriverError::Environment(format!("{BIAS_GRAD_REFUSED}: {e} ({})", grads.as_deref().unwrap_or_default())),
                                    e => DriverError::from(e),
                                })?;
                                items.push(Item::Matmul(Box::new(prepared)))
                            }
                            Step::Conv { .. } => {
                                let spec = conv_spec(&opt, &sched, st)?;
                                // Any refusal is the environment's (the Python side then runs the graph's
                                // convolutions through ATen).
                                let conv = braze_runtime::cudnn::prepare(spec, ordinal, opts.matmul_tune).map_err(|e| DriverError::Environment(e.to_string()))?;
                                if conv.workspace > braze_runtime::cublaslt::WORKSPACE {
                                    own.push((s, items.len(), conv.workspace as i64));
                                }
                                items.push(Item::Conv(Box::new(conv)))
                            }
                            Step::Extern { .. } => {}
                        }
                    }
                    Ok((items, own))
                })();
                lap("libraries", &mut times);
                let placed = nvrtc.map(|h| h.join().expect("the NVRTC thread does not panic"));
                (items, placed)
            });
            let (mut items, own) = items?;
            // [Note: convolution workspaces] (braze-sched): placed by memory planning.
            for (s, i, bytes) in own {
                let buf = sched.add_workspace(s, bytes);
                if let Item::Conv(c) = &mut items[i] {
                    c.own_workspace = Some(buf);
                }
            }
            let m = match placed {
                None => None,
                Some(placed) => {
                    let placed = placed.map_err(DriverError::from)?;
                    lap("nvrtc", &mut times);
                    for l in &mut launches {
                        (l.unit, l.name) = placed.places[l.unit].clone();
                    }
                    let cached = placed.cached && !names.is_empty();
                    let mut cm = CudaModule::load(&placed.cubins, ordinal, launches, items, cached, version).map_err(DriverError::from)?;
                    cm.replay = opts.cuda_graphs;
                    cm.programmatic &= opts.programmatic_launch;
                    Some(Module::Cuda(cm))
                }
            };
            lap("load", &mut times);
            (braze_codegen::cuda::module_source(&distinct), m)
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
    let arena = arena::plan(&sched, &opts.arena_externs);
    let arena_offsets = arena.offsets;
    let arena_windows = arena.windows;
    let kept_temps = arena.kept;
    // A window's first step starts a run of its own: a run's kernels see one arena.
    let window_starts: HashSet<usize> = arena_windows.iter().skip(1).map(|w| w.0).collect();
    // Consecutive kernels and matmuls ("items") become one step: one call into Rust runs
    // them all. Item i is sched step item_steps[i].
    // [Note: runs cut where memory dies] A run's buffers outside the arena are allocated
    // before it and the buffers dying in it are freed after it, so a long run holds what it
    // makes and what it consumes at once. In a training backward, one run held ResNet-50's
    // whole last stage: its f32 weight gradients were allocated at the start and its saved
    // activations freed only at the end, which put the step's peak 66 MiB above eager's. A
    // run therefore also ends once `RUN_FREE_CUT` bytes outside the arena have died in it.
    let freed_bytes = |b: u32| if arena_offsets[b as usize] >= 0 { 0 } else { sched.buffers[b as usize].static_bytes().unwrap_or(0) };
    let mut run_freed = 0i64;
    let mut steps = Vec::new();
    let mut frees: Vec<Vec<u32>> = Vec::new();
    let mut item_writes: Vec<Vec<u32>> = Vec::new();
    let mut step_bufs: Vec<Vec<u32>> = Vec::new();
    let mut plan_step_of: Vec<usize> = Vec::with_capacity(sched.steps.len());
    for (s, st) in sched.steps.iter().enumerate() {
        let touched: Vec<u32> = match st {
            Step::Kernel(k) => sched.kernels[*k].bufs.iter().map(|b| b.id).collect(),
            Step::Conv { .. } | Step::Matmul { .. } => st.library_operands().map(|x| x.buf).chain(st.library_outputs()).collect(),
            Step::Extern { .. } => Vec::new(),
        };
        let writes = match st {
            Step::Kernel(k) => Some(sched.kernels[*k].bufs.iter().filter(|b| b.written).map(|b| b.id).collect::<Vec<_>>()),
            Step::Conv { .. } | Step::Matmul { .. } => Some(st.library_outputs().collect()),
            Step::Extern { .. } => None,
        };
        if let Some(w) = writes {
            let i = item_writes.len() as u32;
            item_writes.push(w);
            match steps.last_mut() {
                Some((kind, _, hi, _, _, _)) if kind == "kernels" && *hi == i && !window_starts.contains(&s) && run_freed < RUN_FREE_CUT => {
                    *hi = i + 1;
                    frees.last_mut().unwrap().extend(sched.frees[s].iter().copied());
                    step_bufs.last_mut().unwrap().extend(touched);
                }
                _ => {
                    steps.push(("kernels".to_string(), i, i + 1, String::new(), vec![], vec![]));
                    frees.push(sched.frees[s].clone());
                    step_bufs.push(touched);
                    run_freed = 0;
                }
            }
            run_freed += sched.frees[s].iter().map(|&b| freed_bytes(b)).sum::<i64>();
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
    // [Note: arena] Temp buffers that kernels and matmuls make (not outputs, not extern
    // results, not operands of extern calls outside [Note: extern operands in arenas]) and
    // have static sizes live in one allocation per window of steps
    // ([Note: arena windows]), at fixed 256-byte aligned offsets: one allocator call instead
    // of one per buffer. Offsets are assigned by lifetime (`arena_layout`), so buffers that
    // are never live together share.
    let arena_windows: Vec<(u32, u32, i64)> = arena_windows.into_iter().map(|(lo, hi, n)| (plan_step_of[lo] as u32, plan_step_of[hi] as u32, n)).collect();
    let arena_bytes = arena_windows.iter().map(|w| w.2).max().unwrap_or(0);
    let reuse = arena.reuse.iter().map(|&(_, o, i)| (o, i)).collect();
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
    for v in sched.steps.iter().flat_map(Step::library_operands).filter_map(|x| x.view.as_ref()) {
        for e in v.sizes.iter().chain(&v.strides).chain([&v.offset]) {
            e.syms(&mut syms);
        }
    }
    syms.sort();
    syms.dedup();
    let num_syms = syms.last().map(|m| *m as usize + 1).unwrap_or(0);
    let mut library_reads: Vec<u32> = sched.steps.iter().flat_map(Step::library_operands).map(|x| x.buf).collect();
    library_reads.sort_unstable();
    library_reads.dedup();
    let plan = Plan {
        allocs,
        step_bufs,
        library_reads,
        arena_offsets,
        kept_temps,
        arena_windows,
        reuse,
        in_place: arena.in_place,
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


