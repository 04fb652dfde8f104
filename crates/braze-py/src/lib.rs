//! `braze._core`: the Python face of the Rust compiler. The Python package walks an FX graph
//! into a [`GraphBuilder`], calls `compile`, and runs the returned [`Compiled`] plan. Errors
//! map to three exceptions: `Unsupported` (the graph falls back to eager), `InternalError`
//! (a braze bug; also falls back, loudly) and `EnvironmentError_` (no C compiler, ...).

use braze_ir::{parse, DType, Expr, Graph, NodeId, Op, TensorTy};
use braze_runtime::cpu::CpuModule;
use braze_runtime::cublaslt::{MatmulSpec, Operand};
use braze_runtime::cuda::{CudaModule, Item};
use braze_sched::{Access, BufKind, Step};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

create_exception!(_core, Unsupported, PyException, "braze cannot compile this graph; it runs eagerly.");
create_exception!(_core, InternalError, PyException, "A braze bug: an invariant was broken.");
create_exception!(_core, EnvironmentError_, PyException, "The machine lacks something braze needs (C compiler, cache dir).");

fn unsupported(e: impl ToString) -> PyErr {
    Unsupported::new_err(e.to_string())
}

fn parse_exprs(v: &[String]) -> PyResult<Vec<Expr>> {
    v.iter().map(|s| braze_ir::sym::parse_expr(s).map_err(unsupported)).collect()
}

fn dtype(s: &str) -> PyResult<DType> {
    DType::from_name(s).ok_or_else(|| unsupported(format!("dtype {s}")))
}

/// Builds a braze graph node by node.
#[pyclass(module = "braze._core")]
pub struct GraphBuilder {
    g: Graph,
}

#[pymethods]
impl GraphBuilder {
    #[new]
    fn new(name: &str) -> Self {
        GraphBuilder { g: Graph::new(name) }
    }

    /// Adds graph input `index` with dtype, sizes and strides (expression strings).
    fn input(&mut self, index: u32, dt: &str, shape: Vec<String>, strides: Vec<String>) -> PyResult<u32> {
        let ty = TensorTy::new(dtype(dt)?, parse_exprs(&shape)?);
        Ok(self.g.add_typed(Op::Input { index, strides: parse_exprs(&strides)? }, vec![], Some(ty)).0)
    }

    /// Adds an op written in the IR's text form (`"sum dims=[1] keepdim=true"`).
    fn op(&mut self, text: &str, inputs: Vec<u32>) -> PyResult<u32> {
        let (op, _) = parse::parse_op(text).map_err(unsupported)?;
        if matches!(op, Op::Input { .. } | Op::Extern { .. } | Op::ExternOut { .. }) {
            return Err(unsupported("use input() / extern_call()"));
        }
        let id = self.g.add(op, inputs.into_iter().map(NodeId).collect()).map_err(unsupported)?;
        Ok(id.0)
    }

    /// Adds a call of ATen op `target`; `outs` are (dtype, sizes, strides) of its results.
    fn extern_call(&mut self, target: &str, inputs: Vec<u32>, outs: Vec<(String, Vec<String>, Vec<String>)>) -> PyResult<Vec<u32>> {
        for &i in &inputs {
            if self.g.nodes.get(i as usize).and_then(|n| n.ty.as_ref()).is_none() {
                return Err(unsupported(format!("extern operand %{i} is not a tensor")));
            }
        }
        let e = self.g.add_typed(Op::Extern { target: target.to_string(), outputs: outs.len() as u32 }, inputs.into_iter().map(NodeId).collect(), None);
        let mut ids = Vec::new();
        for (k, (dt, shape, strides)) in outs.iter().enumerate() {
            let ty = TensorTy::new(dtype(dt)?, parse_exprs(shape)?);
            ids.push(self.g.add_typed(Op::ExternOut { index: k as u32, strides: parse_exprs(strides)? }, vec![e], Some(ty)).0);
        }
        Ok(ids)
    }

    fn set_outputs(&mut self, outs: Vec<u32>) {
        self.g.outputs = outs.into_iter().map(NodeId).collect();
    }

    /// (dtype, sizes) of a node.
    fn node_type(&self, id: u32) -> PyResult<(String, Vec<String>)> {
        let n = self.g.nodes.get(id as usize).ok_or_else(|| unsupported("no such node"))?;
        let t = n.ty.as_ref().ok_or_else(|| unsupported("extern node has no type"))?;
        Ok((t.dtype.name().to_string(), t.shape.iter().map(|e| e.to_string()).collect()))
    }

    fn text(&self) -> String {
        self.g.to_string()
    }

    /// Runs passes, scheduling, code generation and the compiler: the C compiler for
    /// `device="cpu"`, NVRTC for `device="cuda:N"`. `check_cuda` (CPU graphs) also compiles
    /// the graph's CUDA kernels with NVRTC for `arch`, so codegen errors surface without a GPU.
    #[pyo3(signature = (device="cpu", check_cuda=false, arch="sm_90"))]
    fn compile(&self, py: Python<'_>, device: &str, check_cuda: bool, arch: &str) -> PyResult<Compiled> {
        let g = self.g.clone();
        let target = Target::parse(device)?;
        let arch = arch.to_string();
        let res = py.detach(move || catch_unwind(AssertUnwindSafe(|| compile(g, target, check_cuda, &arch))));
        match res {
            Ok(r) => r,
            Err(p) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                Err(InternalError::new_err(format!("panic in the compiler: {msg}")))
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Target {
    Cpu,
    Cuda(i32),
}

impl Target {
    fn parse(s: &str) -> PyResult<Target> {
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

enum Module {
    Cpu(CpuModule),
    Cuda(CudaModule),
}

fn runtime_err(e: braze_runtime::RuntimeError) -> PyErr {
    match e {
        braze_runtime::RuntimeError::Compile(m) => InternalError::new_err(m),
        braze_runtime::RuntimeError::Environment(m) => EnvironmentError_::new_err(m),
        braze_runtime::RuntimeError::Launch(m) => pyo3::exceptions::PyRuntimeError::new_err(m),
    }
}

/// Loads NVRTC (and its builtins library) and, when given, the CUDA driver and cuBLASLt.
#[pyfunction]
#[pyo3(signature = (nvrtc, builtins=None, driver=None, cublaslt=None))]
fn cuda_init(nvrtc: &str, builtins: Option<&str>, driver: Option<&str>, cublaslt: Option<&str>) -> PyResult<(i32, i32)> {
    braze_runtime::cuda::init_nvrtc(nvrtc, builtins).map_err(runtime_err)?;
    if let Some(d) = driver {
        braze_runtime::cuda::init_driver(d).map_err(runtime_err)?;
    }
    if let Some(l) = cublaslt {
        braze_runtime::cublaslt::init(l).map_err(runtime_err)?;
    }
    braze_runtime::cuda::nvrtc_version().map_err(runtime_err)
}

/// Compiles CUDA source with NVRTC for `arch` (a check; returns the cubin's size).
#[pyfunction]
fn nvrtc_compile(source: &str, arch: &str) -> PyResult<usize> {
    braze_runtime::cuda::compile_cubin(source, arch, env!("CARGO_PKG_VERSION")).map(|(c, _)| c.len()).map_err(runtime_err)
}

/// A compiled graph: the plan the Python runtime follows, and the loaded kernels.
#[pyclass(module = "braze._core")]
pub struct Compiled {
    module: Option<Module>,
    exprs: Vec<Expr>,
    #[pyo3(get)]
    graph_before: String,
    #[pyo3(get)]
    graph_after: String,
    #[pyo3(get)]
    schedule: String,
    #[pyo3(get)]
    source: String,
    /// The CUDA source checked with NVRTC for a CPU graph (`check_cuda`), else empty.
    #[pyo3(get)]
    cuda_source: String,
    #[pyo3(get)]
    fusion_log: Vec<String>,
    /// (name, roots) per kernel.
    #[pyo3(get)]
    kernels: Vec<(String, Vec<String>)>,
    /// (kind, input index or -1, dtype, shape expr ids, stride expr ids) per buffer.
    #[pyo3(get)]
    buffers: Vec<(String, i64, String, Vec<usize>, Vec<usize>)>,
    /// ("kernels", lo, hi, [], []) or ("extern", node, target, args, outs) per step.
    #[pyo3(get)]
    steps: Vec<(String, u32, u32, String, Vec<AccessT>, Vec<u32>)>,
    #[pyo3(get)]
    frees: Vec<Vec<u32>>,
    /// Temp buffers first written by each step (allocated just before it).
    #[pyo3(get)]
    allocs: Vec<Vec<u32>>,
    /// Byte offset of each buffer in the per-call arena, or -1 (see [Note: arena]).
    #[pyo3(get)]
    arena_offsets: Vec<i64>,
    #[pyo3(get)]
    arena_bytes: i64,
    #[pyo3(get)]
    outputs: Vec<AccessT>,
    /// Size symbols every kernel call needs, in `S[]` order (0..n).
    #[pyo3(get)]
    num_syms: usize,
    /// (stage, seconds).
    #[pyo3(get)]
    times: Vec<(String, f64)>,
    #[pyo3(get)]
    cached: bool,
}

/// (buffer, None) or (buffer, (size ids, stride ids, offset id)).
type AccessT = (u32, Option<(Vec<usize>, Vec<usize>, usize)>);

struct ExprTable(Vec<Expr>);

impl ExprTable {
    fn id(&mut self, e: &Expr) -> usize {
        if let Some(i) = self.0.iter().position(|x| x == e) {
            return i;
        }
        self.0.push(e.clone());
        self.0.len() - 1
    }
    fn ids(&mut self, v: &[Expr]) -> Vec<usize> {
        v.iter().map(|e| self.id(e)).collect()
    }
    fn access(&mut self, a: &Access) -> AccessT {
        (a.buf, a.view.as_ref().map(|v| (self.ids(&v.sizes), self.ids(&v.strides), self.id(&v.offset))))
    }
}

/// A matmul step's operands as cuBLASLt operands (static layouts only).
fn prepare_matmul(
    g: &Graph,
    sched: &braze_sched::Schedule,
    node: NodeId,
    a: &Access,
    b: &Access,
    bias: Option<&Access>,
    out: u32,
) -> PyResult<braze_runtime::cublaslt::Prepared> {
    let c = |e: &Expr| e.as_const().ok_or_else(|| unsupported("matmul with symbolic sizes"));
    let operand = |x: &Access| -> PyResult<Operand> {
        let buf = &sched.buffers[x.buf as usize];
        let (sizes, strides, offset) = match &x.view {
            Some(v) => (v.sizes.clone(), v.strides.clone(), v.offset.clone()),
            None => (buf.shape.clone(), buf.strides.clone(), Expr::zero()),
        };
        let r = sizes.len();
        Ok(Operand {
            buf: x.buf,
            offset: c(&offset)?,
            rows: c(&sizes[r - 2])? as u64,
            cols: c(&sizes[r - 1])? as u64,
            rs: c(&strides[r - 2])?,
            cs: c(&strides[r - 1])?,
            batch_stride: if r == 3 { c(&strides[0])? } else { 0 },
        })
    };
    let Op::Matmul { epilogue, tf32 } = g.node(node).op else { return Err(InternalError::new_err("not a matmul")) };
    let ty = g.ty(node);
    if ty.rank() > 3 {
        return Err(unsupported("matmul of rank > 3"));
    }
    let bias = match bias {
        Some(x) => {
            let off = x.view.as_ref().map(|v| c(&v.offset)).transpose()?.unwrap_or(0);
            let unit = x.view.as_ref().map(|v| v.strides[0].is_const(1)).unwrap_or(true);
            if !unit {
                return Err(unsupported("strided matmul bias"));
            }
            Some((x.buf, off))
        }
        None => None,
    };
    let spec = MatmulSpec {
        name: format!("braze_matmul_{}", node.0),
        a: operand(a)?,
        b: operand(b)?,
        bias,
        out,
        batch: if ty.rank() == 3 { c(&ty.shape[0])? as u64 } else { 1 },
        dtype: ty.dtype,
        tf32,
        epilogue,
    };
    braze_runtime::cublaslt::prepare(spec).map_err(runtime_err)
}

fn compile(g: Graph, target: Target, check_cuda: bool, check_arch: &str) -> PyResult<Compiled> {
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
        let (_, sms) = braze_runtime::cuda::device_info(ordinal).map_err(runtime_err)?;
        opt = braze_passes::split_reductions::split_reductions(&opt, 2 * sms as i64);
    }
    let errs = braze_ir::verify::verify(&opt);
    if !errs.is_empty() {
        return Err(InternalError::new_err(format!("verifier after passes: {errs:?}")));
    }
    lap("passes", &mut times);
    let sched = braze_sched::schedule(&opt).map_err(unsupported)?;
    lap("schedule", &mut times);
    let names: Vec<String> = sched.kernels.iter().map(|k| k.name.clone()).collect();
    let version = env!("CARGO_PKG_VERSION");
    let mut cuda_source = String::new();
    let (source, module) = match target {
        Target::Cpu => {
            if sched.steps.iter().any(|s| matches!(s, Step::Matmul { .. })) {
                return Err(unsupported("library matmuls run on CUDA only"));
            }
            let source = braze_codegen::openmp::emit_module(&sched.kernels).map_err(unsupported)?;
            if check_cuda && !names.is_empty() {
                let (cu, _) = braze_codegen::cuda::emit_module(&sched.kernels, 132).map_err(unsupported)?;
                braze_runtime::cuda::compile_cubin(&cu, check_arch, version).map_err(runtime_err)?;
                cuda_source = cu;
            }
            lap("codegen", &mut times);
            let m = if names.is_empty() { None } else { Some(Module::Cpu(CpuModule::load(&source, &names, version).map_err(runtime_err)?)) };
            lap("cc", &mut times);
            (source, m)
        }
        Target::Cuda(ordinal) => {
            let (arch, sms) = braze_runtime::cuda::device_info(ordinal).map_err(runtime_err)?;
            let (source, launches) = braze_codegen::cuda::emit_module(&sched.kernels, sms as u32).map_err(unsupported)?;
            lap("codegen", &mut times);
            let mut items = Vec::new();
            for st in &sched.steps {
                match st {
                    Step::Kernel(k) => items.push(Item::Kernel(*k)),
                    Step::Matmul { node, a, b, bias, out } => items.push(Item::Matmul(prepare_matmul(&opt, &sched, *node, a, b, bias.as_ref(), *out)?)),
                    Step::Extern { .. } => {}
                }
            }
            let m = if items.is_empty() {
                None
            } else {
                let (cubin, cached) = if names.is_empty() {
                    (None, false)
                } else {
                    let (c, cached) = braze_runtime::cuda::compile_cubin(&source, &arch, version).map_err(runtime_err)?;
                    (Some(c), cached)
                };
                Some(Module::Cuda(CudaModule::load(cubin.as_deref(), ordinal, launches, items, cached).map_err(runtime_err)?))
            };
            lap("nvrtc", &mut times);
            (source, m)
        }
    };
    let cached = match &module {
        Some(Module::Cpu(m)) => m.cached,
        Some(Module::Cuda(m)) => m.cached,
        None => false,
    };
    let mut tab = ExprTable(Vec::new());
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
    let num_syms = syms.iter().max().map(|m| *m as usize + 1).unwrap_or(0);
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
    // Consecutive kernels and matmuls ("items") become one step: one call into Rust runs
    // them all. Item i is sched step item_steps[i].
    let mut steps = Vec::new();
    let mut frees: Vec<Vec<u32>> = Vec::new();
    let mut item_writes: Vec<Vec<u32>> = Vec::new();
    for (s, st) in sched.steps.iter().enumerate() {
        let writes = match st {
            Step::Kernel(k) => Some(sched.kernels[*k].bufs.iter().filter(|b| b.written).map(|b| b.id).collect::<Vec<_>>()),
            Step::Matmul { out, .. } => Some(vec![*out]),
            Step::Extern { .. } => None,
        };
        if let Some(w) = writes {
            let i = item_writes.len() as u32;
            item_writes.push(w);
            match steps.last_mut() {
                Some((kind, _, hi, _, _, _)) if kind == "kernels" && *hi == i => {
                    *hi = i + 1;
                    frees.last_mut().unwrap().extend(sched.frees[s].iter().copied());
                }
                _ => {
                    steps.push(("kernels".to_string(), i, i + 1, String::new(), vec![], vec![]));
                    frees.push(sched.frees[s].clone());
                }
            }
        } else if let Step::Extern { node, target, args, outs } = st {
            let a = args.iter().map(|x| tab.access(x)).collect();
            steps.push(("extern".to_string(), node.0, 0, target.clone(), a, outs.clone()));
            frees.push(sched.frees[s].clone());
        }
    }
    let outputs = sched.outputs.iter().map(|a| tab.access(a)).collect();
    // [Note: arena] Temp buffers that only kernels and matmuls touch (not outputs, not extern
    // operands or results) and have static sizes live in one allocation per call, at fixed
    // 256-byte aligned offsets: one allocator call instead of one per buffer.
    let mut arena_offsets = vec![-1i64; sched.buffers.len()];
    let mut arena_bytes = 0i64;
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
        for (b, buf) in sched.buffers.iter().enumerate() {
            let bytes = buf.shape.iter().map(|e| e.as_const()).product::<Option<i64>>().map(|n| n * buf.dtype.size() as i64);
            if let (BufKind::Temp, false, Some(bytes)) = (&buf.kind, external[b], bytes) {
                arena_offsets[b] = arena_bytes;
                arena_bytes += (bytes.max(1) + 255) / 256 * 256;
            }
        }
    }
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
    Ok(Compiled {
        allocs,
        arena_offsets,
        arena_bytes,
        module,
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
        times,
        cached,
        exprs: tab.0,
    })
}

#[pymethods]
impl Compiled {
    /// Every size expression of the plan evaluated for these symbol values.
    fn eval(&self, syms: Vec<i64>) -> PyResult<Vec<i64>> {
        self.exprs.iter().map(|e| e.eval_syms(&syms).ok_or_else(|| unsupported(format!("cannot evaluate {e}")))).collect()
    }

    /// Runs kernels `lo..hi` on buffers `ptrs` (data pointers by buffer id) with sizes
    /// `syms`; CUDA kernels are launched on `stream` (PyTorch's current stream).
    #[pyo3(signature = (lo, hi, ptrs, syms, stream=0, arena=0))]
    fn run(&self, py: Python<'_>, lo: usize, hi: usize, ptrs: Vec<usize>, syms: Vec<i64>, stream: usize, arena: usize) -> PyResult<()> {
        let mut ptrs = ptrs;
        if arena != 0 {
            for (p, &off) in ptrs.iter_mut().zip(&self.arena_offsets) {
                if off >= 0 {
                    *p = arena + off as usize;
                }
            }
        }
        let mut s = syms;
        s.resize(self.num_syms.max(1), 0);
        match self.module.as_ref() {
            Some(Module::Cpu(m)) => {
                if hi > m.len() || lo > hi {
                    return Err(InternalError::new_err("kernel range out of bounds"));
                }
                // SAFETY: the Python runtime allocates every buffer as the plan describes
                // before calling, and passes a pointer for each buffer id.
                py.detach(|| unsafe { m.run(lo, hi, &ptrs, &s) });
                Ok(())
            }
            Some(Module::Cuda(m)) => {
                if hi > m.items.len() || lo > hi {
                    return Err(InternalError::new_err("kernel range out of bounds"));
                }
                m.run_items(lo, hi, &ptrs, &s, stream).map_err(runtime_err)
            }
            None => Err(InternalError::new_err("no kernels")),
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GraphBuilder>()?;
    m.add_class::<Compiled>()?;
    m.add_function(wrap_pyfunction!(cuda_init, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_compile, m)?)?;
    m.add("Unsupported", m.py().get_type::<Unsupported>())?;
    m.add("InternalError", m.py().get_type::<InternalError>())?;
    m.add("EnvironmentError_", m.py().get_type::<EnvironmentError_>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
