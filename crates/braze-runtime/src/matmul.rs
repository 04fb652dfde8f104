//! A library matmul as the plan describes it, for whichever library runs it (cuBLASLt on the
//! GPU, `cublaslt.rs`; the CPU's BLAS, `cpu_blas.rs`).

use braze_ir::{DType, Epilogue, Expr};

/// One matrix operand: element `(b, r, c)` is at `offset + b*batch_stride + r*rs + c*cs`.
#[derive(Clone, Debug)]
pub struct Operand {
    pub buf: u32,
    pub offset: i64,
    pub rows: u64,
    pub cols: u64,
    pub rs: i64,
    pub cs: i64,
    pub batch_stride: i64,
}

/// `out[b] = epilogue(a[b] @ b[b] + bias + residual[b])`, row-major, `out` contiguous; the
/// residual is cuBLASLt's C operand (beta = 1), row-major with its own row stride. With a
/// bias-gradient epilogue (2-d, no bias or residual) the sums of `a` (or `b`) over K go to
/// buffer `bias_grad`, contiguous.
#[derive(Clone, Debug)]
pub struct MatmulSpec {
    pub name: String,
    pub a: Operand,
    pub b: Operand,
    pub bias: Option<(u32, i64)>,
    pub residual: Option<Operand>,
    pub out: u32,
    pub bias_grad: Option<u32>,
    pub batch: u64,
    pub dtype: DType,
    pub tf32: bool,
    pub epilogue: Epilogue,
}

/// An [`Operand`] whose offset, sizes and strides may depend on size symbols.
#[derive(Clone, Debug)]
pub struct OperandExprs {
    pub buf: u32,
    pub offset: Expr,
    pub rows: Expr,
    pub cols: Expr,
    pub rs: Expr,
    pub cs: Expr,
    pub batch_stride: Expr,
}

/// A [`MatmulSpec`] whose sizes may depend on size symbols (a graph compiled with dynamic
/// shapes): [`MatmulExprs::eval`] gives the spec of one call.
#[derive(Clone, Debug)]
pub struct MatmulExprs {
    pub name: String,
    pub a: OperandExprs,
    pub b: OperandExprs,
    pub bias: Option<(u32, Expr)>,
    pub residual: Option<OperandExprs>,
    pub out: u32,
    pub bias_grad: Option<u32>,
    pub batch: Expr,
    pub dtype: DType,
    pub tf32: bool,
    pub epilogue: Epilogue,
}

impl OperandExprs {
    fn eval(&self, syms: &[i64]) -> Option<Operand> {
        Some(Operand {
            buf: self.buf,
            offset: self.offset.eval_syms(syms)?,
            rows: u64::try_from(self.rows.eval_syms(syms)?).ok()?,
            cols: u64::try_from(self.cols.eval_syms(syms)?).ok()?,
            rs: self.rs.eval_syms(syms)?,
            cs: self.cs.eval_syms(syms)?,
            batch_stride: self.batch_stride.eval_syms(syms)?,
        })
    }
}

impl MatmulExprs {
    /// The spec for size symbols `syms` (`&[]` for a static one); None when a size needs a
    /// symbol `syms` lacks or is negative.
    pub fn eval(&self, syms: &[i64]) -> Option<MatmulSpec> {
        Some(MatmulSpec {
            name: self.name.clone(),
            a: self.a.eval(syms)?,
            b: self.b.eval(syms)?,
            bias: match &self.bias {
                Some((b, off)) => Some((*b, off.eval_syms(syms)?)),
                None => None,
            },
            residual: match &self.residual {
                Some(r) => Some(r.eval(syms)?),
                None => None,
            },
            out: self.out,
            bias_grad: self.bias_grad,
            batch: u64::try_from(self.batch.eval_syms(syms)?).ok()?,
            dtype: self.dtype,
            tf32: self.tf32,
            epilogue: self.epilogue,
        })
    }

    /// Whether no size depends on a symbol.
    pub fn is_static(&self) -> bool {
        self.eval(&[]).is_some()
    }
}
