//! Symbolic integer expressions, used for tensor sizes (over size symbols `s0`, `s1`, ...)
//! and, in the loop IR, for index arithmetic (over loop variables `i0`, ... and kernel
//! temporaries `t0`, ... that hold gathered indices).
//!
//! An [`Expr`] is kept in a canonical polynomial form: a map from monomials (sorted atom
//! lists) to non-zero integer coefficients. Two expressions are equal exactly when their
//! canonical forms are equal, so shape checks are structural comparisons. Floor division
//! and modulo are atoms; they are folded when the operands allow it, and the identity
//! `(a // b) * b + a % b == a` is applied when both terms appear in one sum.
//! All index arithmetic is on non-negative values, so C's `/` and `%` match `//` and `%`.

use std::collections::BTreeMap;
use std::fmt;

/// An indivisible factor of a monomial.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Atom {
    /// A size symbol `sN`, bound to an integer when the graph is called.
    Sym(u32),
    /// A loop variable `iN` of a kernel.
    Var(u32),
    /// A kernel temporary `tN` holding an index read from memory (gather, embedding).
    Tmp(u32),
    /// `a // b`
    FloorDiv(Box<Expr>, Box<Expr>),
    /// `a % b`
    Mod(Box<Expr>, Box<Expr>),
    /// `Max(a, b)` (sizes such as `Max(1, s0)` in dynamic-shape graphs)
    Max(Box<Expr>, Box<Expr>),
    /// `Min(a, b)`
    Min(Box<Expr>, Box<Expr>),
}

impl Atom {
    /// True when the atom is loop variable `v` or contains it.
    fn uses_var(&self, v: u32) -> bool {
        match self {
            Atom::Var(x) => *x == v,
            Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => x.uses_var(v) || y.uses_var(v),
            _ => false,
        }
    }
    /// True when the atom depends on size symbols alone (no loop variable or temporary).
    fn is_size(&self) -> bool {
        match self {
            Atom::Sym(_) => true,
            Atom::Var(_) | Atom::Tmp(_) => false,
            Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => x.atoms().chain(y.atoms()).all(Atom::is_size),
        }
    }
}

/// A canonical integer polynomial over [`Atom`]s.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Expr {
    terms: BTreeMap<Vec<Atom>, i64>,
}

impl From<i64> for Expr {
    fn from(c: i64) -> Expr {
        Expr::constant(c)
    }
}

impl Expr {
    pub fn constant(c: i64) -> Expr {
        let mut terms = BTreeMap::new();
        if c != 0 {
            terms.insert(vec![], c);
        }
        Expr { terms }
    }
    pub fn zero() -> Expr {
        Expr::default()
    }
    pub fn one() -> Expr {
        Expr::constant(1)
    }
    fn atom(a: Atom) -> Expr {
        let mut terms = BTreeMap::new();
        terms.insert(vec![a], 1);
        Expr { terms }
    }
    pub fn sym(n: u32) -> Expr {
        Expr::atom(Atom::Sym(n))
    }
    pub fn var(n: u32) -> Expr {
        Expr::atom(Atom::Var(n))
    }
    pub fn tmp(n: u32) -> Expr {
        Expr::atom(Atom::Tmp(n))
    }

    /// The value if this expression is a constant.
    pub fn as_const(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&vec![]).copied(),
            _ => None,
        }
    }
    /// The expression's constant term (0 when it has none): `2*i0 + i1 - 256` gives -256.
    pub fn const_term(&self) -> i64 {
        self.terms.get(&Vec::new()).copied().unwrap_or(0)
    }

    pub fn is_const(&self, c: i64) -> bool {
        self.as_const() == Some(c)
    }

    /// Whether this is one product of atoms with coefficient 1 (`s0*s1`; not a constant).
    pub fn is_monomial(&self) -> bool {
        self.terms.len() == 1 && self.terms.iter().all(|(m, c)| !m.is_empty() && *c == 1)
    }

    /// This expression with every monomial that is the left side of a rule
    /// ([`Expr::is_monomial`]) replaced by the rule's right side, scaled by its coefficient
    /// ([Note: equal sizes] in braze-py).
    pub fn substitute(&self, rules: &[(Expr, Expr)]) -> Expr {
        let mut out = Expr::zero();
        for (m, c) in &self.terms {
            let hit = rules.iter().find(|(l, _)| l.is_monomial() && l.terms.contains_key(m));
            let term = Expr { terms: BTreeMap::from([(m.clone(), *c)]) };
            out = out.add(&match hit {
                Some((_, r)) => r.mul(&Expr::constant(*c)),
                None => term,
            });
        }
        out
    }

    pub fn add(&self, o: &Expr) -> Expr {
        let mut terms = self.terms.clone();
        for (m, c) in &o.terms {
            match terms.get_mut(m) {
                Some(e) => {
                    *e += c;
                    if *e == 0 {
                        terms.remove(m);
                    }
                }
                None => {
                    terms.insert(m.clone(), *c);
                }
            }
        }
        recombine_divmod(Expr { terms })
    }
    pub fn neg(&self) -> Expr {
        Expr { terms: self.terms.iter().map(|(m, c)| (m.clone(), -c)).collect() }
    }
    pub fn sub(&self, o: &Expr) -> Expr {
        self.add(&o.neg())
    }
    pub fn mul(&self, o: &Expr) -> Expr {
        // A constant factor scales the coefficients (no monomial changes, none cancels).
        for (e, k) in [(self, o), (o, self)] {
            match k.as_const() {
                Some(0) => return Expr::zero(),
                Some(1) => return e.clone(),
                Some(c) => return recombine_divmod(Expr { terms: e.terms.iter().map(|(m, x)| (m.clone(), x * c)).collect() }),
                None => {}
            }
        }
        // Products of monomials summed into one map, normalised once at the end.
        let mut terms: BTreeMap<Vec<Atom>, i64> = BTreeMap::new();
        for (m1, c1) in &self.terms {
            for (m2, c2) in &o.terms {
                let mut m: Vec<Atom> = m1.iter().chain(m2.iter()).cloned().collect();
                m.sort();
                *terms.entry(m).or_insert(0) += c1 * c2;
            }
        }
        terms.retain(|_, c| *c != 0);
        recombine_divmod(Expr { terms })
    }
    pub fn mul_c(&self, c: i64) -> Expr {
        self.mul(&Expr::constant(c))
    }

    /// Floor division; folded when exact or constant.
    pub fn floordiv(&self, d: &Expr) -> Expr {
        if d.is_const(1) {
            return self.clone();
        }
        if self.terms.is_empty() {
            return Expr::zero();
        }
        if let Some(c) = d.as_const() {
            if c > 0 {
                if let Some(a) = self.as_const() {
                    return Expr::constant(a.div_euclid(c));
                }
                if let Some(q) = self.exact_div(d) {
                    return q;
                }
            }
        }
        if self == d {
            return Expr::one();
        }
        // (a * d) // d == a when d is a single monomial dividing every term.
        if let Some(q) = self.exact_div_monomial(d) {
            return q;
        }
        Expr::atom(Atom::FloorDiv(Box::new(self.clone()), Box::new(d.clone())))
    }

    /// Modulo; folded when constant or when `d` divides every term.
    pub fn rem(&self, d: &Expr) -> Expr {
        if d.is_const(1) || self.terms.is_empty() {
            return Expr::zero();
        }
        if let Some(c) = d.as_const() {
            if c > 0 {
                if let Some(a) = self.as_const() {
                    return Expr::constant(a.rem_euclid(c));
                }
                if self.terms.values().all(|k| k % c == 0) {
                    return Expr::zero();
                }
            }
        }
        if self == d || self.exact_div_monomial(d).is_some() {
            return Expr::zero();
        }
        Expr::atom(Atom::Mod(Box::new(self.clone()), Box::new(d.clone())))
    }

    /// `self / d` when `d` divides every term exactly: a non-zero constant dividing every
    /// coefficient, or a monomial (`2*s0`) dividing every term; else None.
    pub fn exact_div(&self, d: &Expr) -> Option<Expr> {
        match d.as_const() {
            Some(0) => None,
            Some(c) if self.terms.values().all(|k| k % c == 0) => Some(Expr { terms: self.terms.iter().map(|(m, k)| (m.clone(), k / c)).collect() }),
            Some(_) => None,
            None => self.exact_div_monomial(d),
        }
    }

    /// `self / d` when `d` is one monomial (times a coefficient) dividing every term of `self`.
    fn exact_div_monomial(&self, d: &Expr) -> Option<Expr> {
        if d.terms.len() != 1 {
            return None;
        }
        let (dm, dc) = d.terms.iter().next()?;
        if dm.is_empty() {
            return None;
        }
        let mut out = BTreeMap::new();
        for (m, c) in &self.terms {
            if c % dc != 0 {
                return None;
            }
            let mut rest = m.clone();
            for a in dm {
                let pos = rest.iter().position(|x| x == a)?;
                rest.remove(pos);
            }
            out.insert(rest, c / dc);
        }
        Some(Expr { terms: out })
    }

    /// `Max(self, o)`, folded when the difference is a constant.
    pub fn max_of(&self, o: &Expr) -> Expr {
        match self.sub(o).as_const() {
            Some(d) if d >= 0 => self.clone(),
            Some(_) => o.clone(),
            None => {
                let (a, b) = if self <= o { (self, o) } else { (o, self) };
                Expr::atom(Atom::Max(Box::new(a.clone()), Box::new(b.clone())))
            }
        }
    }

    /// `Min(self, o)`, folded when the difference is a constant.
    pub fn min_of(&self, o: &Expr) -> Expr {
        match self.sub(o).as_const() {
            Some(d) if d <= 0 => self.clone(),
            Some(_) => o.clone(),
            None => {
                let (a, b) = if self <= o { (self, o) } else { (o, self) };
                Expr::atom(Atom::Min(Box::new(a.clone()), Box::new(b.clone())))
            }
        }
    }

    pub fn atoms(&self) -> impl Iterator<Item = &Atom> {
        self.terms.keys().flat_map(|m| m.iter())
    }

    /// Calls `f` on every leaf atom (symbol, loop variable, temporary) of this expression,
    /// inside floor divisions, moduli, `Max` and `Min` too.
    fn visit_leaves(&self, f: &mut impl FnMut(&Atom)) {
        for a in self.atoms() {
            match a {
                Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => {
                    x.visit_leaves(f);
                    y.visit_leaves(f);
                }
                leaf => f(leaf),
            }
        }
    }

    /// Every size symbol this expression mentions (recursively).
    pub fn syms(&self, out: &mut Vec<u32>) {
        self.visit_leaves(&mut |a| {
            if let Atom::Sym(s) = a {
                if !out.contains(s) {
                    out.push(*s);
                }
            }
        });
    }

    /// Every kernel temporary this expression mentions (recursively: a gathered index may sit
    /// inside a division, `t13 / 7`, when the rows it picks are a flattened pair of dims).
    pub fn tmps(&self, out: &mut Vec<u32>) {
        self.visit_leaves(&mut |a| {
            if let Atom::Tmp(t) = a {
                if !out.contains(t) {
                    out.push(*t);
                }
            }
        });
    }

    /// True when the expression mentions loop variable `v`.
    pub fn uses_var(&self, v: u32) -> bool {
        self.atoms().any(|a| a.uses_var(v))
    }

    /// The coefficient of loop variable `v` when the expression is affine in it: `v` appears
    /// only in terms `c * v` where `c` mentions no loop variable or temporary, and never
    /// inside a division, modulo, `Max` or `Min`. Zero when `v` does not appear.
    pub fn var_coef(&self, v: u32) -> Option<Expr> {
        let mut coef = Expr::zero();
        for (m, c) in &self.terms {
            let Some(pos) = m.iter().position(|a| *a == Atom::Var(v)) else {
                if m.iter().any(|a| a.uses_var(v)) {
                    return None;
                }
                continue;
            };
            let mut rest = m.clone();
            rest.remove(pos);
            if !rest.iter().all(Atom::is_size) {
                return None;
            }
            coef = coef.add(&Expr { terms: BTreeMap::from([(rest, *c)]) });
        }
        Some(coef)
    }

    /// The expression with each loop variable `iN` replaced by `f(N)`, inside divisions too.
    pub fn subst_vars(&self, f: &dyn Fn(u32) -> Expr) -> Expr {
        self.map_atoms(&|a| match a {
            Atom::Var(n) => Some(f(*n)),
            _ => None,
        })
    }

    /// The expression rebuilt bottom-up: the operands of each division, modulo, `Max` and
    /// `Min` first, then each atom (with its rebuilt operands) replaced by `f` of it where `f`
    /// gives a value, else made again from them (and folded where they allow).
    fn map_atoms(&self, f: &dyn Fn(&Atom) -> Option<Expr>) -> Expr {
        let mut out = Expr::zero();
        for (m, c) in &self.terms {
            let term = m.iter().fold(Expr::constant(*c), |acc, a| {
                let m = |x: &Expr| Box::new(x.map_atoms(f));
                let a = match a {
                    Atom::FloorDiv(x, y) => Atom::FloorDiv(m(x), m(y)),
                    Atom::Mod(x, y) => Atom::Mod(m(x), m(y)),
                    Atom::Max(x, y) => Atom::Max(m(x), m(y)),
                    Atom::Min(x, y) => Atom::Min(m(x), m(y)),
                    other => other.clone(),
                };
                acc.mul(&f(&a).unwrap_or_else(|| match a {
                    Atom::FloorDiv(x, y) => x.floordiv(&y),
                    Atom::Mod(x, y) => x.rem(&y),
                    Atom::Max(x, y) => x.max_of(&y),
                    Atom::Min(x, y) => x.min_of(&y),
                    other => Expr::atom(other),
                }))
            });
            out = out.add(&term);
        }
        out
    }

    /// The constant coefficient of loop variable `v` when `v` appears only linearly and
    /// outside divisions; `None` when it appears in any other way.
    pub fn linear_coef(&self, v: u32) -> Option<i64> {
        let mut coef = 0;
        for (m, c) in &self.terms {
            let hits = m.iter().filter(|a| **a == Atom::Var(v)).count();
            let nested = m.iter().any(|a| match a {
                Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => x.uses_var(v) || y.uses_var(v),
                _ => false,
            });
            if nested {
                return None;
            }
            match (hits, m.len()) {
                (0, _) => {}
                (1, 1) => coef += c,
                _ => return None,
            }
        }
        Some(coef)
    }

    /// True when every term's coefficient (the constant included) is a multiple of `v`, so
    /// the value is a multiple of `v` whatever the atoms are.
    pub fn all_coefs_divisible(&self, v: i64) -> bool {
        self.terms.values().all(|c| c % v == 0)
    }

    /// Evaluates with `atom` giving the value of each symbol, variable and temporary.
    pub fn eval(&self, leaf: &dyn Fn(&Atom) -> Option<i64>) -> Option<i64> {
        let mut total = 0i64;
        for (m, c) in &self.terms {
            let mut p = *c;
            for a in m {
                let v = match a {
                    Atom::FloorDiv(x, y) => {
                        let d = y.eval(leaf)?;
                        if d == 0 {
                            return None;
                        }
                        x.eval(leaf)?.div_euclid(d)
                    }
                    Atom::Mod(x, y) => {
                        let d = y.eval(leaf)?;
                        if d == 0 {
                            return None;
                        }
                        x.eval(leaf)?.rem_euclid(d)
                    }
                    Atom::Max(x, y) => x.eval(leaf)?.max(y.eval(leaf)?),
                    Atom::Min(x, y) => x.eval(leaf)?.min(y.eval(leaf)?),
                    other => leaf(other)?,
                };
                p = p.checked_mul(v)?;
            }
            total = total.checked_add(p)?;
        }
        Some(total)
    }

    /// Evaluates given size-symbol values (`syms[n]` is `sN`).
    pub fn eval_syms(&self, syms: &[i64]) -> Option<i64> {
        self.eval(&|a| match a {
            Atom::Sym(s) => syms.get(*s as usize).copied(),
            _ => None,
        })
    }

    /// The expression with every division and modulo by a positive constant `c` of a sum
    /// `c*q + r` folded to `q` (and `r`) where the loop variables' ranges put `r` in `0..c`
    /// (`extent(n)`: `iN` runs over `0..extent`, when known): `(128*i2 + i3) // 128` is `i2`
    /// and `(128*i2 + i3) % 128` is `i3` in a loop where `i3 < 128`.
    pub fn fold_divmod_in(&self, extent: &dyn Fn(u32) -> Option<i64>) -> Expr {
        if !self.atoms().any(|a| matches!(a, Atom::FloorDiv(..) | Atom::Mod(..) | Atom::Max(..) | Atom::Min(..))) {
            return self.clone();
        }
        self.map_atoms(&|a| match a {
            Atom::FloorDiv(x, y) => x.split_by(y, extent).map(|(q, _)| q),
            Atom::Mod(x, y) => x.split_by(y, extent).map(|(_, r)| r),
            _ => None,
        })
    }

    /// `(q, r)` with `self == d*q + r` and `0 <= r < d` over the loop variables' ranges, for a
    /// positive constant `d`: `q` takes the terms whose coefficients `d` divides.
    fn split_by(&self, d: &Expr, extent: &dyn Fn(u32) -> Option<i64>) -> Option<(Expr, Expr)> {
        let c = d.as_const().filter(|&c| c > 0)?;
        let (mut q, mut r) = (BTreeMap::new(), BTreeMap::new());
        for (m, k) in &self.terms {
            if k % c == 0 {
                q.insert(m.clone(), k / c);
            } else {
                r.insert(m.clone(), *k);
            }
        }
        let r = Expr { terms: r };
        let (lo, hi) = r.range_in(extent)?;
        (lo >= 0 && hi < c).then_some((Expr { terms: q }, r))
    }

    /// The least and greatest value over the loop variables' ranges, for a sum of constant
    /// multiples of loop variables and a constant; `None` for anything else.
    pub fn range_in(&self, extent: &dyn Fn(u32) -> Option<i64>) -> Option<(i64, i64)> {
        let (mut lo, mut hi) = (0i64, 0i64);
        for (m, k) in &self.terms {
            match m.as_slice() {
                [] => {
                    lo = lo.checked_add(*k)?;
                    hi = hi.checked_add(*k)?;
                }
                [Atom::Var(v)] => {
                    let top = k.checked_mul(extent(*v).filter(|&e| e > 0)? - 1)?;
                    if top >= 0 {
                        hi = hi.checked_add(top)?;
                    } else {
                        lo = lo.checked_add(top)?;
                    }
                }
                _ => return None,
            }
        }
        Some((lo, hi))
    }

    /// A bound on the magnitude of every value computed while evaluating the expression as
    /// [`Expr::render`] writes it (each term's partial products, the running sum, nested
    /// divisions' operands), given bounds on the leaves' magnitudes (`leaf`: loop variables,
    /// temporaries, symbols); `None` where a leaf has none or the bound overflows. Whether an
    /// index can be computed in 32 bits ([Note: 32-bit indices] in braze-sched).
    pub fn magnitude_in(&self, leaf: &dyn Fn(&Atom) -> Option<i64>) -> Option<i64> {
        let atom = |a: &Atom| -> Option<i64> {
            match a {
                // |x / y| <= |x| for a nonzero integer y; |x % y| < |y|; both operands are
                // computed, so both must be bounded.
                Atom::FloorDiv(x, y) | Atom::Mod(x, y) | Atom::Max(x, y) | Atom::Min(x, y) => Some(x.magnitude_in(leaf)?.max(y.magnitude_in(leaf)?)),
                other => leaf(other),
            }
        };
        let mut total = 0i64;
        for (m, k) in &self.terms {
            // A factor bounded by 0 still leaves the partial products before it.
            let term = m.iter().try_fold(k.checked_abs()?, |p, a| p.checked_mul(atom(a)?.max(1)))?;
            total = total.checked_add(term)?;
        }
        Some(total)
    }

    /// Renders as C with a caller-supplied spelling for leaves: `/` and `%` for division,
    /// conditional expressions for `Max` and `Min`.
    pub fn render(&self, leaf: &dyn Fn(&Atom) -> String) -> String {
        self.render_as(leaf, true)
    }

    fn render_as(&self, leaf: &dyn Fn(&Atom) -> String, as_c: bool) -> String {
        if self.terms.is_empty() {
            return "0".into();
        }
        let mut parts: Vec<String> = Vec::new();
        // Non-constant terms first, constant last: "2*s0 + 1".
        let mut ordered: Vec<(&Vec<Atom>, &i64)> = self.terms.iter().filter(|(m, _)| !m.is_empty()).collect();
        if let Some(c) = self.terms.get(&vec![]) {
            ordered.push((&EMPTY, c));
        }
        for (m, c) in ordered {
            let mut factors: Vec<String> = m
                .iter()
                .map(|a| match a {
                    Atom::FloorDiv(x, y) => format!("({} / {})", x.render_factor(leaf, as_c), y.render_factor(leaf, as_c)),
                    Atom::Mod(x, y) => format!("({} % {})", x.render_factor(leaf, as_c), y.render_factor(leaf, as_c)),
                    Atom::Max(x, y) | Atom::Min(x, y) => {
                        let max = matches!(a, Atom::Max(..));
                        let (p, q) = (x.render_as(leaf, as_c), y.render_as(leaf, as_c));
                        match (as_c, max) {
                            (true, true) => format!("(({p}) > ({q}) ? ({p}) : ({q}))"),
                            (true, false) => format!("(({p}) < ({q}) ? ({p}) : ({q}))"),
                            (false, true) => format!("Max({p}, {q})"),
                            (false, false) => format!("Min({p}, {q})"),
                        }
                    }
                    other => leaf(other),
                })
                .collect();
            let s = if m.is_empty() {
                c.abs().to_string()
            } else {
                if c.abs() != 1 {
                    factors.insert(0, c.abs().to_string());
                }
                factors.join("*")
            };
            if parts.is_empty() {
                parts.push(if *c < 0 { format!("-{s}") } else { s });
            } else {
                parts.push(if *c < 0 { format!("- {s}") } else { format!("+ {s}") });
            }
        }
        parts.join(" ")
    }

    fn render_factor(&self, leaf: &dyn Fn(&Atom) -> String, as_c: bool) -> String {
        let s = self.render_as(leaf, as_c);
        // Only a constant or a single atom stands bare next to `/` or `%`: `a / 64*s0` would
        // read as `(a / 64) * s0`.
        let bare = self.terms.is_empty() || (self.terms.len() == 1 && self.terms.iter().all(|(m, c)| m.is_empty() && *c >= 0 || m.len() == 1 && *c == 1));
        if !bare {
            format!("({s})")
        } else {
            s
        }
    }
}

static EMPTY: Vec<Atom> = Vec::new();

/// Applies `k*M*(a // b)*b + k*M*(a % b) == k*M*a` wherever both terms are present.
fn recombine_divmod(e: Expr) -> Expr {
    let mods: Vec<(Vec<Atom>, i64, Expr, Expr)> = e
        .terms
        .iter()
        .flat_map(|(m, c)| {
            m.iter().enumerate().filter_map(move |(i, a)| match a {
                Atom::Mod(x, y) => {
                    let mut rest = m.clone();
                    rest.remove(i);
                    Some((rest, *c, (**x).clone(), (**y).clone()))
                }
                _ => None,
            })
        })
        .collect();
    for (rest, k, a, b) in mods {
        if b.terms.len() != 1 {
            continue;
        }
        let (bm, bc) = b.terms.iter().next().unwrap();
        let mut div_mono = rest.clone();
        div_mono.push(Atom::FloorDiv(Box::new(a.clone()), Box::new(b.clone())));
        div_mono.extend(bm.iter().cloned());
        div_mono.sort();
        if e.terms.get(&div_mono) == Some(&(k * bc)) {
            let mut mod_mono = rest.clone();
            mod_mono.push(Atom::Mod(Box::new(a.clone()), Box::new(b.clone())));
            mod_mono.sort();
            let mut terms = e.terms.clone();
            terms.remove(&div_mono);
            terms.remove(&mod_mono);
            let mut rest_e = BTreeMap::new();
            rest_e.insert(rest, k);
            let replaced = a.mul(&Expr { terms: rest_e });
            return Expr { terms }.add(&replaced);
        }
    }
    e
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The text form spells floor division `//` so that it reads like Python.
        let s = self.render_as(
            &|a| match a {
                Atom::Sym(n) => format!("s{n}"),
                Atom::Var(n) => format!("i{n}"),
                Atom::Tmp(n) => format!("t{n}"),
                _ => unreachable!(),
            },
            false,
        );
        f.write_str(&s.replace(" / ", " // "))
    }
}

/// Parses the text form of an expression: integers, `sN`, `iN`, `tN`, `+ - *`, `//`, `%`,
/// parentheses, and sympy's `FloorDiv(a, b)` / `Mod(a, b)` / `PythonMod(a, b)` spellings.
pub fn parse_expr(s: &str) -> Result<Expr, String> {
    let toks = lex(s)?;
    let mut p = P { t: toks, i: 0 };
    let e = p.sum()?;
    if p.i != p.t.len() {
        return Err(format!("unexpected `{}` in size expression `{s}`", p.t[p.i]));
    }
    Ok(e)
}

fn lex(s: &str) -> Result<Vec<String>, String> {
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch.is_ascii_alphanumeric() || ch == '_' {
            let st = i;
            while i < c.len() && (c[i].is_ascii_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(c[st..i].iter().collect());
        } else if ch == '/' && i + 1 < c.len() && c[i + 1] == '/' {
            out.push("//".into());
            i += 2;
        } else if ch == '*' && i + 1 < c.len() && c[i + 1] == '*' {
            out.push("**".into());
            i += 2;
        } else if "+-*%(),".contains(ch) {
            out.push(ch.to_string());
            i += 1;
        } else {
            return Err(format!("unexpected character `{ch}` in size expression `{s}`"));
        }
    }
    Ok(out)
}

struct P {
    t: Vec<String>,
    i: usize,
}

impl P {
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
    fn sum(&mut self) -> Result<Expr, String> {
        let mut e = self.product()?;
        loop {
            if self.eat("+") {
                e = e.add(&self.product()?);
            } else if self.eat("-") {
                e = e.sub(&self.product()?);
            } else {
                return Ok(e);
            }
        }
    }
    fn product(&mut self) -> Result<Expr, String> {
        let mut e = self.unary()?;
        loop {
            if self.eat("*") {
                e = e.mul(&self.unary()?);
            } else if self.eat("//") {
                e = e.floordiv(&self.unary()?);
            } else if self.eat("%") {
                e = e.rem(&self.unary()?);
            } else {
                return Ok(e);
            }
        }
    }
    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat("-") {
            return Ok(self.unary()?.neg());
        }
        let base = self.atom()?;
        if self.eat("**") {
            // sympy prints s0*s0 as s0**2: a constant natural power is a product.
            let e = self.unary()?;
            let n = e.as_const().filter(|n| (0..=16).contains(n)).ok_or_else(|| format!("power `**{e}` in a size expression"))?;
            return Ok((0..n).fold(Expr::one(), |acc, _| acc.mul(&base)));
        }
        Ok(base)
    }
    fn expect(&mut self, tok: &str, after: &str) -> Result<(), String> {
        if self.eat(tok) {
            Ok(())
        } else {
            Err(format!("expected `{tok}` in {after}(...)"))
        }
    }
    /// `(a, b)` after a function name.
    fn two_args(&mut self, f: &str) -> Result<(Expr, Expr), String> {
        self.expect("(", f)?;
        let a = self.sum()?;
        self.expect(",", f)?;
        let b = self.sum()?;
        self.expect(")", f)?;
        Ok((a, b))
    }
    fn atom(&mut self) -> Result<Expr, String> {
        let t = self.peek().ok_or("unexpected end of size expression")?.to_string();
        self.i += 1;
        if t == "(" {
            let e = self.sum()?;
            if !self.eat(")") {
                return Err("expected `)`".into());
            }
            return Ok(e);
        }
        if matches!(t.as_str(), "FloorToInt" | "CeilToInt" | "TruncToInt") {
            // Integer rounding of a size: of an exact integer division (IntTrueDiv(a, b)), or
            // of something already an integer. Sizes are non-negative, so trunc is floor.
            self.expect("(", &t)?;
            let e = if self.eat("IntTrueDiv") {
                let (a, b) = self.two_args("IntTrueDiv")?;
                if t == "CeilToInt" { ceil_div(&a, &b) } else { a.floordiv(&b) }
            } else {
                self.sum()?
            };
            self.expect(")", &t)?;
            return Ok(e);
        }
        if matches!(t.as_str(), "CeilDiv" | "FloorDiv" | "Mod" | "PythonMod" | "Max" | "Min") {
            let (a, b) = self.two_args(&t)?;
            return Ok(match t.as_str() {
                "CeilDiv" => ceil_div(&a, &b),
                "FloorDiv" => a.floordiv(&b),
                "Max" => a.max_of(&b),
                "Min" => a.min_of(&b),
                _ => a.rem(&b),
            });
        }
        if let Ok(v) = t.parse::<i64>() {
            return Ok(Expr::constant(v));
        }
        let (head, num) = t.split_at(1);
        match (head, num.parse::<u32>()) {
            ("s", Ok(n)) => Ok(Expr::sym(n)),
            ("i", Ok(n)) => Ok(Expr::var(n)),
            ("t", Ok(n)) => Ok(Expr::tmp(n)),
            _ => Err(format!("unknown name `{t}` in size expression")),
        }
    }
}

/// `ceil(a / b)` for non-negative sizes.
fn ceil_div(a: &Expr, b: &Expr) -> Expr {
    a.add(b).sub(&Expr::one()).floordiv(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmps_inside_divisions() {
        // A gathered row of a flattened pair of dims: `336*(t13 / 7) + 8*(t13 % 7) + i3`.
        let t = Expr::tmp(13);
        let (c7, i3) = (Expr::constant(7), Expr::var(3));
        let e = t.floordiv(&c7).mul(&Expr::constant(336)).add(&t.rem(&c7).mul(&Expr::constant(8))).add(&i3);
        let mut found = Vec::new();
        e.tmps(&mut found);
        assert_eq!(found, vec![13]);
        let mut none = Vec::new();
        i3.add(&Expr::constant(2)).tmps(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn magnitudes_bound_every_partial_value() {
        let p = |t: &str| parse_expr(t).unwrap();
        let leaf = |a: &Atom| match a {
            Atom::Var(v) => [111, 63, 0].get(*v as usize).copied(),
            Atom::Tmp(_) => Some(999),
            _ => None,
        };
        // Terms add by magnitude, whatever their signs: `-7168*i0` then `+ i1`.
        assert_eq!(p("7168*i0 + i1").magnitude_in(&leaf), Some(7168 * 111 + 63));
        assert_eq!(p("-7168*i0 + i1 - 5").magnitude_in(&leaf), Some(7168 * 111 + 63 + 5));
        // A gathered index at its bound; a variable of extent 1 leaves its coefficient.
        assert_eq!(p("64*t3 + i1").magnitude_in(&leaf), Some(64 * 999 + 63));
        assert_eq!(p("4096*i2").magnitude_in(&leaf), Some(4096));
        // A division's operands are computed too: the larger bounds it.
        assert_eq!(p("(64*i0 + i1) // 3").magnitude_in(&leaf), Some(64 * 111 + 63));
        // Symbols have no bound; overflow has none either.
        assert_eq!(p("s0*i1").magnitude_in(&leaf), None);
        assert_eq!(p("4611686018427387904*i0").magnitude_in(&leaf), None);
    }

    #[test]
    fn divisions_folded_by_loop_ranges() {
        let p = |t: &str| parse_expr(t).unwrap();
        let ext = |v: u32| [4, 5, 128, 128].get(v as usize).copied();
        // A flattened [128, 128] index taken apart again.
        assert_eq!(p("(128*i2 + i3) // 128").fold_divmod_in(&ext), p("i2"));
        assert_eq!(p("(128*i2 + i3) % 128").fold_divmod_in(&ext), p("i3"));
        assert_eq!(p("5*((256*i0 + 2*i3 + 1) // 2)").fold_divmod_in(&ext), p("640*i0 + 5*i3"));
        // Inside other atoms, and not where the rest may reach the divisor.
        assert_eq!(p("((128*i2 + i3) // 128) // 3").fold_divmod_in(&ext), p("i2 // 3"));
        assert_eq!(p("(64*i2 + i3) // 64").fold_divmod_in(&ext), p("(64*i2 + i3) // 64"));
        assert_eq!(p("(128*i2 + t1) // 128").fold_divmod_in(&ext), p("(128*i2 + t1) // 128"));
        assert_eq!(p("(128*i7 + i3) // 128").fold_divmod_in(&ext), p("i7"));
        assert_eq!(p("(i8 + 1) // 128").fold_divmod_in(&ext), p("(i8 + 1) // 128"));
    }

    #[test]
    fn substitute_monomials() {
        let p = |t: &str| parse_expr(t).unwrap();
        let rules = [(p("s2*s3"), p("s0*s1"))];
        // Whole monomials are replaced, scaled by their coefficient; others stay.
        assert_eq!(p("2*s2*s3 + s4").substitute(&rules), p("2*s0*s1 + s4"));
        assert_eq!(p("s2*s3*s4").substitute(&rules), p("s2*s3*s4"));
        assert_eq!(p("s2").substitute(&rules), p("s2"));
        assert!(p("s2*s3").is_monomial() && !p("2*s2").is_monomial() && !p("s2 + 1").is_monomial() && !p("1").is_monomial());
        // Typing compares sizes through the rules in force.
        assert!(!crate::infer::same_size(&p("s2*s3"), &p("s0*s1")));
        assert!(crate::infer::with_size_rules(&rules, || crate::infer::same_size(&p("s2*s3"), &p("s0*s1"))));
        assert!(crate::infer::with_size_rules(&rules, || crate::infer::broadcast(&[p("s2*s3"), p("4")], &[p("s0*s1"), p("1")])).is_ok());
    }

    #[test]
    fn canonical_and_divmod() {
        let e = parse_expr("2*s0 + s0 + 1").unwrap();
        assert_eq!(e.to_string(), "3*s0 + 1");
        let a = parse_expr("i0").unwrap();
        let k = Expr::constant(128);
        let back = a.floordiv(&k).mul(&Expr::constant(128 * 768)).add(&a.rem(&k).mul_c(768));
        assert_eq!(back, a.mul_c(768));
        let s = Expr::sym(0);
        let back = a.floordiv(&s).mul(&s).add(&a.rem(&s));
        assert_eq!(back, a);
        assert_eq!(parse_expr("(s0*4) // 4").unwrap(), Expr::sym(0));
        assert_eq!(parse_expr("FloorDiv(s1, 2)").unwrap().to_string(), "(s1 // 2)");
        assert_eq!(parse_expr("s0 - s0").unwrap(), Expr::zero());
        assert_eq!(parse_expr("s0*s1").unwrap().eval_syms(&[3, 5]), Some(15));
        assert_eq!(parse_expr("Max(1, s0)").unwrap().eval_syms(&[0]), Some(1));
        assert_eq!(parse_expr("Max(s0, s0 + 2)").unwrap(), parse_expr("s0 + 2").unwrap());
        assert_eq!(parse_expr("Min(s0, s1)").unwrap().eval_syms(&[3, 5]), Some(3));
        assert_eq!(parse_expr("2*s0**2*s1").unwrap(), parse_expr("2*s0*s0*s1").unwrap());
        // A product divisor keeps its parentheses in text and in C (it once rendered as
        // `(64*i0 + i1) / 64*s27`, which C reads as `((64*i0 + i1) / 64) * s27`).
        let q = parse_expr("(64*s0 + 5) // (64*s1)").unwrap();
        assert_eq!(q.eval_syms(&[3, 2]), Some(1));
        assert_eq!(parse_expr(&q.to_string()).unwrap(), q, "{q}");
        assert!(q.render(&|a| format!("{a:?}")).contains("/ (64*"), "{}", q.render(&|a| format!("{a:?}")));
        assert_eq!(parse_expr("CeilToInt(IntTrueDiv(s0, 4))").unwrap().eval_syms(&[9]), Some(3));
        assert_eq!(parse_expr("FloorToInt(IntTrueDiv(s0, 4))").unwrap().eval_syms(&[9]), Some(2));
        assert_eq!(parse_expr("CeilDiv(s0, 4)").unwrap().eval_syms(&[8]), Some(2));
        assert_eq!(parse_expr("TruncToInt(s0 + 1)").unwrap().eval_syms(&[8]), Some(9));
    }

    #[test]
    fn compound_numerators_keep_parentheses() {
        let e = parse_expr("(i0 - 1) // 25").unwrap();
        assert_eq!(e.to_string(), "((i0 - 1) // 25)");
        let v = e.eval(&|a| match a {
            Atom::Var(0) => Some(51),
            _ => None,
        });
        assert_eq!(v, Some(2));
    }

    #[test]
    fn var_coefs_and_substitution() {
        let e = parse_expr("3*s1*i0 + s1*i1 + i2 + t0").unwrap();
        assert_eq!(e.var_coef(0), Some(parse_expr("3*s1").unwrap()));
        assert_eq!(e.var_coef(3), Some(Expr::zero()));
        for s in ["i0*i1", "t0*i0", "(i0 // 2) + i1", "Max(i0, 3)"] {
            assert_eq!(parse_expr(s).unwrap().var_coef(0), None, "{s}");
        }
        let f = |n: u32| if n == 0 { Expr::zero() } else { Expr::var(n - 1) };
        assert_eq!(e.subst_vars(&f), parse_expr("s1*i0 + i1 + t0").unwrap());
        assert_eq!(parse_expr("(i2 + 1) % 4").unwrap().subst_vars(&f), parse_expr("(i1 + 1) % 4").unwrap());
    }

    #[test]
    fn roundtrip_display() {
        for s in ["s0", "2*s0 + 1", "s0*s1 - 3", "(s0 // 2)", "Max(1, s0)", "2*Min(s0, s1 + 1) - 1", "(i0 % 4)*8 + i1", "(i0 - 1) // 25", "(i0 + s0) % (s1 + 1)"] {
            let e = parse_expr(s).unwrap();
            assert_eq!(parse_expr(&e.to_string()).unwrap(), e, "{s}");
        }
    }
}
