//! The loop IR: what one kernel computes, as straight-line statements over temporaries
//! inside a fixed loop structure.
//!
//! A kernel loops over `outer` (loop variables `i0..`) and, for reductions, runs one or
//! more passes over `inner` (variables numbered after the outer ones) per outer point:
//!
//! ```text
//! for outer index:            (parallel)
//!     prelude                 (values of the outer point)
//!     for each pass:
//!         for inner index:    (vectorized)
//!             body            (loads, math, stores, reduction inputs)
//!         finish reductions   (their results are temporaries from here on)
//!         after               (math and stores of the outer point)
//! ```
//! A pointwise kernel has no inner dims and one pass whose body runs per outer point.
//! Temporaries `tN` are assigned once; their dtypes are in `Kernel::tmp_dtypes`.

use braze_ir::print::fmt_lit;
use braze_ir::{Atom, BinaryOp, DType, Expr, Lit, RandomDist, ReduceKind, UnaryOp};
use std::fmt;

pub type BufId = u32;
pub type Tmp = u32;

/// One statement. `dst` temporaries hold values of `Kernel::tmp_dtypes[dst]`.
#[derive(Clone, Debug, PartialEq)]
pub enum Stmt {
    /// `dst = buf[index]`, or `mask ? buf[index] : 0` when masked.
    Load { dst: Tmp, buf: BufId, index: Expr, mask: Option<Tmp> },
    /// `dst = value`
    Const { dst: Tmp, value: Lit },
    /// `dst = index` converted to dst's dtype (iota; gathered indices).
    Index { dst: Tmp, index: Expr },
    /// `dst` = the random value of `dist` at counter (`index`, `stream`) under key `seed` (an
    /// i64 temporary), on the grid of dst's dtype ([Note: random values]).
    Random { dst: Tmp, dist: RandomDist, seed: Tmp, index: Expr, stream: i64 },
    /// `dst = (lo <= index) && (index < hi)`: an in-bounds mask.
    InRange { dst: Tmp, index: Expr, lo: Expr, hi: Expr },
    Unary { dst: Tmp, op: UnaryOp, a: Tmp },
    Binary { dst: Tmp, op: BinaryOp, a: Tmp, b: Tmp },
    Where { dst: Tmp, c: Tmp, a: Tmp, b: Tmp },
    /// `dst = a` converted to dst's dtype.
    Cast { dst: Tmp, a: Tmp },
    /// `dst = a`, an index read from memory into a dim of size `hi` (gather, index_select,
    /// embedding). Out of range it is an error, as in eager: the CPU flags it (the runtime
    /// raises after the kernels) and reads index 0; the GPU traps. Never a wild access.
    Bounded { dst: Tmp, a: Tmp, hi: Expr },
    /// `buf[index] = value` (converted to the buffer's dtype).
    Store { buf: BufId, index: Expr, value: Tmp },
}

/// A reduction accumulated in a pass's inner loop.
#[derive(Clone, Debug, PartialEq)]
pub struct Reduction {
    /// Temporary holding the result after the pass.
    pub dst: Tmp,
    pub kind: ReduceKind,
    /// Temporary, computed in the pass body, that is reduced.
    pub src: Tmp,
    /// For `var`: the divisor is `count - correction`.
    pub correction: i64,
    /// Flattened inner index of argmax/argmin (0 for other kinds, which do not use it).
    pub inner_index: Expr,
    /// Number of reduced elements.
    pub count: Expr,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pass {
    pub body: Vec<Stmt>,
    pub reductions: Vec<Reduction>,
    pub after: Vec<Stmt>,
}

/// A buffer a kernel touches, with its dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct BufRef {
    pub id: BufId,
    pub dtype: DType,
    pub written: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// `braze_poi_fused_add_cos_sin_0`: kind, the ops fused, index in the graph.
    pub name: String,
    /// The IR nodes the kernel stores (its roots), for the source comment.
    pub roots: Vec<String>,
    pub outer: Vec<Expr>,
    pub inner: Vec<Expr>,
    pub prelude: Vec<Stmt>,
    pub passes: Vec<Pass>,
    pub tmp_dtypes: Vec<DType>,
    pub bufs: Vec<BufRef>,
    /// The fastest-varying dim of the domain is an outer dim (a reduction over leading dims,
    /// like a bias gradient): neighbouring outer points, not neighbouring reduced elements,
    /// are adjacent in memory, so targets vectorize across outer points.
    pub column: bool,
    /// Every loop variable and every index the kernel computes stays within
    /// [`crate::lower::INDEX32_LIMIT`] in magnitude ([Note: 32-bit indices]): targets may
    /// compute them in 32 bits.
    pub index32: bool,
}

impl Kernel {
    pub fn is_reduction(&self) -> bool {
        self.passes.iter().any(|p| !p.reductions.is_empty())
    }
    /// One pass of statements over the outer dims alone: no reduced dims, reductions,
    /// prelude or values after a pass (targets emit such a kernel as a pointwise loop).
    pub fn is_pointwise(&self) -> bool {
        self.inner.is_empty() && !self.is_reduction() && self.prelude.is_empty() && self.passes.len() == 1 && self.passes.iter().all(|p| p.after.is_empty())
    }
    /// Every size symbol the kernel's loops and indices mention.
    pub fn syms(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for e in self.outer.iter().chain(&self.inner).chain(self.index_exprs()) {
            e.syms(&mut out);
        }
        out.sort();
        out
    }

    /// Every statement of the kernel: the prelude's, then each pass's body and `after`.
    pub fn stmts(&self) -> impl Iterator<Item = &Stmt> {
        self.prelude.iter().chain(self.passes.iter().flat_map(|p| p.body.iter().chain(&p.after)))
    }

    /// [`Kernel::stmts`], to rewrite in place.
    pub fn stmts_mut(&mut self) -> impl Iterator<Item = &mut Stmt> {
        self.prelude.iter_mut().chain(self.passes.iter_mut().flat_map(|p| p.body.iter_mut().chain(p.after.iter_mut())))
    }

    /// Every index expression of the kernel: loads', stores', index values', random
    /// counters', bounds checks' and in-range masks' (index and bounds), and each reduction's
    /// inner index and count.
    pub fn index_exprs(&self) -> Vec<&Expr> {
        let mut out = Vec::new();
        for s in self.stmts() {
            match s {
                Stmt::Load { index, .. } | Stmt::Store { index, .. } | Stmt::Index { index, .. } | Stmt::Random { index, .. } | Stmt::Bounded { hi: index, .. } => out.push(index),
                Stmt::InRange { index, lo, hi, .. } => out.extend([index, lo, hi]),
                Stmt::Const { .. } | Stmt::Unary { .. } | Stmt::Binary { .. } | Stmt::Where { .. } | Stmt::Cast { .. } => {}
            }
        }
        for r in self.passes.iter().flat_map(|p| &p.reductions) {
            out.extend([&r.count, &r.inner_index]);
        }
        out
    }

    /// Every index expression of [`Kernel::index_exprs`] rebuilt by `f`.
    pub fn map_index_exprs(&mut self, f: &dyn Fn(&Expr) -> Expr) {
        for s in self.stmts_mut() {
            match s {
                Stmt::Load { index, .. } | Stmt::Store { index, .. } | Stmt::Index { index, .. } | Stmt::Random { index, .. } | Stmt::Bounded { hi: index, .. } => *index = f(index),
                Stmt::InRange { index, lo, hi, .. } => {
                    *index = f(index);
                    *lo = f(lo);
                    *hi = f(hi);
                }
                Stmt::Const { .. } | Stmt::Unary { .. } | Stmt::Binary { .. } | Stmt::Where { .. } | Stmt::Cast { .. } => {}
            }
        }
        for r in self.passes.iter_mut().flat_map(|p| p.reductions.iter_mut()) {
            r.inner_index = f(&r.inner_index);
            r.count = f(&r.count);
        }
    }

    /// The loop variables' extents in variable order (outer dims, then inner), where constant.
    pub fn const_extents(&self) -> Vec<Option<i64>> {
        self.outer.iter().chain(&self.inner).map(|e| e.as_const()).collect()
    }

    /// [Note: in-place kernels] Pairs (written buffer, read buffer) where the written one may
    /// take the read one's memory when the read one dies at this kernel: a pointwise kernel
    /// that reads the buffer only at the very index it stores the other at, with elements of
    /// the same size, before any store to it. Each element is then read by the thread that
    /// overwrites it, before it does (the stored value depends on the load, so neither the
    /// compiler nor vector grouping can reorder the two), and no other point reads it.
    /// Whether the buffers' lifetimes and sizes allow it is the memory planner's question:
    /// every candidate is listed (a written buffer may have several), and the planner gives
    /// each written buffer at most one and each read buffer to at most one.
    ///
    /// A row reduction qualifies as well when the read buffer is touched in the body of one
    /// pass only, before the store of the written one there and at its index; the written one
    /// is stored nowhere else and read only after that pass; and the store's index mentions
    /// every loop variable (one element per iteration): every target walks the elements of a
    /// row in the same order in each pass (the thread that reads an element in one pass is
    /// the one that reads it in the next), and [Note: stored values reloaded] leaves later
    /// passes reading the written buffer rather than recomputing from the read one.
    pub fn in_place_pairs(&self) -> Vec<(BufId, BufId)> {
        if self.column {
            return Vec::new();
        }
        let pointwise = self.inner.is_empty() && self.passes.len() == 1 && !self.is_reduction();
        if pointwise {
            let stmts: Vec<&Stmt> = self.prelude.iter().chain(&self.passes[0].body).chain(&self.passes[0].after).collect();
            return self.in_place_in(&stmts);
        }
        // Buffers touched outside one pass's body, or in the bodies of several passes.
        let n_vars = (self.outer.len() + self.inner.len()) as u32;
        let mut pairs = Vec::new();
        for (pi, p) in self.passes.iter().enumerate() {
            // Statements outside this pass's body; `loads`: whether loads there count.
            let elsewhere = |b: BufId, loads: bool| {
                let other = self.prelude.iter().chain(self.passes.iter().enumerate().filter(|(j, _)| *j != pi).flat_map(|(_, q)| q.body.iter())).chain(self.passes.iter().flat_map(|q| q.after.iter()));
                other.into_iter().any(|s| match s {
                    Stmt::Store { buf, .. } => *buf == b,
                    Stmt::Load { buf, .. } => loads && *buf == b,
                    _ => false,
                })
            };
            let body: Vec<&Stmt> = p.body.iter().collect();
            for (o, i) in self.in_place_in(&body) {
                let index = body.iter().find_map(|s| match s {
                    Stmt::Store { buf, index, .. } if *buf == o => Some(index),
                    _ => None,
                });
                // The written buffer may be read back after the pass that stores it.
                let read_before = self.prelude.iter().chain(self.passes[..pi].iter().flat_map(|q| q.body.iter().chain(&q.after))).any(|s| matches!(s, Stmt::Load { buf, .. } if *buf == o));
                if !read_before && !elsewhere(o, false) && !elsewhere(i, true) && index.is_some_and(|e| {
                    let mut vars = Vec::new();
                    crate::lower::loop_vars(e, &mut vars);
                    (0..n_vars).all(|v| vars.contains(&v))
                }) {
                    pairs.push((o, i));
                }
            }
        }
        pairs
    }

    /// The pairs of `in_place_pairs` among statements `stmts` of one loop body.
    fn in_place_in(&self, stmts: &[&Stmt]) -> Vec<(BufId, BufId)> {
        let mut pairs = Vec::new();
        for out in self.bufs.iter().filter(|r| r.written) {
            // The one index every store to `out` uses, and where the first store is.
            let mut index = None;
            let mut first_store = usize::MAX;
            let mut one_index = true;
            for (pos, s) in stmts.iter().enumerate() {
                if let Stmt::Store { buf, index: i, .. } = s {
                    if *buf == out.id {
                        first_store = first_store.min(pos);
                        one_index &= index.is_none_or(|x| x == i);
                        index = Some(i);
                    }
                }
            }
            let (Some(index), true) = (index, one_index) else { continue };
            for r in self.bufs.iter().filter(|r| !r.written && r.id != out.id && r.dtype.size() == out.dtype.size()) {
                let loads: Vec<(usize, &Expr)> = stmts
                    .iter()
                    .enumerate()
                    .filter_map(|(pos, s)| match s {
                        Stmt::Load { buf, index: i, .. } if *buf == r.id => Some((pos, i)),
                        _ => None,
                    })
                    .collect();
                if !loads.is_empty() && loads.iter().all(|&(pos, i)| pos < first_store && i == index) {
                    pairs.push((out.id, r.id));
                }
            }
        }
        pairs
    }
}

/// A value's computation, by structure: equal keys compute equal values at the same loop
/// point. Operands are the numbers [`value_numbers`] gave them.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    /// A temporary not defined in a pass body (prelude value, reduction result).
    Outside(Tmp),
    Load(BufId, Expr, Option<u32>),
    Const(u64, u8),
    Index(Expr),
    Random(RandomDist, u32, Expr, i64),
    InRange(Expr, Expr, Expr),
    Unary(UnaryOp, u32),
    Binary(BinaryOp, u32, u32),
    Where(u32, u32, u32),
    Cast(u32),
    Bounded(u32, Expr),
}

/// [Note: value numbers] Numbers for the temporaries the pass bodies define: two with the same
/// number compute the same value at the same loop point (same loads at the same indices and
/// masks, same constants, index values and operations on same-numbered operands, same
/// dtype). A temporary defined elsewhere (the prelude, a reduction's result) is numbered as
/// itself. Every pass walks a row in the same order, so same-numbered temporaries of two
/// passes hold the same element's value.
fn value_numbers(k: &Kernel) -> std::collections::HashMap<Tmp, u32> {
    let mut ids: std::collections::HashMap<(Key, DType), u32> = std::collections::HashMap::new();
    let mut num: std::collections::HashMap<Tmp, u32> = std::collections::HashMap::new();
    for s in k.passes.iter().flat_map(|p| &p.body) {
        let Some(dst) = s.dst() else { continue };
        let mut arg = |t: &Tmp| match num.get(t) {
            Some(&n) => n,
            None => {
                let n = ids.len() as u32;
                *ids.entry((Key::Outside(*t), DType::Bool)).or_insert(n)
            }
        };
        let key = match s {
            Stmt::Load { buf, index, mask, .. } => Key::Load(*buf, index.clone(), mask.map(|m| arg(&m))),
            Stmt::Const { value, .. } => match value {
                Lit::F(f) => Key::Const(f.to_bits(), 0),
                Lit::I(i) => Key::Const(*i as u64, 1),
                Lit::B(b) => Key::Const(*b as u64, 2),
            },
            Stmt::Index { index, .. } => Key::Index(index.clone()),
            Stmt::Random { dist, seed, index, stream, .. } => Key::Random(*dist, arg(seed), index.clone(), *stream),
            Stmt::InRange { index, lo, hi, .. } => Key::InRange(index.clone(), lo.clone(), hi.clone()),
            Stmt::Unary { op, a, .. } => Key::Unary(*op, arg(a)),
            Stmt::Binary { op, a, b, .. } => Key::Binary(*op, arg(a), arg(b)),
            Stmt::Where { c, a, b, .. } => Key::Where(arg(c), arg(a), arg(b)),
            Stmt::Cast { a, .. } => Key::Cast(arg(a)),
            Stmt::Bounded { a, hi, .. } => Key::Bounded(arg(a), hi.clone()),
            Stmt::Store { .. } => unreachable!(),
        };
        let n = ids.len() as u32;
        let id = *ids.entry((key, k.tmp_dtypes[dst as usize])).or_insert(n);
        num.insert(dst, id);
    }
    num
}

/// The temporaries an arithmetic statement combines (none for loads, constants and indices).
fn operands(s: &Stmt) -> Vec<Tmp> {
    match s {
        Stmt::Unary { .. } | Stmt::Cast { .. } | Stmt::Bounded { .. } | Stmt::Binary { .. } | Stmt::Where { .. } => stmt_reads(s),
        _ => Vec::new(),
    }
}

/// [Note: stored values reloaded] A multi-pass row kernel (LayerNorm over `x + a + b`, the
/// new residual stored as well) recomputes in a later pass the value an earlier pass stored:
/// ViT's block-end kernel loaded the old residual and both matmul results again to normalize
/// the sum it had just written. Each later-pass value whose computation matches a stored
/// one (same loads at the same indices, same operations, same dtype, reading nothing the
/// kernel writes) becomes a load of the stored buffer at the store's index, and what only
/// fed it is dropped. The element is read back by the thread that wrote it (every target
/// walks a row in the same order in each pass), and the store's dtype is the value's, so
/// the load returns it exactly. Fewer loads, and the old buffers are no longer read after
/// the store, which lets the new value take their memory ([Note: in-place kernels]).
pub fn reload_stored_values(k: &mut Kernel) {
    if k.passes.len() < 2 || k.column {
        return;
    }
    let written: Vec<BufId> = k.bufs.iter().filter(|b| b.written).map(|b| b.id).collect();
    let mut stores_of: std::collections::HashMap<BufId, usize> = std::collections::HashMap::new();
    for s in k.stmts() {
        if let Stmt::Store { buf, .. } = s {
            *stores_of.entry(*buf).or_default() += 1;
        }
    }
    let num = value_numbers(k);
    // Per temporary defined in a pass body: whether it reads a buffer the kernel writes.
    let mut reads_written: std::collections::HashMap<Tmp, bool> = std::collections::HashMap::new();
    // Stored values: value number -> (buffer, index), from earlier passes.
    let mut stored: std::collections::HashMap<u32, (BufId, Expr)> = std::collections::HashMap::new();
    // Value numbers whose computation loads memory (only those are worth a load in their place).
    let mut loaded: std::collections::HashSet<u32> = std::collections::HashSet::new();
    let mut changed = false;
    for pi in 0..k.passes.len() {
        let mut body = std::mem::take(&mut k.passes[pi].body);
        let mut pass_stores = Vec::new();
        for s in body.iter_mut() {
            let Some(dst) = s.dst() else {
                if let Stmt::Store { buf, index, value } = s {
                    if let (Some(&id), Some(false)) = (num.get(value), reads_written.get(value).copied()) {
                        if k.tmp_dtypes[*value as usize] == k.bufs.iter().find(|b| b.id == *buf).map_or(DType::Bool, |b| b.dtype) && stores_of[buf] == 1 && loaded.contains(&id) {
                            pass_stores.push((id, (*buf, index.clone())));
                        }
                    }
                }
                continue;
            };
            let flag = |t: &Tmp| reads_written.get(t).copied().unwrap_or(false);
            let ops = operands(s);
            let (rw, from_memory) = match s {
                Stmt::Load { buf, mask, .. } => (written.contains(buf) || mask.is_some_and(|m| flag(&m)), true),
                _ => (ops.iter().any(flag), ops.iter().any(|t| num.get(t).is_some_and(|n| loaded.contains(n)))),
            };
            let id = num[&dst];
            if from_memory {
                loaded.insert(id);
            }
            reads_written.insert(dst, rw);
            if !rw {
                if let Some((buf, index)) = stored.get(&id) {
                    *s = Stmt::Load { dst, buf: *buf, index: index.clone(), mask: None };
                    reads_written.insert(dst, true);
                    changed = true;
                }
            }
        }
        k.passes[pi].body = body;
        stored.extend(pass_stores);
    }
    if changed {
        drop_unused(k);
    }
}

/// [Note: stored for reload] A CPU row kernel whose last pass recomputes a transcendental value
/// an earlier pass computed (softmax: `exp(x - max)` summed in the second pass, divided by the
/// sum in the third) stores it in the earlier pass into the buffer the last pass writes, at the
/// same index, and the last pass reads it back instead: one `exp` per element instead of two,
/// for one more store and load of a row that is still in cache. The GPU recomputes instead
/// (memory, not `exp`, bounds its row kernels), so only the CPU target applies this. Applied
/// only where it is plainly safe: the kernel stores one buffer, once, in its last pass, which
/// has no reductions; the value's dtype is the buffer's (the load returns it exactly); and every
/// load of the last pass feeds that value, so nothing the last pass reads can share memory with
/// the buffer (the planner lets a buffer read in one pass only take the memory of a value stored
/// there, [Note: in-place kernels]). Returns whether the kernel changed.
pub fn store_for_reload(k: &mut Kernel) -> bool {
    if k.passes.len() < 2 || k.column {
        return false;
    }
    let last = k.passes.len() - 1;
    if !k.passes[last].reductions.is_empty() || !k.passes[last].after.is_empty() {
        return false;
    }
    let stores: Vec<&Stmt> =
        k.stmts().filter(|s| matches!(s, Stmt::Store { .. })).collect();
    let [Stmt::Store { buf, index, value }] = stores.as_slice() else { return false };
    let (buf, index, value) = (*buf, index.clone(), *value);
    let Some(bdt) = k.bufs.iter().find(|b| b.id == buf).map(|b| b.dtype) else { return false };
    let defs = |p: &Pass| p.body.iter().filter_map(|s| s.dst().map(|d| (d, s.clone()))).collect::<std::collections::HashMap<Tmp, Stmt>>();
    let last_defs = defs(&k.passes[last]);
    if !last_defs.contains_key(&value) {
        return false;
    }
    // The statements a temporary of the last pass is computed from (itself included).
    fn subtree(t: Tmp, defs: &std::collections::HashMap<Tmp, Stmt>, out: &mut std::collections::HashSet<Tmp>) {
        if let Some(s) = defs.get(&t) {
            if out.insert(t) {
                for r in stmt_reads(s) {
                    subtree(r, defs, out);
                }
            }
        }
    }
    let expensive = |s: &Stmt| {
        matches!(s, Stmt::Unary { op, .. } if matches!(op, UnaryOp::Exp | UnaryOp::Exp2 | UnaryOp::Expm1 | UnaryOp::Log | UnaryOp::Log2
            | UnaryOp::Log10 | UnaryOp::Log1p | UnaryOp::Tanh | UnaryOp::Sigmoid | UnaryOp::Erf | UnaryOp::Erfc | UnaryOp::Sin
            | UnaryOp::Cos | UnaryOp::Tan | UnaryOp::Sinh | UnaryOp::Cosh | UnaryOp::Lgamma))
    };
    let loads: Vec<Tmp> = k.passes[last].body.iter().filter(|s| matches!(s, Stmt::Load { .. })).filter_map(|s| s.dst()).collect();
    let num = value_numbers(k);
    // The largest value of the last pass that an earlier pass computes.
    let mut best: Option<(usize, Tmp, usize, Tmp)> = None;
    for s in &k.passes[last].body {
        let Some(t) = s.dst() else { continue };
        if t == value || k.tmp_dtypes[t as usize] != bdt {
            continue;
        }
        let mut sub = std::collections::HashSet::new();
        subtree(t, &last_defs, &mut sub);
        if !sub.iter().any(|x| expensive(&last_defs[x])) || !loads.iter().all(|l| sub.contains(l)) {
            continue;
        }
        if best.as_ref().is_some_and(|b| b.0 >= sub.len()) {
            continue;
        }
        for pi in 0..last {
            if let Some(tp) = k.passes[pi].body.iter().filter_map(|s| s.dst()).find(|u| num[u] == num[&t]) {
                best = Some((sub.len(), t, pi, tp));
                break;
            }
        }
    }
    let Some((_, t, pi, tp)) = best else { return false };
    k.passes[pi].body.push(Stmt::Store { buf, index: index.clone(), value: tp });
    for s in k.passes[last].body.iter_mut() {
        if s.dst() == Some(t) {
            *s = Stmt::Load { dst: t, buf, index: index.clone(), mask: None };
        }
    }
    drop_unused(k);
    true
}

/// Removes pass-body statements whose temporary nothing reads (to a fixed point).
fn drop_unused(k: &mut Kernel) {
    loop {
        let mut used = std::collections::HashSet::new();
        let all = k.stmts();
        for s in all {
            used.extend(stmt_reads(s));
        }
        for p in &k.passes {
            for r in &p.reductions {
                used.insert(r.src);
                let mut v = Vec::new();
                expr_tmps(&r.inner_index, &mut v);
                expr_tmps(&r.count, &mut v);
                used.extend(v);
            }
        }
        let mut removed = false;
        for p in k.passes.iter_mut() {
            let before = p.body.len();
            p.body.retain(|s| s.dst().is_none_or(|t| used.contains(&t)));
            removed |= p.body.len() != before;
        }
        if !removed {
            return;
        }
    }
}

/// [Note: known masks] `body` (statements of a kernel) where the temporaries in `known`
/// hold the given booleans: each of those becomes a constant; `and`, `or` and `not` of known
/// values fold; a select on a known condition is its chosen side (later statements read that
/// side's temporary; where an index expression or `outside` names the select, or `dtypes`
/// shows its sides' dtype to differ from its own, it becomes a cast of that side); a load
/// under a mask known true loses its mask; then whatever no store and no temporary in
/// `outside` (those read by the kernel's other statement lists: a pass's reductions, its
/// `after`) needs any more is dropped. A concatenation's piece of a row ([Note: row
/// segments] in the C dialect) keeps one source's statements of its twenty-five, so the C
/// compiler is not handed every source once per piece.
pub fn fold_known(body: &[Stmt], known: &[(Tmp, bool)], dtypes: &[DType], outside: &std::collections::HashSet<Tmp>) -> Vec<Stmt> {
    use std::collections::{HashMap, HashSet};
    let mut konst: HashMap<Tmp, bool> = known.iter().copied().collect();
    let mut alias: HashMap<Tmp, Tmp> = HashMap::new();
    let named: HashSet<Tmp> = body
        .iter()
        .flat_map(|s| match s {
            Stmt::Load { index, .. } | Stmt::Index { index, .. } | Stmt::Random { index, .. } | Stmt::Store { index, .. } | Stmt::Bounded { hi: index, .. } => vec![index],
            Stmt::InRange { index, lo, hi, .. } => vec![index, lo, hi],
            _ => vec![],
        })
        .flat_map(|e| {
            let mut v = Vec::new();
            expr_tmps(e, &mut v);
            v
        })
        .collect();
    let mut out = Vec::with_capacity(body.len());
    for s in body {
        let r = |t: &Tmp| *alias.get(t).unwrap_or(t);
        let s = match s {
            s if s.dst().is_some_and(|d| konst.contains_key(&d)) => {
                let dst = s.dst().unwrap();
                Stmt::Const { dst, value: Lit::B(konst[&dst]) }
            }
            Stmt::Const { dst, value: Lit::B(b) } => {
                konst.insert(*dst, *b);
                Stmt::Const { dst: *dst, value: Lit::B(*b) }
            }
            Stmt::Where { dst, c, a, b } => {
                let (a, b) = (r(a), r(b));
                let same = |t: Tmp| dtypes.get(t as usize).is_some() && dtypes.get(t as usize) == dtypes.get(*dst as usize);
                match konst.get(&r(c)) {
                    Some(&pick) if !named.contains(dst) && !outside.contains(dst) && same(if pick { a } else { b }) => {
                        alias.insert(*dst, if pick { a } else { b });
                        continue;
                    }
                    Some(&pick) => Stmt::Cast { dst: *dst, a: if pick { a } else { b } },
                    None => Stmt::Where { dst: *dst, c: r(c), a, b },
                }
            }
            Stmt::Binary { dst, op: op @ (BinaryOp::And | BinaryOp::Or), a, b } => {
                let (a, b) = (r(a), r(b));
                let v = match (op, konst.get(&a), konst.get(&b)) {
                    (BinaryOp::And, Some(&x), Some(&y)) => Some(x && y),
                    (BinaryOp::And, Some(false), _) | (BinaryOp::And, _, Some(false)) => Some(false),
                    (BinaryOp::Or, Some(&x), Some(&y)) => Some(x || y),
                    (BinaryOp::Or, Some(true), _) | (BinaryOp::Or, _, Some(true)) => Some(true),
                    _ => None,
                };
                match v {
                    Some(v) => {
                        konst.insert(*dst, v);
                        Stmt::Const { dst: *dst, value: Lit::B(v) }
                    }
                    None => Stmt::Binary { dst: *dst, op: *op, a, b },
                }
            }
            Stmt::Unary { dst, op: UnaryOp::Not, a } => match konst.get(&r(a)) {
                Some(&v) => {
                    konst.insert(*dst, !v);
                    Stmt::Const { dst: *dst, value: Lit::B(!v) }
                }
                None => Stmt::Unary { dst: *dst, op: UnaryOp::Not, a: r(a) },
            },
            Stmt::Load { dst, buf, index, mask: Some(m) } => {
                let mask = if konst.get(&r(m)) == Some(&true) { None } else { Some(r(m)) };
                Stmt::Load { dst: *dst, buf: *buf, index: index.clone(), mask }
            }
            Stmt::Unary { dst, op, a } => Stmt::Unary { dst: *dst, op: *op, a: r(a) },
            Stmt::Binary { dst, op, a, b } => Stmt::Binary { dst: *dst, op: *op, a: r(a), b: r(b) },
            Stmt::Cast { dst, a } => Stmt::Cast { dst: *dst, a: r(a) },
            Stmt::Bounded { dst, a, hi } => Stmt::Bounded { dst: *dst, a: r(a), hi: hi.clone() },
            Stmt::Random { dst, dist, seed, index, stream } => Stmt::Random { dst: *dst, dist: *dist, seed: r(seed), index: index.clone(), stream: *stream },
            Stmt::Store { buf, index, value } => Stmt::Store { buf: *buf, index: index.clone(), value: r(value) },
            s => s.clone(),
        };
        out.push(s);
    }
    // What the stores need, walking back.
    let mut live: HashSet<Tmp> = outside.clone();
    let mut keep = vec![false; out.len()];
    for (j, s) in out.iter().enumerate().rev() {
        if s.dst().is_none_or(|d| live.contains(&d)) {
            keep[j] = true;
            live.extend(stmt_reads(s));
        }
    }
    out.into_iter().zip(keep).filter_map(|(s, k)| k.then_some(s)).collect()
}

/// The kernel with the temporaries in `known` holding the given booleans, each of its
/// statement lists folded by [`fold_known`] (a list keeps what the others read).
pub fn fold_known_kernel(k: &Kernel, known: &[(Tmp, bool)]) -> Kernel {
    use std::collections::HashSet;
    let mut out = k.clone();
    let lists: Vec<&Vec<Stmt>> = std::iter::once(&k.prelude).chain(k.passes.iter().flat_map(|p| [&p.body, &p.after])).collect();
    let mut red_reads: HashSet<Tmp> = HashSet::new();
    for r in k.passes.iter().flat_map(|p| &p.reductions) {
        red_reads.insert(r.src);
        let mut v = Vec::new();
        expr_tmps(&r.inner_index, &mut v);
        expr_tmps(&r.count, &mut v);
        red_reads.extend(v);
    }
    let outside = |skip: usize| -> HashSet<Tmp> {
        let mut o = red_reads.clone();
        for (j, l) in lists.iter().enumerate() {
            if j != skip {
                o.extend(l.iter().flat_map(stmt_reads));
            }
        }
        o
    };
    out.prelude = fold_known(&k.prelude, known, &k.tmp_dtypes, &outside(0));
    for (pi, p) in out.passes.iter_mut().enumerate() {
        p.body = fold_known(&k.passes[pi].body, known, &k.tmp_dtypes, &outside(1 + 2 * pi));
        p.after = fold_known(&k.passes[pi].after, known, &k.tmp_dtypes, &outside(2 + 2 * pi));
    }
    out
}

/// The temporaries an index expression reads.
fn expr_tmps(e: &Expr, out: &mut Vec<Tmp>) {
    for a in e.atoms() {
        match a {
            Atom::Tmp(t) => out.push(*t),
            Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => {
                expr_tmps(x, out);
                expr_tmps(y, out);
            }
            _ => {}
        }
    }
}

/// The temporaries a statement reads.
pub fn stmt_reads(s: &Stmt) -> Vec<Tmp> {
    let mut out = Vec::new();
    match s {
        Stmt::Load { index, mask, .. } => {
            expr_tmps(index, &mut out);
            out.extend(mask);
        }
        Stmt::Const { .. } => {}
        Stmt::Index { index, .. } => expr_tmps(index, &mut out),
        Stmt::Random { seed, index, .. } => {
            out.push(*seed);
            expr_tmps(index, &mut out);
        }
        Stmt::InRange { index, lo, hi, .. } => {
            for e in [index, lo, hi] {
                expr_tmps(e, &mut out);
            }
        }
        Stmt::Unary { a, .. } | Stmt::Cast { a, .. } | Stmt::Bounded { a, .. } => out.push(*a),
        Stmt::Binary { a, b, .. } => out.extend([*a, *b]),
        Stmt::Where { c, a, b, .. } => out.extend([*c, *a, *b]),
        Stmt::Store { index, value, .. } => {
            expr_tmps(index, &mut out);
            out.push(*value);
        }
    }
    out
}

impl Stmt {
    /// The temporary the statement assigns (none for a store).
    pub fn dst(&self) -> Option<Tmp> {
        match self {
            Stmt::Store { .. } => None,
            Stmt::Load { dst, .. }
            | Stmt::Const { dst, .. }
            | Stmt::Index { dst, .. }
            | Stmt::Random { dst, .. }
            | Stmt::InRange { dst, .. }
            | Stmt::Unary { dst, .. }
            | Stmt::Binary { dst, .. }
            | Stmt::Where { dst, .. }
            | Stmt::Cast { dst, .. }
            | Stmt::Bounded { dst, .. } => Some(*dst),
        }
    }
}

impl fmt::Display for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stmt::Load { dst, buf, index, mask: None } => write!(f, "t{dst} = load buf{buf}[{index}]"),
            Stmt::Load { dst, buf, index, mask: Some(m) } => write!(f, "t{dst} = load buf{buf}[{index}] if t{m}"),
            Stmt::Const { dst, value } => write!(f, "t{dst} = {}", fmt_lit(*value)),
            Stmt::Index { dst, index } => write!(f, "t{dst} = index {index}"),
            Stmt::Random { dst, dist, seed, index, stream } => write!(f, "t{dst} = rand {} seed=t{seed} stream={stream} at {index}", dist.name()),
            Stmt::InRange { dst, index, lo, hi } => write!(f, "t{dst} = {lo} <= {index} < {hi}"),
            Stmt::Unary { dst, op, a } => write!(f, "t{dst} = {} t{a}", op.name()),
            Stmt::Binary { dst, op, a, b } => write!(f, "t{dst} = {} t{a}, t{b}", op.name()),
            Stmt::Where { dst, c, a, b } => write!(f, "t{dst} = where t{c}, t{a}, t{b}"),
            Stmt::Cast { dst, a } => write!(f, "t{dst} = cast t{a}"),
            Stmt::Bounded { dst, a, hi } => write!(f, "t{dst} = bounded t{a} < {hi}"),
            Stmt::Store { buf, index, value } => write!(f, "store buf{buf}[{index}] = t{value}"),
        }
    }
}

impl fmt::Display for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[Expr]| v.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", ");
        let column = if self.column { " column" } else { "" };
        let index32 = if self.index32 { " index32" } else { "" };
        writeln!(f, "kernel {} outer=[{}] inner=[{}]{column}{index32}  // {}", self.name, list(&self.outer), list(&self.inner), self.roots.join(", "))?;
        for s in &self.prelude {
            writeln!(f, "  {s}")?;
        }
        for (i, p) in self.passes.iter().enumerate() {
            writeln!(f, "  pass {i}:")?;
            for s in &p.body {
                writeln!(f, "    {s}")?;
            }
            for r in &p.reductions {
                writeln!(f, "    t{} = {} t{}", r.dst, r.kind.name(), r.src)?;
            }
            for s in &p.after {
                writeln!(f, "  {s}")?;
            }
        }
        Ok(())
    }
}
