//! Constant folding: a pointwise op (unary, binary, where, cast) whose operands are all
//! `scalar` constants becomes one `scalar`. Folds f64, f32, integer and bool values with
//! the dtype's rounding; leaves f16/bf16 and ops without a rule here untouched.

use crate::rewrite::{rewrite, Rewrite};
use braze_ir::{BinaryOp, DType, Graph, Lit, NodeId, Op, UnaryOp};

pub fn const_fold(g: &Graph) -> Graph {
    rewrite(g, |out, n| {
        let vals: Option<Vec<(Lit, DType)>> = n
            .inputs
            .iter()
            .map(|&i: &NodeId| match out.node(i).op {
                Op::Scalar { value, dtype } => Some((value, dtype)),
                _ => None,
            })
            .collect();
        let vals = vals?;
        if vals.is_empty() {
            return None;
        }
        let dt = n.ty.as_ref()?.dtype;
        let v = match &n.op {
            Op::Unary(u) => unary(*u, vals[0].0, vals[0].1)?,
            Op::Binary(b) => binary(*b, vals[0].0, vals[1].0, vals[0].1)?,
            Op::Cast(d) => cast(vals[0].0, *d)?,
            Op::Where => {
                if truthy(vals[0].0) {
                    vals[1].0
                } else {
                    vals[2].0
                }
            }
            _ => return None,
        };
        Some(Rewrite::Op(Op::Scalar { value: round(v, dt)?, dtype: dt }, vec![]))
    })
}

fn truthy(v: Lit) -> bool {
    v.as_f64() != 0.0
}

/// Rounds a folded value to what the dtype holds; `None` for dtypes not folded here.
fn round(v: Lit, d: DType) -> Option<Lit> {
    Some(match d {
        DType::F64 => Lit::F(v.as_f64()),
        DType::F32 => Lit::F(v.as_f64() as f32 as f64),
        DType::Bool => Lit::B(truthy(v)),
        DType::I64 | DType::I32 | DType::I16 | DType::I8 | DType::U8 => {
            let i = match v {
                Lit::I(i) => i,
                Lit::B(b) => b as i64,
                Lit::F(_) => return None,
            };
            Lit::I(match d {
                DType::I32 => i as i32 as i64,
                DType::I16 => i as i16 as i64,
                DType::I8 => i as i8 as i64,
                DType::U8 => i as u8 as i64,
                _ => i,
            })
        }
        DType::F16 | DType::BF16 => return None,
    })
}

fn cast(v: Lit, d: DType) -> Option<Lit> {
    if d.is_float() {
        return Some(Lit::F(v.as_f64()));
    }
    match (v, d) {
        (_, DType::Bool) => Some(Lit::B(truthy(v))),
        (Lit::F(f), _) if f.is_finite() => Some(Lit::I(f.trunc() as i64)),
        (Lit::F(_), _) => None,
        (Lit::I(i), _) => Some(Lit::I(i)),
        (Lit::B(b), _) => Some(Lit::I(b as i64)),
    }
}

fn unary(u: UnaryOp, v: Lit, d: DType) -> Option<Lit> {
    use UnaryOp::*;
    if d.is_float() {
        let x = v.as_f64();
        return Some(match u {
            Neg => Lit::F(-x),
            Abs => Lit::F(x.abs()),
            Exp => Lit::F(x.exp()),
            Log => Lit::F(x.ln()),
            Sqrt => Lit::F(x.sqrt()),
            Rsqrt => Lit::F(1.0 / x.sqrt()),
            Sin => Lit::F(x.sin()),
            Cos => Lit::F(x.cos()),
            Tanh => Lit::F(x.tanh()),
            Reciprocal => Lit::F(1.0 / x),
            Relu => Lit::F(if x > 0.0 { x } else { 0.0 }),
            Not => Lit::B(x == 0.0),
            IsNan => Lit::B(x.is_nan()),
            _ => return None,
        });
    }
    let i = match v {
        Lit::I(i) => i,
        Lit::B(b) => b as i64,
        Lit::F(_) => return None,
    };
    Some(match u {
        Neg => Lit::I(i.wrapping_neg()),
        Abs => Lit::I(i.wrapping_abs()),
        Not => Lit::B(i == 0),
        F64FromBits => Lit::F(f64::from_bits(i as u64)),
        _ => return None,
    })
}

fn binary(b: BinaryOp, x: Lit, y: Lit, d: DType) -> Option<Lit> {
    use BinaryOp::*;
    if d.is_float() {
        let (a, c) = (x.as_f64(), y.as_f64());
        return Some(match b {
            Add => Lit::F(a + c),
            Sub => Lit::F(a - c),
            Mul => Lit::F(a * c),
            Div => Lit::F(a / c),
            Pow => Lit::F(a.powf(c)),
            _ => return compare(b, a, c),
        });
    }
    let (a, c) = match (x, y) {
        (Lit::I(a), Lit::I(c)) => (a, c),
        (Lit::B(a), Lit::B(c)) => (a as i64, c as i64),
        _ => return None,
    };
    Some(match b {
        Add => Lit::I(a.wrapping_add(c)),
        Sub => Lit::I(a.wrapping_sub(c)),
        Mul => Lit::I(a.wrapping_mul(c)),
        Eq | Ne | Lt | Le | Gt | Ge => return compare(b, a, c),
        And => Lit::B(a != 0 && c != 0),
        Or => Lit::B(a != 0 || c != 0),
        _ => return None,
    })
}

/// A comparison of two folded values (`None` for other ops).
fn compare<T: PartialOrd>(b: BinaryOp, a: T, c: T) -> Option<Lit> {
    use BinaryOp::*;
    Some(Lit::B(match b {
        Eq => a == c,
        Ne => a != c,
        Lt => a < c,
        Le => a <= c,
        Gt => a > c,
        Ge => a >= c,
        _ => return None,
    }))
}
