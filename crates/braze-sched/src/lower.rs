//! Lowering one fusion group to a loop-IR [`Kernel`].
//!
//! Every root of the group is stored at its index in the group's domain; every node between
//! roots and loads is computed inline by `value(node, index)`, memoized per (node, index,
//! mask) so a value used twice is computed once. Views only rewrite the index; cat and pad
//! become masked loads; index_select and gather read an index into a temporary.
//! Lowering fails with [`Illegal`] when the group cannot be one kernel (a reduction of this
//! group read at another point than its own); fusion uses that as its legality test.

use crate::layout::view_index;
use braze_ir::memory_order::non_1_dims;
use crate::loop_ir::{BufId, BufRef, Kernel, Pass, Reduction, Stmt, Tmp};
use braze_ir::{Atom, BinaryOp, DType, Expr, Graph, Lit, NodeId, Op, ReduceKind};
use std::collections::{HashMap, HashSet};

/// The group cannot be lowered as one kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Illegal(pub String);

/// A group's iteration space: non-1 dims of the (reduction input or pointwise) shape, with
/// a flag for reduced dims. Outer loop variables number the unreduced dims in order, inner
/// variables the reduced ones.
#[derive(Clone, Debug, PartialEq)]
pub struct Domain {
    pub dims: Vec<Expr>,
    pub reduced: Vec<bool>,
    /// Loop nesting order of the dims (outermost first) when it is not `0..n`: a pointwise
    /// kernel that stores a value laid out channels_last iterates in that memory order, so
    /// its stores and the loads of same-layout operands walk memory contiguously.
    pub order: Option<Vec<usize>>,
}

impl Domain {
    /// The dims in loop nesting order, outermost first.
    fn nesting(&self) -> Vec<usize> {
        self.order.clone().unwrap_or_else(|| (0..self.dims.len()).collect())
    }
    /// The unreduced dims' sizes in nesting order (the outer loop variables).
    pub fn outer(&self) -> Vec<Expr> {
        self.nesting().into_iter().filter(|&d| !self.reduced[d]).map(|d| self.dims[d].clone()).collect()
    }
    /// The reduced dims' sizes in nesting order (the inner loop variables).
    pub fn inner(&self) -> Vec<Expr> {
        self.nesting().into_iter().filter(|&d| self.reduced[d]).map(|d| self.dims[d].clone()).collect()
    }
    /// The loop variable of dim `d`: outer variables first, then inner ones.
    fn var(&self, d: usize) -> Expr {
        let nest = self.nesting();
        let n_outer = self.reduced.iter().filter(|r| !**r).count();
        let flag = self.reduced[d];
        let pos = nest.iter().filter(|&&k| self.reduced[k] == flag).position(|&k| k == d).expect("a permutation");
        Expr::var((if flag { n_outer + pos } else { pos }) as u32)
    }
    /// Whether the innermost loop is an unreduced dim (a column reduction).
    pub fn column(&self) -> bool {
        self.has_reduction() && self.nesting().last().is_some_and(|&d| !self.reduced[d])
    }
    /// The flattened index over the reduced dims in their logical order (what arg-reductions
    /// return), in loop variables.
    fn logical_inner_index(&self) -> Expr {
        let red: Vec<usize> = (0..self.dims.len()).filter(|&d| self.reduced[d]).collect();
        let sizes: Vec<Expr> = red.iter().map(|&d| self.dims[d].clone()).collect();
        let cs = braze_ir::contiguous_strides(&sizes);
        red.iter().zip(&cs).fold(Expr::zero(), |a, (&d, st)| a.add(&self.var(d).mul(st)))
    }
    pub fn has_reduction(&self) -> bool {
        self.reduced.iter().any(|r| *r)
    }
    /// The number of points (outer times inner), where the sizes are constants.
    pub fn work(&self) -> Option<i64> {
        self.dims.iter().try_fold(1i64, |a, d| Some(a.saturating_mul(d.as_const()?)))
    }

    /// The domain a root alone would have.
    pub fn of_root(g: &Graph, r: NodeId) -> Domain {
        let n = g.node(r);
        match &n.op {
            Op::Reduce { .. } => {
                let t = g.ty(n.inputs[0]);
                let keep = non_1_dims(&t.shape);
                // Loops nest in the order the input lies in memory ([`braze_ir::memory_order`]).
                let order = braze_ir::memory_order::memory_order(g, n.inputs[0]).and_then(|o| nesting(&o, &keep));
                let (dims, reduced) = reduction_space(g, r);
                Domain { dims, reduced, order }
            }
            _ => {
                let s = &g.ty(r).shape;
                let keep = non_1_dims(s);
                let dims: Vec<Expr> = keep.iter().map(|&d| s[d].clone()).collect();
                // A value stored in a permuted layout (eager's, or its operands') iterates in
                // its memory order.
                let order = match &n.op {
                    Op::Layout { .. } => braze_ir::memory_order::memory_order(g, r),
                    _ => braze_ir::memory_order::inherited_order(g, r),
                }
                .and_then(|o| nesting(&o, &keep));
                Domain { reduced: vec![false; dims.len()], dims, order }
            }
        }
    }
}

/// A reduction's domain dims (its input's non-1 dims) and which of them it reduces.
fn reduction_space(g: &Graph, r: NodeId) -> (Vec<Expr>, Vec<bool>) {
    let n = g.node(r);
    let Op::Reduce { dims, .. } = &n.op else { unreachable!("{r} is not a reduction") };
    let t = g.ty(n.inputs[0]);
    let keep = (0..t.rank()).filter(|&d| !t.shape[d].is_const(1));
    keep.map(|d| (t.shape[d].clone(), dims.contains(&d))).unzip()
}

/// A memory order (the value's non-1 dims, outermost first) as a nesting of domain dims, which
/// number the non-1 dims `keep` in logical order.
fn nesting(order: &[usize], keep: &[usize]) -> Option<Vec<usize>> {
    let o: Vec<usize> = order.iter().map(|d| keep.iter().position(|k| k == d)).collect::<Option<_>>()?;
    (o.len() == keep.len()).then_some(o)
}

/// Where a root is computed within its group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Level {
    /// Once per point of the whole domain (inside the inner loop of a pass).
    Row,
    /// Once per outer point (a reduction result or math on reduction results).
    Outer,
}

/// Maps the non-1 dims of `shape` onto domain dims `ds` in order; 1-dims get index 0.
fn map_dims(shape: &[Expr], dom: &Domain, ds: &[usize]) -> Option<Vec<Expr>> {
    let real = non_1_dims(shape);
    if real.len() != ds.len() || real.iter().zip(ds).any(|(&d, &k)| shape[d] != dom.dims[k]) {
        return None;
    }
    let mut idx = vec![Expr::zero(); shape.len()];
    for (&d, &k) in real.iter().zip(ds) {
        idx[d] = dom.var(k);
    }
    Some(idx)
}

/// [Note: split dims] The index of a value of `shape` in domain dims `ds` where each of its
/// (non-1) dims is one or more consecutive domain dims, outermost first: its dim of 112 in
/// the dims (14, 8) is `8·v + w`. A split reduction's stage 1 reads its input reshaped that
/// way ([Note: split pairs] in braze-passes), and the pointwise value it reduces (a BatchNorm
/// backward's gradient through hardswish, also read by the input-gradient kernel) is stored
/// by that kernel, walking the same elements. `None` where the dims do not line up so.
fn map_split_dims(shape: &[Expr], dom: &Domain, ds: &[usize]) -> Option<Vec<Expr>> {
    let fine: Vec<Expr> = ds.iter().map(|&k| dom.dims[k].clone()).collect();
    let groups = split_groups(&fine, shape)?;
    Some(
        shape
            .iter()
            .zip(groups)
            .map(|(size, g)| if size.is_const(1) { Expr::zero() } else { ds[g].iter().fold(Expr::zero(), |e, &k| e.mul_c(dom.dims[k].as_const().expect("grouped by constant sizes")).add(&dom.var(k))) })
            .collect(),
    )
}

/// Whether dims `fine` are dims `coarse` with some of them split into consecutive dims
/// ([Note: split dims]): constant sizes, the same elements in the same order.
pub fn refines(fine: &[Expr], coarse: &[Expr]) -> bool {
    fine.len() > coarse.len() && split_groups(fine, coarse).is_some()
}

/// For each dim of `coarse` (a 1 takes none), the consecutive dims of `fine` whose product it
/// is, all of `fine` used; `None` where the constant sizes do not group so.
fn split_groups(fine: &[Expr], coarse: &[Expr]) -> Option<Vec<std::ops::Range<usize>>> {
    let mut k = 0;
    let mut groups = Vec::with_capacity(coarse.len());
    for c in coarse {
        let (want, start) = (c.as_const()?, k);
        let mut got = 1i64;
        while got < want {
            got *= fine.get(k)?.as_const()?;
            k += 1;
        }
        if got != want {
            return None;
        }
        groups.push(start..k);
    }
    (k == fine.len()).then_some(groups)
}

/// The index at which root `r` is stored, and its level; `None` if `r` does not fit `dom`.
pub fn root_index(g: &Graph, dom: &Domain, r: NodeId) -> Option<(Vec<Expr>, Level)> {
    let n = g.node(r);
    let all: Vec<usize> = (0..dom.dims.len()).collect();
    let outer: Vec<usize> = all.iter().copied().filter(|&k| !dom.reduced[k]).collect();
    match &n.op {
        Op::Reduce { dims, keepdim, .. } => {
            // The dims alone: the loop order (a walk of the graph) does not decide the fit.
            let t = g.ty(n.inputs[0]);
            let in_idx = map_dims(&t.shape, dom, &reduction_dims_in(g, dom, r)?)?;
            let out_idx = (0..t.rank()).filter(|d| *keepdim || !dims.contains(d)).map(|d| if dims.contains(&d) { Expr::zero() } else { in_idx[d].clone() }).collect();
            Some((out_idx, Level::Outer))
        }
        _ => {
            let s = &g.ty(r).shape;
            if let Some(idx) = map_dims(s, dom, &all) {
                return Some((idx, Level::Row));
            }
            if let Some(idx) = map_split_dims(s, dom, &all) {
                return Some((idx, Level::Row));
            }
            if dom.has_reduction() {
                if let Some(idx) = map_dims(s, dom, &outer) {
                    return Some((idx, Level::Outer));
                }
                // [Note: embedded reductions]: a value over the reduced dims and some of the
                // kept ones (a LayerNorm's normalized row, stored for the backward), computed
                // in a pass at every point and stored by each.
                if embeddable(g, dom, r) {
                    let real: Vec<Expr> = s.iter().filter(|d| !d.is_const(1)).cloned().collect();
                    let same_size = |d: usize, k: usize| dom.dims[k] == real[d];
                    if let Some(ks) = embed_in(real.len(), &outer, same_size) {
                        return map_dims(s, dom, &ks).map(|idx| (idx, Level::Outer));
                    }
                    if let Some(ks) = embed_in(real.len(), &all, same_size).filter(|ks| covers_reduced(dom, ks)) {
                        return map_dims(s, dom, &ks).map(|idx| (idx, Level::Row));
                    }
                }
            }
            None
        }
    }
}

/// The domain dims a reduction root's (non-1) input dims are, or `None` where it does not fit
/// `dom`: its own domain, or [Note: embedded reductions].
fn reduction_dims_in(g: &Graph, dom: &Domain, r: NodeId) -> Option<Vec<usize>> {
    let (own_dims, own_reduced) = reduction_space(g, r);
    if own_dims == dom.dims && own_reduced == dom.reduced {
        return Some((0..dom.dims.len()).collect());
    }
    if !embeddable(g, dom, r) {
        return None;
    }
    let all: Vec<usize> = (0..dom.dims.len()).collect();
    embed_in(own_dims.len(), &all, |d, k| dom.dims[k] == own_dims[d] && dom.reduced[k] == own_reduced[d]).filter(|ks| covers_reduced(dom, ks))
}

/// Whether root `r` may be embedded in `dom` ([Note: embedded reductions]): the domain is
/// small, and `r` is no graph output (nor viewed by one). An embedded root is stored by every
/// point of the domain, the same value each time; an output may be an input's new value that
/// the runtime has its kernel store in place ([Note: input mutations]: BatchNorm's running
/// statistics and batch count), where a point that reads the input after another has stored
/// the new value would compute from it again.
fn embeddable(g: &Graph, dom: &Domain, r: NodeId) -> bool {
    let base = |mut o: NodeId| {
        while g.node(o).op.is_view() {
            o = g.node(o).inputs[0];
        }
        o
    };
    dom.work().is_some_and(|w| w <= EMBED_MAX_WORK) && !g.outputs.iter().any(|&o| base(o) == r)
}

/// [Note: embedded reductions] A reduction over the same reduced dims as a bigger group, whose
/// kept dims are some of the group's (a LayerNorm's row statistics under a small matmul that
/// normalizes the rows: `[rows] x [k]` in `[rows, n] x [k]`), can be computed in that group:
/// each outer point of the group recomputes it in an earlier pass, and every point stores the
/// same value where another kernel reads it. The fusion loop (`schedule::fuse`) takes this only
/// for small groups, where the kernel it saves costs more than the work repeated
/// ([`EMBED_MAX_WORK`]), and never for graph outputs (`embeddable`). The reduced dims
/// must be all of the group's; each dim maps onto the first later group dim of its size and
/// kind (`embed_in`).
pub const EMBED_MAX_WORK: i64 = 1 << 18;

/// The domain dims among `cands` that `n` dims are, in order: for each dim `d`, the first
/// later candidate `k` that `fits(d, k)`.
fn embed_in(n: usize, cands: &[usize], fits: impl Fn(usize, usize) -> bool) -> Option<Vec<usize>> {
    let mut it = cands.iter();
    (0..n).map(|d| it.find(|&&k| fits(d, k)).copied()).collect()
}

/// Whether domain dims `ks` include every reduced dim of `dom` (an embedded value or
/// reduction runs over the whole inner loop).
fn covers_reduced(dom: &Domain, ks: &[usize]) -> bool {
    (0..dom.dims.len()).filter(|&k| dom.reduced[k]).all(|k| ks.contains(&k))
}

/// The input index of a reduction root in its group's domain.
fn reduction_input_index(g: &Graph, dom: &Domain, r: NodeId) -> Vec<Expr> {
    let t = g.ty(g.node(r).inputs[0]);
    map_dims(&t.shape, dom, &reduction_dims_in(g, dom, r).expect("checked by root_index")).expect("checked by root_index")
}

/// What lowering needs to know about the rest of the schedule.
pub struct Ctx<'a> {
    pub g: &'a Graph,
    /// The group of every root (`None` for inlined nodes, buffers, externs).
    pub group_of: &'a [Option<usize>],
    /// The buffer holding a node's value, its strides and dtype, for nodes read from memory.
    pub buffer: &'a dyn Fn(NodeId) -> Option<(BufId, Vec<Expr>)>,
}

struct Builder<'a, 'c> {
    cx: &'a Ctx<'c>,
    me: usize,
    tmp_dtypes: Vec<DType>,
    out: Vec<Stmt>,
    inner_cache: HashMap<(NodeId, Vec<Expr>, Option<Tmp>), Tmp>,
    outer_cache: HashMap<(NodeId, Vec<Expr>, Option<Tmp>), Tmp>,
    in_inner: bool,
    mask: Option<Tmp>,
    /// Loop variables of the dims that `mask` guards (a pad's or cat's dim): a value read at an
    /// index that mentions none of them is in bounds wherever the kernel runs, so it is
    /// computed unmasked and shared (a BatchNorm's per-channel scale before a max pool's nine
    /// padded loads is computed once, not nine times under nine masks).
    guarded: Vec<u32>,
    /// Finished reductions of this group: result temporary and the index it belongs to.
    reds: HashMap<NodeId, (Tmp, Vec<Expr>)>,
    bufs: Vec<BufRef>,
    ops: Vec<&'static str>,
    /// Known bounds `[lo, hi]` of integer temporaries ([Note: index ranges]).
    ranges: HashMap<Tmp, (i64, i64)>,
    /// The loop variables' constant extents (outer dims, then inner), for `ranges`.
    extents: Vec<Option<i64>>,
}

impl Builder<'_, '_> {
    fn tmp(&mut self, dt: DType) -> Tmp {
        self.tmp_dtypes.push(dt);
        (self.tmp_dtypes.len() - 1) as Tmp
    }
    fn emit(&mut self, dt: DType, f: impl FnOnce(Tmp) -> Stmt) -> Tmp {
        let t = self.tmp(dt);
        let s = f(t);
        if let Some(r) = self.range_of(&s, dt) {
            self.ranges.insert(t, r);
        }
        self.out.push(s);
        t
    }

    /// The bounds of the integer value statement `s` computes, as far as its operands'
    /// bounds and constants tell ([Note: index ranges]).
    fn range_of(&self, s: &Stmt, dt: DType) -> Option<(i64, i64)> {
        let r = |t: &Tmp| self.ranges.get(t).copied();
        let (lo, hi) = match dt {
            DType::I32 => (i32::MIN as i64, i32::MAX as i64),
            DType::I16 => (i16::MIN as i64, i16::MAX as i64),
            DType::I8 => (i8::MIN as i64, i8::MAX as i64),
            DType::U8 | DType::Bool => (0, if dt == DType::Bool { 1 } else { 255 }),
            DType::I64 => (i64::MIN, i64::MAX),
            _ => return None,
        };
        // With each range, whether the value cannot wrap (a selection of an operand, a
        // comparison, a quotient or remainder by a positive constant: clamped to the dtype),
        // or may (a cast or arithmetic that leaves the dtype has no bound).
        let (range, cannot_wrap) = match s {
            Stmt::Const { value: Lit::I(v), .. } => ((*v, *v), true),
            // An iota over the loop variables: the bounds of its linear index.
            Stmt::Index { index, .. } => (index.range_in(&|v| self.extents.get(v as usize).copied().flatten())?, false),
            Stmt::Const { value: Lit::B(v), .. } => ((*v as i64, *v as i64), true),
            // A checked index is inside its dim (out of range, the GPU traps and the CPU
            // reads element 0).
            Stmt::Bounded { hi, .. } => ((0, hi.as_const().filter(|&n| n > 0)? - 1), true),
            Stmt::Cast { a, .. } if self.tmp_dtypes[*a as usize] == DType::Bool => ((0, 1), true),
            Stmt::Cast { a, .. } if self.tmp_dtypes[*a as usize].is_int() => (r(a)?, false),
            Stmt::Where { c, a, b, .. } => match r(c) {
                // A condition known from its operands' bounds (a negative index wrapped
                // where the index cannot be negative) selects one side.
                Some((1, 1)) => (r(a)?, true),
                Some((0, 0)) => (r(b)?, true),
                _ => (r(a).zip(r(b)).map(|(x, y)| (x.0.min(y.0), x.1.max(y.1)))?, true),
            },
            Stmt::Binary { op: op @ (BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge), a, b, .. } => {
                let (x, y) = r(a).zip(r(b))?;
                // `x < y` always / never, by the bounds; `>` and `>=` as `<` and `<=` swapped.
                let (x, y, strict) = match op {
                    BinaryOp::Lt => (x, y, true),
                    BinaryOp::Le => (x, y, false),
                    BinaryOp::Gt => (y, x, true),
                    _ => (y, x, false),
                };
                let always = if strict { x.1 < y.0 } else { x.1 <= y.0 };
                let never = if strict { x.0 >= y.1 } else { x.0 > y.1 };
                (if always { (1, 1) } else if never { (0, 0) } else { (0, 1) }, true)
            }
            Stmt::Binary { op, a, b, .. } => match (op, r(a), r(b)) {
                // One operand's bound suffices for max's low end and min's high end.
                (BinaryOp::Max, x, y) => {
                    let low = x.map(|x| x.0).into_iter().chain(y.map(|y| y.0)).max()?;
                    ((low, x.zip(y).map_or(hi, |(x, y)| x.1.max(y.1))), true)
                }
                (BinaryOp::Min, x, y) => {
                    let high = x.map(|x| x.1).into_iter().chain(y.map(|y| y.1)).min()?;
                    ((x.zip(y).map_or(lo, |(x, y)| x.0.min(y.0)), high), true)
                }
                (BinaryOp::Add, Some(x), Some(y)) => ((x.0.checked_add(y.0)?, x.1.checked_add(y.1)?), false),
                (BinaryOp::Sub, Some(x), Some(y)) => ((x.0.checked_sub(y.1)?, x.1.checked_sub(y.0)?), false),
                (BinaryOp::Mul, Some(x), Some(y)) => {
                    let p = [x.0.checked_mul(y.0)?, x.0.checked_mul(y.1)?, x.1.checked_mul(y.0)?, x.1.checked_mul(y.1)?];
                    ((*p.iter().min()?, *p.iter().max()?), false)
                }
                (BinaryOp::FloorDiv, Some(x), Some((c, c2))) if c == c2 && c > 0 => ((x.0.div_euclid(c), x.1.div_euclid(c)), true),
                // Python's remainder takes the divisor's sign: in `0..c` for any dividend.
                (BinaryOp::Rem, _, Some((c, c2))) if c == c2 && c > 0 => ((0, c - 1), true),
                // C's remainder takes the dividend's sign.
                (BinaryOp::Fmod, x, Some((c, c2))) if c == c2 && c > 0 => {
                    let lo = if x.is_some_and(|x| x.0 >= 0) { 0 } else { 1 - c };
                    let hi = if x.is_some_and(|x| x.1 <= 0) { 0 } else { c - 1 };
                    ((lo, hi), true)
                }
                _ => return None,
            },
            _ => return None,
        };
        if !cannot_wrap && (range.0 < lo || range.1 > hi) {
            return None;
        }
        let range = (range.0.max(lo), range.1.min(hi));
        (range.0 <= range.1).then_some(range)
    }
    fn touch(&mut self, id: BufId, dtype: DType, written: bool) {
        match self.bufs.iter_mut().find(|b| b.id == id) {
            Some(b) => b.written |= written,
            None => self.bufs.push(BufRef { id, dtype, written }),
        }
    }
    fn mine(&self, n: NodeId) -> bool {
        self.cx.group_of[n.index()] == Some(self.me)
    }

    fn bcast(&self, operand: NodeId, out_shape: &[Expr], idx: &[Expr]) -> Vec<Expr> {
        let s = &self.cx.g.ty(operand).shape;
        let off = out_shape.len() - s.len();
        (0..s.len()).map(|d| if s[d].is_const(1) { Expr::zero() } else { idx[d + off].clone() }).collect()
    }

    /// Runs `f` under mask `m` (and the current one), which guards the loop variables of `dims`.
    fn with_mask<T>(&mut self, m: Tmp, dims: &[Expr], f: impl FnOnce(&mut Self) -> Result<T, Illegal>) -> Result<T, Illegal> {
        let saved = self.mask;
        let saved_guarded = self.guarded.len();
        let combined = match saved {
            Some(old) => self.emit(DType::Bool, |dst| Stmt::Binary { dst, op: BinaryOp::And, a: old, b: m }),
            None => m,
        };
        for e in dims {
            let before = self.guarded.len();
            loop_vars(e, &mut self.guarded);
            if self.guarded.len() == before {
                // A guarded dim at a fixed index: every read under the mask stays masked.
                self.guarded.push(GUARD_ALL);
            }
        }
        self.mask = Some(combined);
        let r = f(self);
        self.mask = saved;
        self.guarded.truncate(saved_guarded);
        r
    }

    /// Whether index `idx` mentions a guarded loop variable or a temporary (an index read
    /// from memory under the mask).
    fn guarded_index(&self, idx: &[Expr]) -> bool {
        let mut vs = Vec::new();
        for e in idx {
            loop_vars(e, &mut vs);
        }
        self.guarded.contains(&GUARD_ALL) || vs.iter().any(|v| *v == u32::MAX || self.guarded.contains(v))
    }

    /// An index read from memory, used in a dim of size `hi`: widened to i64 and checked.
    /// Under a mask (a gather inside a pad's or cat's masked-off region: `flip` then
    /// `slice_backward` in cumsum's backward) the index is only checked where the mask holds;
    /// elsewhere it is 0, and the masked load it feeds reads nothing.
    fn as_index(&mut self, t: Tmp, hi: Expr) -> Expr {
        // An index computed in range (a clamped window position) needs no check, nor
        // widening: a 32-bit one keeps the address arithmetic 32-bit ([Note: 32-bit indices]).
        if let (Some(&(lo, top)), Some(n)) = (self.ranges.get(&t), hi.as_const()) {
            if lo >= 0 && top < n {
                let t = if self.tmp_dtypes[t as usize] == DType::I64 && top <= i32::MAX as i64 { self.emit(DType::I32, |dst| Stmt::Cast { dst, a: t }) } else { t };
                return Expr::tmp(t);
            }
        }
        let mut t = if self.tmp_dtypes[t as usize] == DType::I64 { t } else { self.emit(DType::I64, |dst| Stmt::Cast { dst, a: t }) };
        if let Some(m) = self.mask {
            let zero = self.emit(DType::I64, |dst| Stmt::Const { dst, value: braze_ir::Lit::I(0) });
            t = self.emit(DType::I64, |dst| Stmt::Where { dst, c: m, a: t, b: zero });
        }
        // A checked index into a dim that fits 32 bits is a 32-bit value.
        let dt = if hi.as_const().is_some_and(|n| n <= i32::MAX as i64) { DType::I32 } else { DType::I64 };
        let t = self.emit(dt, |dst| Stmt::Bounded { dst, a: t, hi });
        Expr::tmp(t)
    }

    fn value(&mut self, n: NodeId, idx: &[Expr]) -> Result<Tmp, Illegal> {
        if self.mask.is_some() && !self.guarded_index(idx) {
            let (mask, guarded) = (self.mask.take(), std::mem::take(&mut self.guarded));
            let r = self.value(n, idx);
            (self.mask, self.guarded) = (mask, guarded);
            return r;
        }
        let key = (n, idx.to_vec(), self.mask);
        if self.in_inner {
            if let Some(&t) = self.inner_cache.get(&key) {
                return Ok(t);
            }
        }
        if let Some(&t) = self.outer_cache.get(&key) {
            return Ok(t);
        }
        let t = self.compute(n, idx)?;
        if self.in_inner { &mut self.inner_cache } else { &mut self.outer_cache }.insert(key, t);
        Ok(t)
    }

    fn compute(&mut self, n: NodeId, idx: &[Expr]) -> Result<Tmp, Illegal> {
        let g = self.cx.g;
        let node = g.node(n);
        let is_reduce = matches!(node.op, Op::Reduce { .. });
        if is_reduce && self.mine(n) {
            return match self.reds.get(&n) {
                Some((t, own)) if own.as_slice() == idx => Ok(*t),
                Some(_) => Err(Illegal(format!("{n} is read at another point than its own"))),
                None => Err(Illegal(format!("{n} is read before it is finished"))),
            };
        }
        if !self.mine(n) {
            if let Some((buf, strides)) = (self.cx.buffer)(n) {
                let index = idx.iter().zip(&strides).fold(Expr::zero(), |a, (i, s)| a.add(&i.mul(s)));
                let dt = g.ty(n).dtype;
                self.touch(buf, dt, false);
                let mask = self.mask;
                return Ok(self.emit(dt, |dst| Stmt::Load { dst, buf, index, mask }));
            }
        }
        let ty = g.ty(n).clone();
        let dt = ty.dtype;
        if !node.op.is_view() && !matches!(node.op, Op::Scalar { .. } | Op::Size { .. }) {
            self.ops.push(node.op.name());
        }
        let ins = node.inputs.clone();
        Ok(match &node.op {
            Op::Scalar { value, .. } => {
                let v = *value;
                self.emit(dt, |dst| Stmt::Const { dst, value: v })
            }
            Op::Size { value, .. } => {
                let index = value.clone();
                self.emit(dt, |dst| Stmt::Index { dst, index })
            }
            Op::Iota { start, step, .. } => {
                let index = Expr::constant(*start).add(&idx[0].mul_c(*step));
                self.emit(dt, |dst| Stmt::Index { dst, index })
            }
            Op::Random { dist, shape, stream, .. } => {
                // [Note: random values] The element's row-major position in the op's own
                // shape is the counter: the value does not depend on the kernel, the loop
                // order or the layout it is stored in, so a value recomputed in another
                // kernel (inlined into two consumers) is the same value.
                let seed = self.value(ins[0], &[])?;
                let mut index = Expr::zero();
                for (i, n) in idx.iter().zip(shape) {
                    index = index.mul(n).add(i);
                }
                let (dist, stream) = (*dist, *stream);
                self.emit(dt, |dst| Stmt::Random { dst, dist, seed, index, stream })
            }
            Op::Unary(u) => {
                let a = self.value(ins[0], idx)?;
                let u = *u;
                self.emit(dt, |dst| Stmt::Unary { dst, op: u, a })
            }
            Op::Binary(b) => {
                let (ia, ib) = (self.bcast(ins[0], &ty.shape, idx), self.bcast(ins[1], &ty.shape, idx));
                let a = self.value(ins[0], &ia)?;
                let bb = self.value(ins[1], &ib)?;
                let op = *b;
                self.emit(dt, |dst| Stmt::Binary { dst, op, a, b: bb })
            }
            Op::Where => {
                let mut v = [0; 3];
                for k in 0..3 {
                    let i = self.bcast(ins[k], &ty.shape, idx);
                    v[k] = self.value(ins[k], &i)?;
                }
                self.emit(dt, |dst| Stmt::Where { dst, c: v[0], a: v[1], b: v[2] })
            }
            Op::Layout { .. } => {
                self.ops.pop();
                return self.value(ins[0], idx);
            }
            Op::Cast(_) => {
                let a = self.value(ins[0], idx)?;
                self.emit(dt, |dst| Stmt::Cast { dst, a })
            }
            op if op.is_view() => {
                let i = view_index(g, n, idx);
                self.value(ins[0], &i)?
            }
            Op::IndexSelect { dim } => {
                let j = self.value(ins[1], &[idx[*dim].clone()])?;
                let mut i = idx.to_vec();
                i[*dim] = self.as_index(j, g.ty(ins[0]).shape[*dim].clone());
                self.value(ins[0], &i)?
            }
            Op::Gather { dim } => {
                let j = self.value(ins[1], idx)?;
                let mut i = idx.to_vec();
                i[*dim] = self.as_index(j, g.ty(ins[0]).shape[*dim].clone());
                self.value(ins[0], &i)?
            }
            Op::Cat { dim } => {
                let dim = *dim;
                let mut parts = Vec::new();
                let mut off = Expr::zero();
                for &x in &ins {
                    let hi = off.add(&g.ty(x).shape[dim]);
                    let (index, lo, hi2) = (idx[dim].clone(), off.clone(), hi.clone());
                    let m = self.emit(DType::Bool, |dst| Stmt::InRange { dst, index, lo, hi: hi2 });
                    let mut i = idx.to_vec();
                    i[dim] = idx[dim].sub(&off);
                    let v = self.with_mask(m, &idx[dim..dim + 1], |b| b.value(x, &i))?;
                    parts.push((m, v));
                    off = hi;
                }
                let mut acc = parts.last().unwrap().1;
                for &(m, v) in parts.iter().rev().skip(1) {
                    acc = self.emit(dt, |dst| Stmt::Where { dst, c: m, a: v, b: acc });
                }
                acc
            }
            Op::Pad { pads, value } => {
                let x = ins[0];
                let xs = g.ty(x).shape.clone();
                let mut cond: Option<Tmp> = None;
                let mut i = idx.to_vec();
                for (d, &(before, after)) in pads.iter().enumerate() {
                    if before == 0 && after == 0 {
                        continue;
                    }
                    let b = Expr::constant(before);
                    let (index, lo, hi) = (idx[d].clone(), b.clone(), b.add(&xs[d]));
                    let m = self.emit(DType::Bool, |dst| Stmt::InRange { dst, index, lo, hi });
                    cond = Some(match cond {
                        Some(c) => self.emit(DType::Bool, |dst| Stmt::Binary { dst, op: BinaryOp::And, a: c, b: m }),
                        None => m,
                    });
                    i[d] = idx[d].sub(&b);
                }
                let Some(c) = cond else { return self.value(x, idx) };
                let padded: Vec<Expr> = pads.iter().zip(idx).filter(|(p, _)| p.0 != 0 || p.1 != 0).map(|(_, e)| e.clone()).collect();
                let v = self.with_mask(c, &padded, |bld| bld.value(x, &i))?;
                let lit = lit_for(*value, dt);
                let p = self.emit(dt, |dst| Stmt::Const { dst, value: lit });
                self.emit(dt, |dst| Stmt::Where { dst, c, a: v, b: p })
            }
            Op::Reduce { .. } => return Err(Illegal(format!("{n}: a reduction of another group has no buffer"))),
            Op::Input { .. } | Op::ExternOut { .. } | Op::Extern { .. } | Op::BiasGrad => {
                return Err(Illegal(format!("{n} has no buffer")));
            }
            _ => unreachable!(),
        })
    }

    /// Same-group reductions that `n` needs (through inlined nodes).
    fn red_deps(&self, n: NodeId, memo: &mut HashMap<NodeId, HashSet<NodeId>>) -> HashSet<NodeId> {
        if let Some(s) = memo.get(&n) {
            return s.clone();
        }
        let g = self.cx.g;
        let mut out = HashSet::new();
        let node = g.node(n);
        if !self.mine(n) && (self.cx.buffer)(n).is_some() {
            // read from memory
        } else {
            for &i in &node.inputs {
                if matches!(g.node(i).op, Op::Reduce { .. }) && self.mine(i) {
                    out.insert(i);
                } else {
                    out.extend(self.red_deps(i, memo));
                }
            }
        }
        memo.insert(n, out.clone());
        out
    }

    fn store(&mut self, r: NodeId, idx: &[Expr], value: Tmp) {
        if let Some((buf, strides)) = (self.cx.buffer)(r) {
            let index = idx.iter().zip(&strides).fold(Expr::zero(), |a, (i, s)| a.add(&i.mul(s)));
            self.touch(buf, self.cx.g.ty(r).dtype, true);
            self.out.push(Stmt::Store { buf, index, value });
        }
    }
}

fn lit_for(v: Lit, dt: DType) -> Lit {
    match (v, dt.is_float(), dt == DType::Bool) {
        (_, true, _) => Lit::F(v.as_f64()),
        (_, _, true) => Lit::B(v.as_f64() != 0.0),
        (Lit::F(f), _, _) => Lit::I(f as i64),
        _ => v,
    }
}

/// [Note: index ranges] An index read from memory is checked against its dim (`Stmt::Bounded`:
/// a trap on the GPU, a flag on the CPU), but many gathered indices are computed, not read: a
/// max pool's backward finds each input's windows by integer arithmetic and clamps their
/// positions to the output's extent before it reads the window's stored offset and gradient
/// (ResNet's stem: four windows, two gathered values each, eight checks per element). The
/// builder keeps the bounds `[lo, hi]` of the integer temporaries it can: constants, casts,
/// iotas (their linear index over the loop variables' constant extents), max/min (one operand's
/// bound is enough for max's low end), where (a condition its operands' bounds decide picks
/// one side), remainders by a positive constant (`roll`'s shifted positions), and add/sub/mul/
/// floordiv by a constant while they cannot wrap in the temporary's dtype. An index whose
/// bounds lie inside its dim needs no check (adaptive pools' windows, `roll`, a max pool's
/// backward).
///
/// Lowers group `me` (its roots in topological order over `dom`) to a kernel.
pub fn lower(cx: &Ctx, me: usize, dom: &Domain, roots: &[NodeId]) -> Result<Kernel, Illegal> {
    let g = cx.g;
    let mut b = Builder {
        cx,
        me,
        tmp_dtypes: Vec::new(),
        out: Vec::new(),
        inner_cache: HashMap::new(),
        outer_cache: HashMap::new(),
        in_inner: false,
        mask: None,
        guarded: Vec::new(),
        reds: HashMap::new(),
        bufs: Vec::new(),
        ranges: HashMap::new(),
        extents: dom.outer().iter().chain(dom.inner().iter()).map(|e| e.as_const()).collect(),
        ops: Vec::new(),
    };
    // Place every root: reductions and row-level roots in a pass, outer-level roots in the
    // prelude or after the pass whose reductions they need.
    let mut memo = HashMap::new();
    let mut pass_of: HashMap<NodeId, usize> = HashMap::new();
    let mut placed: Vec<(NodeId, Vec<Expr>, Level, Option<usize>)> = Vec::new();
    for &r in roots {
        let (idx, level) = root_index(g, dom, r).ok_or_else(|| Illegal(format!("{r} does not fit the group's domain")))?;
        let deps = if matches!(g.node(r).op, Op::Reduce { .. }) {
            let mut d = b.red_deps(g.node(r).inputs[0], &mut memo);
            if matches!(g.node(g.node(r).inputs[0]).op, Op::Reduce { .. }) && b.mine(g.node(r).inputs[0]) {
                d.insert(g.node(r).inputs[0]);
            }
            d
        } else {
            b.red_deps(r, &mut memo)
        };
        let need = deps.iter().map(|d| pass_of.get(d).copied().ok_or_else(|| Illegal(format!("{r} needs {d} first")))).collect::<Result<Vec<_>, _>>()?;
        let slot = match (matches!(g.node(r).op, Op::Reduce { .. }), level) {
            (true, _) | (false, Level::Row) => Some(need.iter().map(|p| p + 1).max().unwrap_or(0)),
            (false, Level::Outer) => need.iter().max().copied(),
        };
        if matches!(g.node(r).op, Op::Reduce { .. }) {
            pass_of.insert(r, slot.unwrap());
        }
        placed.push((r, idx, level, slot));
    }
    let is_red = |r: NodeId| matches!(g.node(r).op, Op::Reduce { .. });
    let n_passes = placed.iter().filter(|(r, _, l, _)| is_red(*r) || *l == Level::Row).filter_map(|p| p.3).max().map(|m| m + 1).unwrap_or(0);
    // Prelude: outer-level roots that need no reduction.
    for (r, idx, level, slot) in &placed {
        if *level == Level::Outer && slot.is_none() && !is_red(*r) {
            let v = b.value(*r, idx)?;
            b.store(*r, idx, v);
        }
    }
    let prelude = std::mem::take(&mut b.out);
    let inner = dom.inner();
    let inner_index = dom.logical_inner_index();
    let count = inner.iter().fold(Expr::one(), |a, s| a.mul(s));
    let mut passes = Vec::new();
    for p in 0..n_passes.max(if placed.iter().any(|x| x.2 == Level::Row) { 1 } else { 0 }) {
        b.in_inner = true;
        b.inner_cache.clear();
        let mut reductions = Vec::new();
        for (r, idx, level, slot) in &placed {
            if *slot != Some(p) {
                continue;
            }
            if is_red(*r) {
                let Op::Reduce { kind, correction, .. } = g.node(*r).op.clone() else { unreachable!() };
                let in_idx = reduction_input_index(g, dom, *r);
                let src = b.value(g.node(*r).inputs[0], &in_idx)?;
                let dst = b.tmp(g.ty(*r).dtype);
                b.ops.push(kind.name());
                let inner_index = if matches!(kind, ReduceKind::ArgMax | ReduceKind::ArgMin) { inner_index.clone() } else { Expr::zero() };
                reductions.push((*r, idx.clone(), Reduction { dst, kind, src, correction, inner_index, count: count.clone() }));
            } else if *level == Level::Row {
                let v = b.value(*r, idx)?;
                b.store(*r, idx, v);
            }
        }
        let body = std::mem::take(&mut b.out);
        b.in_inner = false;
        for (r, idx, red) in &reductions {
            b.reds.insert(*r, (red.dst, idx.clone()));
            b.store(*r, idx, red.dst);
        }
        for (r, idx, level, slot) in &placed {
            if *level == Level::Outer && !is_red(*r) && *slot == Some(p) {
                let v = b.value(*r, idx)?;
                b.store(*r, idx, v);
            }
        }
        let after = std::mem::take(&mut b.out);
        passes.push(Pass { body, reductions: reductions.into_iter().map(|x| x.2).collect(), after });
    }
    let mut ops = b.ops.clone();
    ops.sort();
    ops.dedup();
    ops.truncate(6);
    let kind = if passes.iter().any(|p| !p.reductions.is_empty()) { "red" } else { "poi" };
    // A kernel that only moves values (a layout copy, a cat of views) is named a copy.
    let name = if ops.is_empty() { format!("braze_{kind}_copy") } else { format!("braze_{kind}_fused_{}", ops.join("_")) };
    let mut k = Kernel {
        name,
        roots: roots.iter().map(|r| r.to_string()).collect(),
        outer: dom.outer(),
        inner,
        prelude,
        passes,
        tmp_dtypes: b.tmp_dtypes,
        bufs: b.bufs,
        column: dom.column(),
        index32: false,
    };
    crate::loop_ir::reload_stored_values(&mut k);
    k.index32 = fits_index32(&k, &b.ranges);
    Ok(k)
}

/// [Note: 32-bit indices] A GPU computes 64-bit integers in pairs of 32-bit registers and
/// instructions: loop variables, flat positions and address arithmetic in `long long` cost
/// registers (ResNet's stem backward kernel: 54, two 512-thread blocks per SM; the same
/// source with 32-bit index arithmetic: 40, three) and instructions. A kernel whose loop
/// extents are constants and whose every index — each term, partial product and running sum
/// as the emitter writes it, loop variables at their extents and gathered indices at their
/// bounds ([Note: index ranges]) — stays within `INDEX32_LIMIT` in magnitude is marked
/// `index32`, and the CUDA emitter declares its index variables `int`. The limit leaves room
/// for a grid-stride loop's last step past the end (at most one grid of threads, capped
/// far below 2^30). A gathered index is a 32-bit temporary where its dim fits (`as_index`);
/// rendered into an index it is converted to the target's index type, so a kernel whose
/// addresses pass the limit widens it before it scales it by a stride. Eager's kernels do the
/// same (`canUse32BitIndexMath`), as do Inductor's.
pub const INDEX32_LIMIT: i64 = 1 << 30;

/// Whether every index of `k` fits 32 bits ([Note: 32-bit indices]); `ranges` bound its
/// integer temporaries.
fn fits_index32(k: &Kernel, ranges: &HashMap<Tmp, (i64, i64)>) -> bool {
    let Some(extents) = k.const_extents().into_iter().collect::<Option<Vec<i64>>>() else {
        return false;
    };
    if extents.iter().try_fold(1i64, |a, &e| a.checked_mul(e)).is_none_or(|w| w > INDEX32_LIMIT) {
        return false;
    }
    let leaf = |a: &Atom| match a {
        Atom::Var(v) => extents.get(*v as usize).map(|&e| (e - 1).max(0)),
        Atom::Tmp(t) => ranges.get(t).map(|&(lo, hi)| lo.unsigned_abs().max(hi.unsigned_abs()).min(i64::MAX as u64) as i64),
        _ => None,
    };
    k.index_exprs().into_iter().all(|e| e.magnitude_in(&leaf).is_some_and(|m| m <= INDEX32_LIMIT))
}

/// In `Builder::guarded`: a guarded dim whose index mentions no loop variable.
const GUARD_ALL: u32 = u32::MAX - 1;

/// The loop variables `e` mentions (recursively), with `u32::MAX` for a temporary.
pub(crate) fn loop_vars(e: &Expr, out: &mut Vec<u32>) {
    for a in e.atoms() {
        match a {
            Atom::Var(v) => out.push(*v),
            Atom::Tmp(_) => out.push(u32::MAX),
            Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => {
                loop_vars(x, out);
                loop_vars(y, out);
            }
            _ => {}
        }
    }
}
