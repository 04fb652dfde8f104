//! [Note: CPU matmuls] f32 matmuls on the CPU through the BLAS PyTorch itself calls: the
//! `sgemm_` that PyTorch's CPU library exports (MKL in the x86-64 wheels), found in the
//! already loaded `libtorch_cpu` (no library of our own, no second copy of MKL). A matmul is
//! then an item of a run of kernels, called from Rust with the run's pointers, where it was an
//! ATen call from Python (`aten.addmm` cost ~10 µs of host time per call on the 2-core build
//! machine, for a 16x64 product).
//!
//! It computes what ATen's `addmm` computes, the same way: the bias is written into the
//! output rows and the product is accumulated onto them (beta = 1); a residual is added and
//! the activation applied after the product, in that order (`act(a @ b + bias + r)`, the
//! IR's `matmul`). The thread count is MKL's own, which `torch.set_num_threads` sets.
//! Where no `sgemm_` is found (another BLAS, another platform) lowering leaves matmuls to
//! ATen ([`available`]).

use crate::matmul::{MatmulExprs, MatmulSpec, Operand};
use crate::RuntimeError;
use braze_ir::{DType, Epilogue};
use std::ffi::c_char;
use std::sync::OnceLock;

/// Fortran BLAS `sgemm_`: column-major `c = alpha * op(a) @ op(b) + beta * c`.
type Sgemm = unsafe extern "C" fn(
    transa: *const c_char,
    transb: *const c_char,
    m: *const i32,
    n: *const i32,
    k: *const i32,
    alpha: *const f32,
    a: *const f32,
    lda: *const i32,
    b: *const f32,
    ldb: *const i32,
    beta: *const f32,
    c: *mut f32,
    ldc: *const i32,
);

/// MKL's `sgemm_batch_` (one group): `group_size` products of the same sizes and flags, each
/// with its own pointers, which MKL spreads over its threads. [Note: batched CPU matmuls]
/// A batch of small products (Swin's window attention: 384 products of 49 x 32 x 49) called
/// `sgemm_` once per item, each call a parallel region of its own: 3.5 ms against ATen's
/// `bmm` at 1.2 ms on the 2-core machine, and Swin-T's CPU training step at 0.73x eager.
type SgemmBatch = unsafe extern "C" fn(
    transa: *const c_char,
    transb: *const c_char,
    m: *const i32,
    n: *const i32,
    k: *const i32,
    alpha: *const f32,
    a: *const *const f32,
    lda: *const i32,
    b: *const *const f32,
    ldb: *const i32,
    beta: *const f32,
    c: *const *mut f32,
    ldc: *const i32,
    group_count: *const i32,
    group_size: *const i32,
);

/// The address of `sym` in the loaded `libtorch_cpu`, or why there is none.
fn torch_symbol(sym: &[u8]) -> Result<usize, String> {
    // Only a library PyTorch has loaded already (RTLD_NOLOAD): its BLAS, not another.
    let flags = libloading::os::unix::RTLD_NOW | libc_rtld_noload();
    for name in ["libtorch_cpu.so", "libtorch_cpu.dylib"] {
        // SAFETY: RTLD_NOLOAD opens nothing new; it returns a handle to a loaded library.
        if let Ok(lib) = unsafe { libloading::os::unix::Library::open(Some(name), flags) } {
            // SAFETY: only the address is taken here; callers give it its BLAS signature.
            if let Ok(s) = unsafe { lib.get::<*const ()>(sym) } {
                let addr = *s as usize;
                // The library stays loaded (PyTorch holds it); keep our handle's count too.
                std::mem::forget(lib);
                return Ok(addr);
            }
        }
    }
    Err(format!("no {} in a loaded libtorch_cpu (PyTorch built without MKL or another BLAS)", String::from_utf8_lossy(sym)))
}

/// The loaded library's `sgemm_batch_` (MKL's), when it has one.
fn sgemm_batch() -> Option<SgemmBatch> {
    static S: OnceLock<Option<usize>> = OnceLock::new();
    // SAFETY: the address of MKL's `sgemm_batch_`, whose signature `SgemmBatch` declares,
    // from a library that stays loaded.
    S.get_or_init(|| torch_symbol(b"sgemm_batch_").ok()).map(|a| unsafe { std::mem::transmute::<usize, SgemmBatch>(a) })
}

/// The loaded library's `sgemm_`, or why there is none.
fn sgemm() -> Result<Sgemm, RuntimeError> {
    static S: OnceLock<Result<usize, String>> = OnceLock::new();
    let f = S.get_or_init(|| torch_symbol(b"sgemm_"));
    match f {
        // SAFETY: the address of `sgemm_`, resolved above from a library that stays loaded.
        Ok(a) => Ok(unsafe { std::mem::transmute::<usize, Sgemm>(*a) }),
        Err(e) => Err(RuntimeError::Environment(e.clone())),
    }
}

const fn libc_rtld_noload() -> i32 {
    if cfg!(target_os = "macos") { 0x10 } else { 0x4 }
}

/// Whether CPU matmuls can run here (an `sgemm_` in the loaded PyTorch).
pub fn available() -> bool {
    sgemm().is_ok()
}

/// How BLAS sees one row-major-indexed operand: (transpose flag, leading dimension), for the
/// column-major matrix it is passed as (the operand transposed, for a row-major operand).
/// None when neither its rows nor its columns are unit-stride.
fn blas_view(o: &Operand) -> Option<(u8, i32)> {
    let (r, c) = (o.rows as i64, o.cols as i64);
    let ld = |v: i64| i32::try_from(v).ok();
    if (o.cs == 1 || c <= 1) && (r <= 1 || o.rs >= c.max(1)) {
        return ld(if r <= 1 { c.max(1) } else { o.rs }).map(|l| (b'N', l));
    }
    if (o.rs == 1 || r <= 1) && (c <= 1 || o.cs >= r.max(1)) {
        return ld(if c <= 1 { r.max(1) } else { o.cs }).map(|l| (b'T', l));
    }
    None
}

/// One call's `sgemm_` arguments: the row-major product `out = a @ b` is the column-major
/// `out^T = b^T @ a^T`, so BLAS's A is our `b` and its B our `a`.
struct Call {
    spec: MatmulSpec,
    ta: u8,
    lda: i32,
    tb: u8,
    ldb: i32,
    m: i32,
    n: i32,
    k: i32,
}

fn call_of(spec: MatmulSpec) -> Result<Call, RuntimeError> {
    let bad = |why: &str| Err(RuntimeError::Environment(format!("{}: {why}", spec.name)));
    if spec.dtype != DType::F32 {
        return bad("CPU matmuls are f32");
    }
    let (Some((ta, lda)), Some((tb, ldb))) = (blas_view(&spec.b), blas_view(&spec.a)) else {
        return bad("an operand with neither unit-stride rows nor columns");
    };
    let dims = (i32::try_from(spec.b.cols), i32::try_from(spec.a.rows), i32::try_from(spec.a.cols));
    let (Ok(m), Ok(n), Ok(k)) = dims else { return bad("a dimension past 2^31") };
    if spec.a.cols != spec.b.rows {
        return bad("operand shapes do not chain");
    }
    Ok(Call { spec, ta, lda, tb, ldb, m, n, k })
}

/// A matmul item of a CPU module: its arguments worked out once when its sizes are static,
/// per call from the size symbols otherwise.
pub struct CpuMatmul {
    pub exprs: MatmulExprs,
    f: Sgemm,
    batched: Option<SgemmBatch>,
    fixed: Option<Call>,
}

pub fn prepare(exprs: MatmulExprs) -> Result<CpuMatmul, RuntimeError> {
    if exprs.dtype != DType::F32 {
        return Err(RuntimeError::Environment(format!("{}: CPU matmuls are f32", exprs.name)));
    }
    if exprs.bias_grad.is_some() || matches!(exprs.epilogue, Epilogue::BiasGradA | Epilogue::BiasGradB) {
        return Err(RuntimeError::Environment(format!("{}: bias-gradient epilogues run on the GPU only", exprs.name)));
    }
    let f = sgemm()?;
    let fixed = exprs.eval(&[]).map(call_of).transpose()?;
    Ok(CpuMatmul { exprs, f, batched: sgemm_batch(), fixed })
}

impl CpuMatmul {
    /// Runs the matmul on the buffers `ptrs` (by id).
    ///
    /// # Safety
    /// Every buffer the spec names must be in `ptrs` and laid out as the plan says.
    pub unsafe fn run(&self, ptrs: &[usize], syms: &[i64]) -> Result<(), RuntimeError> {
        let per_call;
        let c = match &self.fixed {
            Some(c) => c,
            None => {
                let spec = self.exprs.eval(syms).ok_or_else(|| RuntimeError::Launch(format!("{}: sizes of this call unknown", self.exprs.name)))?;
                per_call = call_of(spec)?;
                &per_call
            }
        };
        // SAFETY: guaranteed by the caller.
        unsafe { self.call(c, ptrs) }
    }

    unsafe fn call(&self, c: &Call, ptrs: &[usize]) -> Result<(), RuntimeError> {
        let s = &c.spec;
        let ptr = |b: u32| ptrs.get(b as usize).copied().filter(|&p| p != 0).ok_or_else(|| RuntimeError::Launch(format!("{}: buffer {b} has no pointer", s.name)));
        let (rows, cols) = (s.a.rows as usize, s.b.cols as usize);
        if rows * cols * s.batch as usize == 0 {
            // An empty result (a batch of zero rows under dynamic shapes): nothing to write,
            // and empty operands may have no memory at all.
            return Ok(());
        }
        let pout = ptr(s.out)? as *mut f32;
        // Empty operands (k = 0: the result is the bias or zeros) are never read.
        let (pa, pb) = if c.k == 0 { (std::ptr::null(), std::ptr::null()) } else { (ptr(s.a.buf)? as *const f32, ptr(s.b.buf)? as *const f32) };
        let bias = match s.bias {
            Some((b, off)) => Some(ptr(b)? as *const f32).map(|p| unsafe { p.offset(off as isize) }),
            None => None,
        };
        let residual = match &s.residual {
            Some(r) => Some((ptr(r.buf)? as *const f32, r)),
            None => None,
        };
        let per = rows * cols;
        let alpha = 1.0f32;
        let beta = if bias.is_some() { 1.0f32 } else { 0.0 };
        let (ta, tb) = (c.ta as c_char, c.tb as c_char);
        let batch = s.batch as usize;
        let ldc = c.m.max(1);
        // SAFETY (this block and the loops below): offsets within the buffers the plan sized
        // for this matmul.
        unsafe {
            let operands = |bi: usize| {
                let a = pb.offset((s.b.offset + bi as i64 * s.b.batch_stride) as isize);
                let b = pa.offset((s.a.offset + bi as i64 * s.a.batch_stride) as isize);
                (a, b, pout.add(bi * per))
            };
            for bi in 0..batch {
                let out = pout.add(bi * per);
                if let Some(bias) = bias {
                    let row = std::slice::from_raw_parts(bias, cols);
                    for r in 0..rows {
                        std::slice::from_raw_parts_mut(out.add(r * cols), cols).copy_from_slice(row);
                    }
                } else if c.k == 0 {
                    std::ptr::write_bytes(out, 0, per);
                }
            }
            match self.batched {
                // [Note: batched CPU matmuls]: one call for the batch.
                Some(fb) if c.k > 0 && batch > 1 => {
                    let (mut av, mut bv, mut cv) = (Vec::with_capacity(batch), Vec::with_capacity(batch), Vec::with_capacity(batch));
                    for bi in 0..batch {
                        let (a, b, o) = operands(bi);
                        av.push(a);
                        bv.push(b);
                        cv.push(o);
                    }
                    let (groups, size) = (1i32, i32::try_from(batch).map_err(|_| RuntimeError::Launch(format!("{}: a batch past 2^31", s.name)))?);
                    fb(&ta, &tb, &c.m, &c.n, &c.k, &alpha, av.as_ptr(), &c.lda, bv.as_ptr(), &c.ldb, &beta, cv.as_ptr(), &ldc, &groups, &size);
                }
                _ if c.k > 0 => {
                    for bi in 0..batch {
                        let (a, b, out) = operands(bi);
                        (self.f)(&ta, &tb, &c.m, &c.n, &c.k, &alpha, a, &c.lda, b, &c.ldb, &beta, out, &ldc);
                    }
                }
                _ => {}
            }
            for bi in 0..batch {
                let out = pout.add(bi * per);
                if let Some((pr, r)) = residual {
                    let base = pr.offset((r.offset + bi as i64 * r.batch_stride) as isize);
                    for i in 0..rows {
                        let o = std::slice::from_raw_parts_mut(out.add(i * cols), cols);
                        for (j, v) in o.iter_mut().enumerate() {
                            *v += *base.offset((i as i64 * r.rs + j as i64 * r.cs) as isize);
                        }
                    }
                }
                let o = std::slice::from_raw_parts_mut(out, per);
                match s.epilogue {
                    Epilogue::None | Epilogue::BiasGradA | Epilogue::BiasGradB => {}
                    Epilogue::Relu => o.iter_mut().for_each(|v| *v = if *v > 0.0 || v.is_nan() { *v } else { 0.0 }),
                    Epilogue::Gelu => o.iter_mut().for_each(|v| {
                        let x = *v;
                        *v = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh());
                    }),
                }
            }
        }
        Ok(())
    }
}
