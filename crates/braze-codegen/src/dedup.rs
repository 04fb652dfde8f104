//! [Note: kernel dedup] Kernels whose code is the same up to their names and the buffers
//! they are handed (the same block in each layer of a transformer) are emitted once: every
//! later copy calls the first one's function with its own buffers. The repeated layers of a
//! graph then cost the compiler (NVRTC or cc) once. Both targets pass buffers by position
//! (CUDA as kernel parameters, C through a per-kernel pointer array), so a kernel's text
//! with its buffer ids replaced by their positions is the key.

/// For each kernel with canonical text `keys[i]`, the index of the first kernel with the
/// same key: the one whose function it calls (`i` itself when it is the first).
pub(crate) fn owners(keys: &[String]) -> Vec<usize> {
    let mut first: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    keys.iter().enumerate().map(|(i, k)| *first.entry(k.as_str()).or_insert(i)).collect()
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
    let buf_at = |from: usize, to: usize| body[from..to].parse::<u32>().ok().and_then(|b| pos.get(&b));
    let mut i = 0;
    while i < bytes.len() {
        if let Some(j) = numbered(bytes, i, b'b').filter(|&j| !continues(bytes, j)) {
            if let Some(p) = buf_at(i + 1, j) {
                out.push_str(&format!("p{p}"));
                i = j;
                continue;
            }
        }
        // A staging array `s<value>_<buffer id>` (CUDA wide stores).
        if let Some(j) = numbered(bytes, i, b's').filter(|&j| bytes.get(j) == Some(&b'_')) {
            let e = digits_end(bytes, j + 1);
            if e > j + 1 && !continues(bytes, e) {
                if let Some(p) = buf_at(j + 1, e) {
                    out.push_str(&format!("{}_p{p}", &body[i..j]));
                    i = e;
                    continue;
                }
            }
        }
        out.push(bytes[i] as char);
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
        match numbered(b, i, b'b') {
            Some(j) => {
                if let Some(id) = (!continues(b, j)).then(|| body[i + 1..j].parse::<u32>().ok()).flatten() {
                    if bufs.contains(&id) && !order.contains(&id) {
                        order.push(id);
                    }
                }
                i = j;
            }
            None => i += 1,
        }
    }
    let unused: Vec<u32> = bufs.iter().copied().filter(|id| !order.contains(id)).collect();
    order.extend(unused);
    order
}

fn ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Whether an identifier goes on at byte `j` of `b`.
fn continues(b: &[u8], j: usize) -> bool {
    b.get(j).is_some_and(|&c| ident_char(c))
}

/// The end of the digits of `b` from `from`.
fn digits_end(b: &[u8], from: usize) -> usize {
    from + b[from.min(b.len())..].iter().take_while(|c| c.is_ascii_digit()).count()
}

/// Where an identifier that starts at `i` with `letter` and one or more digits (`b17`,
/// `s3` of `s3_17`) has its digits end; None when none starts there.
fn numbered(b: &[u8], i: usize, letter: u8) -> Option<usize> {
    if b[i] != letter || (i > 0 && ident_char(b[i - 1])) {
        return None;
    }
    let j = digits_end(b, i + 1);
    (j > i + 1).then_some(j)
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
