//! Loads, stores and the 16 x 16 transpose between rows of samples and registers of
//! lanes.

use std::arch::x86_64::*;

use super::LANES;

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn load(v: &[f32; LANES]) -> __m512 {
    // SAFETY: `v` is 16 readable floats, and the unaligned load has no alignment
    // requirement.
    unsafe { _mm512_loadu_ps(v.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn store(v: &mut [f32; LANES], x: __m512) {
    // SAFETY: `v` is 16 writable floats, exclusively borrowed; unaligned store.
    unsafe { _mm512_storeu_ps(v.as_mut_ptr(), x) }
}

/// The 16 floats at `s[at..]` as an array (panics past the end, like any index).
#[inline]
fn sixteen(s: &[f32], at: usize) -> &[f32; LANES] {
    &s[at..at + LANES].as_chunks::<LANES>().0[0]
}

#[inline]
fn sixteen_mut(s: &mut [f32], at: usize) -> &mut [f32; LANES] {
    &mut s[at..at + LANES].as_chunks_mut::<LANES>().0[0]
}

/// Transposes 16 registers in place: afterwards `r[i]` lane `j` is the old `r[j]` lane
/// `i`. Interleave pairs of rows, then pairs of pairs, then 128-bit quarters twice.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn transpose(r: &mut [__m512; 16]) {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for i in 0..4 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        r[4 * i] = _mm512_shuffle_ps::<0x44>(a, c);
        r[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
        r[4 * i + 2] = _mm512_shuffle_ps::<0x44>(b, d);
        r[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
    }
    for h in 0..2 {
        for i in 0..4 {
            t[8 * h + i] = _mm512_shuffle_f32x4::<0x88>(r[8 * h + i], r[8 * h + i + 4]);
            t[8 * h + i + 4] = _mm512_shuffle_f32x4::<0xDD>(r[8 * h + i], r[8 * h + i + 4]);
        }
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[i + 8]);
        r[i + 8] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[i + 8]);
    }
}

/// Rows to lanes: `lanes[c]` lane `s` = `rows[s * stride + c]`, for 16 rows and columns
/// `0..cols`. Whole groups of 16 columns go through the register transpose, the rest one
/// value at a time.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn to_lanes(rows: &[f32], stride: usize, cols: usize, lanes: &mut [[f32; LANES]]) {
    let whole = cols / LANES * LANES;
    for c in (0..whole).step_by(LANES) {
        let mut r = [_mm512_setzero_ps(); 16];
        for (s, r) in r.iter_mut().enumerate() {
            *r = load(sixteen(rows, s * stride + c));
        }
        transpose(&mut r);
        for (k, r) in r.into_iter().enumerate() {
            store(&mut lanes[c + k], r);
        }
    }
    for (c, lane) in lanes.iter_mut().enumerate().take(cols).skip(whole) {
        for (s, v) in lane.iter_mut().enumerate() {
            *v = rows[s * stride + c];
        }
    }
}

/// Lanes to rows, the inverse of [`to_lanes`]: `rows[s * stride + offset + c]` =
/// `lanes[c]` lane `s`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn from_lanes(
    lanes: &[[f32; LANES]],
    cols: usize,
    rows: &mut [f32],
    stride: usize,
    offset: usize,
) {
    from_lanes_with(lanes, cols, rows, stride, offset, false)
}

/// [`from_lanes`] with streaming stores where the whole groups land on 64-byte aligned
/// addresses: for an output that is read again only after much else has passed through
/// the cache, so that writing it does not first read every line from memory. The caller
/// fences ([`_mm_sfence`]) before the output is read.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn from_lanes_streaming(
    lanes: &[[f32; LANES]],
    cols: usize,
    rows: &mut [f32],
    stride: usize,
    offset: usize,
) {
    let aligned =
        (rows.as_ptr() as usize + offset * 4).is_multiple_of(64) && stride.is_multiple_of(LANES);
    from_lanes_with(lanes, cols, rows, stride, offset, aligned)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn from_lanes_with(
    lanes: &[[f32; LANES]],
    cols: usize,
    rows: &mut [f32],
    stride: usize,
    offset: usize,
    stream: bool,
) {
    let whole = cols / LANES * LANES;
    for c in (0..whole).step_by(LANES) {
        let mut r = [_mm512_setzero_ps(); 16];
        for (k, r) in r.iter_mut().enumerate() {
            *r = load(&lanes[c + k]);
        }
        transpose(&mut r);
        for (s, r) in r.into_iter().enumerate() {
            let dst = sixteen_mut(rows, s * stride + offset + c);
            if stream {
                // SAFETY: `dst` is 16 writable floats, and `stream` is set only when the
                // buffer start, the offset and the row stride keep every group on a
                // 64-byte boundary, as the streaming store requires.
                unsafe { _mm512_stream_ps(dst.as_mut_ptr(), r) }
            } else {
                store(dst, r);
            }
        }
    }
    for (c, lane) in lanes.iter().enumerate().take(cols).skip(whole) {
        for (s, &v) in lane.iter().enumerate() {
            rows[s * stride + offset + c] = v;
        }
    }
}
