//! Matrix products through cuBLASLt, loaded at run time from the path the caller gives (the
//! copy PyTorch's NVIDIA wheels ship, so the process holds one cuBLASLt). Descriptors and the
//! heuristic's algorithm are made once per matmul when the module loads; a call is one
//! `cublasLtMatmul` on PyTorch's stream, with bias and relu/gelu fused as the epilogue.
//!
//! braze's tensors are row-major; cuBLASLt's matrices are column-major. A row-major `C = A @ B`
//! is the column-major `C^T = B^T @ A^T`, so B is passed as cuBLASLt's first operand and A as
//! its second, each as a transposed or plain view of its own memory.

use crate::choices::Choices;
use crate::RuntimeError;
use braze_ir::{DType, Epilogue};
use libloading::Library;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

type Status = c_int;
type Handle = *mut c_void;
type Desc = *mut c_void;

struct Lt {
    _lib: Library,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    version: unsafe extern "C" fn() -> usize,
    desc_create: unsafe extern "C" fn(*mut Desc, c_int, c_int) -> Status,
    desc_destroy: unsafe extern "C" fn(Desc) -> Status,
    layout_destroy: unsafe extern "C" fn(Desc) -> Status,
    pref_destroy: unsafe extern "C" fn(Desc) -> Status,
    desc_set: unsafe extern "C" fn(Desc, c_int, *const c_void, usize) -> Status,
    layout_create: unsafe extern "C" fn(*mut Desc, c_int, u64, u64, i64) -> Status,
    layout_set: unsafe extern "C" fn(Desc, c_int, *const c_void, usize) -> Status,
    pref_create: unsafe extern "C" fn(*mut Desc) -> Status,
    pref_set: unsafe extern "C" fn(Desc, c_int, *const c_void, usize) -> Status,
    #[allow(clippy::type_complexity)]
    heuristic: unsafe extern "C" fn(Handle, Desc, Desc, Desc, Desc, Desc, Desc, c_int, *mut HeuristicResult, *mut c_int) -> Status,
    #[allow(clippy::type_complexity)]
    matmul: unsafe extern "C" fn(Handle, Desc, *const c_void, *const c_void, Desc, *const c_void, Desc, *const c_void, *const c_void, Desc, *mut c_void, Desc, *const Algo, *mut c_void, usize, *mut c_void) -> Status,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Algo {
    data: [u64; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HeuristicResult {
    algo: Algo,
    workspace_size: usize,
    state: Status,
    waves: f32,
    reserved: [c_int; 4],
}

// cublasLt.h values.
const COMPUTE_32F: c_int = 68;
const COMPUTE_32F_FAST_TF32: c_int = 77;
const R_32F: c_int = 0;
const R_16F: c_int = 2;
const R_16BF: c_int = 14;
const DESC_TRANSA: c_int = 3;
const DESC_TRANSB: c_int = 4;
const DESC_EPILOGUE: c_int = 7;
const DESC_BIAS_POINTER: c_int = 8;
const LAYOUT_BATCH_COUNT: c_int = 5;
const LAYOUT_BATCH_OFFSET: c_int = 6;
const PREF_MAX_WORKSPACE: c_int = 1;
const PREF_ALIGN_A: c_int = 5;
const OP_N: c_int = 0;
const OP_T: c_int = 1;

/// Workspace bytes handed to cuBLASLt.
pub const WORKSPACE: usize = 32 << 20;

/// How many of the heuristic's algorithms are timed when a matmul is prepared.
const TUNE_CANDIDATES: usize = 8;

/// Matmuls smaller than this many multiply-adds (about a microsecond of tensor-core work) are
/// not timed: launch cost dominates them, and the heuristic's favourite keeps their rounding
/// (summation order) what it always was.
const TUNE_MIN_MACS: f64 = (1u64 << 28) as f64;

/// Algorithms chosen by timing, by `Prepared::tune_key` within `scope` ([Note: remembered
/// choices]): a model's repeated layers are timed once, and a later process reuses the choice.
fn tuned() -> &'static Choices {
    static T: OnceLock<Choices> = OnceLock::new();
    T.get_or_init(|| Choices::new("cublaslt"))
}

/// What an algorithm chosen on device `ordinal` is valid for: cuBLASLt's version and the device.
fn scope(ordinal: i32) -> Result<String, RuntimeError> {
    // SAFETY: a version query without arguments.
    crate::choices::scope("cuBLASLt", unsafe { (lt()?.version)() }, ordinal)
}

impl Algo {
    /// The algorithm as text: cuBLASLt's algorithm structure may be saved and restored with the
    /// same library version.
    fn to_text(self) -> String {
        self.data.iter().map(|w| format!("{w:016x}")).collect()
    }

    fn from_text(t: &str) -> Option<Algo> {
        if t.len() != 128 {
            return None;
        }
        let mut data = [0u64; 8];
        for (i, w) in data.iter_mut().enumerate() {
            *w = u64::from_str_radix(t.get(i * 16..i * 16 + 16)?, 16).ok()?;
        }
        Some(Algo { data })
    }
}

/// Timing is on unless `BRAZE_MATMUL_TUNE=0`.
pub(crate) fn tuning_enabled() -> bool {
    std::env::var("BRAZE_MATMUL_TUNE").map(|v| v != "0").unwrap_or(true)
}

static LT: OnceLock<Result<Lt, String>> = OnceLock::new();
static HANDLE: OnceLock<Result<usize, String>> = OnceLock::new();

/// Loads cuBLASLt from `path`.
pub fn init(path: &str) -> Result<(), RuntimeError> {
    let r = LT.get_or_init(|| {
        let lib = crate::open_library(path)?;
        Ok(Lt {
            create: sym!(lib, b"cublasLtCreate"),
            version: sym!(lib, b"cublasLtGetVersion"),
            desc_create: sym!(lib, b"cublasLtMatmulDescCreate"),
            desc_set: sym!(lib, b"cublasLtMatmulDescSetAttribute"),
            desc_destroy: sym!(lib, b"cublasLtMatmulDescDestroy"),
            layout_destroy: sym!(lib, b"cublasLtMatrixLayoutDestroy"),
            pref_destroy: sym!(lib, b"cublasLtMatmulPreferenceDestroy"),
            layout_create: sym!(lib, b"cublasLtMatrixLayoutCreate"),
            layout_set: sym!(lib, b"cublasLtMatrixLayoutSetAttribute"),
            pref_create: sym!(lib, b"cublasLtMatmulPreferenceCreate"),
            pref_set: sym!(lib, b"cublasLtMatmulPreferenceSetAttribute"),
            heuristic: sym!(lib, b"cublasLtMatmulAlgoGetHeuristic"),
            matmul: sym!(lib, b"cublasLtMatmul"),
            _lib: lib,
        })
    });
    r.as_ref().map(|_| ()).map_err(|e| RuntimeError::Environment(e.clone()))
}

fn lt() -> Result<&'static Lt, RuntimeError> {
    crate::loaded(&LT, "cuBLASLt")
}

fn handle() -> Result<Handle, RuntimeError> {
    let l = lt()?;
    let h = HANDLE.get_or_init(|| {
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: creates a library handle.
        let st = unsafe { (l.create)(&mut h) };
        if st != 0 { Err(format!("cublasLtCreate failed ({st})")) } else { Ok(h as usize) }
    });
    h.as_ref().map(|h| *h as Handle).map_err(|e| RuntimeError::Environment(e.clone()))
}

fn ok(st: Status, what: &str) -> Result<(), RuntimeError> {
    if st == 0 { Ok(()) } else { Err(RuntimeError::Launch(format!("cuBLASLt {what} failed (status {st})"))) }
}

pub use crate::matmul::{MatmulSpec, Operand};

pub struct Prepared {
    pub spec: MatmulSpec,
    desc: Desc,
    la: Desc,
    lb: Desc,
    /// C's layout (the residual's, else D's) and D's.
    lc: Desc,
    ld: Desc,
    /// Algorithms by the byte alignment of (cuBLASLt A, B, C, D) they were chosen for.
    algos: Mutex<Vec<([u32; 4], Algo)>>,
    /// Held from setting the call's bias pointer on `desc` until cuBLASLt has read it, so
    /// calls from several threads do not see each other's pointers.
    call: Mutex<()>,
}

// SAFETY: the descriptors are only changed (bias pointer) under `call`; cuBLASLt handles and
// descriptors may be used from any thread.
unsafe impl Send for Prepared {}
unsafe impl Sync for Prepared {}

impl Drop for Prepared {
    fn drop(&mut self) {
        if let Ok(l) = lt() {
            // SAFETY: the descriptors were created by prepare() and nothing uses them now.
            unsafe {
                (l.desc_destroy)(self.desc);
                for d in [self.la, self.lb, self.ld] {
                    (l.layout_destroy)(d);
                }
                if self.lc != self.ld {
                    (l.layout_destroy)(self.lc);
                }
            }
        }
    }
}

fn data_type(d: DType) -> Result<c_int, RuntimeError> {
    match d {
        DType::F32 => Ok(R_32F),
        DType::F16 => Ok(R_16F),
        DType::BF16 => Ok(R_16BF),
        _ => Err(RuntimeError::Environment(format!("cuBLASLt matmul on {d}"))),
    }
}

/// The column-major view of a row-major operand: (rows, cols, ld, transposed).
fn colmajor(o: &Operand) -> Result<(u64, u64, i64, bool), RuntimeError> {
    let cs = if o.cols == 1 { 1 } else { o.cs };
    let rs = if o.rows == 1 { o.cols.max(1) as i64 } else { o.rs };
    if cs == 1 && rs >= o.cols as i64 {
        // Row-major R x C, ld rs == column-major C x R: the operand's transpose, untransposed.
        Ok((o.cols, o.rows, rs.max(1), false))
    } else if rs == 1 && cs >= o.rows as i64 {
        Ok((o.rows, o.cols, cs.max(1), true))
    } else {
        Err(RuntimeError::Environment(format!("matmul operand layout rs={} cs={} not supported", o.rs, o.cs)))
    }
}

fn layout(l: &Lt, ty: c_int, rows: u64, cols: u64, ld: i64, batch: u64, stride: i64) -> Result<Desc, RuntimeError> {
    let mut d: Desc = std::ptr::null_mut();
    // SAFETY: creates and configures a layout descriptor.
    unsafe {
        ok((l.layout_create)(&mut d, ty, rows, cols, ld), "layout")?;
        if batch > 1 {
            let n = batch as c_int;
            ok((l.layout_set)(d, LAYOUT_BATCH_COUNT, &n as *const c_int as *const c_void, 4), "batch count")?;
            ok((l.layout_set)(d, LAYOUT_BATCH_OFFSET, &stride as *const i64 as *const c_void, 8), "batch stride")?;
        }
    }
    Ok(d)
}

/// Creates descriptors and picks an algorithm (cuBLASLt's heuristic) for one matmul.
pub fn prepare(spec: MatmulSpec, tune_on: Option<i32>) -> Result<Prepared, RuntimeError> {
    let l = lt()?;
    handle()?;
    let ty = data_type(spec.dtype)?;
    let compute = if spec.dtype == DType::F32 && spec.tf32 { COMPUTE_32F_FAST_TF32 } else { COMPUTE_32F };
    // cuBLASLt A := our B^T (N x K), B := our A^T (K x M), D := C^T (N x M).
    let (br, bc, bld, bt) = colmajor(&spec.b)?;
    let (ar, ac, ald, at) = colmajor(&spec.a)?;
    let (m, n) = (spec.a.rows, spec.b.cols);
    // The residual must be D's column-major N x M untransposed (row-major M x N rows): its
    // leading dim and batch stride.
    let c_layout = match &spec.residual {
        Some(r) => match colmajor(r)? {
            (rows, cols, cld, false) if (rows, cols) == (n, m) => Some((cld, r.batch_stride)),
            _ => return Err(RuntimeError::Environment(format!("{}: residual layout rs={} cs={} not supported", spec.name, r.rs, r.cs))),
        },
        None => None,
    };
    let mut desc: Desc = std::ptr::null_mut();
    // SAFETY: descriptor set-up with values of the documented types.
    unsafe {
        ok((l.desc_create)(&mut desc, compute, R_32F), "matmul desc")?;
        let (ta, tb) = (if bt { OP_T } else { OP_N }, if at { OP_T } else { OP_N });
        ok((l.desc_set)(desc, DESC_TRANSA, &ta as *const c_int as *const c_void, 4), "transa")?;
        ok((l.desc_set)(desc, DESC_TRANSB, &tb as *const c_int as *const c_void, 4), "transb")?;
        let epi: c_int = match (spec.epilogue, spec.bias.is_some()) {
            (Epilogue::None, false) => 1,
            (Epilogue::Relu, false) => 2,
            (Epilogue::None, true) => 4,
            (Epilogue::Relu, true) => 6,
            (Epilogue::Gelu, false) => 32,
            (Epilogue::Gelu, true) => 36,
            // cuBLASLt's A is our B and its B our A: our a's sums over K are its B's
            // (BGRADB), our b's its A's (BGRADA).
            (Epilogue::BiasGradA, false) if spec.bias_grad.is_some() && spec.residual.is_none() && spec.batch == 1 => 512,
            (Epilogue::BiasGradB, false) if spec.bias_grad.is_some() && spec.residual.is_none() && spec.batch == 1 => 256,
            (e, _) => return Err(RuntimeError::Environment(format!("{}: {} epilogue needs one 2-d product and its output", spec.name, e.name()))),
        };
        ok((l.desc_set)(desc, DESC_EPILOGUE, &epi as *const c_int as *const c_void, 4), "epilogue")?;
    }
    let la = layout(l, ty, br, bc, bld, spec.batch, spec.b.batch_stride)?;
    let lb = layout(l, ty, ar, ac, ald, spec.batch, spec.a.batch_stride)?;
    let ld = layout(l, ty, n, m, n as i64, spec.batch, (m * n) as i64)?;
    let lc = match c_layout {
        Some((cld, batch_stride)) => layout(l, ty, n, m, cld, spec.batch, batch_stride)?,
        None => ld,
    };
    let p = Prepared { spec, desc, la, lb, lc, ld, algos: Mutex::new(Vec::new()), call: Mutex::new(()) };
    // Chosen for 256-byte aligned operands (PyTorch's allocations), timed on the device when
    // `tune_on` names one; calls with less aligned pointers (views at an offset) pick again.
    match tune_on {
        Some(ordinal) if tuning_enabled() => p.tune(ordinal)?,
        _ => {
            p.algo_for([256; 4])?;
        }
    }
    Ok(p)
}

/// Whether cuBLASLt offers an algorithm for a 2-d `dtype` matmul `[m, k] @ [k, n]` with a
/// bias-gradient epilogue (`side_a`: our a's sums, else b's), each operand stored row-major
/// or transposed (`a_t`, `b_t`): `Ok(())` or cuBLASLt's refusal. For finding which layouts
/// the epilogue takes ([Note: bias-gradient epilogues] in braze-passes).
pub fn probe_bias_grad(dtype: DType, side_a: bool, a_t: bool, b_t: bool, m: u64, n: u64, k: u64) -> Result<(), RuntimeError> {
    let operand = |buf: u32, rows: u64, cols: u64, t: bool| {
        let (rs, cs) = if t { (1, rows as i64) } else { (cols as i64, 1) };
        Operand { buf, offset: 0, rows, cols, rs, cs, batch_stride: 0 }
    };
    let spec = MatmulSpec {
        name: "bias_grad_probe".into(),
        a: operand(0, m, k, a_t),
        b: operand(1, k, n, b_t),
        bias: None,
        residual: None,
        out: 2,
        bias_grad: Some(3),
        batch: 1,
        dtype,
        tf32: false,
        epilogue: if side_a { Epilogue::BiasGradA } else { Epilogue::BiasGradB },
    };
    prepare(spec, None).map(|_| ())
}

/// The largest power of two (at most 256) dividing an address.
fn alignment(addr: usize) -> u32 {
    if addr == 0 { 256 } else { (1u32 << addr.trailing_zeros().min(8)).min(256) }
}

impl Prepared {
    /// Up to `n` algorithms cuBLASLt's heuristic offers for operands with these alignments,
    /// its favourite first.
    fn heuristic(&self, align: [u32; 4], n: usize) -> Result<Vec<Algo>, RuntimeError> {
        let l = lt()?;
        let h = handle()?;
        let mut pref: Desc = std::ptr::null_mut();
        let empty = HeuristicResult { algo: Algo { data: [0; 8] }, workspace_size: 0, state: 0, waves: 0.0, reserved: [0; 4] };
        let mut res = vec![empty; n.max(1)];
        let mut count: c_int = 0;
        // SAFETY: heuristic query over this matmul's descriptors.
        unsafe {
            ok((l.pref_create)(&mut pref), "preference")?;
            let ws: u64 = WORKSPACE as u64;
            let mut st = (l.pref_set)(pref, PREF_MAX_WORKSPACE, &ws as *const u64 as *const c_void, 8);
            for (i, a) in align.iter().enumerate() {
                if st == 0 {
                    st = (l.pref_set)(pref, PREF_ALIGN_A + i as c_int, a as *const u32 as *const c_void, 4);
                }
            }
            if st == 0 {
                st = (l.heuristic)(h, self.desc, self.la, self.lb, self.lc, self.ld, pref, res.len() as c_int, res.as_mut_ptr(), &mut count);
            }
            (l.pref_destroy)(pref);
            ok(st, &format!("heuristic for {}", self.spec.name))?;
        }
        let algos: Vec<Algo> = res[..count.max(0) as usize].iter().filter(|r| r.state == 0).map(|r| r.algo).collect();
        if algos.is_empty() {
            return Err(RuntimeError::Environment(format!("cuBLASLt has no algorithm for {}", self.spec.name)));
        }
        Ok(algos)
    }

    /// An algorithm that works for operands with (at least) these alignments.
    fn algo_for(&self, align: [u32; 4]) -> Result<Algo, RuntimeError> {
        let mut cache = self.algos.lock().unwrap();
        if let Some((_, a)) = cache.iter().find(|(al, _)| al.iter().zip(&align).all(|(x, y)| x <= y)) {
            return Ok(*a);
        }
        let a = self.heuristic(align, 1)?[0];
        cache.push((align, a));
        Ok(a)
    }

    /// Bytes each buffer the matmul touches needs, by buffer id (0 for buffers it does not).
    fn extents(&self) -> Vec<usize> {
        let s = &self.spec;
        let es = s.dtype.size();
        let mut need: Vec<usize> = Vec::new();
        let mut touch = |buf: u32, elems: i64| {
            let b = buf as usize;
            if need.len() <= b {
                need.resize(b + 1, 0);
            }
            need[b] = need[b].max(elems.max(0) as usize * es);
        };
        let span = |o: &Operand| o.offset + (s.batch as i64 - 1) * o.batch_stride + (o.rows as i64 - 1) * o.rs + (o.cols as i64 - 1) * o.cs + 1;
        touch(s.a.buf, span(&s.a));
        touch(s.b.buf, span(&s.b));
        if let Some(r) = &s.residual {
            touch(r.buf, span(r));
        }
        if let Some((buf, off)) = s.bias {
            touch(buf, off + s.b.cols as i64);
        }
        if let Some(buf) = s.bias_grad {
            touch(buf, if s.epilogue == Epilogue::BiasGradA { s.a.rows } else { s.b.cols } as i64);
        }
        touch(s.out, (s.batch * s.a.rows * s.b.cols) as i64);
        need
    }

    /// Times the heuristic's candidates for operands aligned as PyTorch allocates them on device `ordinal` and
    /// keeps the fastest (the heuristic's favourite is not always it: on the H100 it picked a
    /// 128x128 tile for TinyBlock's second linear where a 128x256 one runs in 3/4 of the time).
    fn tune(&self, ordinal: i32) -> Result<(), RuntimeError> {
        // Buffers are 256-byte aligned; a view at an offset is aligned as its offset is.
        let s = &self.spec;
        let es = s.dtype.size();
        let off = |o: &Operand| alignment(o.offset as usize * es);
        let align = [off(&s.b), off(&s.a), s.residual.as_ref().map_or(256, off), 256];
        let macs = s.batch as f64 * s.a.rows as f64 * s.a.cols as f64 * s.b.cols as f64;
        let best = if macs < TUNE_MIN_MACS { self.heuristic(align, 1)?[0] } else { self.fastest(ordinal, align)? };
        self.algos.lock().unwrap().push((align, best));
        Ok(())
    }

    /// The fastest of the heuristic's candidates on device `ordinal`, remembered per
    /// `tune_key`. Timing is an optimization: without it (no memory left for the scratch
    /// buffers, say) the heuristic's favourite is used and nothing is remembered.
    fn fastest(&self, ordinal: i32, align: [u32; 4]) -> Result<Algo, RuntimeError> {
        let key = self.tune_key();
        let scope = scope(ordinal)?;
        if let Some(a) = tuned().get(&scope, &key).and_then(|t| Algo::from_text(&t)) {
            return Ok(a);
        }
        let cands = self.heuristic(align, TUNE_CANDIDATES)?;
        if cands.len() == 1 {
            return Ok(cands[0]);
        }
        let mut sizes: Vec<(usize, u8)> = self.extents().into_iter().map(|n| (n, crate::cuda::FILL_FLOAT)).collect();
        let nbuf = sizes.len();
        sizes.push((WORKSPACE, crate::cuda::FILL_FLOAT));
        let timed = crate::cuda::time_candidates(ordinal, &sizes, cands.len(), &mut |i, ptrs, stream| {
            self.launch(&ptrs[..nbuf], stream, ptrs[nbuf], &cands[i])
        });
        let Ok(times) = timed else { return Ok(cands[0]) };
        let (i, t) = times.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
        if t.is_finite() {
            tuned().put(&scope, &key, &cands[i].to_text());
        }
        Ok(cands[i])
    }

    /// What decides the best algorithm: the descriptors' contents.
    fn tune_key(&self) -> String {
        let s = &self.spec;
        let o = |o: &Operand| (o.rows, o.cols, o.rs, o.cs, o.batch_stride, o.offset);
        format!(
            "{:?} {} {:?} {} {:?} {:?} {:?} {}",
            s.dtype,
            s.tf32,
            s.epilogue,
            s.bias.is_some(),
            o(&s.a),
            o(&s.b),
            s.residual.as_ref().map(o),
            s.batch
        )
    }

    /// Runs the matmul on `stream` with buffer pointers by id.
    pub fn run(&self, ptrs: &[usize], stream: usize, workspace: usize) -> Result<(), RuntimeError> {
        let s = &self.spec;
        let es = s.dtype.size() as i64;
        let at = |o: &Operand| (ptrs[o.buf as usize] as i64 + o.offset * es) as usize;
        let d = ptrs[s.out as usize];
        let c = s.residual.as_ref().map_or(d, at);
        let align = [alignment(at(&s.b)), alignment(at(&s.a)), alignment(c), alignment(d)];
        let algo = self.algo_for(align)?;
        self.launch(ptrs, stream, workspace, &algo)
    }

    /// One `cublasLtMatmul` with algorithm `algo`.
    fn launch(&self, ptrs: &[usize], stream: usize, workspace: usize, algo: &Algo) -> Result<(), RuntimeError> {
        let l = lt()?;
        let h = handle()?;
        let s = &self.spec;
        let es = s.dtype.size() as i64;
        let at = |o: &Operand| (ptrs[o.buf as usize] as i64 + o.offset * es) as usize as *const c_void;
        let (alpha, beta) = (1.0f32, if s.residual.is_some() { 1.0f32 } else { 0.0 });
        let _call = self.call.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: pointers come from live device buffers laid out as the spec says.
        unsafe {
            if let Some((buf, off)) = s.bias {
                let p = (ptrs[buf as usize] as i64 + off * es) as usize as *const c_void;
                ok((l.desc_set)(self.desc, DESC_BIAS_POINTER, &p as *const *const c_void as *const c_void, 8), "bias pointer")?;
            }
            // A bias-gradient epilogue writes its sums where the bias pointer points.
            if let Some(buf) = s.bias_grad {
                let p = ptrs[buf as usize] as *const c_void;
                ok((l.desc_set)(self.desc, DESC_BIAS_POINTER, &p as *const *const c_void as *const c_void, 8), "bias-gradient pointer")?;
            }
            let d = ptrs[s.out as usize] as *mut c_void;
            let c = s.residual.as_ref().map_or(d as *const c_void, at);
            let (pa, pb) = (at(&s.b), at(&s.a));
            let st = (l.matmul)(
                h, self.desc, &alpha as *const f32 as *const c_void, pa, self.la, pb, self.lb,
                &beta as *const f32 as *const c_void, c, self.lc, d, self.ld, algo, workspace as *mut c_void, WORKSPACE, stream as *mut c_void,
            );
            ok(st, &format!("matmul {}", s.name))
        }
    }
}
