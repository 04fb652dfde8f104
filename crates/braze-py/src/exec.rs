//! [Note: the call loop in Rust] One compiled graph's call, run by one Rust call
//! (`Executor.call`): the graph inputs bound (their strides checked, relayouts where they
//! differ), each plan step's buffers allocated through PyTorch's allocator, its kernels and
//! matmuls run straight from here (no Python list of pointers per run), its extern ATen call
//! made through the callable and argument builder prepared at compile time, its dead buffers
//! freed, the windows' arenas opened and closed (a CPU graph's kept in a pool), and the
//! outputs assembled. Python keeps what is per graph rather than per step: choosing the plan
//! of a dynamic graph's sizes, the mutated inputs' copies and the outputs that are not tensors.
//!
//! The plan arrives once as tagged rows from `runtime.py`'s `_plan` and is kept here as typed
//! steps: a static graph's with its sizes, a dynamic graph's as a template whose sizes are
//! indices into its size expressions' values, instantiated here per size set ([Note: plan
//! templates], `Executor.instantiate`). Tensors stay
//! Python objects: buffers are a Python list (what `on_step` debugging hooks see), data
//! pointers a Rust vector beside it.

use crate::{Compiled, ScalarFn, SymVals};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A Python object the plan holds (a shape or stride tuple, a dtype, a tensor, a callable).
type Obj = Py<PyAny>;
/// An extern call's result: (buffer, path into what the call returned, shape, strides).
type ResultRow = (usize, Vec<Obj>, Obj, Obj);
/// An extern operand in the window's arena: (buffer, dtype, shape, strides, element offset).
type ArenaOperand = (usize, Obj, Obj, Obj, i64);

/// An extern call's argument as prepared at compile time: a value used as it is, or a
/// position filled per call (an operand tensor, a size expression, a host value), inside
/// lists, tuples and dicts as the op's schema nests them.
enum Arg {
    Fixed(Obj),
    Tensor(usize),
    Sym(ScalarFn),
    Host(usize),
    List(Vec<Arg>),
    Tuple(Vec<Arg>),
    Dict(Vec<(Obj, Arg)>),
}

impl Arg {
    /// From `runtime._template`'s tagged rows.
    fn from_row(row: &Bound<'_, PyAny>) -> PyResult<Arg> {
        let tag: String = row.get_item(0)?.extract()?;
        let v = row.get_item(1)?;
        let items = |v: &Bound<'_, PyAny>| -> PyResult<Vec<Arg>> { v.try_iter()?.map(|r| Arg::from_row(&r?)).collect() };
        Ok(match tag.as_str() {
            "c" => Arg::Fixed(v.unbind()),
            "t" => Arg::Tensor(v.extract()?),
            "s" => Arg::Sym(ScalarFn::new(&v.extract::<String>()?)?),
            "h" => Arg::Host(v.extract()?),
            "l" => Arg::List(items(&v)?),
            "u" => Arg::Tuple(items(&v)?),
            "d" => Arg::Dict(Arg::pairs(&v)?),
            _ => return Err(crate::InternalError::new_err(format!("unknown argument {tag:?}"))),
        })
    }

    /// (key, argument) rows: a dict's items, or a call's keyword arguments.
    fn pairs(rows: &Bound<'_, PyAny>) -> PyResult<Vec<(Obj, Arg)>> {
        rows.try_iter()?
            .map(|kv| {
                let kv = kv?;
                Ok((kv.get_item(0)?.unbind(), Arg::from_row(&kv.get_item(1)?)?))
            })
            .collect()
    }

    /// A dict of `pairs` filled.
    fn fill_dict<'py>(pairs: &[(Obj, Arg)], py: Python<'py>, tensors: &[Bound<'py, PyAny>], syms: &[i64], hosts: Option<&Bound<'py, PyList>>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, a) in pairs {
            d.set_item(k.bind(py), a.fill(py, tensors, syms, hosts)?)?;
        }
        Ok(d)
    }

    /// Reports the fixed values to the cycle collector (`Executor.__traverse__`).
    fn visit(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        match self {
            Arg::Fixed(o) => visit.call(o),
            Arg::List(v) | Arg::Tuple(v) => v.iter().try_for_each(|a| a.visit(visit)),
            Arg::Dict(v) => v.iter().try_for_each(|(k, a)| {
                visit.call(k)?;
                a.visit(visit)
            }),
            _ => Ok(()),
        }
    }

    /// This argument for one plan instance of a dynamic graph ([Note: plan templates]): a size
    /// expression reading none of the `varying` symbols (host scalars, whose values change per
    /// call) evaluated once for `syms`, and a list or tuple left with only such values made one
    /// value, as a static plan's are; None where nothing changes.
    fn resolved(&self, py: Python<'_>, syms: &[i64], varying: &[u32]) -> PyResult<Option<Arg>> {
        let items = |v: &[Arg]| -> PyResult<Option<Vec<Arg>>> {
            let new = v.iter().map(|a| a.resolved(py, syms, varying)).collect::<PyResult<Vec<_>>>()?;
            if new.iter().all(Option::is_none) {
                return Ok(None);
            }
            Ok(Some(new.into_iter().zip(v).map(|(n, a)| n.unwrap_or_else(|| a.clone_ref(py))).collect()))
        };
        let fixed = |v: &[Arg]| v.iter().all(|a| matches!(a, Arg::Fixed(_)));
        let objs = |v: &[Arg]| v.iter().map(|a| match a { Arg::Fixed(o) => o.clone_ref(py), _ => unreachable!() }).collect::<Vec<_>>();
        Ok(match self {
            Arg::Sym(f) if f.syms().iter().all(|n| !varying.contains(n)) => Some(Arg::Fixed(f.value(py, syms)?.unbind())),
            Arg::List(v) => items(v)?.map(|v| -> PyResult<Arg> {
                Ok(if fixed(&v) { Arg::Fixed(PyList::new(py, objs(&v))?.into_any().unbind()) } else { Arg::List(v) })
            }).transpose()?,
            Arg::Tuple(v) => items(v)?.map(|v| -> PyResult<Arg> {
                Ok(if fixed(&v) { Arg::Fixed(PyTuple::new(py, objs(&v))?.into_any().unbind()) } else { Arg::Tuple(v) })
            }).transpose()?,
            Arg::Dict(v) => {
                let vals: Vec<Arg> = v.iter().map(|(_, a)| a.clone_ref(py)).collect();
                items(&vals)?.map(|new| Arg::Dict(v.iter().zip(new).map(|((k, _), a)| (k.clone_ref(py), a)).collect()))
            }
            _ => None,
        })
    }

    fn clone_ref(&self, py: Python<'_>) -> Arg {
        match self {
            Arg::Fixed(o) => Arg::Fixed(o.clone_ref(py)),
            Arg::Tensor(k) => Arg::Tensor(*k),
            Arg::Sym(f) => Arg::Sym(f.clone()),
            Arg::Host(slot) => Arg::Host(*slot),
            Arg::List(v) => Arg::List(v.iter().map(|a| a.clone_ref(py)).collect()),
            Arg::Tuple(v) => Arg::Tuple(v.iter().map(|a| a.clone_ref(py)).collect()),
            Arg::Dict(v) => Arg::Dict(v.iter().map(|(k, a)| (k.clone_ref(py), a.clone_ref(py))).collect()),
        }
    }

    /// Whether the symbol values are read.
    fn reads_syms(&self) -> bool {
        match self {
            Arg::Sym(..) => true,
            Arg::List(v) | Arg::Tuple(v) => v.iter().any(Arg::reads_syms),
            Arg::Dict(v) => v.iter().any(|(_, a)| a.reads_syms()),
            _ => false,
        }
    }

    fn fill<'py>(&self, py: Python<'py>, tensors: &[Bound<'py, PyAny>], syms: &[i64], hosts: Option<&Bound<'py, PyList>>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Arg::Fixed(o) => o.bind(py).clone(),
            Arg::Tensor(k) => tensors[*k].clone(),
            Arg::Sym(f) => f.value(py, syms)?,
            Arg::Host(slot) => hosts.ok_or_else(|| crate::InternalError::new_err("a host argument without host slots"))?.get_item(*slot)?,
            Arg::List(v) => PyList::new(py, v.iter().map(|a| a.fill(py, tensors, syms, hosts)).collect::<PyResult<Vec<_>>>()?)?.into_any(),
            Arg::Tuple(v) => PyTuple::new(py, v.iter().map(|a| a.fill(py, tensors, syms, hosts)).collect::<PyResult<Vec<_>>>()?)?.into_any(),
            Arg::Dict(v) => Arg::fill_dict(v, py, tensors, syms, hosts)?.into_any(),
        })
    }
}

/// A graph input: argument `arg` of the call, or a tensor constant of the graph.
pub struct Input {
    arg: Option<usize>,
    constant: Option<Obj>,
    buf: usize,
    shape: Obj,
    stride: Obj,
}

/// How a step's new buffer gets its tensor.
enum Alloc {
    /// A new tensor from the allocator.
    New { buf: usize, shape: Obj, stride: Obj, dtype: Obj },
    /// The memory of buffer `from`, dying at this step ([Note: in-place kernels]), viewed
    /// with this buffer's layout where it differs.
    Reuse { buf: usize, from: usize, restride: bool, shape: Obj, stride: Obj },
    /// Input `arg`'s new value stored into it when its layout allows ([Note: input mutations]).
    InPlace { buf: usize, arg: usize, shape: Obj, stride: Obj, dtype: Obj },
}

/// A tensor as a plan reads it: buffer `buf`, or a strided view of it (sizes, strides, element
/// offset added to the buffer's own).
struct View {
    buf: usize,
    view: Option<(Obj, Obj, i64)>,
}

/// An extern (ATen) call of a step: its arguments built in Rust from the template prepared at
/// compile time, then one call of the op's callable (`runtime._callable`).
struct Extern {
    /// What no size changes (shared by a dynamic graph's plans, [Note: plan templates]).
    call: Arc<ExternCall>,
    operands: Vec<View>,
    results: Vec<ResultRow>,
    in_arena: Vec<ArenaOperand>,
}

struct ExternCall {
    target: Obj,
    /// Positional arguments (a tuple's items) and keyword arguments.
    args: Vec<Arg>,
    kwargs: Vec<(Obj, Arg)>,
    /// Whether the arguments read the call's symbol values.
    reads_syms: bool,
    /// Results kept on the host: (path into the result, host slot).
    host_outs: Vec<(Vec<Obj>, usize)>,
}

impl ExternCall {
    /// The call for one plan instance ([`Arg::resolved`]): shared with the template where no
    /// argument changes.
    fn resolved(self: &Arc<Self>, py: Python<'_>, syms: &[i64], varying: &[u32]) -> PyResult<Arc<ExternCall>> {
        if !self.reads_syms {
            return Ok(self.clone());
        }
        let args = self.args.iter().map(|a| Ok(a.resolved(py, syms, varying)?.unwrap_or_else(|| a.clone_ref(py)))).collect::<PyResult<Vec<_>>>()?;
        let kwargs = self.kwargs.iter().map(|(k, a)| Ok((k.clone_ref(py), a.resolved(py, syms, varying)?.unwrap_or_else(|| a.clone_ref(py))))).collect::<PyResult<Vec<_>>>()?;
        let reads_syms = args.iter().any(Arg::reads_syms) || kwargs.iter().any(|(_, a)| a.reads_syms());
        let host_outs = self.host_outs.iter().map(|(path, slot)| (path.iter().map(|k| k.clone_ref(py)).collect(), *slot)).collect();
        Ok(Arc::new(ExternCall { target: self.target.clone_ref(py), args, kwargs, reads_syms, host_outs }))
    }
}

enum Work {
    /// Plan step `n`'s kernels and matmuls.
    Run(usize),
    Extern(Extern),
}

struct Step {
    allocs: Vec<Alloc>,
    work: Work,
    /// What an `on_step` hook is told (the plan step, or the extern call's target).
    what: Obj,
    frees: Vec<usize>,
    /// Bytes of the arena window opening before this step (0: none opens).
    opens: i64,
    closes: bool,
}

struct Out {
    view: View,
    copy: bool,
}

#[pyclass(module = "braze._core", frozen)]
pub struct Executor {
    compiled: Py<Compiled>,
    n_bufs: usize,
    inputs: Vec<Input>,
    steps: Vec<Step>,
    outs: Vec<Out>,
    /// (shape, stride, dtype) -> a new tensor on the graph's device.
    empty: Obj,
    /// (tensor, shape, stride, stream) -> the tensor laid out so (`CompiledGraph._in_layout`).
    in_layout: Obj,
    uint8: Obj,
    /// The symbol values runs read (`sym_vals`), unless a call passes its own.
    syms: Vec<i64>,
    /// [Note: CPU arenas] Arenas by bytes, kept between calls (None on the GPU).
    pool: Option<Kept<i64>>,
    /// [Note: kept temps] in braze-driver: which buffers' tensors this CPU instance of a
    /// dynamic plan keeps between calls (empty: none), and the kept tensors by buffer.
    kept: Vec<bool>,
    temps: Kept<usize>,
    /// [Note: plan templates] Sizes, strides and view offsets are indices into the values of a
    /// dynamic graph's size expressions: not callable, only instantiated.
    template: bool,
}

/// Rows as `CompiledGraph._executor` writes them.
pub type InputRow = (i64, Option<Obj>, usize, Obj, Obj);
pub type OutRow = (usize, Option<(Obj, Obj, i64)>, bool);

fn data_ptr(t: &Bound<'_, PyAny>) -> PyResult<usize> {
    t.call_method0(intern!(t.py(), "data_ptr"))?.extract()
}

/// `t.as_strided(shape, stride, t.storage_offset() + off)`.
fn strided<'py>(t: &Bound<'py, PyAny>, shape: &Obj, stride: &Obj, off: i64) -> PyResult<Bound<'py, PyAny>> {
    let py = t.py();
    let base: i64 = t.call_method0(intern!(py, "storage_offset"))?.extract()?;
    t.call_method1(intern!(py, "as_strided"), (shape.bind(py), stride.bind(py), base + off))
}

fn walk<'py>(r: &Bound<'py, PyAny>, path: &[Obj]) -> PyResult<Bound<'py, PyAny>> {
    let mut t = r.clone();
    for k in path {
        t = t.get_item(k.bind(r.py()))?;
    }
    Ok(t)
}

fn alloc_row(row: &Bound<'_, PyAny>) -> PyResult<Alloc> {
    let tag: String = row.get_item(0)?.extract()?;
    let item = |i: usize| -> PyResult<Obj> { Ok(row.get_item(i)?.unbind()) };
    let int = |i: usize| -> PyResult<usize> { row.get_item(i)?.extract() };
    Ok(match tag.as_str() {
        "new" => Alloc::New { buf: int(1)?, shape: item(2)?, stride: item(3)?, dtype: item(4)? },
        "reuse" => Alloc::Reuse { buf: int(1)?, from: int(2)?, restride: row.get_item(3)?.extract()?, shape: item(4)?, stride: item(5)? },
        "input" => Alloc::InPlace { buf: int(1)?, arg: int(2)?, shape: item(3)?, stride: item(4)?, dtype: item(5)? },
        _ => return Err(crate::InternalError::new_err(format!("unknown allocation {tag:?}"))),
    })
}

/// Tensors an executor keeps between calls for its next ones, by key: a CPU graph's arenas by
/// bytes ([Note: CPU arenas]), a dynamic plan instance's temps by buffer ([Note: kept temps]).
struct Kept<K>(Mutex<HashMap<K, Vec<Obj>>>);

impl<K: Eq + std::hash::Hash> Kept<K> {
    fn new() -> Self {
        Kept(Mutex::new(HashMap::new()))
    }

    /// A kept tensor of `key`, taken out.
    fn take(&self, key: &K) -> Option<Obj> {
        self.0.lock().ok()?.get_mut(key)?.pop()
    }

    /// Keeps `t` under `key` for a later call.
    fn put(&self, key: K, t: Obj) {
        if let Ok(mut p) = self.0.lock() {
            p.entry(key).or_default().push(t);
        }
    }

    fn visit(&self, visit: &pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Ok(p) = self.0.try_lock() {
            for t in p.values().flatten() {
                visit.call(t)?;
            }
        }
        Ok(())
    }
}

/// [Note: kept temps]: the largest temp a CPU plan instance keeps between calls, and the most
/// bytes it keeps in all (an allocation costs about a microsecond; past these sizes the kernels
/// reading the memory take far longer than allocating it).
const KEPT_TEMP_BYTES: i64 = 1 << 20;
const KEPT_BYTES: i64 = 8 << 20;

type ExternRow<'py> = (
    Obj,
    Bound<'py, PyAny>,
    Vec<(usize, Option<(Obj, Obj, i64)>)>,
    Vec<ResultRow>,
    Vec<ArenaOperand>,
    Vec<(Vec<Obj>, usize)>,
);

impl Executor {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        py: Python<'_>,
        compiled: Py<Compiled>,
        n_bufs: usize,
        inputs: Vec<InputRow>,
        steps: &Bound<'_, PyList>,
        outs: Vec<OutRow>,
        empty: Obj,
        in_layout: Obj,
        syms: Vec<i64>,
        pool: bool,
        template: bool,
    ) -> PyResult<Executor> {
        let inputs = inputs
            .into_iter()
            .map(|(arg, constant, buf, shape, stride)| Input { arg: usize::try_from(arg).ok(), constant, buf, shape, stride })
            .collect();
        let mut typed = Vec::with_capacity(steps.len());
        for row in steps.iter() {
            let allocs: Vec<Bound<'_, PyAny>> = row.get_item(0)?.extract()?;
            let allocs = allocs.iter().map(alloc_row).collect::<PyResult<Vec<_>>>()?;
            let what = row.get_item(1)?;
            let frees: Vec<usize> = row.get_item(2)?.extract()?;
            let opens: i64 = row.get_item(3)?.extract()?;
            let closes: bool = row.get_item(4)?.extract()?;
            let ext = row.get_item(5)?;
            let work = if ext.is_none() {
                Work::Run(what.extract()?)
            } else {
                let (target, template, operands, results, in_arena, host_outs): ExternRow = ext.extract()?;
                let args = template.get_item(0)?.try_iter()?.map(|r| Arg::from_row(&r?)).collect::<PyResult<Vec<_>>>()?;
                let kwargs = Arg::pairs(&template.get_item(1)?)?;
                let reads_syms = args.iter().any(Arg::reads_syms) || kwargs.iter().any(|(_, a)| a.reads_syms());
                let operands = operands.into_iter().map(|(buf, view)| View { buf, view }).collect();
                Work::Extern(Extern { call: Arc::new(ExternCall { target, args, kwargs, reads_syms, host_outs }), operands, results, in_arena })
            };
            typed.push(Step { allocs, work, what: what.unbind(), frees, opens, closes });
        }
        let outs = outs.into_iter().map(|(b, v, copy)| Out { view: View { buf: b, view: v }, copy }).collect();
        let uint8 = py.import("torch")?.getattr("uint8")?.unbind();
        Ok(Executor {
            compiled,
            n_bufs,
            inputs,
            steps: typed,
            outs,
            empty,
            in_layout,
            uint8,
            syms,
            pool: pool.then(Kept::new),
            kept: Vec::new(),
            temps: Kept::new(),
            template,
        })
    }

    /// Operand `v` of an extern call as a tensor.
    fn operand<'py>(bufs: &Bound<'py, PyList>, v: &View) -> PyResult<Bound<'py, PyAny>> {
        let t = bufs.get_item(v.buf)?;
        match &v.view {
            None => Ok(t),
            Some((shape, stride, off)) => strided(&t, shape, stride, *off),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn call_extern<'py>(
        &self,
        e: &Extern,
        bufs: &Bound<'py, PyList>,
        ptrs: &mut [usize],
        arena: Option<&Bound<'py, PyAny>>,
        arena_views: &mut Vec<(usize, Bound<'py, PyAny>)>,
        syms: &Bound<'py, PyAny>,
        hosts: Option<&Bound<'py, PyList>>,
        stream: usize,
    ) -> PyResult<()> {
        let py = bufs.py();
        for (buf, dtype, shape, stride, off) in &e.in_arena {
            let key = dtype.as_ptr() as usize;
            let base = match arena_views.iter().find(|(k, _)| *k == key) {
                Some((_, b)) => b.clone(),
                None => {
                    let arena = arena.ok_or_else(|| crate::InternalError::new_err("an arena operand outside a window"))?;
                    let b = arena.call_method1(intern!(py, "view"), (dtype.bind(py),))?;
                    arena_views.push((key, b.clone()));
                    b
                }
            };
            bufs.set_item(*buf, base.call_method1(intern!(py, "as_strided"), (shape.bind(py), stride.bind(py), *off))?)?;
        }
        let tensors = e.operands.iter().map(|v| Self::operand(bufs, v)).collect::<PyResult<Vec<_>>>()?;
        let c = &*e.call;
        let owned;
        let syms: &[i64] = if c.reads_syms {
            owned = syms.extract::<Vec<i64>>()?;
            &owned
        } else {
            &[]
        };
        let args = PyTuple::new(py, c.args.iter().map(|a| a.fill(py, &tensors, syms, hosts)).collect::<PyResult<Vec<_>>>()?)?;
        let kwargs = if c.kwargs.is_empty() { None } else { Some(Arg::fill_dict(&c.kwargs, py, &tensors, syms, hosts)?) };
        drop(tensors);
        let r = c.target.bind(py).call(args, kwargs.as_ref())?;
        for (path, slot) in &c.host_outs {
            let hosts = hosts.ok_or_else(|| crate::InternalError::new_err("host results without host slots"))?;
            hosts.set_item(*slot, walk(&r, path)?)?;
        }
        for (o, path, shape, stride) in &e.results {
            let mut t = walk(&r, path)?;
            if !t.call_method0(intern!(py, "stride"))?.eq(stride.bind(py))? {
                t = self.in_layout.bind(py).call1((t, shape.bind(py), stride.bind(py), stream))?;
            }
            ptrs[*o] = data_ptr(&t)?;
            bufs.set_item(*o, t)?;
        }
        // [Note: no stray references]: the operands (views of the window's arena among them)
        // and results are held by `bufs` alone once this returns.
        Ok(())
    }
}

#[pymethods]
impl Executor {
    /// The Python objects it holds, for the cycle collector: `in_layout` is a bound method of
    /// the `CompiledGraph` that holds this executor, so the two make a cycle that only the
    /// collector frees once the graph is dropped (`torch._dynamo.reset()`).
    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.compiled)?;
        visit.call(&self.empty)?;
        visit.call(&self.in_layout)?;
        for i in &self.inputs {
            visit.call(&i.constant)?;
        }
        for st in &self.steps {
            visit.call(&st.what)?;
            if let Work::Extern(e) = &st.work {
                visit.call(&e.call.target)?;
                for a in e.call.args.iter().chain(e.call.kwargs.iter().map(|(_, a)| a)) {
                    a.visit(&visit)?;
                }
            }
        }
        if let Some(p) = &self.pool {
            p.visit(&visit)?;
        }
        self.temps.visit(&visit)
    }

    /// [Note: plan templates] The executor of one size set of a dynamic graph, from this
    /// template: every shape and stride (tuples of indices into `vals`, the values of the
    /// graph's size expressions for the call's symbols, `Compiled.eval`) and every view offset
    /// resolved; an extern call's size arguments evaluated for `syms` unless they read one of
    /// the `varying` symbols (host scalars, set per call: [`Arg::resolved`]); what no size
    /// changes (kernel runs, extern callables, frees, arena windows) shared. `syms`: the
    /// symbol values the runs read.
    fn instantiate(&self, py: Python<'_>, vals: Vec<i64>, syms: Vec<i64>, varying: Vec<u32>) -> PyResult<Executor> {
        if !self.template {
            return Err(crate::InternalError::new_err("only a plan template is instantiated"));
        }
        let val = |i: i64| -> PyResult<i64> {
            usize::try_from(i).ok().and_then(|i| vals.get(i).copied()).ok_or_else(|| crate::InternalError::new_err(format!("no size expression {i}")))
        };
        let dims = |o: &Obj| -> PyResult<Obj> {
            let idx: Vec<i64> = o.extract(py)?;
            Ok(PyTuple::new(py, idx.into_iter().map(val).collect::<PyResult<Vec<i64>>>()?)?.into_any().unbind())
        };
        let view = |v: &View| -> PyResult<View> {
            Ok(View { buf: v.buf, view: match &v.view {
                None => None,
                Some((shape, stride, off)) => Some((dims(shape)?, dims(stride)?, val(*off)?)),
            } })
        };
        let inputs = self.inputs.iter().map(|i| -> PyResult<Input> {
            Ok(Input { arg: i.arg, constant: i.constant.as_ref().map(|c| c.clone_ref(py)), buf: i.buf, shape: dims(&i.shape)?, stride: dims(&i.stride)? })
        }).collect::<PyResult<Vec<_>>>()?;
        let mut steps = Vec::with_capacity(self.steps.len());
        for st in &self.steps {
            let allocs = st.allocs.iter().map(|a| -> PyResult<Alloc> {
                Ok(match a {
                    Alloc::New { buf, shape, stride, dtype } => Alloc::New { buf: *buf, shape: dims(shape)?, stride: dims(stride)?, dtype: dtype.clone_ref(py) },
                    Alloc::Reuse { buf, from, restride, shape, stride } => Alloc::Reuse { buf: *buf, from: *from, restride: *restride, shape: dims(shape)?, stride: dims(stride)? },
                    Alloc::InPlace { buf, arg, shape, stride, dtype } => Alloc::InPlace { buf: *buf, arg: *arg, shape: dims(shape)?, stride: dims(stride)?, dtype: dtype.clone_ref(py) },
                })
            }).collect::<PyResult<Vec<_>>>()?;
            let work = match &st.work {
                Work::Run(n) => Work::Run(*n),
                Work::Extern(e) => Work::Extern(Extern {
                    call: e.call.resolved(py, &syms, &varying)?,
                    operands: e.operands.iter().map(view).collect::<PyResult<Vec<_>>>()?,
                    results: e.results.iter().map(|(o, path, shape, stride)| -> PyResult<ResultRow> {
                        Ok((*o, path.iter().map(|k| k.clone_ref(py)).collect(), dims(shape)?, dims(stride)?))
                    }).collect::<PyResult<Vec<_>>>()?,
                    in_arena: e.in_arena.iter().map(|(b, dtype, shape, stride, off)| -> PyResult<ArenaOperand> {
                        Ok((*b, dtype.clone_ref(py), dims(shape)?, dims(stride)?, *off))
                    }).collect::<PyResult<Vec<_>>>()?,
                }),
            };
            steps.push(Step { allocs, work, what: st.what.clone_ref(py), frees: st.frees.clone(), opens: st.opens, closes: st.closes });
        }
        let outs = self.outs.iter().map(|o| -> PyResult<Out> { Ok(Out { view: view(&o.view)?, copy: o.copy }) }).collect::<PyResult<Vec<_>>>()?;
        let compiled = self.compiled.bind(py).borrow();
        let num_syms = compiled.plan.num_syms;
        // [Note: kept temps]: on the CPU, the tensors of temps only kernels and matmuls address
        // are kept for this size set's next call, those of up to KEPT_TEMP_BYTES each and
        // KEPT_BYTES in all (an instance lives while its size set is among the latest used).
        let mut kept = Vec::new();
        if compiled.on_cpu() && !compiled.plan.kept_temps.is_empty() {
            kept = vec![false; self.n_bufs];
            let mut keepable = vec![false; self.n_bufs];
            compiled.plan.kept_temps.iter().for_each(|&b| keepable[b as usize] = true);
            let mut total = 0i64;
            for a in steps.iter().flat_map(|st| &st.allocs) {
                let Alloc::New { buf, shape, stride, dtype } = a else { continue };
                if !keepable[*buf] {
                    continue;
                }
                let (shape, stride): (Vec<i64>, Vec<i64>) = (shape.extract(py)?, stride.extract(py)?);
                let item: i64 = dtype.bind(py).getattr(intern!(py, "itemsize"))?.extract()?;
                let bytes = if shape.contains(&0) { 0 } else { (1 + shape.iter().zip(&stride).map(|(n, s)| (n - 1) * s).sum::<i64>()) * item };
                if bytes <= KEPT_TEMP_BYTES && total + bytes <= KEPT_BYTES {
                    kept[*buf] = true;
                    total += bytes;
                }
            }
        }
        drop(compiled);
        Ok(Executor {
            compiled: self.compiled.clone_ref(py),
            n_bufs: self.n_bufs,
            inputs,
            steps,
            outs,
            empty: self.empty.clone_ref(py),
            in_layout: self.in_layout.clone_ref(py),
            uint8: self.uint8.clone_ref(py),
            syms: crate::padded(syms, num_syms),
            pool: self.pool.as_ref().map(|_| Kept::new()),
            kept,
            temps: Kept::new(),
            template: false,
        })
    }

    /// How many temps' tensors are kept for the next call ([Note: kept temps] in braze-driver).
    fn kept_temps(&self) -> usize {
        self.temps.0.lock().map(|p| p.values().map(Vec::len).sum()).unwrap_or(0)
    }

    /// The arenas kept for the next calls, by bytes (empty where none are kept).
    fn arena_pool<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(Ok(p)) = self.pool.as_ref().map(|p| p.0.lock()) {
            for (n, ts) in p.iter() {
                d.set_item(n, PyList::new(py, ts.iter().map(|t| t.bind(py)))?)?;
            }
        }
        Ok(d)
    }

    /// Runs the plan on `args` (boxed: the list is cleared once its inputs are bound, so each
    /// input lives until its last reader, [Note: inputs freed at their last use]). `syms`: the
    /// call's symbol values as extern calls' size arguments read them; `vals`: the runs' symbol
    /// values when they differ from the plan's (host scalars); `margs`: the mutated inputs by
    /// argument index; `hosts`: the host-value slots; `copies`: where a mutated input whose
    /// layout did not allow storing in place gets `(None, arg, new value)` appended; `on_step`:
    /// a debugging hook called after each step, before its frees, as `on_step(kind, what,
    /// bufs)`. Returns the output tensors of the plan.
    #[pyo3(signature = (args, stream, syms, vals=None, margs=None, hosts=None, copies=None, on_step=None))]
    #[allow(clippy::too_many_arguments)]
    fn call<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyAny>,
        stream: usize,
        syms: &Bound<'py, PyAny>,
        vals: Option<PyRef<'py, SymVals>>,
        margs: Option<&Bound<'py, PyDict>>,
        hosts: Option<&Bound<'py, PyList>>,
        copies: Option<&Bound<'py, PyList>>,
        on_step: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        if self.template {
            return Err(crate::InternalError::new_err("a plan template is instantiated, not called"));
        }
        let compiled = self.compiled.bind(py).borrow();
        let run_syms: &[i64] = match &vals {
            Some(v) => &v.v,
            None => &self.syms,
        };
        let none = py.None().into_bound(py);
        let bufs = PyList::new(py, std::iter::repeat_n(&none, self.n_bufs))?;
        let mut ptrs = vec![0usize; self.n_bufs];
        // Graph inputs in the layout the kernels were compiled for: one stride comparison
        // each in the common case.
        let stride_s = intern!(py, "stride");
        let mut bound = Vec::with_capacity(self.inputs.len());
        let mut same = true;
        for inp in &self.inputs {
            let t = match (inp.arg, &inp.constant) {
                (Some(i), _) => args.get_item(i)?,
                (None, Some(c)) => c.bind(py).clone(),
                (None, None) => return Err(crate::InternalError::new_err("an input with no source")),
            };
            if same && !t.call_method0(stride_s)?.eq(inp.stride.bind(py))? {
                same = false;
            }
            bound.push(t);
        }
        if !same {
            for (t, inp) in bound.iter_mut().zip(&self.inputs) {
                *t = self.in_layout.bind(py).call1((t.clone(), inp.shape.bind(py), inp.stride.bind(py), stream))?;
            }
        }
        for (t, inp) in bound.into_iter().zip(&self.inputs) {
            ptrs[inp.buf] = data_ptr(&t)?;
            bufs.set_item(inp.buf, t)?;
        }
        args.call_method0(intern!(py, "clear"))?;
        let empty = self.empty.bind(py);
        let mut arena: Option<Bound<'py, PyAny>> = None;
        let mut arena_bytes = 0i64;
        let mut arena_ptr = 0usize;
        let mut arena_views: Vec<(usize, Bound<'py, PyAny>)> = Vec::new();
        for st in &self.steps {
            if st.opens > 0 {
                arena = self.pool.as_ref().and_then(|p| p.take(&st.opens)).map(|a| a.into_bound(py));
                if arena.is_none() {
                    arena = Some(empty.call1(((st.opens,), (1,), self.uint8.bind(py)))?);
                }
                arena_bytes = st.opens;
                arena_ptr = data_ptr(arena.as_ref().expect("opened"))?;
                arena_views.clear();
            }
            for a in &st.allocs {
                let (buf, t) = match a {
                    Alloc::New { buf, shape, stride, dtype } => {
                        let t = if self.kept.get(*buf) == Some(&true) {
                            self.temps.take(buf).map(|t| t.into_bound(py))
                        } else {
                            None
                        };
                        (*buf, match t {
                            Some(t) => t,
                            None => empty.call1((shape.bind(py), stride.bind(py), dtype.bind(py)))?,
                        })
                    }
                    Alloc::Reuse { buf, from, restride, shape, stride } => {
                        let t = bufs.get_item(*from)?;
                        (*buf, if *restride { strided(&t, shape, stride, 0)? } else { t })
                    }
                    Alloc::InPlace { buf, arg, shape, stride, dtype } => {
                        let margs = margs.ok_or_else(|| crate::InternalError::new_err("an in-place store without the mutated inputs"))?;
                        let mut t = margs.get_item(*arg)?.ok_or_else(|| crate::InternalError::new_err("a mutated input missing"))?;
                        let fits = t.call_method0(stride_s)?.eq(stride.bind(py))?
                            && t.getattr(intern!(py, "dtype"))?.is(dtype.bind(py))
                            && t.getattr(intern!(py, "shape"))?.eq(shape.bind(py))?;
                        if !fits {
                            t = empty.call1((shape.bind(py), stride.bind(py), dtype.bind(py)))?;
                            let copies = copies.ok_or_else(|| crate::InternalError::new_err("no list for the mutated inputs' copies"))?;
                            copies.append((py.None(), *arg, t.clone()))?;
                        }
                        (*buf, t)
                    }
                };
                ptrs[buf] = data_ptr(&t)?;
                bufs.set_item(buf, t)?;
            }
            let kind = match &st.work {
                Work::Run(n) => {
                    compiled.run_step(py, *n, |b| Ok(ptrs[b]), run_syms, stream, arena_ptr)?;
                    0
                }
                Work::Extern(e) => {
                    self.call_extern(e, &bufs, &mut ptrs, arena.as_ref(), &mut arena_views, syms, hosts, stream)?;
                    1
                }
            };
            if let Some(f) = on_step {
                f.call1((kind, st.what.bind(py), &bufs))?;
            }
            for &b in &st.frees {
                if self.kept.get(b) == Some(&true) {
                    let t = bufs.get_item(b)?;
                    if !t.is_none() {
                        self.temps.put(b, t.unbind());
                    }
                }
                bufs.set_item(b, py.None())?;
                ptrs[b] = 0;
            }
            if st.closes {
                arena_views.clear();
                if let (Some(pool), Some(a)) = (&self.pool, arena.take()) {
                    pool.put(arena_bytes, a.unbind());
                }
                arena = None;
                arena_ptr = 0;
            }
        }
        let outs = PyList::empty(py);
        for o in &self.outs {
            let t = Self::operand(&bufs, &o.view)?;
            outs.append(if o.copy { t.call_method0(intern!(py, "clone"))? } else { t })?;
        }
        Ok(outs)
    }
}
