//! `braze._core`: the Python face of the Rust compiler. The Python package walks an FX graph
//! into a [`GraphBuilder`], calls `compile`, and runs the returned [`Compiled`] plan. Errors
//! map to three exceptions: `Unsupported` (the graph falls back to eager), `InternalError`
//! (a braze bug; also falls back, loudly) and `EnvironmentError_` (no C compiler, ...).

/// [Note: allocator] The compiler allocates and frees many small values (symbolic index
/// expressions, IR nodes, loop statements); with the system allocator malloc and free were
/// ~40% of a large graph's compile. mimalloc serves Rust's allocations in this module (Python
/// and PyTorch keep their own).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use braze_driver::{AccessT, DriverError, Module, Plan, Target};
use braze_ir::{parse, DType, Expr, Graph, NodeId, Op, TensorTy};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PyString, PyTuple};
use std::panic::{catch_unwind, AssertUnwindSafe};

mod exec;

create_exception!(_core, Unsupported, PyException, "braze cannot compile this graph; it runs eagerly.");
create_exception!(_core, InternalError, PyException, "A braze bug: an invariant was broken.");
create_exception!(_core, EnvironmentError_, PyException, "The machine lacks something braze needs (C compiler, cache dir).");

fn unsupported(e: impl ToString) -> PyErr {
    Unsupported::new_err(e.to_string())
}

fn parse_exprs(v: &[String]) -> PyResult<Vec<Expr>> {
    v.iter().map(|s| braze_ir::sym::parse_expr(s).map_err(unsupported)).collect()
}

/// An op attribute from Python: a bool, int, float, a name or symbolic size (str), or a list of
/// sizes or dims (ints and symbolic sizes).
fn attr(v: &Bound<'_, PyAny>) -> PyResult<parse::Attr> {
    use parse::Attr;
    if v.is_instance_of::<PyBool>() {
        return Ok(Attr::Bool(v.extract()?));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(Attr::Int(i));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(Attr::Float(v.extract()?));
    }
    if v.is_instance_of::<PyString>() {
        return Ok(Attr::Text(v.extract()?));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let mut out = Vec::new();
        for x in v.try_iter()? {
            let x = x?;
            out.push(match x.extract::<i64>() {
                Ok(i) if !x.is_instance_of::<PyBool>() => Expr::constant(i),
                _ => braze_ir::sym::parse_expr(&x.extract::<String>()?).map_err(unsupported)?,
            });
        }
        return Ok(Attr::Exprs(out));
    }
    Err(unsupported(format!("op attribute of type {}", v.get_type().name()?)))
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

    /// Adds op `name` with typed attributes (`op("sum", [x], {"dims": [1], "keepdim": True})`):
    /// bools, ints, floats, names and symbolic sizes as str, lists of sizes or dims.
    #[pyo3(signature = (name, inputs, attrs=None))]
    fn op(&mut self, name: &str, inputs: Vec<u32>, attrs: Option<&Bound<'_, PyDict>>) -> PyResult<u32> {
        let mut a = parse::Attrs::new();
        for (k, v) in attrs.into_iter().flat_map(|d| d.iter()) {
            a.insert(k.extract::<String>()?, attr(&v)?);
        }
        let op = parse::build_op(name, &a).map_err(unsupported)?;
        if matches!(op, Op::Input { .. } | Op::Extern { .. } | Op::ExternOut { .. } | Op::BiasGrad) {
            return Err(unsupported("use input() / extern_call()"));
        }
        let id = self.g.add(op, inputs.into_iter().map(NodeId).collect()).map_err(unsupported)?;
        Ok(id.0)
    }

    /// Adds a call of ATen op `target`; `outs` are (dtype, sizes, strides) of its results.
    /// `effect`: the call runs even when nothing reads its results (random ops, asserts).
    #[pyo3(signature = (target, inputs, outs, effect=false))]
    fn extern_call(&mut self, target: &str, inputs: Vec<u32>, outs: Vec<(String, Vec<String>, Vec<String>)>, effect: bool) -> PyResult<Vec<u32>> {
        for &i in &inputs {
            if self.g.nodes.get(i as usize).and_then(|n| n.ty.as_ref()).is_none() {
                return Err(unsupported(format!("extern operand %{i} is not a tensor")));
            }
        }
        let e = self.g.add_typed(Op::Extern { target: target.to_string(), outputs: outs.len() as u32, effect }, inputs.into_iter().map(NodeId).collect(), None);
        let mut ids = Vec::new();
        for (k, (dt, shape, strides)) in outs.iter().enumerate() {
            let ty = TensorTy::new(dtype(dt)?, parse_exprs(shape)?);
            ids.push(self.g.add_typed(Op::ExternOut { index: k as u32, strides: parse_exprs(strides)? }, vec![e], Some(ty)).0);
        }
        Ok(ids)
    }

    /// The graph's outputs; those from position `free_layout_from` on come back in the
    /// strides braze stores them with (a forward's saved tensors), the others in eager's.
    #[pyo3(signature = (outs, free_layout_from=None))]
    fn set_outputs(&mut self, outs: Vec<u32>, free_layout_from: Option<usize>) {
        self.g.outputs = outs.into_iter().map(NodeId).collect();
        self.g.free_layout_from = free_layout_from;
    }

    /// (dtype, sizes) of a node.
    fn node_type(&self, id: u32) -> PyResult<(String, Vec<String>)> {
        let n = self.g.nodes.get(id as usize).ok_or_else(|| unsupported("no such node"))?;
        let t = n.ty.as_ref().ok_or_else(|| unsupported("extern node has no type"))?;
        Ok((t.dtype.name().to_string(), t.shape.iter().map(|e| e.to_string()).collect()))
    }

    /// Whether a node's sizes equal `shape` (size expressions, compared in canonical form:
    /// `s1*(s0+s2)` is `s0*s1 + s1*s2`).
    fn shape_is(&self, id: u32, shape: Vec<String>) -> PyResult<bool> {
        let n = self.g.nodes.get(id as usize).ok_or_else(|| unsupported("no such node"))?;
        let t = n.ty.as_ref().ok_or_else(|| unsupported("extern node has no type"))?;
        let want = parse_exprs(&shape)?;
        Ok(t.shape.len() == want.len()
            && braze_ir::infer::with_size_rules(&self.g.size_rules, || t.shape.iter().zip(&want).all(|(a, b)| braze_ir::infer::same_size(a, b))))
    }

    /// Declares two sizes equal (a product PyTorch's guards equate to another, [Note: equal
    /// sizes] in lowering.py): `monomial` (a product of symbols) is `size` wherever typing
    /// compares sizes. Anything else as `monomial` is refused.
    fn assume_equal(&mut self, monomial: &str, size: &str) -> PyResult<()> {
        let (l, r) = (braze_ir::sym::parse_expr(monomial).map_err(unsupported)?, braze_ir::sym::parse_expr(size).map_err(unsupported)?);
        if !l.is_monomial() {
            return Err(unsupported(format!("{monomial} is not a product of symbols")));
        }
        self.g.size_rules.push((l, r));
        Ok(())
    }

    /// The op name of a node (`"add"`, `"permute"`, `"extern_out"`, ...).
    fn node_op(&self, id: u32) -> PyResult<String> {
        let n = self.g.nodes.get(id as usize).ok_or_else(|| unsupported("no such node"))?;
        Ok(n.op.name().to_string())
    }

    fn text(&self) -> String {
        self.g.to_string()
    }

    /// Runs passes, scheduling, code generation and the compiler: the C compiler for
    /// `device="cpu"`, NVRTC for `device="cuda:N"`. `check_cuda` (CPU graphs) also compiles
    /// the graph's CUDA kernels with NVRTC for `arch`, so codegen errors surface without a GPU.
    /// `cuda_graphs`, `matmul_tune` and `kernel_tune` are the user's options of those names
    /// (GPU graphs; `kernel_tune` with `check_cuda` also has NVRTC compile every candidate
    /// configuration of a CPU graph's kernels).
    /// `arena_externs`: the extern calls (by key) whose operands may live in arenas.
    /// `elide_layouts`: drop redundant `layout` copies on the GPU too (always done on the CPU).
    /// `plan_only` (CUDA): the plan without a GPU, not runnable ([Note: plans without a GPU]).
    /// `bias_grads` (CUDA): linears' bias gradients as epilogues of their weight gradients'
    /// matmuls ([Note: bias-gradient epilogues]); off only to compare.
    /// `programmatic_launch` (CUDA, Hopper and newer): braze-runtime's [Note: programmatic launch].
    /// `column_clusters` (CUDA, Hopper and newer): braze-codegen's [Note: cluster columns].
    #[pyo3(signature = (device="cpu", check_cuda=false, arch="sm_90", cuda_graphs=true, matmul_tune=true, kernel_tune=false, arena_externs=Vec::new(), elide_layouts=false, plan_only=false, bias_grads=true, programmatic_launch=true, column_clusters=true))]
    #[allow(clippy::too_many_arguments)]
    fn compile(&self, py: Python<'_>, device: &str, check_cuda: bool, arch: &str, cuda_graphs: bool, matmul_tune: bool, kernel_tune: bool, arena_externs: Vec<String>, elide_layouts: bool, plan_only: bool, bias_grads: bool, programmatic_launch: bool, column_clusters: bool) -> PyResult<Compiled> {
        let g = self.g.clone();
        let target = Target::parse(device).map_err(driver_err)?;
        let arch = arch.to_string();
        let opts = braze_driver::Options { cuda_graphs, matmul_tune, kernel_tune, arena_externs: arena_externs.into_iter().collect(), elide_layouts, plan_only, bias_grads, programmatic_launch, column_clusters };
        let res = py.detach(move || catch_unwind(AssertUnwindSafe(|| braze_driver::compile_with(g, target, check_cuda, &arch, opts))));
        match res {
            Ok(r) => r.map(|(plan, module)| Compiled { plan, module }).map_err(driver_err),
            Err(p) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                Err(InternalError::new_err(format!("panic in the compiler: {msg}")))
            }
        }
    }
}

fn runtime_err(e: braze_runtime::RuntimeError) -> PyErr {
    driver_err(e.into())
}

fn driver_err(e: DriverError) -> PyErr {
    match e {
        DriverError::Unsupported(m) => Unsupported::new_err(m),
        DriverError::Internal(m) => InternalError::new_err(m),
        DriverError::Environment(m) => EnvironmentError_::new_err(m),
        DriverError::Launch(m) => pyo3::exceptions::PyRuntimeError::new_err(m),
        DriverError::OutOfRange(m) => pyo3::exceptions::PyIndexError::new_err(m),
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

/// Starts this process's NVRTC worker processes ([Note: NVRTC worker processes] in
/// braze-runtime): `python -S -c code *args`, where `code` calls `nvrtc_serve`. Returns how
/// many started (0 with `BRAZE_NVRTC_WORKERS=0`).
#[pyfunction]
fn nvrtc_workers_start(py: Python<'_>, python: &str, code: &str, args: Vec<String>) -> usize {
    py.detach(|| braze_runtime::cuda::nvrtc_workers::start(python, code, &args))
}

/// A worker process's loop: loads NVRTC and answers compile requests on stdin until it closes.
#[pyfunction]
#[pyo3(signature = (nvrtc, builtins=None))]
fn nvrtc_serve(py: Python<'_>, nvrtc: &str, builtins: Option<&str>) -> PyResult<()> {
    py.detach(|| braze_runtime::cuda::serve_nvrtc_requests(nvrtc, builtins)).map_err(runtime_err)
}

/// How many compiles this process's NVRTC workers have answered.
#[pyfunction]
fn nvrtc_worker_compiles() -> usize {
    braze_runtime::cuda::nvrtc_workers::compiled()
}

/// Process-wide counts of runs of kernels replayed as CUDA graphs, captured, and launched
/// item by item ([Note: replay] in braze-runtime).
#[pyfunction]
fn run_counts() -> (usize, usize, usize) {
    braze_runtime::cuda::run_counts()
}

/// How many graph kernels NVRTC has compiled in this process, cache hits not counted
/// ([Note: per-kernel CUDA cache] in braze-runtime).
#[pyfunction]
fn nvrtc_kernels_compiled() -> usize {
    braze_runtime::cuda::kernels_compiled()
}

/// How many matmuls, convolutions and kernels this process has timed at compile time, choices
/// remembered in memory or on disk not counted ([Note: remembered choices] in braze-runtime).
#[pyfunction]
fn tunings_timed() -> usize {
    braze_runtime::cuda::timings()
}

/// How many of braze's own kernels this process has timed in their candidate configurations
/// (max-autotune, [Note: kernel configurations] in braze-codegen), remembered choices not
/// counted.
#[pyfunction]
fn kernels_timed() -> usize {
    braze_runtime::cuda::kernel_tune::kernels_timed()
}

/// How many kernels the C compiler has compiled in this process, cache hits not counted
/// ([Note: per-kernel cache] in braze-runtime).
#[pyfunction]
fn cc_kernels_compiled() -> usize {
    braze_runtime::cpu::kernels_compiled()
}

/// Whether cuBLASLt takes a bias-gradient epilogue for a 2-d matmul of `dtype` ("bf16",
/// "f16", "f32") `[m, k] @ [k, n]`, the sums of a (`side_a`) or b, each operand row-major or
/// transposed: None, or cuBLASLt's refusal (needs `cuda_init` with cuBLASLt).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cublaslt_probe_bias_grad(dtype: &str, side_a: bool, a_t: bool, b_t: bool, m: u64, n: u64, k: u64) -> PyResult<Option<String>> {
    let dt = match dtype {
        "bf16" => braze_ir::DType::BF16,
        "f16" => braze_ir::DType::F16,
        "f32" => braze_ir::DType::F32,
        _ => return Err(pyo3::exceptions::PyValueError::new_err(format!("dtype {dtype}"))),
    };
    Ok(braze_runtime::cublaslt::probe_bias_grad(dt, side_a, a_t, b_t, m, n, k).err().map(|e| e.to_string()))
}

/// Loads cuDNN from `path` for library convolutions ([Note: library convolutions] in
/// braze-runtime).
#[pyfunction]
fn cudnn_init(path: &str) -> PyResult<()> {
    braze_runtime::cudnn::init(path).map_err(runtime_err)
}

/// Whether f32 matmuls on the CPU can run as plan items through the BLAS of the loaded
/// PyTorch ([Note: CPU matmuls] in braze-runtime).
#[pyfunction]
fn cpu_blas_ready() -> bool {
    braze_runtime::cpu_blas::available()
}

/// The host CPU's identity as CPU modules' cache keys hold it (the target flags
/// `-march=native` expands to); read once per process.
#[pyfunction]
fn cpu_id(py: Python<'_>) -> String {
    py.detach(|| braze_runtime::cpu::cpu_id().to_string())
}

/// Pays NVRTC's first-use cost now (called from a background thread; releases the GIL).
#[pyfunction]
fn nvrtc_warm_up(py: Python<'_>, arch: &str) -> PyResult<()> {
    let arch = arch.to_string();
    py.detach(move || braze_runtime::cuda::warm_up(&arch)).map_err(runtime_err)
}

/// Copies a strided tensor into another layout on the GPU (one kernel launch on `stream`):
/// graph inputs whose strides differ from the compiled ones.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn relayout(device: i32, src: usize, src_strides: Vec<i64>, dst: usize, dst_strides: Vec<i64>, shape: Vec<i64>, elem: usize, stream: usize) -> PyResult<()> {
    braze_runtime::cuda::relayout::relayout(device, src, &src_strides, dst, &dst_strides, &shape, elem, stream).map_err(runtime_err)
}

/// [Note: patched inputs] (braze-runtime's graph_patch.rs): the kernel nodes of a captured
/// CUDA graph that read one input's buffer, rewritten per call to read the call's input.
#[pyclass(module = "braze._core", frozen)]
struct GraphInputSites {
    sites: std::sync::Mutex<braze_runtime::cuda::graph_patch::InputSites>,
}

#[pymethods]
impl GraphInputSites {
    /// Makes the graph's kernels read the input at device address `addr` from the next
    /// replay on.
    fn point_at(&self, addr: u64) -> PyResult<()> {
        self.sites.lock().unwrap_or_else(|e| e.into_inner()).point_at(addr).map_err(runtime_err)
    }

    fn __len__(&self) -> usize {
        self.sites.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The kernel nodes of captured graph `graph` (instantiated as `exec`, both raw handles)
/// that read `[addr, addr + nbytes)`, or a string saying why that range cannot be patched.
#[pyfunction]
fn graph_input_sites(py: Python<'_>, graph: usize, exec: usize, addr: u64, nbytes: u64) -> PyResult<Py<PyAny>> {
    match braze_runtime::cuda::graph_patch::find(graph, exec, addr, nbytes).map_err(runtime_err)? {
        Ok(sites) => Ok(Py::new(py, GraphInputSites { sites: std::sync::Mutex::new(sites) })?.into_any()),
        Err(why) => Ok(why.into_pyobject(py)?.into_any().unbind()),
    }
}

/// The CUDA source of the relayout kernels (for the check that it compiles).
#[pyfunction]
fn relayout_source() -> &'static str {
    braze_runtime::cuda::relayout::SOURCE
}

/// Compiles CUDA source with NVRTC for `arch` through the disk cache (a check; returns the
/// cubin's size), the GIL released: threads may compile side by side.
#[pyfunction]
fn nvrtc_compile(py: Python<'_>, source: &str, arch: &str) -> PyResult<usize> {
    py.detach(|| braze_runtime::cuda::compile_cubin(source, arch, env!("CARGO_PKG_VERSION"))).map(|(c, _)| c.len()).map_err(runtime_err)
}

/// A compiled graph: its plan (read by the Python runtime) and its loaded kernels.
#[pyclass(module = "braze._core")]
pub struct Compiled {
    plan: Plan,
    module: Option<Module>,
}

#[pymethods]
impl Compiled {
    /// Runs launched as a captured CUDA graph so far ([Note: replay] in braze-runtime).
    #[getter]
    fn replays(&self) -> usize {
        match self.module.as_ref() {
            Some(braze_driver::Module::Cuda(m)) => m.replays.load(std::sync::atomic::Ordering::Relaxed),
            _ => 0,
        }
    }

    /// Whether the kernels launch with programmatic dependent launch (braze-runtime's [Note:
    /// programmatic launch]).
    #[getter]
    fn programmatic_launch(&self) -> bool {
        matches!(self.module.as_ref(), Some(braze_driver::Module::Cuda(m)) if m.programmatic)
    }

    #[getter]
    fn graph_before(&self) -> String {
        self.plan.graph_before.clone()
    }

    #[getter]
    fn graph_after(&self) -> String {
        self.plan.graph_after.clone()
    }

    #[getter]
    fn schedule(&self) -> String {
        self.plan.schedule.clone()
    }

    #[getter]
    fn source(&self) -> String {
        self.plan.source.clone()
    }

    /// The CUDA source checked with NVRTC for a CPU graph (`check_cuda`), else empty.
    #[getter]
    fn cuda_source(&self) -> String {
        self.plan.cuda_source.clone()
    }

    #[getter]
    fn fusion_log(&self) -> Vec<String> {
        self.plan.fusion_log.clone()
    }

    /// (name, roots) per kernel.
    #[getter]
    fn kernels(&self) -> Vec<(String, Vec<String>)> {
        self.plan.kernels.clone()
    }

    /// (kind, input index or -1, dtype, shape expr ids, stride expr ids) per buffer.
    #[getter]
    fn buffers(&self) -> Vec<braze_driver::BufferRow> {
        self.plan.buffers.clone()
    }

    /// The buffers matmuls and convolutions read.
    #[getter]
    fn library_reads(&self) -> Vec<u32> {
        self.plan.library_reads.clone()
    }

    /// ("kernels", lo, hi, "", [], []) or ("extern", node, 0, target, args, outs) per step.
    #[getter]
    fn steps(&self) -> Vec<braze_driver::StepRow> {
        self.plan.steps.clone()
    }

    #[getter]
    fn frees(&self) -> Vec<Vec<u32>> {
        self.plan.frees.clone()
    }

    /// Temp buffers first written by each step (allocated just before it).
    #[getter]
    fn allocs(&self) -> Vec<Vec<u32>> {
        self.plan.allocs.clone()
    }

    /// Byte offset of each buffer in the per-call arena, or -1.
    #[getter]
    fn arena_offsets(&self) -> Vec<i64> {
        self.plan.arena_offsets.clone()
    }

    /// (first plan step, last plan step, bytes) per arena window: each is allocated before
    /// its first step and dropped after its last.
    #[getter]
    fn arena_windows(&self) -> Vec<(u32, u32, i64)> {
        self.plan.arena_windows.clone()
    }

    /// (written buffer, read buffer) outside the arenas: the written one may take the read
    /// one's tensor when it is allocated (a pointwise kernel storing it where the read one
    /// dies).
    #[getter]
    fn reuse(&self) -> Vec<(u32, u32)> {
        self.plan.reuse.clone()
    }

    /// How many buffers share a dying buffer's memory (in arenas or through `reuse`).
    #[getter]
    fn in_place(&self) -> usize {
        self.plan.in_place
    }

    /// The largest arena window.
    #[getter]
    fn arena_bytes(&self) -> i64 {
        self.plan.arena_bytes
    }

    #[getter]
    fn outputs(&self) -> Vec<AccessT> {
        self.plan.outputs.clone()
    }

    /// Length of the size-symbol array kernels read (`S[n]` is `sN`).
    #[getter]
    fn num_syms(&self) -> usize {
        self.plan.num_syms
    }

    /// The size symbols the plan mentions.
    #[getter]
    fn syms(&self) -> Vec<u32> {
        self.plan.syms.clone()
    }

    /// (stage, seconds).
    #[getter]
    fn times(&self) -> Vec<(String, f64)> {
        self.plan.times.clone()
    }

    #[getter]
    fn cached(&self) -> bool {
        self.plan.cached
    }

    /// Every size expression of the plan evaluated for these symbol values.
    /// A call's symbol values (`syms[n]` is `sN`) as `run` takes them without converting a
    /// list per run: made once per size set of a dynamic graph.
    fn sym_vals(&self, syms: Vec<i64>) -> SymVals {
        SymVals { v: padded(syms, self.plan.num_syms) }
    }

    fn eval(&self, syms: Vec<i64>) -> PyResult<Vec<i64>> {
        self.plan.exprs.iter().map(|e| e.eval_syms(&syms).ok_or_else(|| unsupported(format!("cannot evaluate {e}")))).collect()
    }

    /// Runs the kernels and matmuls of plan step `step` on buffers `ptrs` (a list of data
    /// pointers by buffer id, of which only the step's own buffers are read) with sizes
    /// `syms`; CUDA kernels are launched on `stream` (PyTorch's current stream); buffers in
    /// the arena get their pointers from `arena` (the arena window the step lies in). CPU kernels run on PyTorch's thread count
    /// (`torch.get_num_threads()`, read on every call: the user may change it at any time).
    #[pyo3(signature = (step, ptrs, syms, stream=0, arena=0))]
    fn run(&self, py: Python<'_>, step: usize, ptrs: &Bound<'_, PyList>, syms: &Bound<'_, PyAny>, stream: usize, arena: usize) -> PyResult<()> {
        // Prepared values (`sym_vals`) as they are; a list converted (a type check first:
        // a failed extraction would build a Python exception per call).
        let owned;
        let vals = syms.cast::<SymVals>().ok().map(|v| v.get());
        let s: &[i64] = match vals {
            Some(v) => &v.v,
            None => {
                owned = syms.extract::<Vec<i64>>()?;
                &owned
            }
        };
        self.run_step(py, step, |b| ptrs.get_item(b)?.extract(), s, stream, arena)
    }

    /// An executor of one prepared plan ([Note: the call loop in Rust], `exec.rs`); with
    /// `template`, a dynamic graph's plan whose sizes are indices into its size expressions'
    /// values ([Note: plan templates]).
    #[pyo3(signature = (inputs, steps, outs, empty, in_layout, syms, pool, template=false))]
    #[allow(clippy::too_many_arguments)]
    fn executor(
        slf: &Bound<'_, Self>,
        inputs: Vec<exec::InputRow>,
        steps: &Bound<'_, PyList>,
        outs: Vec<exec::OutRow>,
        empty: Py<PyAny>,
        in_layout: Py<PyAny>,
        syms: Vec<i64>,
        pool: bool,
        template: bool,
    ) -> PyResult<exec::Executor> {
        let (n_bufs, num_syms) = {
            let c = slf.borrow();
            (c.plan.buffers.len(), c.plan.num_syms)
        };
        exec::Executor::new(slf.py(), slf.clone().unbind(), n_bufs, inputs, steps, outs, empty, in_layout, padded(syms, num_syms), pool, template)
    }

    /// How many size expressions the plan has (`eval`'s values, by index).
    #[getter]
    fn num_exprs(&self) -> usize {
        self.plan.exprs.len()
    }

    /// Each size expression's value where it is a constant, else None.
    #[getter]
    fn const_exprs(&self) -> Vec<Option<i64>> {
        self.plan.exprs.iter().map(|e| e.as_const()).collect()
    }
}

impl Compiled {
    /// Whether its kernels are the CPU's.
    fn on_cpu(&self) -> bool {
        matches!(self.module, Some(Module::Cpu(_)))
    }

    /// Runs plan step `step`'s kernels and matmuls: `ptr(b)` is buffer `b`'s data pointer,
    /// asked only for the step's own buffers outside the arena.
    fn run_step(&self, py: Python<'_>, step: usize, ptr: impl Fn(usize) -> PyResult<usize>, syms: &[i64], stream: usize, arena: usize) -> PyResult<()> {
        let m = self.module.as_ref().ok_or_else(|| InternalError::new_err("no kernels"))?;
        let (Some(row), Some(used)) = (self.plan.steps.get(step), self.plan.step_bufs.get(step)) else {
            return Err(InternalError::new_err(format!("no step {step}")));
        };
        let (lo, hi) = (row.1 as usize, row.2 as usize);
        // Only the step's buffers are read: a graph has thousands, a step a handful.
        let mut table = vec![0usize; self.plan.buffers.len()];
        let offsets = &self.plan.arena_offsets;
        for &b in used {
            let b = b as usize;
            table[b] = match offsets[b] {
                off if off >= 0 && arena != 0 => arena + off as usize,
                _ => ptr(b)?,
            };
        }
        let owned;
        let s: &[i64] = if syms.len() >= self.plan.num_syms.max(1) {
            syms
        } else {
            owned = padded(syms.to_vec(), self.plan.num_syms);
            &owned
        };
        let threads = if matches!(m, Module::Cpu(_)) { torch_num_threads(py)? } else { 0 };
        // SAFETY: the Python runtime allocates every buffer as the plan describes before
        // calling, and passes a pointer for each buffer id the step touches.
        py.detach(|| unsafe { m.run(lo..hi, used, &table, s, stream, threads) }).map_err(driver_err)
    }
}

/// Size-symbol values made once (`Compiled.sym_vals`) and passed to every run of a call.
#[pyclass(module = "braze._core", frozen)]
pub struct SymVals {
    v: Vec<i64>,
}

/// `v` extended with zeros to at least one entry per symbol id of the plan (and one).
pub(crate) fn padded(mut v: Vec<i64>, num_syms: usize) -> Vec<i64> {
    if v.len() < num_syms.max(1) {
        v.resize(num_syms.max(1), 0);
    }
    v
}

/// `torch.get_num_threads()` (the function looked up once per process).
fn torch_num_threads(py: Python<'_>) -> PyResult<i32> {
    static GET: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    GET.import(py, "torch", "get_num_threads")?.call0()?.extract()
}

/// A scalar expression over size symbols (a SymInt, SymFloat or SymBool as PyTorch prints
/// it), parsed once and evaluated per call from the call's symbol values.
#[pyclass(module = "braze._core", frozen)]
#[derive(Clone)]
pub struct ScalarFn {
    e: braze_ir::scalar_expr::ScalarExpr,
    text: String,
}

#[pymethods]
impl ScalarFn {
    #[new]
    fn new(text: &str) -> PyResult<Self> {
        let e = braze_ir::scalar_expr::ScalarExpr::parse(text).map_err(unsupported)?;
        Ok(ScalarFn { e, text: text.to_string() })
    }

    /// The size symbols it reads (`sN` -> N).
    #[getter]
    fn syms(&self) -> Vec<u32> {
        let mut v = Vec::new();
        self.e.syms(&mut v);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Its value (int, float or bool) for the symbol values `syms`.
    fn __call__(&self, py: Python<'_>, syms: Vec<i64>) -> PyResult<Py<PyAny>> {
        Ok(self.value(py, &syms)?.unbind())
    }

    fn __repr__(&self) -> String {
        format!("ScalarFn({:?})", self.text)
    }
}

impl ScalarFn {
    /// Its value for the symbol values `syms`, as a Python int, float or bool (also an extern
    /// call's size argument, `exec.rs`).
    fn value<'py>(&self, py: Python<'py>, syms: &[i64]) -> PyResult<Bound<'py, PyAny>> {
        use braze_ir::scalar_expr::Value;
        let v = self.e.eval(syms).map_err(|m| pyo3::exceptions::PyRuntimeError::new_err(format!("braze: evaluating `{}`: {m}", self.text)))?;
        Ok(match v {
            Value::Int(i) => i.into_pyobject(py)?.into_any(),
            Value::Float(x) => x.into_pyobject(py)?.into_any(),
            Value::Bool(b) => pyo3::types::PyBool::new(py, b).to_owned().into_any(),
        })
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GraphBuilder>()?;
    m.add_class::<Compiled>()?;
    m.add_class::<ScalarFn>()?;
    m.add_class::<SymVals>()?;
    m.add_class::<exec::Executor>()?;
    m.add_function(wrap_pyfunction!(cuda_init, m)?)?;
    m.add_function(wrap_pyfunction!(cudnn_init, m)?)?;
    m.add_function(wrap_pyfunction!(run_counts, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_workers_start, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_serve, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_worker_compiles, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_kernels_compiled, m)?)?;
    m.add_function(wrap_pyfunction!(cc_kernels_compiled, m)?)?;
    m.add_function(wrap_pyfunction!(tunings_timed, m)?)?;
    m.add_function(wrap_pyfunction!(kernels_timed, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_compile, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_warm_up, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_id, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_blas_ready, m)?)?;
    m.add_function(wrap_pyfunction!(cublaslt_probe_bias_grad, m)?)?;
    m.add_function(wrap_pyfunction!(relayout, m)?)?;
    m.add_function(wrap_pyfunction!(graph_input_sites, m)?)?;
    m.add_class::<GraphInputSites>()?;
    m.add_function(wrap_pyfunction!(relayout_source, m)?)?;
    m.add("Unsupported", m.py().get_type::<Unsupported>())?;
    m.add("InternalError", m.py().get_type::<InternalError>())?;
    m.add("EnvironmentError_", m.py().get_type::<EnvironmentError_>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
