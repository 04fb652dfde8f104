//! Result types of ops: the typing rules that the builder applies and the verifier re-checks.

use crate::dtype::DType;
use crate::graph::TensorTy;
use crate::op::{Op, ReduceKind, UnaryOp};
use crate::sym::Expr;
use crate::Error;

fn bad(msg: String) -> Error {
    Error::Invalid(msg)
}

thread_local! {
    /// The graph's size equalities while its ops are typed ([`with_size_rules`]).
    static SIZE_RULES: std::cell::RefCell<Vec<(Expr, Expr)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with `rules` (monomial -> equal size, [`crate::Graph::size_rules`]) in force for
/// the size comparisons of typing.
pub fn with_size_rules<T>(rules: &[(Expr, Expr)], f: impl FnOnce() -> T) -> T {
    if rules.is_empty() {
        return f();
    }
    let saved = SIZE_RULES.with(|r| std::mem::replace(&mut *r.borrow_mut(), rules.to_vec()));
    let out = f();
    SIZE_RULES.with(|r| *r.borrow_mut() = saved);
    out
}

/// Whether two sizes are equal: the same expression, or the same once the graph's size
/// equalities are applied.
pub fn same_size(a: &Expr, b: &Expr) -> bool {
    a == b || SIZE_RULES.with(|r| {
        let r = r.borrow();
        !r.is_empty() && a.substitute(&r) == b.substitute(&r)
    })
}

/// Numpy-style broadcast of shapes.
pub fn broadcast(a: &[Expr], b: &[Expr]) -> Result<Vec<Expr>, Error> {
    let n = a.len().max(b.len());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let x = if i + a.len() >= n { Some(&a[i + a.len() - n]) } else { None };
        let y = if i + b.len() >= n { Some(&b[i + b.len() - n]) } else { None };
        out.push(match (x, y) {
            (Some(x), Some(y)) if same_size(x, y) => x.clone(),
            (Some(x), Some(y)) if x.is_const(1) => y.clone(),
            (Some(x), Some(y)) if y.is_const(1) => x.clone(),
            (Some(x), None) | (None, Some(x)) => x.clone(),
            (Some(x), Some(y)) => return Err(bad(format!("shapes do not broadcast: {x} vs {y}"))),
            (None, None) => unreachable!(),
        });
    }
    Ok(out)
}

/// The type of `op` applied to operands of types `ins`.
pub fn infer(op: &Op, ins: &[&TensorTy]) -> Result<Option<TensorTy>, Error> {
    if let Some(n) = op.arity() {
        if ins.len() != n && !matches!(op, Op::ExternOut { .. }) {
            return Err(bad(format!("{} takes {n} operands, got {}", op.name(), ins.len())));
        }
    }
    let t = |dtype: DType, shape: Vec<Expr>| Ok(Some(TensorTy::new(dtype, shape)));
    match op {
        Op::Input { .. } | Op::ExternOut { .. } | Op::BiasGrad => Err(bad(format!("{} needs an explicit type", op.name()))),
        Op::Extern { .. } => Ok(None),
        Op::Scalar { dtype, .. } => t(*dtype, vec![]),
        Op::Iota { len, dtype, .. } => t(*dtype, vec![len.clone()]),
        Op::Size { dtype, .. } => t(*dtype, vec![]),
        Op::Random { shape, dtype, .. } => {
            if ins[0].dtype != DType::I64 || ins[0].rank() != 0 {
                return Err(bad("rand's operand is its seed, a 0-dim i64".into()));
            }
            if !dtype.is_float() {
                return Err(bad(format!("rand makes float values, not {dtype}")));
            }
            t(*dtype, shape.clone())
        }
        Op::Unary(u) => {
            let dt = match u {
                UnaryOp::F64FromBits if ins[0].dtype != DType::I64 => return Err(bad("f64_from_bits takes an i64".into())),
                UnaryOp::F64FromBits => DType::F64,
                _ if u.is_predicate() => DType::Bool,
                _ => ins[0].dtype,
            };
            t(dt, ins[0].shape.clone())
        }
        Op::Binary(b) => {
            if ins[0].dtype != ins[1].dtype {
                return Err(bad(format!("{} operands differ in dtype: {} vs {}", b.name(), ins[0].dtype, ins[1].dtype)));
            }
            let dt = if b.is_predicate() { DType::Bool } else { ins[0].dtype };
            t(dt, broadcast(&ins[0].shape, &ins[1].shape)?)
        }
        Op::Where => {
            if ins[0].dtype != DType::Bool {
                return Err(bad("where's condition must be bool".into()));
            }
            if ins[1].dtype != ins[2].dtype {
                return Err(bad(format!("where's branches differ in dtype: {} vs {}", ins[1].dtype, ins[2].dtype)));
            }
            let s = broadcast(&broadcast(&ins[0].shape, &ins[1].shape)?, &ins[2].shape)?;
            t(ins[1].dtype, s)
        }
        Op::Cast(d) => t(*d, ins[0].shape.clone()),
        Op::Layout { strides } => {
            if strides.len() != ins[0].rank() {
                return Err(bad(format!("layout needs one stride per dim, got {}", strides.len())));
            }
            t(ins[0].dtype, ins[0].shape.clone())
        }
        Op::Reduce { kind, dims, keepdim, .. } => {
            let x = ins[0];
            check_dims(dims, x.rank())?;
            let mut shape = Vec::new();
            for (d, s) in x.shape.iter().enumerate() {
                if dims.contains(&d) {
                    if *keepdim {
                        shape.push(Expr::one());
                    }
                } else {
                    shape.push(s.clone());
                }
            }
            let dt = match kind {
                ReduceKind::ArgMax | ReduceKind::ArgMin => DType::I64,
                ReduceKind::Any | ReduceKind::All => DType::Bool,
                ReduceKind::Sum | ReduceKind::Prod if !x.dtype.is_float() => DType::I64,
                ReduceKind::Var if !x.dtype.is_float() => return Err(bad("var needs a float operand".into())),
                _ => x.dtype,
            };
            t(dt, shape)
        }
        Op::Permute(p) => {
            let x = ins[0];
            let mut sorted = p.clone();
            sorted.sort();
            if sorted != (0..x.rank()).collect::<Vec<_>>() {
                return Err(bad(format!("permute {p:?} is not a permutation of {} dims", x.rank())));
            }
            t(x.dtype, p.iter().map(|&d| x.shape[d].clone()).collect())
        }
        Op::Expand(shape) => {
            let x = ins[0];
            if shape.len() < x.rank() {
                return Err(bad("expand cannot drop dims".into()));
            }
            let off = shape.len() - x.rank();
            for (d, s) in x.shape.iter().enumerate() {
                if !(s == &shape[d + off] || s.is_const(1)) {
                    return Err(bad(format!("expand: size {s} cannot become {}", shape[d + off])));
                }
            }
            t(x.dtype, shape.clone())
        }
        Op::Reshape(shape) => {
            let x = ins[0];
            let n: Expr = shape.iter().fold(Expr::one(), |a, b| a.mul(b));
            if !same_size(&n, &x.numel()) {
                return Err(bad(format!("reshape changes the element count: {} vs {}", x.numel(), n)));
            }
            t(x.dtype, shape.clone())
        }
        Op::Slice { dim, len, step, .. } => {
            let x = ins[0];
            check_dims(&[*dim], x.rank())?;
            if *step < 1 {
                return Err(bad("slice step must be positive".into()));
            }
            let mut s = x.shape.clone();
            s[*dim] = len.clone();
            t(x.dtype, s)
        }
        Op::Select { dim, .. } => {
            let x = ins[0];
            check_dims(&[*dim], x.rank())?;
            let mut s = x.shape.clone();
            s.remove(*dim);
            t(x.dtype, s)
        }
        Op::IndexSelect { dim } => {
            let (x, idx) = (ins[0], ins[1]);
            check_dims(&[*dim], x.rank())?;
            if idx.rank() != 1 || !idx.dtype.is_int() {
                return Err(bad("index_select needs a 1-dim integer index".into()));
            }
            let mut s = x.shape.clone();
            s[*dim] = idx.shape[0].clone();
            t(x.dtype, s)
        }
        Op::Gather { dim } => {
            let (x, idx) = (ins[0], ins[1]);
            check_dims(&[*dim], x.rank())?;
            if idx.rank() != x.rank() || !idx.dtype.is_int() {
                return Err(bad("gather needs an integer index of the operand's rank".into()));
            }
            t(x.dtype, idx.shape.clone())
        }
        Op::Cat { dim } => {
            let first = ins.first().ok_or_else(|| bad("cat needs operands".into()))?;
            check_dims(&[*dim], first.rank())?;
            let mut s = first.shape.clone();
            for x in &ins[1..] {
                if x.dtype != first.dtype || x.rank() != first.rank() {
                    return Err(bad("cat operands differ in dtype or rank".into()));
                }
                for d in 0..x.rank() {
                    if d != *dim && x.shape[d] != first.shape[d] {
                        return Err(bad(format!("cat operands differ in size on dim {d}")));
                    }
                }
                s[*dim] = s[*dim].add(&x.shape[*dim]);
            }
            t(first.dtype, s)
        }
        Op::Matmul { residual, epilogue, .. } => {
            let n = ins.len() - usize::from(*residual);
            if matches!(epilogue, crate::op::Epilogue::BiasGradA | crate::op::Epilogue::BiasGradB) && (ins.len() != 2 || ins[0].rank() != 2) {
                return Err(bad("a bias-gradient matmul takes two 2-d operands, no bias or residual".into()));
            }
            if (n != 2 && n != 3) || ins.len() < 2 {
                return Err(bad("matmul takes (a, b[, bias][, residual])".into()));
            }
            let (a, b) = (ins[0], ins[1]);
            let r = a.rank();
            if r < 2 || b.rank() != r || a.dtype != b.dtype || !a.dtype.is_float() {
                return Err(bad("matmul needs float operands of one rank (>= 2) and dtype".into()));
            }
            if a.shape[..r - 2] != b.shape[..r - 2] || a.shape[r - 1] != b.shape[r - 2] {
                return Err(bad("matmul operand shapes do not match".into()));
            }
            if let Some(bias) = ins[..n].get(2) {
                if bias.rank() != 1 || bias.shape[0] != b.shape[r - 1] || bias.dtype != a.dtype {
                    return Err(bad("matmul bias must be [N] of the operands' dtype".into()));
                }
            }
            let mut s = a.shape[..r - 1].to_vec();
            s.push(b.shape[r - 1].clone());
            if *residual && (ins[n].shape != s || ins[n].dtype != a.dtype) {
                return Err(bad("matmul residual must have the result's shape and dtype".into()));
            }
            t(a.dtype, s)
        }
        Op::Conv { dir, stride, padding, dilation, groups, spatial, strides, .. } => {
            use crate::op::ConvDir;
            let (a, b) = (ins[0], ins[1]);
            if a.rank() != 4 || b.rank() != 4 || a.dtype != b.dtype || !a.dtype.is_float() || strides.len() != 4 {
                return Err(bad("conv takes two float 4-d operands of one dtype, and 4 strides".into()));
            }
            let consts = |t: &TensorTy| -> Option<Vec<i64>> { t.shape.iter().map(Expr::as_const).collect() };
            let (Some(sa), Some(sb)) = (consts(a), consts(b)) else { return Err(bad("conv needs static sizes".into())) };
            let params_ok = [stride, padding, dilation].iter().all(|p| p.len() == 2) && stride.iter().chain(dilation).all(|&v| v > 0) && padding.iter().all(|&v| v >= 0);
            if !params_ok || *groups < 1 || spatial.len() != if *dir == ConvDir::Forward { 0 } else { 2 } {
                return Err(bad("conv parameters do not match its direction".into()));
            }
            // (x, w, y) shapes: two from the operands, the third computed.
            let out = |hw: &[i64], k: &[i64], d: usize| (hw[d] + 2 * padding[d] - dilation[d] * (k[d] - 1) - 1) / stride[d] + 1;
            let (x, w, y) = match dir {
                ConvDir::Forward => {
                    let y = vec![sa[0], sb[0], out(&sa[2..], &sb[2..], 0), out(&sa[2..], &sb[2..], 1)];
                    (sa, sb, y)
                }
                ConvDir::Data => (vec![sa[0], sb[1] * groups, spatial[0], spatial[1]], sb, sa),
                ConvDir::Filter => {
                    let w = vec![sb[1], sa[1] / groups, spatial[0], spatial[1]];
                    (sa, w, sb)
                }
            };
            let consistent = x[1] == w[1] * groups
                && w[0] % groups == 0
                && y[0] == x[0]
                && y[1] == w[0]
                && y[2] == out(&x[2..], &w[2..], 0)
                && y[3] == out(&x[2..], &w[2..], 1)
                && y.iter().chain(&x).chain(&w).all(|&n| n >= 1);
            if !consistent {
                return Err(bad("conv operands do not match its parameters".into()));
            }
            let result = match dir {
                ConvDir::Forward => y,
                ConvDir::Data => x,
                ConvDir::Filter => w,
            };
            t(a.dtype, result.into_iter().map(Expr::from).collect())
        }
        Op::Pad { pads, .. } => {
            let x = ins[0];
            if pads.len() != x.rank() || pads.iter().any(|&(a, b)| a < 0 || b < 0) {
                return Err(bad("pad needs one non-negative (before, after) pair per dim".into()));
            }
            let s = x.shape.iter().zip(pads).map(|(s, &(a, b))| s.add(&Expr::constant(a + b))).collect();
            t(x.dtype, s)
        }
    }
}

fn check_dims(dims: &[usize], rank: usize) -> Result<(), Error> {
    for (i, &d) in dims.iter().enumerate() {
        if d >= rank || dims[..i].contains(&d) {
            return Err(bad(format!("dims {dims:?} invalid for rank {rank}")));
        }
    }
    Ok(())
}
