//! Copying a tensor into the layout a compiled graph's kernels were built for, on the GPU, in
//! one launch from Rust. A graph input whose strides differ from the compiled ones (an
//! expanded gradient from `loss.sum().backward()`, a transposed view) is copied before the
//! graph runs; PyTorch's own `copy_` of such a view costs tens of microseconds of host time
//! (TensorIterator set-up), this costs one kernel launch. The kernel is one fixed source,
//! compiled by NVRTC once per architecture (and cached on disk like every module).

use super::{check, compile_cubin, get_function, device_info, driver, ensure_current, make_primary_current, CuContext, CuFunction, CuModule, CuStream};
use crate::RuntimeError;
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::{Mutex, OnceLock};

/// The most dimensions a relayout handles (the caller copies higher ranks itself).
pub const MAX_RANK: usize = 8;

pub const SOURCE: &str = r#"
struct BrazeLayout { long long size[8]; long long src[8]; long long dst[8]; int rank; };
template <typename T>
__device__ void braze_relayout(const T* __restrict__ src, T* __restrict__ dst, long long n, const BrazeLayout& l) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long r = i, s = 0, d = 0;
    for (int k = l.rank - 1; k >= 0; --k) {
      long long c = r % l.size[k];
      r /= l.size[k];
      s += c * l.src[k];
      d += c * l.dst[k];
    }
    dst[d] = src[s];
  }
}
extern "C" __global__ void braze_relayout_1(const unsigned char* s, unsigned char* d, long long n, BrazeLayout l) { braze_relayout(s, d, n, l); }
extern "C" __global__ void braze_relayout_2(const unsigned short* s, unsigned short* d, long long n, BrazeLayout l) { braze_relayout(s, d, n, l); }
extern "C" __global__ void braze_relayout_4(const unsigned int* s, unsigned int* d, long long n, BrazeLayout l) { braze_relayout(s, d, n, l); }
extern "C" __global__ void braze_relayout_8(const unsigned long long* s, unsigned long long* d, long long n, BrazeLayout l) { braze_relayout(s, d, n, l); }
"#;

#[repr(C)]
struct Layout {
    size: [i64; MAX_RANK],
    src: [i64; MAX_RANK],
    dst: [i64; MAX_RANK],
    rank: i32,
}

struct Loaded {
    ctx: CuContext,
    /// Kernels for 1-, 2-, 4- and 8-byte elements.
    fns: [CuFunction; 4],
    max_blocks: u32,
    _module: CuModule,
}

// SAFETY: module and function handles may be used from any thread with the context current.
unsafe impl Send for Loaded {}

fn loaded() -> &'static Mutex<HashMap<i32, Loaded>> {
    static L: OnceLock<Mutex<HashMap<i32, Loaded>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

fn load(ordinal: i32) -> Result<Loaded, RuntimeError> {
    let d = driver()?;
    let (arch, sms) = device_info(ordinal)?;
    let (cubin, _) = compile_cubin(SOURCE, &arch, env!("CARGO_PKG_VERSION"))?;
    let mut module: CuModule = std::ptr::null_mut();
    // SAFETY: driver API as documented; the cubin outlives cuModuleLoadData.
    unsafe {
        let (ctx, _) = make_primary_current(d, ordinal)?;
        check(d, (d.load)(&mut module, cubin.as_ptr() as *const c_void), "cuModuleLoadData (relayout)")?;
        let mut fns: [CuFunction; 4] = [std::ptr::null_mut(); 4];
        for (f, bytes) in fns.iter_mut().zip([1, 2, 4, 8]) {
            *f = get_function(d, module, &format!("braze_relayout_{bytes}"))?;
        }
        Ok(Loaded { ctx, fns, max_blocks: 8 * sms.max(1) as u32, _module: module })
    }
}

/// Copies the `shape` tensor at `src` (element strides `src_strides`) to `dst` (element
/// strides `dst_strides`) on `stream` of device `ordinal`; elements are `elem` bytes.
#[allow(clippy::too_many_arguments)]
pub fn relayout(ordinal: i32, src: usize, src_strides: &[i64], dst: usize, dst_strides: &[i64], shape: &[i64], elem: usize, stream: usize) -> Result<(), RuntimeError> {
    let rank = shape.len();
    if rank > MAX_RANK || src_strides.len() != rank || dst_strides.len() != rank {
        return Err(RuntimeError::Launch(format!("relayout of rank {rank}")));
    }
    let which = match elem {
        1 => 0,
        2 => 1,
        4 => 2,
        8 => 3,
        _ => return Err(RuntimeError::Launch(format!("relayout of {elem}-byte elements"))),
    };
    let n: i64 = shape.iter().product();
    if n == 0 {
        return Ok(());
    }
    let mut map = loaded().lock().unwrap_or_else(|e| e.into_inner());
    let l = match map.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(load(ordinal)?),
    };
    let mut lay = Layout { size: [1; MAX_RANK], src: [0; MAX_RANK], dst: [0; MAX_RANK], rank: rank as i32 };
    lay.size[..rank].copy_from_slice(shape);
    lay.src[..rank].copy_from_slice(src_strides);
    lay.dst[..rank].copy_from_slice(dst_strides);
    let d = driver()?;
    let (mut s, mut t, mut count) = (src as u64, dst as u64, n);
    let mut params: [*mut c_void; 4] = [
        &mut s as *mut u64 as *mut c_void,
        &mut t as *mut u64 as *mut c_void,
        &mut count as *mut i64 as *mut c_void,
        &mut lay as *mut Layout as *mut c_void,
    ];
    let blocks = (n as u64).div_ceil(256).clamp(1, l.max_blocks as u64) as c_uint;
    // SAFETY: the kernel's parameters are exactly (src, dst, n, layout); the caller passes
    // live device buffers large enough for the layouts given.
    unsafe {
        ensure_current(d, l.ctx)?;
        let rc = (d.launch)(l.fns[which], blocks, 1, 1, 256, 1, 1, 0, stream as CuStream, params.as_mut_ptr(), std::ptr::null_mut());
        check(d, rc, "launch of braze_relayout")
    }
}
