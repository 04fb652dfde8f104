//! Statements of the loop IR as C expressions, shared by every dialect.

use crate::dialect::{compute_type, Dialect};
use crate::CodegenError;
use braze_ir::{Atom, BinaryOp, DType, Expr, Lit, RandomDist, ReduceKind, UnaryOp};
use braze_sched::loop_ir::{stmt_reads, Kernel, Reduction, Stmt};

/// Index expressions in C, computed in `bz_ix`: a kernel's loop variables are of that type,
/// and a temporary (a gathered index, 32-bit where its dim fits) is converted to it, so
/// `64*t1` does not multiply in 32 bits in a kernel whose addresses pass 2^31 ([Note: 32-bit
/// indices] in braze-sched; each target declares `bz_ix`).
pub fn index(e: &Expr) -> String {
    e.render(&|a| match a {
        Atom::Sym(n) => format!("s{n}"),
        Atom::Var(n) => format!("i{n}"),
        Atom::Tmp(n) => format!("((bz_ix)t{n})"),
        _ => unreachable!(),
    })
}

pub fn lit(v: Lit, dt: DType) -> String {
    match dt {
        DType::Bool => (if v.as_f64() != 0.0 { "true" } else { "false" }).into(),
        d if d.is_float() => {
            let x = v.as_f64();
            let s = if x.is_nan() {
                "NAN".to_string()
            } else if x.is_infinite() {
                (if x > 0.0 { "INFINITY" } else { "(-INFINITY)" }).to_string()
            } else {
                let s = format!("{x:?}");
                if s.contains(['.', 'e']) {
                    s
                } else {
                    format!("{s}.0")
                }
            };
            if d == DType::F64 || x.is_nan() || x.is_infinite() {
                format!("(({})({s}))", compute_type(d))
            } else {
                format!("{s}f")
            }
        }
        d => {
            let i = match v {
                Lit::I(i) => i,
                Lit::B(b) => b as i64,
                Lit::F(f) => f as i64,
            };
            if i == i64::MIN {
                format!("(({})INT64_MIN)", compute_type(d))
            } else {
                format!("(({}){i}LL)", compute_type(d))
            }
        }
    }
}

pub struct Emitter<'a> {
    pub k: &'a Kernel,
    pub d: &'a dyn Dialect,
}

impl Emitter<'_> {
    pub(crate) fn dt(&self, t: u32) -> DType {
        self.k.tmp_dtypes[t as usize]
    }
    pub(crate) fn buf_dtype(&self, id: u32) -> DType {
        self.k.bufs.iter().find(|b| b.id == id).map(|b| b.dtype).expect("buffer of kernel")
    }

    fn load(&self, buf: u32, idx: &Expr) -> String {
        self.from_storage(buf, &format!("b{buf}[{}]", index(idx)))
    }

    /// A value read from buffer `buf`'s storage (`raw`), as the compute type.
    pub fn from_storage(&self, buf: u32, raw: &str) -> String {
        match self.buf_dtype(buf) {
            DType::F16 => format!("bz_h2f({raw})"),
            DType::BF16 => format!("bz_bf2f({raw})"),
            _ => raw.to_string(),
        }
    }

    /// Temporary `value` converted to buffer `buf`'s storage type.
    pub fn to_storage(&self, buf: u32, value: u32) -> String {
        let v = format!("t{value}");
        match self.buf_dtype(buf) {
            DType::F16 => format!("bz_f2h({v})"),
            DType::BF16 => format!("bz_f2bf({v})"),
            to => cast(&v, self.dt(value), to),
        }
    }

    /// One statement as a line of C.
    pub fn stmt(&self, s: &Stmt) -> Result<String, CodegenError> {
        let decl = |t: u32, rhs: String| format!("{} t{t} = {rhs};", compute_type(self.dt(t)));
        Ok(match s {
            Stmt::Load { dst, buf, index: i, mask: None } => decl(*dst, self.load(*buf, i)),
            Stmt::Load { dst, buf, index: i, mask: Some(m) } => {
                // Branch-free: a masked-off lane reads element 0 and discards it.
                let safe = Expr::tmp(*m).mul(i);
                let ct = compute_type(self.dt(*dst));
                decl(*dst, sel(&format!("t{m}"), &self.load(*buf, &safe), &format!("({ct})0"), self.dt(*dst)))
            }
            Stmt::Const { dst, value } => decl(*dst, lit(*value, self.dt(*dst))),
            Stmt::Index { dst, index: i } => decl(*dst, format!("({})({})", compute_type(self.dt(*dst)), index(i))),
            Stmt::Random { dst, dist, seed, index: i, stream } => {
                let (seed, at) = (format!("(uint64_t)t{seed}"), format!("(uint64_t)({})", index(i)));
                let call = match (dist, self.dt(*dst)) {
                    (RandomDist::Uniform, DType::F64) => format!("bz_uniform_f64({seed}, {at}, {stream}u)"),
                    (RandomDist::Uniform, dt) => {
                        let bits = match dt {
                            DType::F16 => 11,
                            DType::BF16 => 8,
                            _ => 24,
                        };
                        format!("bz_uniform_bits({seed}, {at}, {stream}u, {bits})")
                    }
                    (RandomDist::Normal, DType::F64) => format!("bz_normal_f64({seed}, {at}, {stream}u)"),
                    (RandomDist::Normal, _) => format!("bz_normal_f32({seed}, {at}, {stream}u)"),
                };
                decl(*dst, call)
            }
            Stmt::InRange { dst, index: i, lo, hi } => {
                let v = index(i);
                decl(*dst, format!("({} <= ({v})) & (({v}) < {})", index(lo), index(hi)))
            }
            Stmt::Unary { dst, op, a } => decl(*dst, self.unary(*op, format!("t{a}"), self.dt(*a))?),
            Stmt::Binary { dst, op, a, b } => decl(*dst, self.binary(*op, format!("t{a}"), format!("t{b}"), self.dt(*a))?),
            Stmt::Where { dst, c, a, b } => decl(*dst, sel(&format!("t{c}"), &format!("t{a}"), &format!("t{b}"), self.dt(*dst))),
            Stmt::Cast { dst, a } => decl(*dst, cast(&format!("t{a}"), self.dt(*a), self.dt(*dst))),
            Stmt::Bounded { dst, a, hi } => decl(*dst, format!("bz_bounded(t{a}, {})", index(hi))),
            Stmt::Store { buf, index: i, value } => {
                let v = format!("t{value}");
                let from = self.dt(*value);
                let rhs = match self.buf_dtype(*buf) {
                    DType::F16 => format!("bz_f2h({v})"),
                    DType::BF16 => format!("bz_f2bf({v})"),
                    to => cast(&v, from, to),
                };
                format!("b{buf}[{}] = {rhs};", index(i))
            }
        })
    }

    fn unary(&self, op: UnaryOp, a: String, dt: DType) -> Result<String, CodegenError> {
        use UnaryOp::*;
        let ct = compute_type(dt);
        if dt.is_float() {
            let m = |f: &str| format!("{}({a})", self.d.math(f, dt));
            return Ok(match op {
                Neg => format!("-{a}"),
                Abs => m("fabs"),
                Exp | Exp2 | Expm1 | Log | Log2 | Log10 | Log1p | Sqrt | Sin | Cos | Tan | Asin | Acos | Atan | Sinh | Cosh | Tanh | Asinh | Acosh | Atanh | Erf | Erfc | Floor | Ceil | Trunc | Lgamma => m(op.name()),
                Round => m("nearbyint"),
                Rsqrt => format!("({ct})1 / {}", m("sqrt")),
                Reciprocal => format!("({ct})1 / {a}"),
                Sigmoid => format!("({ct})1 / (({ct})1 + {}({}))", self.d.math("exp", dt), format_args!("-{a}")),
                Relu => sel(&format!("{a} < 0"), &format!("({ct})0"), &a, dt),
                Sign => sel(&format!("{a} != {a}"), &a, &format!("({ct})(({a} > 0) - ({a} < 0))"), dt),
                Not => format!("{a} == 0"),
                IsNan => format!("{a} != {a}"),
                IsInf => format!("bz_isinf({a})"),
                BitwiseNot | F64FromBits => return Err(CodegenError::Unsupported(format!("{} on {dt}", op.name()))),
            });
        }
        Ok(match op {
            Neg => format!("({ct})-{a}"),
            Abs => sel(&format!("{a} < 0"), &format!("({ct})-{a}"), &a, dt),
            Relu => sel(&format!("{a} < 0"), &format!("({ct})0"), &a, dt),
            Sign => format!("({ct})(({a} > 0) - ({a} < 0))"),
            Not => format!("!{a}"),
            BitwiseNot if dt == DType::Bool => format!("!{a}"),
            BitwiseNot => format!("({ct})~{a}"),
            IsNan | IsInf => "false".into(),
            F64FromBits if dt == DType::I64 => format!("bz_f64_from_bits({a})"),
            _ => return Err(CodegenError::Unsupported(format!("{} on {dt}", op.name()))),
        })
    }

    fn binary(&self, op: BinaryOp, a: String, b: String, dt: DType) -> Result<String, CodegenError> {
        use BinaryOp::*;
        let ct = compute_type(dt);
        let cmp = |o: &str| format!("{a} {o} {b}");
        let common = match op {
            Eq => Some(cmp("==")),
            Ne => Some(cmp("!=")),
            Lt => Some(cmp("<")),
            Le => Some(cmp("<=")),
            Gt => Some(cmp(">")),
            Ge => Some(cmp(">=")),
            And => Some(format!("({a} != 0) & ({b} != 0)")),
            Or => Some(format!("({a} != 0) | ({b} != 0)")),
            Xor => Some(format!("({a} != 0) != ({b} != 0)")),
            _ => None,
        };
        if let Some(c) = common {
            return Ok(c);
        }
        if dt.is_float() {
            let m = |f: &str| format!("{}({a}, {b})", self.d.math(f, dt));
            return Ok(match op {
                Add => cmp("+"),
                Sub => cmp("-"),
                Mul => cmp("*"),
                Div => cmp("/"),
                FloorDiv => format!("{}({a} / {b})", self.d.math("floor", dt)),
                Rem => format!("bz_rem_{ct}({a}, {b})"),
                Fmod => m("fmod"),
                Pow => m("pow"),
                Max => sel(&format!("({a} != {a}) | ({a} > {b})"), &a, &b, dt),
                Min => sel(&format!("({a} != {a}) | ({a} < {b})"), &a, &b, dt),
                Atan2 => m("atan2"),
                Hypot => m("hypot"),
                Copysign => m("copysign"),
                _ => return Err(CodegenError::Unsupported(format!("{} on {dt}", op.name()))),
            });
        }
        Ok(match op {
            // bool + bool is logical or, bool * bool logical and (torch semantics).
            Add if dt == DType::Bool => format!("{a} | {b}"),
            Mul if dt == DType::Bool => format!("{a} & {b}"),
            Sub if dt == DType::Bool => return Err(CodegenError::Unsupported("sub on bool".into())),
            Add => format!("({ct})({a} + {b})"),
            Sub => format!("({ct})({a} - {b})"),
            Mul => format!("({ct})({a} * {b})"),
            // [Note: 32-bit integer division] Integers of 32 bits or fewer divide in 32 bits:
            // a GPU's 64-bit division is a long instruction sequence (max-pool window offsets
            // turned into ATen's indices spent most of their kernel there). The helpers, both
            // widths from one definition, are `integer_division_helpers!` in dialect.rs.
            FloorDiv if narrow_int(dt) => format!("({ct})bz_floordiv_i32({a}, {b})"),
            Rem if narrow_int(dt) => format!("({ct})bz_rem_i32({a}, {b})"),
            FloorDiv if dt != DType::Bool => format!("({ct})bz_floordiv_i64({a}, {b})"),
            Rem if dt != DType::Bool => format!("({ct})bz_rem_i64({a}, {b})"),
            // fmod by -1 is 0 without dividing: the type's minimum % -1 traps on x86.
            Fmod if dt != DType::Bool => format!("({ct})({b} == 0 || {b} == -1 ? 0 : {a} % {b})"),
            Pow if dt != DType::Bool => format!("({ct})bz_pow_i64({a}, {b})"),
            Max => sel(&format!("{a} > {b}"), &a, &b, dt),
            Min => sel(&format!("{a} < {b}"), &a, &b, dt),
            BitAnd => format!("({ct})({a} & {b})"),
            BitOr => format!("({ct})({a} | {b})"),
            BitXor => format!("({ct})({a} ^ {b})"),
            Shl if dt != DType::Bool => format!("({ct})({a} << {b})"),
            Shr if dt != DType::Bool => format!("({ct})({a} >> {b})"),
            _ => return Err(CodegenError::Unsupported(format!("{} on {dt}", op.name()))),
        })
    }

    /// Declarations of a reduction's accumulator before the inner loop.
    pub fn red_init(&self, r: &Reduction) -> Vec<String> {
        let sdt = self.dt(r.src);
        let st = compute_type(sdt);
        let acc = acc_type(r.kind, sdt);
        let n = r.dst;
        match r.kind {
            ReduceKind::Sum => vec![format!("{acc} a{n} = 0;")],
            ReduceKind::Prod => vec![format!("{acc} a{n} = 1;")],
            ReduceKind::Max | ReduceKind::Min | ReduceKind::ArgMax | ReduceKind::ArgMin => {
                let is_max = matches!(r.kind, ReduceKind::Max | ReduceKind::ArgMax);
                let init = if sdt.is_float() {
                    if is_max { "(-INFINITY)" } else { "INFINITY" }.to_string()
                } else if sdt == DType::Bool {
                    (if is_max { "false" } else { "true" }).to_string()
                } else {
                    format!("bz_{}_{st}", if is_max { "min" } else { "max" })
                };
                let mut v = vec![format!("{st} a{n} = {init};")];
                if matches!(r.kind, ReduceKind::ArgMax | ReduceKind::ArgMin) {
                    v.push(format!("int64_t ai{n} = 0;"));
                }
                v
            }
            ReduceKind::Any => vec![format!("bool a{n} = false;")],
            ReduceKind::All => vec![format!("bool a{n} = true;")],
            ReduceKind::Var => vec![format!("{} wm{n} = 0, wq{n} = 0; bz_count_t wn{n} = 0;", self.d.variance_type(sdt))],
        }
    }

    /// The variables holding a reduction's state (C type, name), as `red_init` declares them.
    pub fn red_state(&self, r: &Reduction) -> Vec<(&'static str, String)> {
        let sdt = self.dt(r.src);
        let st = compute_type(sdt);
        let n = r.dst;
        match r.kind {
            ReduceKind::Sum | ReduceKind::Prod => vec![(acc_type(r.kind, sdt), format!("a{n}"))],
            ReduceKind::Max | ReduceKind::Min => vec![(st, format!("a{n}"))],
            ReduceKind::ArgMax | ReduceKind::ArgMin => vec![(st, format!("a{n}")), ("int64_t", format!("ai{n}"))],
            ReduceKind::Any | ReduceKind::All => vec![("bool", format!("a{n}"))],
            ReduceKind::Var => {
                let vt = self.d.variance_type(sdt);
                vec![(vt, format!("wm{n}")), (vt, format!("wq{n}")), ("bz_count_t", format!("wn{n}"))]
            }
        }
    }

    /// The accumulator update inside the inner loop.
    pub fn red_update(&self, r: &Reduction) -> String {
        let (n, s) = (r.dst, format!("t{}", r.src));
        let fl = self.dt(r.src).is_float();
        let nan_first = |cmp: &str| if fl { format!("({s} != {s} && a{n} == a{n}) || {s} {cmp} a{n}") } else { format!("{s} {cmp} a{n}") };
        match r.kind {
            ReduceKind::Sum => format!("a{n} += {s};"),
            ReduceKind::Prod => format!("a{n} *= {s};"),
            ReduceKind::Max => format!("a{n} = {};", sel(&if fl { format!("({s} != {s}) | ({s} > a{n})") } else { format!("{s} > a{n}") }, &s, &format!("a{n}"), self.dt(r.src))),
            ReduceKind::Min => format!("a{n} = {};", sel(&if fl { format!("({s} != {s}) | ({s} < a{n})") } else { format!("{s} < a{n}") }, &s, &format!("a{n}"), self.dt(r.src))),
            ReduceKind::ArgMax => format!("if ({}) {{ a{n} = {s}; ai{n} = {}; }}", nan_first(">"), index(&r.inner_index)),
            ReduceKind::ArgMin => format!("if ({}) {{ a{n} = {s}; ai{n} = {}; }}", nan_first("<"), index(&r.inner_index)),
            ReduceKind::Any => format!("a{n} |= ({s} != 0);"),
            ReduceKind::All => format!("a{n} &= ({s} != 0);"),
            ReduceKind::Var => {
                let ct = self.d.variance_type(self.dt(r.src));
                let div = if ct == "double" { "bz_wdivd" } else { "bz_wdiv" };
                format!("{{ wn{n} += 1; {ct} d = {s} - wm{n}; wm{n} += {div}(d, ({ct})wn{n}); wq{n} += d * ({s} - wm{n}); }}")
            }
        }
    }

    /// A reduction's update in a vector step of `v` lanes (a CUDA row kernel's wide loads):
    /// lines before the lanes, the line ending each lane, lines after the lanes. A variance
    /// folds the step's `v` elements into its Welford state at once, their mean and squared
    /// deviations merged as Chan et al. do: one division per step, not one per element.
    pub fn red_vector(&self, r: &Reduction, v: i64) -> (Vec<String>, String, Vec<String>) {
        if r.kind != ReduceKind::Var {
            return (Vec::new(), self.red_update(r), Vec::new());
        }
        let (n, s) = (r.dst, format!("t{}", r.src));
        let ct = self.d.variance_type(self.dt(r.src));
        let div = if ct == "double" { "bz_wdivd" } else { "bz_wdiv" };
        (
            vec![format!("{ct} vs{n} = 0, vx{n}[{v}];")],
            format!("vx{n}[j] = {s}; vs{n} += {s};"),
            vec![
                format!("{{ const {ct} m = vs{n} * ({ct})(1.0 / {v}); {ct} q = 0;"),
                "  #pragma unroll".to_string(),
                format!("  for (int j = 0; j < {v}; j++) {{ const {ct} d = vx{n}[j] - m; q += d * d; }}"),
                format!("  const bz_count_t nn = wn{n} + {v}; const {ct} d = m - wm{n}, f = {div}(({ct}){v}, ({ct})nn);"),
                format!("  wm{n} += d * f; wq{n} += q + d * d * ({ct})wn{n} * f; wn{n} = nn; }}"),
            ],
        )
    }

    /// The accumulator update in a loop over lanes ([`crate::openmp`]'s blocked reductions):
    /// as [`Self::red_update`], with argmax/argmin branch-free so the loop vectorizes.
    pub fn red_update_lane(&self, r: &Reduction) -> String {
        let (n, s) = (r.dst, format!("t{}", r.src));
        let sdt = self.dt(r.src);
        let cond = |cmp: &str| if sdt.is_float() { format!("(({s} != {s}) & (a{n} == a{n})) | ({s} {cmp} a{n})") } else { format!("{s} {cmp} a{n}") };
        match r.kind {
            ReduceKind::ArgMax | ReduceKind::ArgMin => {
                let c = cond(if r.kind == ReduceKind::ArgMax { ">" } else { "<" });
                format!("{{ const int c = {c}; a{n} = {}; ai{n} = bz_seli(c, {}, ai{n}); }}", sel("c", &s, &format!("a{n}"), sdt), index(&r.inner_index))
            }
            _ => self.red_update(r),
        }
    }

    /// Folds one lane's partial state (the variables of [`Self::red_state`], each read as
    /// `lane(name)`) into the reduction's state: partial results of disjoint pieces of the
    /// row, every element of a lane after those of lower lanes at the same step. Max/min keep
    /// NaN, argmax/argmin the first index of the extreme (or of the first NaN), variance
    /// merges Welford states (Chan et al.).
    pub fn red_combine(&self, r: &Reduction, lane: &dyn Fn(&str) -> String) -> String {
        let n = r.dst;
        let sdt = self.dt(r.src);
        let ct = compute_type(sdt);
        let a = lane(&format!("a{n}"));
        match r.kind {
            ReduceKind::Sum => format!("a{n} += {a};"),
            ReduceKind::Prod => format!("a{n} *= {a};"),
            ReduceKind::Any => format!("a{n} |= {a};"),
            ReduceKind::All => format!("a{n} &= {a};"),
            ReduceKind::Max | ReduceKind::Min => {
                let cmp = if r.kind == ReduceKind::Max { ">" } else { "<" };
                let c = if sdt.is_float() { format!("(v != v) | (v {cmp} a{n})") } else { format!("v {cmp} a{n}") };
                format!("{{ const {ct} v = {a}; a{n} = {}; }}", sel(&c, "v", &format!("a{n}"), sdt))
            }
            ReduceKind::ArgMax | ReduceKind::ArgMin => {
                let cmp = if r.kind == ReduceKind::ArgMax { ">" } else { "<" };
                let ai = lane(&format!("ai{n}"));
                let c = if sdt.is_float() {
                    format!("(v != v && (a{n} == a{n} || vi < ai{n})) || v {cmp} a{n} || (v == a{n} && vi < ai{n})")
                } else {
                    format!("v {cmp} a{n} || (v == a{n} && vi < ai{n})")
                };
                format!("{{ const {ct} v = {a}; const int64_t vi = {ai}; if ({c}) {{ a{n} = v; ai{n} = vi; }} }}")
            }
            ReduceKind::Var => {
                let ct = self.d.variance_type(sdt);
                let (m, q, c) = (lane(&format!("wm{n}")), lane(&format!("wq{n}")), lane(&format!("wn{n}")));
                format!(
                    "{{ const int64_t nb = {c}; if (nb > 0) {{ const int64_t nn = wn{n} + nb; const {ct} d = {m} - wm{n}; const {ct} f = ({ct})nb / ({ct})nn; \
                     wm{n} += d * f; wq{n} += {q} + d * d * ({ct})wn{n} * f; wn{n} = nn; }} }}"
                )
            }
        }
    }

    /// The result temporary after the inner loop.
    pub fn red_final(&self, r: &Reduction) -> String {
        let n = r.dst;
        let ct = compute_type(self.dt(n));
        match r.kind {
            ReduceKind::ArgMax | ReduceKind::ArgMin => format!("{ct} t{n} = ai{n};"),
            // Divided by max(count - correction, 0), as eager: inf (or NaN), not a negative
            // variance, when the correction reaches the count.
            ReduceKind::Var if r.correction == 0 => format!("{ct} t{n} = ({ct})(wq{n} / ({}) wn{n});", self.d.variance_type(self.dt(r.src))),
            ReduceKind::Var => {
                let c = r.correction;
                format!("{ct} t{n} = ({ct})(wq{n} / ({}) (wn{n} > {c} ? wn{n} - {c} : 0));", self.d.variance_type(self.dt(r.src)))
            }
            _ => format!("{ct} t{n} = ({ct})a{n};"),
        }
    }

    /// The `reduction(...)` clause for a vectorized inner loop, or `None` when some
    /// accumulator of the pass cannot be vectorized that way.
    ///
    /// [Note: simd max] A max or min (not of bools) is an OpenMP `max`/`min` reduction
    /// whose update is `a = s > a ? s : a` (GCC's MAX_EXPR: one vector max per vector of
    /// elements, accumulators in registers); a float one also ORs `s != s` into a flag,
    /// and the result is NaN when the flag is set, as eager's max is when any element is.
    /// Through [Note: lanes]' per-lane arrays instead, GCC kept the accumulators in memory:
    /// a row max of 4096 x 1024 f32 took 0.76 ms on one core of the build machine, the same
    /// as a sum written that way, against 0.20 ms for this form (an `omp simd` sum: 0.22).
    pub fn simd_clause(&self, reds: &[Reduction]) -> Option<String> {
        let mut plus = Vec::new();
        let mut times = Vec::new();
        let mut max = Vec::new();
        let mut min = Vec::new();
        let mut nan = Vec::new();
        for r in reds {
            let sdt = self.dt(r.src);
            match r.kind {
                ReduceKind::Sum => plus.push(format!("a{}", r.dst)),
                ReduceKind::Prod => times.push(format!("a{}", r.dst)),
                ReduceKind::Max | ReduceKind::Min if sdt != DType::Bool => {
                    if r.kind == ReduceKind::Max { &mut max } else { &mut min }.push(format!("a{}", r.dst));
                    if sdt.is_float() {
                        nan.push(format!("an{}", r.dst));
                    }
                }
                _ => return None,
            }
        }
        let mut c = String::new();
        for (op, names) in [("+", plus), ("*", times), ("max", max), ("min", min), ("|", nan)] {
            if !names.is_empty() {
                c.push_str(&format!(" reduction({op}:{})", names.join(",")));
            }
        }
        Some(c)
    }

    /// Declarations before a loop vectorized with [`Self::simd_clause`]: [`Self::red_init`]'s,
    /// and a float max's or min's NaN flag ([Note: simd max]).
    pub fn simd_red_init(&self, r: &Reduction) -> Vec<String> {
        let mut v = self.red_init(r);
        if self.simd_nan_flag(r) {
            v.push(format!("int an{} = 0;", r.dst));
        }
        v
    }

    /// The update inside a loop vectorized with [`Self::simd_clause`].
    pub fn simd_red_update(&self, r: &Reduction) -> String {
        let (n, s) = (r.dst, format!("t{}", r.src));
        let cmp = match r.kind {
            ReduceKind::Max => ">",
            ReduceKind::Min => "<",
            _ => return self.red_update(r),
        };
        let flag = if self.simd_nan_flag(r) { format!("an{n} |= ({s} != {s}); ") } else { String::new() };
        format!("{flag}a{n} = ({s} {cmp} a{n}) ? {s} : a{n};")
    }

    /// The result after a loop vectorized with [`Self::simd_clause`].
    pub fn simd_red_final(&self, r: &Reduction) -> String {
        let n = r.dst;
        if self.simd_nan_flag(r) {
            format!("if (an{n}) a{n} = NAN; {}", self.red_final(r))
        } else {
            self.red_final(r)
        }
    }

    fn simd_nan_flag(&self, r: &Reduction) -> bool {
        matches!(r.kind, ReduceKind::Max | ReduceKind::Min) && self.dt(r.src).is_float()
    }
}

/// An integer type of 32 bits or fewer ([Note: 32-bit integer division]).
fn narrow_int(dt: DType) -> bool {
    matches!(dt, DType::I32 | DType::I16 | DType::I8 | DType::U8)
}

/// `c ? a : b` without a branch. GCC 12 does not if-convert loops that call (vector) math
/// functions, so a `?:` there would stop vectorization of the whole loop.
pub fn sel(c: &str, a: &str, b: &str, dt: DType) -> String {
    match dt {
        DType::F64 => format!("bz_seld({c}, {a}, {b})"),
        d if d.is_float() => format!("bz_self({c}, {a}, {b})"),
        DType::Bool => format!("(bool)bz_seli({c}, {a}, {b})"),
        d => format!("({})bz_seli({c}, {a}, {b})", compute_type(d)),
    }
}

fn acc_type(kind: ReduceKind, src: DType) -> &'static str {
    match kind {
        ReduceKind::Sum | ReduceKind::Prod if !src.is_float() => "int64_t",
        _ => compute_type(src),
    }
}

/// Converts a computed value to another dtype (C semantics; bool is `!= 0`; half types round).
pub fn cast(v: &str, from: DType, to: DType) -> String {
    if from == to {
        return v.to_string();
    }
    match to {
        DType::Bool => format!("({v} != 0)"),
        DType::F16 => format!("bz_round_h((float){v})"),
        DType::BF16 => format!("bz_round_bf((float){v})"),
        _ => format!("({}){v}", compute_type(to)),
    }
}

/// The loop variables (bit `n` for `in`) an index expression depends on, through the
/// temporaries it reads (`deps`).
pub(crate) fn expr_deps(e: &Expr, deps: &std::collections::HashMap<u32, u64>) -> u64 {
    e.atoms().fold(0, |m, a| m | atom_deps(a, deps))
}

fn atom_deps(a: &braze_ir::Atom, deps: &std::collections::HashMap<u32, u64>) -> u64 {
    use braze_ir::Atom;
    match a {
        Atom::Var(n) => 1u64.checked_shl(*n).unwrap_or(u64::MAX),
        Atom::Tmp(t) => deps.get(t).copied().unwrap_or(u64::MAX),
        Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => expr_deps(x, deps) | expr_deps(y, deps),
        Atom::Sym(_) => 0,
    }
}

/// The loop variables each temporary of `body` depends on (bit `n` for `in`).
pub(crate) fn tmp_deps(body: &[Stmt]) -> std::collections::HashMap<u32, u64> {
    let mut deps = std::collections::HashMap::new();
    for s in body {
        let d = match s {
            Stmt::Load { index, mask, .. } => expr_deps(index, &deps) | mask.map_or(0, |m| deps.get(&m).copied().unwrap_or(u64::MAX)),
            Stmt::Index { index, .. } => expr_deps(index, &deps),
            Stmt::Random { seed, index, .. } => expr_deps(index, &deps) | deps.get(seed).copied().unwrap_or(u64::MAX),
            Stmt::InRange { index, lo, hi, .. } => expr_deps(index, &deps) | expr_deps(lo, &deps) | expr_deps(hi, &deps),
            Stmt::Bounded { a, hi, .. } => deps.get(a).copied().unwrap_or(u64::MAX) | expr_deps(hi, &deps),
            s => stmt_reads(s).iter().fold(0, |m, t| m | deps.get(t).copied().unwrap_or(u64::MAX)),
        };
        if let Some(t) = s.dst() {
            deps.insert(t, d);
        }
    }
    deps
}
