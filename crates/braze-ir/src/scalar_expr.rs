//! Scalar expressions over size symbols, as PyTorch prints them (sympy's `str`): the values of
//! SymInt, SymFloat and SymBool nodes, the arguments of extern calls that depend on sizes, and
//! the conditions of runtime asserts. Parsed once when a graph is compiled, evaluated at every
//! call from the symbol values of that call; nothing goes through Python's `eval`.
//!
//! Size expressions inside the IR are [`crate::sym::Expr`] polynomials; this module is the
//! host-side evaluator for everything else a shape expression may contain: `Max`, `Min`,
//! `CeilToInt`, `FloorToInt`, `PythonMod`, `IntTrueDiv`, relations, `Piecewise`, ...

use std::fmt;

/// A value: PyTorch's SymInt, SymFloat or SymBool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Value {
    fn f(self) -> f64 {
        match self {
            Value::Int(i) => i as f64,
            Value::Float(x) => x,
            Value::Bool(b) => f64::from(u8::from(b)),
        }
    }
    fn i(self) -> Result<i64, String> {
        match self {
            Value::Int(i) => Ok(i),
            Value::Bool(b) => Ok(i64::from(b)),
            Value::Float(x) => Err(format!("integer expected, got {x}")),
        }
    }
    fn b(self) -> bool {
        match self {
            Value::Bool(b) => b,
            Value::Int(i) => i != 0,
            Value::Float(x) => x != 0.0,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x:?}"),
            Value::Bool(b) => write!(f, "{}", if *b { "True" } else { "False" }),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bin {
    Add,
    Sub,
    Mul,
    TrueDiv,
    FloorDiv,
    Mod,
    Pow,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
}

/// A parsed scalar expression.
#[derive(Clone, Debug, PartialEq)]
pub enum ScalarExpr {
    Const(Value),
    /// Size symbol `sN`.
    Sym(u32),
    Neg(Box<ScalarExpr>),
    Not(Box<ScalarExpr>),
    Bin(Bin, Box<ScalarExpr>, Box<ScalarExpr>),
    Call(Func, Vec<ScalarExpr>),
    /// `Piecewise((v0, c0), (v1, c1), ...)`: the first value whose condition holds.
    Piecewise(Vec<(ScalarExpr, ScalarExpr)>),
}

/// The functions PyTorch's shape expressions use (torch/utils/_sympy/functions.py).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Func {
    Max,
    Min,
    FloorDiv,
    CeilDiv,
    PythonMod,
    Mod,
    IntTrueDiv,
    FloatTrueDiv,
    TruncToInt,
    FloorToInt,
    CeilToInt,
    RoundToInt,
    TruncToFloat,
    ToFloat,
    Abs,
    Floor,
    Ceiling,
    PowByNatural,
    FloatPow,
    Sqrt,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
    Not,
}

impl Func {
    fn from_name(s: &str) -> Option<Func> {
        Some(match s {
            "Max" => Func::Max,
            "Min" => Func::Min,
            "FloorDiv" => Func::FloorDiv,
            "CeilDiv" => Func::CeilDiv,
            "CleanDiv" => Func::FloorDiv,
            "PythonMod" => Func::PythonMod,
            "Mod" => Func::Mod,
            "IntTrueDiv" => Func::IntTrueDiv,
            "FloatTrueDiv" => Func::FloatTrueDiv,
            "TruncToInt" => Func::TruncToInt,
            "FloorToInt" => Func::FloorToInt,
            "CeilToInt" => Func::CeilToInt,
            "RoundToInt" => Func::RoundToInt,
            "TruncToFloat" => Func::TruncToFloat,
            "ToFloat" => Func::ToFloat,
            "Abs" => Func::Abs,
            "floor" => Func::Floor,
            "ceiling" => Func::Ceiling,
            "PowByNatural" => Func::PowByNatural,
            "FloatPow" => Func::FloatPow,
            "sqrt" | "OpaqueUnaryFn_sqrt" => Func::Sqrt,
            "Eq" => Func::Eq,
            "Ne" => Func::Ne,
            "Lt" | "StrictLessThan" => Func::Lt,
            "Le" | "LessThan" => Func::Le,
            "Gt" | "StrictGreaterThan" => Func::Gt,
            "Ge" | "GreaterThan" => Func::Ge,
            "And" => Func::And,
            "Or" => Func::Or,
            "Not" => Func::Not,
            _ => return None,
        })
    }
}

impl ScalarExpr {
    /// Parses sympy's printed form (`Max(1, s0)`, `2*s0 + 1`, `Eq(s1, 4)`, `(s0 >= 2) & (s1 < 8)`).
    pub fn parse(s: &str) -> Result<ScalarExpr, String> {
        let toks = lex(s)?;
        let mut p = Parser { t: toks, i: 0, src: s };
        let e = p.or()?;
        if p.i != p.t.len() {
            return Err(format!("unexpected `{}` in expression `{s}`", p.t[p.i]));
        }
        Ok(e)
    }

    /// The symbols the expression reads.
    pub fn syms(&self, out: &mut Vec<u32>) {
        match self {
            ScalarExpr::Const(_) => {}
            ScalarExpr::Sym(n) => out.push(*n),
            ScalarExpr::Neg(a) | ScalarExpr::Not(a) => a.syms(out),
            ScalarExpr::Bin(_, a, b) => {
                a.syms(out);
                b.syms(out);
            }
            ScalarExpr::Call(_, xs) => xs.iter().for_each(|x| x.syms(out)),
            ScalarExpr::Piecewise(ps) => ps.iter().for_each(|(v, c)| {
                v.syms(out);
                c.syms(out);
            }),
        }
    }

    /// The value for the symbol values `syms` (`syms[n]` is `sN`).
    pub fn eval(&self, syms: &[i64]) -> Result<Value, String> {
        Ok(match self {
            ScalarExpr::Const(v) => *v,
            ScalarExpr::Sym(n) => Value::Int(*syms.get(*n as usize).ok_or_else(|| format!("no value for s{n}"))?),
            ScalarExpr::Neg(a) => match a.eval(syms)? {
                Value::Float(x) => Value::Float(-x),
                v => Value::Int(-v.i()?),
            },
            ScalarExpr::Not(a) => Value::Bool(!a.eval(syms)?.b()),
            ScalarExpr::Bin(op, a, b) => {
                let (a, b) = (a.eval(syms)?, b.eval(syms)?);
                binary(*op, a, b)?
            }
            ScalarExpr::Call(f, xs) => {
                let vs = xs.iter().map(|x| x.eval(syms)).collect::<Result<Vec<_>, _>>()?;
                call(*f, &vs)?
            }
            ScalarExpr::Piecewise(ps) => {
                for (v, c) in ps {
                    if c.eval(syms)?.b() {
                        return v.eval(syms);
                    }
                }
                return Err("no branch of a Piecewise holds".into());
            }
        })
    }
}

fn floordiv(a: i64, b: i64) -> Result<i64, String> {
    if b == 0 {
        return Err("integer division by zero in a size expression".into());
    }
    Ok(a.div_euclid(b) - if b < 0 && a.rem_euclid(b) != 0 { 1 } else { 0 })
}

fn pymod(a: i64, b: i64) -> Result<i64, String> {
    Ok(a - b * floordiv(a, b)?)
}

fn binary(op: Bin, a: Value, b: Value) -> Result<Value, String> {
    let ints = matches!((a, b), (Value::Int(_) | Value::Bool(_), Value::Int(_) | Value::Bool(_)));
    Ok(match op {
        Bin::Add | Bin::Sub | Bin::Mul if ints => {
            let (x, y) = (a.i()?, b.i()?);
            Value::Int(match op {
                Bin::Add => x.checked_add(y),
                Bin::Sub => x.checked_sub(y),
                _ => x.checked_mul(y),
            }
            .ok_or("integer overflow in a size expression")?)
        }
        Bin::Add => Value::Float(a.f() + b.f()),
        Bin::Sub => Value::Float(a.f() - b.f()),
        Bin::Mul => Value::Float(a.f() * b.f()),
        Bin::TrueDiv => Value::Float(a.f() / b.f()),
        Bin::FloorDiv if ints => Value::Int(floordiv(a.i()?, b.i()?)?),
        Bin::FloorDiv => Value::Float((a.f() / b.f()).floor()),
        Bin::Mod if ints => Value::Int(pymod(a.i()?, b.i()?)?),
        Bin::Mod => Value::Float(a.f() - b.f() * (a.f() / b.f()).floor()),
        Bin::Pow if ints && b.i()? >= 0 => Value::Int(a.i()?.checked_pow(u32::try_from(b.i()?).map_err(|_| "exponent too large")?).ok_or("integer overflow in a size expression")?),
        Bin::Pow => Value::Float(a.f().powf(b.f())),
        Bin::Lt => Value::Bool(a.f() < b.f()),
        Bin::Le => Value::Bool(a.f() <= b.f()),
        Bin::Gt => Value::Bool(a.f() > b.f()),
        Bin::Ge => Value::Bool(a.f() >= b.f()),
        Bin::Eq => Value::Bool(if ints { a.i()? == b.i()? } else { a.f() == b.f() }),
        Bin::Ne => Value::Bool(if ints { a.i()? != b.i()? } else { a.f() != b.f() }),
        Bin::And => Value::Bool(a.b() && b.b()),
        Bin::Or => Value::Bool(a.b() || b.b()),
    })
}

fn call(f: Func, v: &[Value]) -> Result<Value, String> {
    let want = match f {
        Func::Max | Func::Min | Func::And | Func::Or => None,
        Func::FloorDiv | Func::CeilDiv | Func::PythonMod | Func::Mod | Func::IntTrueDiv | Func::FloatTrueDiv | Func::PowByNatural | Func::FloatPow | Func::Eq | Func::Ne | Func::Lt | Func::Le | Func::Gt | Func::Ge => Some(2),
        _ => Some(1),
    };
    if want.is_some_and(|n| n != v.len()) || v.is_empty() {
        return Err(format!("{f:?} takes {} argument(s), got {}", want.unwrap_or(1), v.len()));
    }
    let int_or_float = |x: f64| -> Result<Value, String> {
        if x.is_finite() && x.abs() < 9.0e18 {
            Ok(Value::Int(x as i64))
        } else {
            Err(format!("{x} is not an integer size"))
        }
    };
    Ok(match f {
        Func::Max | Func::Min => {
            let mut best = v[0];
            for &x in &v[1..] {
                let better = if f == Func::Max { x.f() > best.f() } else { x.f() < best.f() };
                if better {
                    best = x;
                }
            }
            best
        }
        Func::FloorDiv => binary(Bin::FloorDiv, v[0], v[1])?,
        Func::CeilDiv => Value::Int(-floordiv(-v[0].i()?, v[1].i()?)?),
        Func::PythonMod | Func::Mod => binary(Bin::Mod, v[0], v[1])?,
        Func::IntTrueDiv | Func::FloatTrueDiv => Value::Float(v[0].f() / v[1].f()),
        Func::TruncToInt => int_or_float(v[0].f().trunc())?,
        Func::FloorToInt | Func::Floor => match v[0] {
            Value::Float(x) => int_or_float(x.floor())?,
            x => x,
        },
        Func::CeilToInt | Func::Ceiling => match v[0] {
            Value::Float(x) => int_or_float(x.ceil())?,
            x => x,
        },
        // Python's round: halves to even.
        Func::RoundToInt => int_or_float(v[0].f().round_ties_even())?,
        Func::TruncToFloat => Value::Float(v[0].f().trunc()),
        Func::ToFloat => Value::Float(v[0].f()),
        Func::Abs => match v[0] {
            Value::Float(x) => Value::Float(x.abs()),
            x => Value::Int(x.i()?.abs()),
        },
        Func::PowByNatural => binary(Bin::Pow, v[0], v[1])?,
        Func::FloatPow => Value::Float(v[0].f().powf(v[1].f())),
        Func::Sqrt => Value::Float(v[0].f().sqrt()),
        Func::Eq => binary(Bin::Eq, v[0], v[1])?,
        Func::Ne => binary(Bin::Ne, v[0], v[1])?,
        Func::Lt => binary(Bin::Lt, v[0], v[1])?,
        Func::Le => binary(Bin::Le, v[0], v[1])?,
        Func::Gt => binary(Bin::Gt, v[0], v[1])?,
        Func::Ge => binary(Bin::Ge, v[0], v[1])?,
        Func::And => Value::Bool(v.iter().all(|x| x.b())),
        Func::Or => Value::Bool(v.iter().any(|x| x.b())),
        Func::Not => Value::Bool(!v[0].b()),
    })
}

fn lex(s: &str) -> Result<Vec<String>, String> {
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_ascii_digit() || (ch == '.' && c.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            let st = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '.' || ((c[i] == '-' || c[i] == '+') && matches!(c[i - 1], 'e' | 'E'))) {
                i += 1;
            }
            out.push(c[st..i].iter().collect());
        } else if ch.is_ascii_alphabetic() || ch == '_' {
            let st = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(c[st..i].iter().collect());
        } else {
            let two: String = c[i..(i + 2).min(c.len())].iter().collect();
            if ["//", "**", "<=", ">=", "==", "!="].contains(&two.as_str()) {
                out.push(two);
                i += 2;
            } else if "+-*/%(),<>&|~".contains(ch) {
                out.push(ch.to_string());
                i += 1;
            } else {
                return Err(format!("unexpected character `{ch}` in expression `{s}`"));
            }
        }
    }
    Ok(out)
}

struct Parser<'a> {
    t: Vec<String>,
    i: usize,
    src: &'a str,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&str> {
        self.t.get(self.i).map(|s| s.as_str())
    }
    fn eat(&mut self, s: &str) -> bool {
        if self.peek() == Some(s) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, s: &str) -> Result<(), String> {
        if self.eat(s) {
            Ok(())
        } else {
            Err(format!("expected `{s}` in expression `{}`", self.src))
        }
    }
    fn bin(op: Bin, a: ScalarExpr, b: ScalarExpr) -> ScalarExpr {
        ScalarExpr::Bin(op, Box::new(a), Box::new(b))
    }
    fn or(&mut self) -> Result<ScalarExpr, String> {
        let mut e = self.and()?;
        while self.eat("|") {
            e = Self::bin(Bin::Or, e, self.and()?);
        }
        Ok(e)
    }
    fn and(&mut self) -> Result<ScalarExpr, String> {
        let mut e = self.not()?;
        while self.eat("&") {
            e = Self::bin(Bin::And, e, self.not()?);
        }
        Ok(e)
    }
    fn not(&mut self) -> Result<ScalarExpr, String> {
        if self.eat("~") {
            return Ok(ScalarExpr::Not(Box::new(self.not()?)));
        }
        self.cmp()
    }
    fn cmp(&mut self) -> Result<ScalarExpr, String> {
        let e = self.sum()?;
        let op = match self.peek() {
            Some("<") => Bin::Lt,
            Some("<=") => Bin::Le,
            Some(">") => Bin::Gt,
            Some(">=") => Bin::Ge,
            Some("==") => Bin::Eq,
            Some("!=") => Bin::Ne,
            _ => return Ok(e),
        };
        self.i += 1;
        Ok(Self::bin(op, e, self.sum()?))
    }
    fn sum(&mut self) -> Result<ScalarExpr, String> {
        let mut e = self.product()?;
        loop {
            if self.eat("+") {
                e = Self::bin(Bin::Add, e, self.product()?);
            } else if self.eat("-") {
                e = Self::bin(Bin::Sub, e, self.product()?);
            } else {
                return Ok(e);
            }
        }
    }
    fn product(&mut self) -> Result<ScalarExpr, String> {
        let mut e = self.unary()?;
        loop {
            let op = match self.peek() {
                Some("*") => Bin::Mul,
                Some("/") => Bin::TrueDiv,
                Some("//") => Bin::FloorDiv,
                Some("%") => Bin::Mod,
                _ => return Ok(e),
            };
            self.i += 1;
            e = Self::bin(op, e, self.unary()?);
        }
    }
    fn unary(&mut self) -> Result<ScalarExpr, String> {
        if self.eat("-") {
            return Ok(ScalarExpr::Neg(Box::new(self.unary()?)));
        }
        if self.eat("+") {
            return self.unary();
        }
        self.power()
    }
    fn power(&mut self) -> Result<ScalarExpr, String> {
        let base = self.atom()?;
        if self.eat("**") {
            // Right-associative, binding tighter than unary minus on its left.
            return Ok(Self::bin(Bin::Pow, base, self.unary()?));
        }
        Ok(base)
    }
    fn args(&mut self) -> Result<Vec<ScalarExpr>, String> {
        self.expect("(")?;
        let mut out = Vec::new();
        if self.eat(")") {
            return Ok(out);
        }
        loop {
            out.push(self.or()?);
            if self.eat(")") {
                return Ok(out);
            }
            self.expect(",")?;
        }
    }
    fn atom(&mut self) -> Result<ScalarExpr, String> {
        let t = self.peek().ok_or_else(|| format!("unexpected end of expression `{}`", self.src))?.to_string();
        self.i += 1;
        if t == "(" {
            let e = self.or()?;
            self.expect(")")?;
            return Ok(e);
        }
        if t.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
            if let Ok(v) = t.parse::<i64>() {
                return Ok(ScalarExpr::Const(Value::Int(v)));
            }
            return t.parse::<f64>().map(|x| ScalarExpr::Const(Value::Float(x))).map_err(|_| format!("bad number `{t}` in expression `{}`", self.src));
        }
        match t.as_str() {
            "True" | "true" => return Ok(ScalarExpr::Const(Value::Bool(true))),
            "False" | "false" => return Ok(ScalarExpr::Const(Value::Bool(false))),
            "oo" => return Ok(ScalarExpr::Const(Value::Float(f64::INFINITY))),
            "Piecewise" => {
                self.expect("(")?;
                let mut ps = Vec::new();
                loop {
                    self.expect("(")?;
                    let v = self.or()?;
                    self.expect(",")?;
                    let c = self.or()?;
                    self.expect(")")?;
                    ps.push((v, c));
                    if self.eat(")") {
                        return Ok(ScalarExpr::Piecewise(ps));
                    }
                    self.expect(",")?;
                }
            }
            _ => {}
        }
        if self.peek() == Some("(") {
            let f = Func::from_name(&t).ok_or_else(|| format!("unknown function `{t}` in expression `{}`", self.src))?;
            return Ok(ScalarExpr::Call(f, self.args()?));
        }
        if let Some(n) = t.strip_prefix('s').and_then(|n| n.parse::<u32>().ok()) {
            return Ok(ScalarExpr::Sym(n));
        }
        Err(format!("unknown name `{t}` in expression `{}` (only size symbols sN are bound)", self.src))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(s: &str, syms: &[i64]) -> Value {
        ScalarExpr::parse(s).unwrap().eval(syms).unwrap()
    }

    #[test]
    fn arithmetic_follows_python() {
        assert_eq!(ev("2*s0 + 1", &[3]), Value::Int(7));
        assert_eq!(ev("-7 // 2", &[]), Value::Int(-4));
        assert_eq!(ev("PythonMod(-7, 3)", &[]), Value::Int(2));
        assert_eq!(ev("FloorDiv(s0, 4)", &[9]), Value::Int(2));
        assert_eq!(ev("CeilDiv(s0, 4)", &[9]), Value::Int(3));
        assert_eq!(ev("s0**2 - s1", &[3, 1]), Value::Int(8));
        assert_eq!(ev("-s0**2", &[3]), Value::Int(-9));
        assert_eq!(ev("IntTrueDiv(s0, 2)", &[5]), Value::Float(2.5));
        assert_eq!(ev("CeilToInt(IntTrueDiv(s0, 2))", &[5]), Value::Int(3));
        assert_eq!(ev("FloorToInt(IntTrueDiv(s0, 2))", &[5]), Value::Int(2));
        assert_eq!(ev("RoundToInt(2.5)", &[]), Value::Int(2));
        assert_eq!(ev("TruncToInt(-2.5)", &[]), Value::Int(-2));
        assert_eq!(ev("0.5*s0", &[3]), Value::Float(1.5));
        assert_eq!(ev("1.0e-3*s0", &[1000]), Value::Float(1.0));
    }

    #[test]
    fn max_min_relations_and_piecewise() {
        assert_eq!(ev("Max(1, s0)", &[0]), Value::Int(1));
        assert_eq!(ev("Min(s0, s1, 4)", &[7, 5]), Value::Int(4));
        assert_eq!(ev("Eq(s0, 4)", &[4]), Value::Bool(true));
        assert_eq!(ev("Ne(s0, 4)", &[4]), Value::Bool(false));
        assert_eq!(ev("(s0 >= 2) & (s1 < 8)", &[2, 8]), Value::Bool(false));
        assert_eq!(ev("(s0 >= 2) | ~(s1 < 8)", &[1, 8]), Value::Bool(true));
        assert_eq!(ev("Piecewise((s0, s0 > 3), (3, True))", &[2]), Value::Int(3));
        assert_eq!(ev("True", &[]), Value::Bool(true));
    }

    #[test]
    fn errors_name_what_is_wrong() {
        assert!(ScalarExpr::parse("Foo(s0)").unwrap_err().contains("unknown function `Foo`"));
        assert!(ScalarExpr::parse("u0 + 1").unwrap_err().contains("unknown name `u0`"));
        assert!(ScalarExpr::parse("s0 // 0").unwrap().eval(&[1]).is_err());
        assert!(ScalarExpr::parse("s3").unwrap().eval(&[1]).is_err());
        let mut syms = Vec::new();
        ScalarExpr::parse("Max(s2, s0*s5)").unwrap().syms(&mut syms);
        assert_eq!(syms, vec![2, 0, 5]);
    }
}
