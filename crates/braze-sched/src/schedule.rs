//! From an optimized graph to a [`Schedule`]: which values live in memory (realization),
//! which roots share a kernel (fusion), the kernels in loop IR, and the ordered steps
//! (kernels and extern calls) with the buffers they read and write.
//!
//! [Note: realization] A node's value is stored to a buffer only when something outside
//! a kernel needs it: a graph output, an extern operand, or a root of another kernel. Views
//! of stored values are handed to externs and outputs as strided views, never copied,
//! unless a reshape makes that impossible. Pointwise nodes otherwise are computed inline
//! inside each kernel that uses them; one used by several kernels is stored when it is not
//! cheap to recompute (more than `RECOMPUTE_LIMIT` ops).
//!
//! [Note: fusion] Roots (stored pointwise nodes and every reduction) are visited in order.
//! A root joins an earlier kernel when (1) its shape fits the kernel's domain (the same
//! iteration space, or for reduction kernels the space of kept dims), (2) every step it
//! depends on runs before that kernel, and (3) the kernel still lowers (a reduction is only
//! read at its own point). Otherwise it starts a new kernel. The candidates are the kernels
//! whose roots it reads, latest first, then the latest kernel (sibling fusion).

use crate::layout::{strided, view_base, View};
use crate::loop_ir::{BufId, Kernel};
use crate::lower::{lower, root_index, Ctx, Domain, Illegal};
use crate::merge_dims::merge_dims;
use braze_ir::{contiguous_strides, DType, Expr, Graph, NodeId, Op};
use std::collections::HashSet;

const RECOMPUTE_LIMIT: usize = 4;
/// See [Note: broadcast values stored].
const BROADCAST_LIMIT: usize = 16;
/// See [Note: long inlined chains].
const CHAIN_LIMIT: usize = 64;

/// An extern result nothing reads (its `extern_out` was removed as dead code).
pub const UNUSED: BufId = u32::MAX;

#[derive(Clone, Debug, PartialEq)]
pub enum BufKind {
    /// Graph input `n`.
    Input(u32),
    /// A result of an extern call.
    ExternOut,
    /// Written by a kernel; allocated by the runtime, contiguous.
    Temp,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub node: NodeId,
    pub dtype: DType,
    pub shape: Vec<Expr>,
    pub strides: Vec<Expr>,
    pub kind: BufKind,
}

impl Buffer {
    /// Its bytes where its sizes are constants.
    pub fn static_bytes(&self) -> Option<i64> {
        self.shape.iter().map(|e| e.as_const()).product::<Option<i64>>().map(|n| n * self.dtype.size() as i64)
    }
}

/// How a step or output reads a value: a buffer, or a strided view of one.
#[derive(Clone, Debug, PartialEq)]
pub struct Access {
    pub buf: BufId,
    pub view: Option<View>,
}

#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // a handful per graph; boxing buys nothing
pub enum Step {
    /// Run kernel `n`.
    Kernel(usize),
    /// A matrix product by the vendor library: `out = epilogue(a @ b + bias)`; with a
    /// bias-gradient epilogue it also writes the sums over K to `bias_grad` (the `bias_grad`
    /// node's buffer; [Note: bias-gradient epilogues] in braze-passes).
    Matmul { node: NodeId, a: Access, b: Access, bias: Option<Access>, residual: Option<Access>, out: BufId, bias_grad: Option<BufId> },
    /// A 2-d convolution or one of its gradients by the vendor library (conv node `node`):
    /// `out = conv(a, b)`, the operands in the op's order; `workspace`, a buffer of its own
    /// where its plan needs more than the libraries' shared workspace
    /// ([`Schedule::add_workspace`]).
    Conv { node: NodeId, a: Access, b: Access, out: BufId, workspace: Option<BufId> },
    /// Call ATen op `target` (extern node `node`) on `args`; its results fill `outs`
    /// (`UNUSED` for results nothing reads).
    Extern { node: NodeId, target: String, args: Vec<Access>, outs: Vec<BufId> },
}

impl Step {
    /// A library step's operands (a matmul's a, b, then bias and residual where present; a
    /// convolution's two); none for other steps.
    pub fn library_operands(&self) -> impl Iterator<Item = &Access> {
        let ops = match self {
            Step::Matmul { a, b, bias, residual, .. } => [Some(a), Some(b), bias.as_ref(), residual.as_ref()],
            Step::Conv { a, b, .. } => [Some(a), Some(b), None, None],
            _ => [None, None, None, None],
        };
        ops.into_iter().flatten()
    }

    /// The buffers a library step writes: its result, a matmul's bias gradient, a
    /// convolution's own workspace; none for other steps.
    pub fn library_outputs(&self) -> impl Iterator<Item = BufId> {
        let outs = match self {
            Step::Matmul { out, bias_grad, .. } => [Some(*out), *bias_grad],
            Step::Conv { out, workspace, .. } => [Some(*out), *workspace],
            _ => [None, None],
        };
        outs.into_iter().flatten()
    }
}

/// Ops run by a vendor library as a step of their own (stored, never fused).
fn is_library(op: &Op) -> bool {
    matches!(op, Op::Matmul { .. } | Op::Conv { .. })
}

#[derive(Clone, Debug, Default)]
pub struct Schedule {
    pub buffers: Vec<Buffer>,
    pub kernels: Vec<Kernel>,
    pub steps: Vec<Step>,
    pub outputs: Vec<Access>,
    /// Buffers that can be dropped after each step.
    pub frees: Vec<Vec<BufId>>,
    /// Why roots did not join a kernel (for `BRAZE_LOGS=fusion`).
    pub log: Vec<String>,
}

impl Schedule {
    /// [Note: convolution workspaces] Gives convolution step `step` a workspace of `bytes` of
    /// its own: a temp buffer that only that step touches and that is freed after it, so memory
    /// planning places it like any temp (in an arena window, live at that step alone). For
    /// plans that need more than the shared library workspace (braze-runtime's `cudnn`).
    pub fn add_workspace(&mut self, step: usize, bytes: i64) -> BufId {
        let id = self.buffers.len() as BufId;
        let Step::Conv { node, workspace, .. } = &mut self.steps[step] else { panic!("step {step} is not a convolution") };
        *workspace = Some(id);
        let node = *node;
        self.buffers.push(Buffer { node, dtype: DType::U8, shape: vec![Expr::constant(bytes)], strides: vec![Expr::constant(1)], kind: BufKind::Temp });
        self.frees[step].push(id);
        id
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("cannot schedule: {0}")]
    Unsupported(String),
}

struct Group {
    dom: Domain,
    roots: Vec<NodeId>,
    /// Creation order among steps (kernels and externs).
    order: usize,
}

fn is_compute(op: &Op) -> bool {
    op.is_pointwise() || op.is_view() || matches!(op, Op::Scalar { .. } | Op::Size { .. } | Op::Iota { .. } | Op::Reduce { .. })
}

/// Buffer nodes and roots reachable from `n` without passing through another root.
fn reads(g: &Graph, n: NodeId, stored: &[bool], out: &mut HashSet<NodeId>, seen: &mut HashSet<NodeId>) {
    for &i in &g.node(n).inputs {
        if !seen.insert(i) {
            continue;
        }
        if stored[i.index()] || matches!(g.node(i).op, Op::Reduce { .. }) {
            out.insert(i);
        } else {
            reads(g, i, stored, out, seen);
        }
    }
}

fn inline_cost(g: &Graph, n: NodeId, stored: &[bool], seen: &mut HashSet<NodeId>) -> usize {
    let mut c = 1;
    for &i in &g.node(n).inputs {
        if seen.insert(i) && !stored[i.index()] && !matches!(g.node(i).op, Op::Reduce { .. }) {
            c += inline_cost(g, i, stored, seen);
        }
    }
    c
}

/// Ops inlined into a value (as `inline_cost`), counted up to `cap + 1`.
fn bounded_inline_cost(g: &Graph, n: NodeId, stored: &[bool], cap: usize) -> usize {
    let mut seen = HashSet::new();
    let mut stack = vec![n];
    let mut c = 0;
    while let Some(x) = stack.pop() {
        c += 1;
        if c > cap {
            break;
        }
        for &i in &g.node(x).inputs {
            if !stored[i.index()] && !matches!(g.node(i).op, Op::Reduce { .. }) && seen.insert(i) {
                stack.push(i);
            }
        }
    }
    c
}

/// Whether inlining `n` loads anything: it reaches a stored value or a reduction through
/// values that are not stored. Past `8 * CHAIN_LIMIT` values without one, taken as not (a
/// pool's 25 window masks are that much index arithmetic).
fn reads_memory(g: &Graph, n: NodeId, stored: &[bool]) -> bool {
    let mut seen = HashSet::new();
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        if seen.len() > 8 * CHAIN_LIMIT {
            return false;
        }
        for &i in &g.node(x).inputs {
            if stored[i.index()] || matches!(g.node(i).op, Op::Reduce { .. }) {
                return true;
            }
            if seen.insert(i) {
                stack.push(i);
            }
        }
    }
    false
}

/// Stored values of `n`'s own size that inlining it loads, counted up to `cap`.
fn full_loads(g: &Graph, n: NodeId, stored: &[bool], cap: usize) -> usize {
    let size = g.ty(n).numel();
    let mut seen = HashSet::new();
    let mut stack = vec![n];
    let mut c = 0;
    while let Some(x) = stack.pop() {
        for &i in &g.node(x).inputs {
            if !seen.insert(i) || matches!(g.node(i).op, Op::Reduce { .. }) {
                continue;
            }
            if stored[i.index()] || g.node(i).op.is_view() {
                let base = view_base(g, i);
                if stored[base.index()] {
                    if g.ty(i).numel() == size {
                        c += 1;
                        if c >= cap {
                            return c;
                        }
                    }
                    continue;
                }
            }
            if seen.len() > 8 * CHAIN_LIMIT {
                return c;
            }
            stack.push(i);
        }
    }
    c
}

pub fn schedule(g: &Graph) -> Result<Schedule, SchedError> {
    let n = g.nodes.len();
    let mut stored = vec![false; n];
    // Values that must be in memory: the base of a strided view when the view is one the
    // reader accepts (`ok`), else the value itself, stored contiguously.
    let need_access = |stored: &mut Vec<bool>, o: NodeId, ok: fn(&View) -> bool| {
        let base = view_base(g, o);
        let as_view = base != o
            && !matches!(g.node(base).op, Op::Scalar { .. } | Op::Size { .. } | Op::Iota { .. })
            && strided(g, o, &base_strides(g, base)).is_some_and(|v| ok(&v));
        stored[if as_view { base } else { o }.index()] = true;
    };
    let any_view: fn(&View) -> bool = |_| true;
    for id in g.ids() {
        let node = g.node(id);
        if node.op.is_buffer() || is_library(&node.op) {
            stored[id.index()] = true;
        }
        if let Op::Conv { .. } = node.op {
            // cuDNN reads whole tensors: the operands themselves are stored.
            for &i in &node.inputs {
                need_access(&mut stored, i, |_| false);
            }
        }
        if matches!(node.op, Op::Extern { .. }) {
            for &i in &node.inputs {
                need_access(&mut stored, i, any_view);
            }
        }
        if let Op::Matmul { residual, .. } = node.op {
            // Operands must be matrices the library can read: a unit stride in one of the
            // last two dims; the residual (cuBLASLt's C) row-major like the result.
            let n = node.inputs.len() - usize::from(residual);
            for &i in &node.inputs[..n] {
                need_access(&mut stored, i, matmul_operand_ok);
            }
            if residual {
                need_access(&mut stored, node.inputs[n], residual_operand_ok);
            }
        }
    }
    for &o in &g.outputs {
        need_access(&mut stored, o, any_view);
    }
    for id in g.ids() {
        if matches!(g.node(id).op, Op::Extern { .. }) || is_library(&g.node(id).op) {
            continue;
        }
        if !is_compute(&g.node(id).op) && !g.node(id).op.is_buffer() {
            return Err(SchedError::Unsupported(format!("{id}: {}", g.node(id).op.name())));
        }
    }
    // [Note: long inlined chains] A pointwise value with several users that inlines a long
    // expression is stored before the first fusion round. Without this, a chain of pointwise
    // values with no stored link (the f32 residual gradient of a bf16 backward graph runs
    // through every layer; only its bf16 casts are matmul operands) is inlined whole into
    // each root that reads it, and fusion trials cost O(depth) each: quadratic in the graph.
    // The rule below would store such a value after the first round anyway (used by several
    // kernels, more than `RECOMPUTE_LIMIT` ops); `CHAIN_LIMIT` is far above that, so short
    // shared values are still decided by the rule.
    let mut users = vec![0u32; n];
    for id in g.ids() {
        for &i in &g.node(id).inputs {
            users[i.index()] += 1;
        }
    }
    for id in g.ids() {
        if !stored[id.index()] && users[id.index()] > 1 && g.node(id).op.is_pointwise() && bounded_inline_cost(g, id, &stored, CHAIN_LIMIT) > CHAIN_LIMIT {
            stored[id.index()] = true;
        }
    }
    // [Note: broadcast values stored] A pointwise value read through a broadcast (an `expand`,
    // or the operand of an elementwise op with fewer elements than its result), seen through
    // views, is computed per element of the result when inlined. One that inlines a long
    // expression (more than `BROADCAST_LIMIT` ops) and is broadcast over at least twice its
    // own elements is stored, computed once per its own element: Swin's shifted-window
    // attention mask (built by slice assignments, 70 ops an element) was evaluated inline for
    // every head and query of each window's softmax, 3 of its kernels 16% of the call on the
    // 2-core CPU. Only a value that reads memory: index arithmetic on iotas alone (a pool's
    // window masks) stays inline, where a kernel can tell it constant over a row's interior
    // ([Note: interior rows] in braze-codegen).
    for id in g.ids() {
        let node = g.node(id);
        if !matches!(node.op, Op::Expand(_) | Op::Binary(_) | Op::Where) {
            continue;
        }
        let Some(wide) = g.ty(id).numel().as_const() else { continue };
        for &i in &node.inputs {
            let base = view_base(g, i);
            let b = base.index();
            if stored[b] || !g.node(base).op.is_pointwise() || g.ty(i).numel().as_const().is_none_or(|n| 2 * n > wide) {
                continue;
            }
            if bounded_inline_cost(g, base, &stored, BROADCAST_LIMIT) > BROADCAST_LIMIT && reads_memory(g, base, &stored) {
                stored[b] = true;
            }
        }
    }
    // [Note: gathered values stored] A pointwise value read through a gather (`index_select`,
    // `gather`, chains of them) is computed once per gathered element when inlined. Where the
    // gathers read it at least four times per element (their results' elements summed) and
    // inlining it loads two or more values of its size, it is stored: each gathered read is
    // then one load, not one per operand, for one more write and read of its size. A
    // max pool's backward gathers the pooled output's gradient four times per input element
    // (its candidates, [Note: max-pool backward by candidates] in lowering.py); in a ResNet
    // block that gradient is the residual sum `relu_mask(a + b) + c`, three loads per
    // candidate, and the stem's fused backward kernel was bound by the latency of its sixteen
    // gathered loads per element.
    let mut gathered = vec![0i64; n];
    for id in g.ids() {
        if !matches!(g.node(id).op, Op::IndexSelect { .. } | Op::Gather { .. }) {
            continue;
        }
        let mut src = view_base(g, g.node(id).inputs[0]);
        while !stored[src.index()] && matches!(g.node(src).op, Op::IndexSelect { .. } | Op::Gather { .. }) {
            src = view_base(g, g.node(src).inputs[0]);
        }
        if let Some(wide) = g.ty(id).numel().as_const() {
            gathered[src.index()] = gathered[src.index()].saturating_add(wide);
        }
    }
    for id in g.ids() {
        if gathered[id.index()] > 0
            && !stored[id.index()]
            && g.node(id).op.is_pointwise()
            && g.ty(id).numel().as_const().is_some_and(|own| gathered[id.index()] >= 4 * own)
            && full_loads(g, id, &stored, 2) >= 2
        {
            stored[id.index()] = true;
        }
    }
    let mut log = Vec::new();
    let (mut groups, mut group_of, mut ext_order) = fuse(g, &stored, &mut log)?;
    // Store pointwise values recomputed by several kernels when they are not cheap.
    for _ in 0..3 {
        let mut users_in: Vec<HashSet<usize>> = vec![HashSet::new(); n];
        for (k, gr) in groups.iter().enumerate() {
            for &r in &gr.roots {
                let mut seen = HashSet::new();
                mark_inlined(g, r, &stored, &mut users_in, k, &mut seen);
            }
        }
        // [Note: narrow shared values first] A shared value is stored when more than one
        // kernel recomputes it and it is not cheap. Where a shared value narrows a wider one
        // of its own shape (a bf16 cast of an f32 gradient), the narrow one is stored first:
        // the kernels that inlined it are then marked again, stopping at it, and its own
        // kernel marks what it inlines, so the wide values inside it count only the kernels
        // that still reach them. BERT's loss head (8192 x 30522) stored the f32 one-hot, the
        // log-probabilities and the f32 gradient, all inside the bf16 gradient that the
        // bias-gradient reduction and the padded matmul operand read. Other shared values
        // are then decided as before, all at once (storing an outer f32 wrapper first, a
        // softmax's `x * 1.5`, stored more than the value it wraps: the max's kernel still
        // read the inner one). A shared value also goes first when the shared values of its
        // shape it inlines that only its own readers share (so no longer shared once it is
        // stored), masks among them, take more bytes per element than it: a hardswish
        // gradient (f32) over its two masks and its f32 factor, which BatchNorm's output
        // recomputed in the backward ([Note: BatchNorm outputs recomputable] in decomp.py) made
        // shared, 6 bytes stored and read back instead of 4. (Without the narrower ones the
        // rule also fired in a chain of softmaxes, each storing its exponentials instead of
        // its scaled input: one more buffer live at once.)
        let shared = |id: NodeId, stored: &[bool], users_in: &[HashSet<usize>]| {
            !stored[id.index()] && g.node(id).op.is_pointwise() && users_in[id.index()].len() > 1 && inline_cost(g, id, stored, &mut HashSet::new()) > RECOMPUTE_LIMIT
        };
        let mut changed = false;
        let mut next_kernel = groups.len();
        for id in g.ids().rev() {
            if !shared(id, &stored, &users_in) {
                continue;
            }
            // Shared values it inlines, wider than it and of its shape.
            let (ty, mut narrows, mut freed, mut freed_narrow) = (g.ty(id), false, 0usize, false);
            let mut seen = HashSet::new();
            let mut stack = vec![id];
            let mut inside = Vec::new();
            while let Some(x) = stack.pop() {
                for &i in &g.node(x).inputs {
                    if !stored[i.index()] && !matches!(g.node(i).op, Op::Reduce { .. }) && seen.insert(i) {
                        let ti = g.ty(i);
                        if ti.shape == ty.shape && shared(i, &stored, &users_in) {
                            narrows |= ti.dtype.size() > ty.dtype.size();
                            // Shared only through the kernels that recompute `id`: no longer
                            // shared once `id` is stored.
                            if users_in[i.index()].is_subset(&users_in[id.index()]) {
                                freed += ti.dtype.size();
                                freed_narrow |= ti.dtype.size() < ty.dtype.size();
                            }
                        }
                        inside.push(i);
                        stack.push(i);
                    }
                }
            }
            if !(narrows || (freed_narrow && freed > ty.dtype.size())) {
                continue;
            }
            stored[id.index()] = true;
            changed = true;
            let affected: Vec<usize> = users_in[id.index()].iter().copied().collect();
            for i in inside {
                for k in &affected {
                    users_in[i.index()].remove(k);
                }
            }
            for &k in affected.iter().filter(|&&k| k < groups.len()) {
                for &r in &groups[k].roots {
                    mark_inlined(g, r, &stored, &mut users_in, k, &mut HashSet::new());
                }
            }
            mark_inlined(g, id, &stored, &mut users_in, next_kernel, &mut HashSet::new());
            next_kernel += 1;
        }
        for id in g.ids() {
            if shared(id, &stored, &users_in) {
                stored[id.index()] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
        log.clear();
        (groups, group_of, ext_order) = fuse(g, &stored, &mut log)?;
    }
    // Reductions read by other steps are stored too.
    for (k, gr) in groups.iter().enumerate() {
        for &r in &gr.roots {
            let mut rs = HashSet::new();
            reads(g, r, &stored, &mut rs, &mut HashSet::new());
            for x in rs {
                if matches!(g.node(x).op, Op::Reduce { .. }) && group_of[x.index()] != Some(k) {
                    stored[x.index()] = true;
                }
            }
        }
    }
    // Buffers.
    let mut buffers = Vec::new();
    let mut buf_of: Vec<Option<BufId>> = vec![None; n];
    for id in g.ids() {
        if !stored[id.index()] {
            continue;
        }
        let ty = g.ty(id);
        let (kind, strides) = match &g.node(id).op {
            Op::Input { index, strides } => (BufKind::Input(*index), strides.clone()),
            Op::ExternOut { strides, .. } => (BufKind::ExternOut, strides.clone()),
            _ => (BufKind::Temp, base_strides(g, id)),
        };
        buf_of[id.index()] = Some(buffers.len() as BufId);
        buffers.push(Buffer { node: id, dtype: ty.dtype, shape: ty.shape.clone(), strides, kind });
    }
    let buffer = |id: NodeId| buf_of[id.index()].map(|b| (b, buffers[b as usize].strides.clone()));
    let cx = Ctx { g, group_of: &group_of, buffer: &buffer };
    // Steps in creation order (a topological order by construction).
    let mut order: Vec<(usize, Option<usize>, Option<NodeId>)> = groups.iter().enumerate().map(|(k, gr)| (gr.order, Some(k), None)).collect();
    order.extend(ext_order.iter().map(|&(o, e)| (o, None, Some(e))));
    order.sort_by_key(|x| x.0);
    let mut kernels = Vec::new();
    let mut steps = Vec::new();
    let access = |o: NodeId| -> Access {
        if let Some(b) = buf_of[o.index()] {
            return Access { buf: b, view: None };
        }
        let base = view_base(g, o);
        let b = buf_of[base.index()].expect("realized base");
        Access { buf: b, view: strided(g, o, &buffers[b as usize].strides) }
    };
    // Each extern's results and each matmul's bias gradient, found in one pass over the graph.
    let mut extern_outs: std::collections::HashMap<NodeId, Vec<NodeId>> = std::collections::HashMap::new();
    for id in g.ids() {
        if let Op::ExternOut { .. } | Op::BiasGrad = g.node(id).op {
            extern_outs.entry(g.node(id).inputs[0]).or_default().push(id);
        }
    }
    for (_, k, e) in order {
        if let Some(k) = k {
            let gr = &groups[k];
            let mut kern = lower(&cx, k, &gr.dom, &gr.roots).map_err(|Illegal(m)| SchedError::Unsupported(format!("lowering failed: {m}")))?;
            merge_dims(&mut kern);
            kern.name = format!("{}_{}", kern.name, kernels.len());
            steps.push(Step::Kernel(kernels.len()));
            kernels.push(kern);
        } else if let Some(e) = e.filter(|&e| matches!(g.node(e).op, Op::Matmul { .. })) {
            let Op::Matmul { residual, .. } = g.node(e).op else { unreachable!() };
            let ins = &g.node(e).inputs;
            let n = ins.len() - usize::from(residual);
            let residual = residual.then(|| access(ins[n]));
            let bias_grad = extern_outs.get(&e).and_then(|v| v.first()).map(|&bg| buf_of[bg.index()].unwrap());
            steps.push(Step::Matmul { node: e, a: access(ins[0]), b: access(ins[1]), bias: ins[..n].get(2).map(|&b| access(b)), residual, out: buf_of[e.index()].unwrap(), bias_grad });
        } else if let Some(e) = e.filter(|&e| matches!(g.node(e).op, Op::Conv { .. })) {
            let ins = &g.node(e).inputs;
            steps.push(Step::Conv { node: e, a: access(ins[0]), b: access(ins[1]), out: buf_of[e.index()].unwrap(), workspace: None });
        } else if let Some(e) = e {
            let Op::Extern { target, outputs, .. } = &g.node(e).op else { unreachable!() };
            let mut outs = vec![UNUSED; *outputs as usize];
            for &id in extern_outs.get(&e).into_iter().flatten() {
                if let Op::ExternOut { index, .. } = g.node(id).op {
                    outs[index as usize] = buf_of[id.index()].unwrap();
                }
            }
            let args = g.node(e).inputs.iter().map(|&i| access(i)).collect();
            steps.push(Step::Extern { node: e, target: target.clone(), args, outs });
        }
    }
    let outputs: Vec<Access> = g.outputs.iter().map(|&o| access(o)).collect();
    drop_dead_stores(&buffers, &mut kernels, &steps, &outputs);
    let frees = plan_frees(&buffers, &kernels, &steps, &outputs);
    Ok(Schedule { buffers, kernels, steps, outputs, frees, log })
}

/// A view the library can read as the C operand: row-major rows (unit last stride), rows
/// not overlapping.
fn residual_operand_ok(v: &View) -> bool {
    let r = v.sizes.len();
    r >= 1 && (v.strides[r - 1].is_const(1) || v.sizes[r - 1].is_const(1)) && !(r >= 2 && v.strides[r - 2].is_const(0) && !v.sizes[r - 2].is_const(1))
}

/// A strided view the matrix library can read: a unit stride (or size 1) in one of the last
/// two dims, and no zero strides there.
fn matmul_operand_ok(v: &View) -> bool {
    let r = v.sizes.len();
    if r < 1 {
        return false;
    }
    if r == 1 {
        return v.strides[0].is_const(1);
    }
    let (rs, cs) = (&v.strides[r - 2], &v.strides[r - 1]);
    let unit = |s: &Expr, n: &Expr| s.is_const(1) || n.is_const(1);
    let zero = rs.is_const(0) && !v.sizes[r - 2].is_const(1) || cs.is_const(0) && !v.sizes[r - 1].is_const(1);
    !zero && (unit(cs, &v.sizes[r - 1]) || unit(rs, &v.sizes[r - 2]))
}

/// The strides of `base`'s buffer: its own for inputs, extern results and `layout` values;
/// the order of its operands for other elementwise values
/// ([`braze_ir::memory_order::inherited_order`]); row-major otherwise.
fn base_strides(g: &Graph, base: NodeId) -> Vec<Expr> {
    match &g.node(base).op {
        Op::Input { strides, .. } | Op::ExternOut { strides, .. } | Op::Layout { strides } | Op::Conv { strides, .. } => strides.clone(),
        _ => match braze_ir::memory_order::inherited_order(g, base) {
            Some(order) => braze_ir::memory_order::dense_strides(&g.ty(base).shape, &order),
            None => contiguous_strides(&g.ty(base).shape),
        },
    }
}

fn mark_inlined(g: &Graph, n: NodeId, stored: &[bool], users_in: &mut [HashSet<usize>], k: usize, seen: &mut HashSet<NodeId>) {
    for &i in &g.node(n).inputs {
        if seen.insert(i) && !stored[i.index()] && !matches!(g.node(i).op, Op::Reduce { .. }) {
            users_in[i.index()].insert(k);
            mark_inlined(g, i, stored, users_in, k, seen);
        }
    }
}

type Fused = (Vec<Group>, Vec<Option<usize>>, Vec<(usize, NodeId)>);

/// Most groups a root tries to join because they read what it reads ([Note: sibling fusion]).
const MAX_SIBLING_TRIALS: usize = 4;

fn fuse(g: &Graph, stored: &[bool], log: &mut Vec<String>) -> Result<Fused, SchedError> {
    let mut groups: Vec<Group> = Vec::new();
    let mut group_of: Vec<Option<usize>> = vec![None; g.nodes.len()];
    let mut step_of: Vec<Option<usize>> = vec![None; g.nodes.len()];
    let mut externs = Vec::new();
    let mut next_order = 0;
    // Groups by the stored values and inputs they read ([Note: sibling fusion]).
    let mut readers: std::collections::HashMap<NodeId, Vec<usize>> = std::collections::HashMap::new();
    // The first group of a scalar root ([Note: scalar kernels]).
    let mut scalar_group: Option<usize> = None;
    let dummy = |id: NodeId| if stored[id.index()] || matches!(g.node(id).op, Op::Reduce { .. }) { Some((id.0, contiguous_strides(&g.ty(id).shape))) } else { None };
    for id in g.ids() {
        let node = g.node(id);
        if matches!(node.op, Op::Extern { .. }) || is_library(&node.op) {
            externs.push((next_order, id));
            step_of[id.index()] = Some(next_order);
            next_order += 1;
            continue;
        }
        if let Op::ExternOut { .. } | Op::BiasGrad = node.op {
            step_of[id.index()] = step_of[node.inputs[0].index()];
            continue;
        }
        let is_root = matches!(node.op, Op::Reduce { .. }) || (stored[id.index()] && !node.op.is_buffer() && !is_library(&node.op));
        if !is_root {
            continue;
        }
        let mut rs = HashSet::new();
        reads(g, id, stored, &mut rs, &mut HashSet::new());
        // Steps this root depends on, and candidate groups.
        let dep_steps: Vec<usize> = rs.iter().filter_map(|x| step_of[x.index()]).collect();
        let mut cands: Vec<usize> = rs.iter().filter_map(|x| group_of[x.index()]).collect();
        cands.sort_by_key(|&k| std::cmp::Reverse(groups[k].order));
        cands.dedup();
        if let Some(last) = groups.len().checked_sub(1) {
            if !cands.contains(&last) {
                cands.push(last);
            }
        }
        // The root's own domain, computed once (its loop order walks the graph).
        let own = std::cell::OnceCell::new();
        // [Note: sibling fusion] Groups that read what this root reads, latest first: two
        // reductions of one input with another kernel between them (BatchNorm backward's
        // sum(g) and sum(g * (x - mean)) once split in two stages, the first sum's second
        // stage between them) read the input once when fused.
        let mut siblings: Vec<usize> = rs.iter().filter_map(|x| readers.get(x)).flatten().copied().filter(|k| !cands.contains(k)).collect();
        siblings.sort_by_key(|&k| std::cmp::Reverse(groups[k].order));
        siblings.dedup();
        cands.extend(siblings.into_iter().take(MAX_SIBLING_TRIALS));
        // [Note: scalar kernels] A scalar root (no dims: BatchNorm's `num_batches_tracked + 1`,
        // one per layer) may join the first group of scalar roots, whatever they read: one
        // kernel for all of them instead of one launch of one thread each (MobileNet-v3-small's
        // training forward had 34 such kernels, ~1.2 µs of GPU time each on the H100).
        if let Some(sg) = scalar_group {
            if !cands.contains(&sg) && own.get_or_init(|| Domain::of_root(g, id)).dims.is_empty() {
                cands.push(sg);
            }
        }
        let mut joined = None;
        for k in cands {
            let gr = &groups[k];
            if dep_steps.iter().any(|&s| s > gr.order) {
                log.push(format!("{id} not fused into group {k}: it needs a step that runs later"));
                continue;
            }
            // Whether the group runs in the root's own domain: a pointwise group of the root's
            // dims; or ([Note: embedded reductions] in lower.rs) a small reduction group whose
            // roots all fit the root's own domain, which takes the group in (its reductions
            // recomputed per point, in an earlier pass).
            let takes_own = || {
                let o = own.get_or_init(|| Domain::of_root(g, id));
                (!gr.dom.has_reduction() && (o.dims == gr.dom.dims || crate::lower::refines(&o.dims, &gr.dom.dims)))
                    || (gr.dom.has_reduction() && o.has_reduction() && gr.roots.iter().all(|&x| root_index(g, o, x).is_some()))
            };
            let dom = if root_index(g, &gr.dom, id).is_some() {
                gr.dom.clone()
            } else if takes_own() {
                own.get().unwrap().clone()
            } else {
                log.push(format!("{id} not fused into group {k}: iteration space differs"));
                continue;
            };
            let mut roots = gr.roots.clone();
            roots.push(id);
            // The trial sees `id` in group k (set here, undone below: no copy per trial).
            group_of[id.index()] = Some(k);
            let cx = Ctx { g, group_of: &group_of, buffer: &dummy };
            let trial = lower(&cx, k, &dom, &roots);
            group_of[id.index()] = None;
            match trial {
                Ok(_) => {
                    joined = Some((k, dom));
                    break;
                }
                Err(Illegal(m)) => log.push(format!("{id} not fused into group {k}: {m}")),
            }
        }
        let group = joined.as_ref().map_or(groups.len(), |j| j.0);
        for x in &rs {
            let r = readers.entry(*x).or_default();
            if !r.contains(&group) {
                r.push(group);
            }
        }
        match joined {
            Some((k, dom)) => {
                groups[k].dom = dom;
                groups[k].roots.push(id);
                group_of[id.index()] = Some(k);
                step_of[id.index()] = Some(groups[k].order);
            }
            None => {
                let dom = own.into_inner().unwrap_or_else(|| Domain::of_root(g, id));
                if scalar_group.is_none() && dom.dims.is_empty() {
                    scalar_group = Some(groups.len());
                }
                groups.push(Group { dom, roots: vec![id], order: next_order });
                group_of[id.index()] = Some(groups.len() - 1);
                step_of[id.index()] = Some(next_order);
                next_order += 1;
            }
        }
    }
    Ok((groups, group_of, externs))
}

/// For each step, the buffers whose last reader it is (outputs excluded). Inputs are among
/// them: the runtime drops its reference there, and a caller that handed its list over (the
/// boxed calling convention; AOTAutograd's backward hands over the saved activations) frees
/// each input as the backward stops needing it, as eager does.
/// [Note: dead stores] A value is stored because more than one kernel recomputed it in the
/// first fusion round ([Note: realization]); fused again, its readers may all have joined
/// the kernel that computes it, which uses the value directly. Its store is then dead: no
/// step loads the buffer and no output returns it. Such stores are dropped with the
/// buffer's place among the kernel's parameters, so it is never allocated (the buffer stays
/// in the list, touched by no step). In a reduction kernel only the stores inside a pass's
/// loop go (a pointwise kernel taken over by a reduction, [Note: split dims]: MobileNet's
/// stem backward stored the hardswish gradient's `grad * (x / 3 + 0.5)` branch, 25.7 MB that
/// nothing read); a buffer stored after a pass or in the prelude is kept, since the
/// reduction's emitters place those stores themselves. A CPU max pool with indices stored
/// two boolean masks and a partial maximum per output that nothing read.
fn drop_dead_stores(buffers: &[Buffer], kernels: &mut [Kernel], steps: &[Step], outputs: &[Access]) {
    use crate::loop_ir::Stmt;
    let mut read = vec![false; buffers.len()];
    for a in outputs {
        read[a.buf as usize] = true;
    }
    for st in steps {
        match st {
            Step::Kernel(_) => {}
            Step::Matmul { .. } | Step::Conv { .. } => st.library_operands().for_each(|x| read[x.buf as usize] = true),
            Step::Extern { args, .. } => args.iter().for_each(|a| read[a.buf as usize] = true),
        }
    }
    for k in kernels.iter() {
        for st in k.stmts() {
            if let Stmt::Load { buf, .. } = st {
                read[*buf as usize] = true;
            }
        }
    }
    let dead = |b: BufId| !read[b as usize] && buffers[b as usize].kind == BufKind::Temp;
    for k in kernels.iter_mut() {
        if !k.bufs.iter().any(|r| dead(r.id)) {
            continue;
        }
        // Buffers stored outside the passes' loops stay (see the note).
        let mut pinned: HashSet<BufId> = HashSet::new();
        for st in k.prelude.iter().chain(k.passes.iter().flat_map(|p| &p.after)) {
            if let Stmt::Store { buf, .. } = st {
                pinned.insert(*buf);
            }
        }
        let drop = |b: BufId| dead(b) && !pinned.contains(&b);
        let keep = |st: &Stmt| !matches!(st, Stmt::Store { buf, .. } if drop(*buf));
        for p in &mut k.passes {
            p.body.retain(keep);
        }
        let gone: Vec<String> = k.bufs.iter().filter(|r| drop(r.id)).map(|r| buffers[r.id as usize].node.to_string()).collect();
        k.roots.retain(|r| !gone.contains(r));
        k.bufs.retain(|r| !drop(r.id));
    }
}

fn plan_frees(buffers: &[Buffer], kernels: &[Kernel], steps: &[Step], outputs: &[Access]) -> Vec<Vec<BufId>> {
    let mut last = vec![None; buffers.len()];
    for (s, st) in steps.iter().enumerate() {
        match st {
            Step::Kernel(k) => {
                for b in &kernels[*k].bufs {
                    last[b.id as usize] = Some(s);
                }
            }
            Step::Matmul { .. } | Step::Conv { .. } => {
                for x in st.library_operands() {
                    last[x.buf as usize] = Some(s);
                }
                for o in st.library_outputs() {
                    if last[o as usize].is_none() {
                        last[o as usize] = Some(s);
                    }
                }
            }
            Step::Extern { args, outs, .. } => {
                for a in args {
                    last[a.buf as usize] = Some(s);
                }
                for &o in outs.iter().filter(|&&o| o != UNUSED) {
                    if last[o as usize].is_none() {
                        last[o as usize] = Some(s);
                    }
                }
            }
        }
    }
    let mut frees = vec![Vec::new(); steps.len()];
    let mut out_buf = vec![false; buffers.len()];
    for a in outputs {
        out_buf[a.buf as usize] = true;
    }
    for (b, l) in last.iter().enumerate() {
        if let (Some(s), false) = (l, out_buf[b]) {
            frees[*s].push(b as BufId);
        }
    }
    frees
}
