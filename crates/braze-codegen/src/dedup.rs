//! [Note: kernel dedup] Kernels whose code is the same up to their names and the buffers
//! they are handed (the same block in each layer of a transformer) are emitted once: every
//! later copy calls the first one's function with its own buffers. The repeated layers of a
//! graph then cost the compiler (NVRTC or cc) once. Both targets pass buffers by position
//! (CUDA as kernel parameters, C through a per-kernel pointer array), so a kernel's text
//! with its buffer ids replaced by their positions is the key.

/// Where each kernel's function is: for kernel `i` with canonical text `keys[i]`, the index
/// of the first kernel with the same key (whose function it calls; `i` itself when it is the
/// first) and the translation unit defining that function. Distinct kernels fill units in
/// order, `per_unit` each, or as many as [`crate::units::kernels_per_unit`] gives for the
/// number of distinct kernels (what the compiler runs on) and NVRTC's minimum, when
/// `per_unit` is `None`.
pub(crate) fn assign(keys: &[String], per_unit: Option<usize>) -> Vec<(usize, usize)> {
    let mut first: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let owner: Vec<usize> = keys.iter().enumerate().map(|(i, k)| *first.entry(k.as_str()).or_insert(i)).collect();
    let per = per_unit.unwrap_or_else(|| crate::units::kernels_per_unit(first.len(), crate::units::MIN_KERNELS_PER_NVRTC_UNIT)).max(1);
    let mut unit_of = vec![0; keys.len()];
    let mut n = 0;
    for (i, &o) in owner.iter().enumerate() {
        if o == i {
            unit_of[i] = n / per;
            n += 1;
        }
    }
    owner.iter().map(|&o| (o, unit_of[o])).collect()
}

/// A kernel's code with its name, its leading comment and its buffer parameters' ids
/// (`b17` -> `p0`, in parameter order; also in the CUDA staging arrays' names, `s3_17` ->
/// `s3_p0`) taken out: equal keys mean interchangeable functions.
pub(crate) fn canonical(text: &str, name: &str, bufs: &[u32]) -> String {
    let body = text.split_once('\n').map_or(text, |(first, rest)| if first.starts_with("/*") { rest } else { text });
    let body = body.replace(name, "K");
    let pos: std::collections::HashMap<u32, usize> = bufs.iter().enumerate().map(|(i, &b)| (b, i)).collect();
    let mut out = String::with_capacity(body.len());
    let bytes = body.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let starts_ident = c == b'b' && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts_ident {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j].is_ascii_digit() {
                j += 1;
            }
            let ends = j == bytes.len() || !(bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_');
            if j > i + 1 && ends {
                if let Some(p) = body[i + 1..j].parse::<u32>().ok().and_then(|b| pos.get(&b)) {
                    out.push_str(&format!("p{p}"));
                    i = j;
                    continue;
                }
            }
        }
        // A staging array `s<value>_<buffer id>` (CUDA wide stores).
        let starts_staging = c == b's' && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts_staging {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j].is_ascii_digit() {
                j += 1;
            }
            if j > i + 1 && j < bytes.len() && bytes[j] == b'_' {
                let mut e = j + 1;
                while e < bytes.len() && bytes[e].is_ascii_digit() {
                    e += 1;
                }
                let ends = e == bytes.len() || !(bytes[e].is_ascii_alphanumeric() || bytes[e] == b'_');
                if e > j + 1 && ends {
                    if let Some(p) = body[j + 1..e].parse::<u32>().ok().and_then(|b| pos.get(&b)) {
                        out.push_str(&format!("{}_p{p}", &body[i..j]));
                        i = e;
                        continue;
                    }
                }
            }
        }
        out.push(c as char);
        i += 1;
    }
    out
}

/// The buffer ids of `bufs` in the order `body` first names them (`b<id>`); any it never
/// names last, by id.
pub(crate) fn first_use_order(body: &str, bufs: &[u32]) -> Vec<u32> {
    let mut order: Vec<u32> = Vec::with_capacity(bufs.len());
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts = b[i] == b'b' && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'));
        if starts {
            let mut j = i + 1;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            let ends = j > i + 1 && (j == b.len() || !(b[j].is_ascii_alphanumeric() || b[j] == b'_'));
            if ends {
                if let Ok(id) = body[i + 1..j].parse::<u32>() {
                    if bufs.contains(&id) && !order.contains(&id) {
                        order.push(id);
                    }
                }
            }
            i = j;
        } else {
            i += 1;
        }
    }
    let unused: Vec<u32> = bufs.iter().copied().filter(|id| !order.contains(id)).collect();
    order.extend(unused);
    order
}

#[cfg(test)]
mod tests {
    use super::canonical;

    #[test]
    fn names_buffer_ids_and_staging_arrays_taken_out() {
        let a = "/* k_3: stores %9 */\nvoid k_3(float* b7, float* b2) { float s0_2[4]; s0_2[0] = b7[0]; b2[0] = s0_2[0]; }";
        let b = "/* k_8: stores %4 */\nvoid k_8(float* b1, float* b5) { float s0_5[4]; s0_5[0] = b1[0]; b5[0] = s0_5[0]; }";
        assert_eq!(canonical(a, "k_3", &[7, 2]), canonical(b, "k_8", &[1, 5]));
        // The same code with its parameters the other way round is another function.
        assert_ne!(canonical(a, "k_3", &[7, 2]), canonical(b, "k_8", &[5, 1]));
    }
}
