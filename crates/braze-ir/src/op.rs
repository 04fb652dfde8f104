//! The op table: every operation a braze graph can hold, one doc line each.
//! Adding an op: add the variant here, its name in `Op::name`/`parse`, its typing rule in
//! `infer.rs`, its loop-IR lowering in braze-sched and its C spelling in braze-codegen
//! (docs/architecture.md, "How to add an op").

use crate::dtype::DType;
use crate::sym::Expr;

/// A literal scalar value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lit {
    F(f64),
    I(i64),
    B(bool),
}

impl Lit {
    pub fn as_f64(self) -> f64 {
        match self {
            Lit::F(v) => v,
            Lit::I(v) => v as f64,
            Lit::B(b) => b as i64 as f64,
        }
    }
}

macro_rules! named_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vm])* $v),* }
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$v),*];
            pub fn name(self) -> &'static str { match self { $($name::$v => $s),* } }
            pub fn from_name(s: &str) -> Option<$name> {
                match s { $($s => Some($name::$v),)* _ => None }
            }
        }
    };
}

named_enum! {
    /// Elementwise ops of one operand; the result has the operand's dtype unless noted.
    UnaryOp {
        Neg = "neg", Abs = "abs", Exp = "exp", Exp2 = "exp2", Expm1 = "expm1",
        Log = "log", Log2 = "log2", Log10 = "log10", Log1p = "log1p",
        Sqrt = "sqrt", Rsqrt = "rsqrt", Sin = "sin", Cos = "cos", Tan = "tan",
        Asin = "asin", Acos = "acos", Atan = "atan", Sinh = "sinh", Cosh = "cosh",
        Tanh = "tanh", Asinh = "asinh", Acosh = "acosh", Atanh = "atanh",
        Sigmoid = "sigmoid", Relu = "relu", Erf = "erf", Erfc = "erfc",
        Reciprocal = "reciprocal", Floor = "floor", Ceil = "ceil", Round = "round",
        Trunc = "trunc", Sign = "sign", Lgamma = "lgamma",
        /// Logical not; result is bool.
        Not = "not",
        BitwiseNot = "bitwise_not",
        /// NaN test; result is bool.
        IsNan = "isnan",
        /// Infinity test; result is bool.
        IsInf = "isinf",
        /// The f64 whose bits are the i64 operand; result is f64 (a float scalar of the
        /// host carried in the size-symbol array, [Note: host scalars]).
        F64FromBits = "f64_from_bits",
    }
}

named_enum! {
    /// Elementwise ops of two operands of one dtype, broadcast numpy-style.
    BinaryOp {
        Add = "add", Sub = "sub", Mul = "mul",
        /// True division (float operands).
        Div = "div",
        /// Floor division, rounding toward negative infinity.
        FloorDiv = "floordiv",
        /// Python-style remainder: the result has the divisor's sign.
        Rem = "rem",
        /// C-style remainder (torch.fmod).
        Fmod = "fmod",
        Pow = "pow",
        /// NaN-propagating maximum (torch.maximum).
        Max = "max",
        /// NaN-propagating minimum (torch.minimum).
        Min = "min",
        Atan2 = "atan2", Hypot = "hypot", Copysign = "copysign",
        /// Comparisons; result is bool.
        Eq = "eq", Ne = "ne", Lt = "lt", Le = "le", Gt = "gt", Ge = "ge",
        /// Logical ops on any dtype (non-zero is true); result is bool.
        And = "and", Or = "or", Xor = "xor",
        /// Bitwise ops on integer or bool operands.
        BitAnd = "bitwise_and", BitOr = "bitwise_or", BitXor = "bitwise_xor",
        Shl = "shl", Shr = "shr",
    }
}

named_enum! {
    /// What a matmul applies to its result before storing it, or computes beside it.
    Epilogue {
        None = "none", Relu = "relu", Gelu = "gelu",
        /// Also the sums of `a` over K (its rows' sums, `[M]`): a linear's bias gradient
        /// when `a` is the output gradient transposed (`dW = dYᵀ X`). Read by `bias_grad`.
        BiasGradA = "bias_grad_a",
        /// Also the sums of `b` over K (its columns' sums, `[N]`): the bias gradient when
        /// `b` is the output gradient (`dW = Xᵀ dY`, GPT-2's Conv1D). Read by `bias_grad`.
        BiasGradB = "bias_grad_b",
    }
}

named_enum! {
    /// What a `conv` op computes: the convolution, or one of its gradients.
    ConvDir {
        /// `y = conv(x, w)`; operands (x, w).
        Forward = "forward",
        /// The input's gradient `dx` from (dy, w).
        Data = "data",
        /// The weight's gradient `dw` from (x, dy).
        Filter = "filter",
    }
}

named_enum! {
    /// The distribution of a `rand` op's values.
    RandomDist {
        /// Uniform on [0, 1), on the grid of the dtype's precision (so a 16-bit value never
        /// rounds up to 1).
        Uniform = "uniform",
        /// Standard normal (Box-Muller over two uniforms).
        Normal = "normal",
    }
}

named_enum! {
    /// Reductions over a set of dims.
    ReduceKind {
        Sum = "sum", Prod = "prod",
        /// NaN-propagating maximum.
        Max = "amax",
        /// NaN-propagating minimum.
        Min = "amin",
        /// Index (i64, over the reduced dims flattened) of the first maximum.
        ArgMax = "argmax",
        /// Index (i64, over the reduced dims flattened) of the first minimum.
        ArgMin = "argmin",
        /// Logical any; result is bool.
        Any = "any",
        /// Logical all; result is bool.
        All = "all",
        /// Variance by Welford's algorithm, divided by `n - correction`.
        Var = "var",
    }
}

impl BinaryOp {
    /// True for ops whose result is bool whatever the operand dtype.
    pub fn is_predicate(self) -> bool {
        use BinaryOp::*;
        matches!(self, Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor)
    }
}

impl UnaryOp {
    pub fn is_predicate(self) -> bool {
        matches!(self, UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf)
    }
}

/// One operation of the graph. Operands are the node's `inputs`, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Graph input `index`, a tensor laid out with `strides` (elements). No operands.
    Input { index: u32, strides: Vec<Expr> },
    /// A 0-dim constant. No operands.
    Scalar { value: Lit, dtype: DType },
    /// A 0-dim value equal to a size expression (e.g. an element count `s0*768`). No operands.
    Size { value: Expr, dtype: DType },
    /// `start + step * i` for `i` in `0..len`, 1-dim. No operands.
    Iota { len: Expr, start: i64, step: i64, dtype: DType },
    /// Random values of `shape` and a float `dtype` drawn from `dist` ([Note: random
    /// values] in lowering.py): the element at row-major position `i` is a function of
    /// (seed, `stream`, `i`) alone, so any kernel, layout or iteration order computes the
    /// same value. Operand: the seed, a 0-dim i64 the runtime draws from PyTorch's
    /// generator per call. `stream` tells apart the random ops of one graph.
    Random { dist: RandomDist, shape: Vec<Expr>, stream: i64, dtype: DType },
    /// Elementwise op of one operand.
    Unary(UnaryOp),
    /// Elementwise op of two broadcast operands of one dtype.
    Binary(BinaryOp),
    /// `where(cond, a, b)`: cond is bool; a and b share a dtype; all broadcast.
    Where,
    /// Converts the operand to `dtype` (C semantics; bool is `x != 0`).
    Cast(DType),
    /// Reduces the operand over `dims`; keeps them as size 1 when `keepdim`.
    Reduce { kind: ReduceKind, dims: Vec<usize>, keepdim: bool, correction: i64 },
    /// Reorders dims: output dim d is input dim `perm[d]`. A view.
    Permute(Vec<usize>),
    /// Broadcasts size-1 dims (and new leading dims) to `shape`. A view.
    Expand(Vec<Expr>),
    /// Same elements in row-major order, new shape. A view.
    Reshape(Vec<Expr>),
    /// Elements `start + step * k` for `k` in `0..len` along `dim`. A view.
    Slice { dim: usize, start: Expr, len: Expr, step: i64 },
    /// Index `index` along `dim`, which is removed. A view.
    Select { dim: usize, index: Expr },
    /// `out[.., i, ..] = x[.., idx[i], ..]` along `dim`; operands (x, idx: 1-dim integer).
    IndexSelect { dim: usize },
    /// `out[i] = x[i with dim replaced by idx[i]]`; operands (x, idx: same rank).
    Gather { dim: usize },
    /// Concatenation of all operands along `dim`.
    Cat { dim: usize },
    /// Constant padding: `pads[d] = (before, after)` elements on dim d, both >= 0.
    Pad { pads: Vec<(i64, i64)>, value: Lit },
    /// Matrix product `a @ b (+ bias) (+ residual)`, then `epilogue`: operands (a: [.., M, K],
    /// b: [.., K, N] [, bias: [N]] [, residual: [.., M, N]]), batch dims equal; the residual
    /// (last operand, when `residual`) has the result's shape and dtype. Runs as a
    /// vendor-library call (cuBLASLt), with bias, residual and activation fused. `tf32`
    /// allows TF32 arithmetic for f32 operands.
    Matmul { epilogue: Epilogue, tf32: bool, residual: bool },
    /// A 2-d convolution (cross-correlation, as PyTorch's) or one of its gradients (`dir`) by
    /// the vendor library (cuDNN), static sizes, one float dtype: forward (x: [N, C, H, W],
    /// w: [O, C / groups, kH, kW]) -> y; data (dy, w) -> dx; filter (x, dy) -> dw. `stride`,
    /// `padding` and `dilation` are per spatial dim; `spatial` is the result's spatial size
    /// where the operands do not tell it (dx's H, W; dw's kH, kW; empty for forward). The
    /// result is laid out with `strides` (channels_last; a weight gradient packed so). The
    /// operands must be in memory: activations densely in any order, a weight packed
    /// channels_last. No bias (a following add fuses it; its gradient is a reduction).
    /// `tf32` allows TF32 arithmetic for f32 operands.
    Conv { dir: ConvDir, stride: Vec<i64>, padding: Vec<i64>, dilation: Vec<i64>, groups: i64, spatial: Vec<i64>, tf32: bool, strides: Vec<Expr> },
    /// A call of the ATen op `target` (by name) on the operands; `outputs` results, each
    /// taken by an `ExternOut`. The runtime (Python) holds the non-tensor arguments.
    /// `effect`: the call must run even when nothing reads its results (random ops, asserts,
    /// ops returning no tensor), so dead-code elimination keeps it.
    Extern { target: String, outputs: u32, effect: bool },
    /// Result `index` of the `Extern` operand, laid out with `strides`.
    ExternOut { index: u32, strides: Vec<Expr> },
    /// The sums over K that a 2-d matmul operand with a bias-gradient epilogue computed
    /// beside its product (`[M]` for `bias_grad_a`, `[N]` for `bias_grad_b`, the matmul's
    /// dtype), written by the same library call ([Note: bias-gradient epilogues] in
    /// braze-passes). Typed explicitly, as `extern_out` is.
    BiasGrad,
    /// The operand's value; when stored, its buffer is laid out with `strides` (a dense
    /// permutation: eager's strides for this value, e.g. channels_last), and a kernel that
    /// stores it iterates in that memory order.
    Layout { strides: Vec<Expr> },
}

impl Op {
    /// The op's text name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Scalar { .. } => "scalar",
            Op::Iota { .. } => "iota",
            Op::Random { .. } => "rand",
            Op::Size { .. } => "size",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Where => "where",
            Op::Cast(_) => "cast",
            Op::Reduce { kind, .. } => kind.name(),
            Op::Permute(_) => "permute",
            Op::Expand(_) => "expand",
            Op::Reshape(_) => "reshape",
            Op::Slice { .. } => "slice",
            Op::Select { .. } => "select",
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
            Op::Cat { .. } => "cat",
            Op::Pad { .. } => "pad",
            Op::Matmul { .. } => "matmul",
            Op::Conv { .. } => "conv",
            Op::Extern { .. } => "extern",
            Op::ExternOut { .. } => "extern_out",
            Op::BiasGrad => "bias_grad",
            Op::Layout { .. } => "layout",
        }
    }

    /// Views change only how elements are indexed, never their values.
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Permute(_) | Op::Expand(_) | Op::Reshape(_) | Op::Slice { .. } | Op::Select { .. })
    }

    /// Ops whose result is one value per output element computed from operand elements
    /// (including computed loads: index_select, gather, cat, pad).
    pub fn is_pointwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Random { .. }
                | Op::Where
                | Op::Cast(_)
                | Op::Layout { .. }
                | Op::IndexSelect { .. }
                | Op::Gather { .. }
                | Op::Cat { .. }
                | Op::Pad { .. }
        )
    }

    /// Nodes whose values already live in memory (graph inputs, extern results, a matmul's
    /// bias gradient).
    pub fn is_buffer(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::ExternOut { .. } | Op::BiasGrad)
    }

    /// Expected number of operands, `None` when variadic.
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. } | Op::Scalar { .. } | Op::Iota { .. } | Op::Size { .. } => 0,
            Op::Unary(_) | Op::Cast(_) | Op::Reduce { .. } | Op::Pad { .. } | Op::ExternOut { .. } | Op::Layout { .. } | Op::BiasGrad => 1,
            Op::Random { .. } => 1,
            Op::Permute(_) | Op::Expand(_) | Op::Reshape(_) | Op::Slice { .. } | Op::Select { .. } => 1,
            Op::Binary(_) | Op::IndexSelect { .. } | Op::Gather { .. } | Op::Conv { .. } => 2,
            Op::Where => 3,
            Op::Cat { .. } | Op::Extern { .. } | Op::Matmul { .. } => return None,
        })
    }
}
