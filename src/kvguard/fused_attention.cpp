// Decode attention over kvguard's quantized KV codes, without dequantizing the stored history into a tensor.
//
// Two kernels, each reading a part's codes exactly once per decode step (kvguard/fused_attention.py merges
// them with the full-precision segments and does the softmax in between). A part holds h of the layer's H_kv
// heads (``heads`` maps them, empty = all) and T tokens stored from column ``column`` of the layer's N columns:
//
//   key_scores(scores [B, H_kv, R, N] f32, column, heads, q [B, h, R, D] f32, codes, scale, zero, table, bits,
//              tokens_per_row, channels_per_entry, correct, signs, cos, sin)
//       writes scores[b, heads[i], r, column + t] = sum_d q[b, i, r, d] * (code[t, d] * s(t, d) + z(t, d))
//       and, with `correct`, adds the softmax-bias correction -1/2 sum_d q[b, i, r, d]^2 s(t, d)^2 / 12
//       (kvguard/score_bias.py), computed once per scale row. Keys stored before RoPE (CacheConfig.prerope_keys)
//       pass `cos` / `sin` [T, D] f32, RoPE's rows at the part's positions, and `signs` [h, D] f32 where they
//       are stored rotated: each dequantized key is rotated back (x H / sqrt(D) * s, kvguard/rotation.py) and
//       turned by its position (x * cos + rotate_half(x) * sin, kvguard/rope.py) before the dot products,
//       since a position-dependent turn cannot move onto the query once for all keys
//   value_accumulate(p [B, H_kv, R, N] f32, column, heads, codes, scale, zero, table, bits, tokens_per_row,
//                    channels_per_entry, head_dim)
//       -> out [B, h, R, D] f32:  out[b, i, r, d] = sum_t p[b, heads[i], r, column + t] * (code[t, d] * s + z)
//
// R is every query row a KV head serves (grouped-query heads x query tokens), so codes are read once for all
// of them. codes: [B, h, T, D * bits / 8] uint8, packed as kvguard/packing.py packs them (INT8: the int8 codes
// viewed as uint8; INT4: even channel in the low nibble; INT2: four per byte, low bits first; INT3: eight codes
// in a little-endian 24-bit word of three bytes). scale / zero: float16 [B, h, rows, entries] (any strides,
// the last axis contiguous), s(t, d) = scale[t / tokens_per_row, d / channels_per_entry]: keys grouped per
// channel over G tokens pass (G, 1), values grouped per token over G channels pass (1, G); a calibrated INT8
// scale shared by every token comes expanded with a zero row stride. zero is empty for symmetric INT8.
// One-byte scales (kvguard/scale_codes.py) come as their codes: scale uint8, zero int8, and `table` the float16
// value of each scale code (empty for float16 scales); they are decoded here as scale_codes.py decodes them
// (s = table[code], z = float16(zero code * s / 16)), so no decoded copy is made at every step.
// Codes are dequantized exactly as QuantizedTensor.dequantize does (code * s + z in float32, a product then a
// sum), eight channels at a time with AVX2, so the results equal the reference up to float summation order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxDim = 512;     // head_dim bound of the row buffers
constexpr int64_t kTokenBlock = 256; // tokens per parallel task (a multiple of every group size used)

struct Codes {
  const uint8_t* data;
  int64_t sb, sh, st;  // element strides of batch, head, token
  int bits;
};

struct Scales {
  const at::Half* scale;
  const at::Half* zero;  // nullptr: symmetric
  int64_t sb, sh, sr;    // strides of batch, head, row (shared by scale and zero)
  int64_t zb, zh, zr;
  int64_t tokens_per_row, channels_per_entry, entries;
  const uint8_t* scale_code = nullptr;  // one-byte scales: their codes and the table they index
  const int8_t* zero_code = nullptr;
  const at::Half* table = nullptr;
};

constexpr float kZeroFraction = 16.0f;  // scale_codes.ZERO_FRACTION: a zero code counts 1/16 of its group's step

// The scale at element offset i of the scale tensor, and the zero point at offset j of the zero tensor
// (of a group whose scale is `scale`).
inline float scale_value(const Scales& s, int64_t i) {
  return s.table ? static_cast<float>(s.table[s.scale_code[i]]) : static_cast<float>(s.scale[i]);
}

inline float zero_value(const Scales& s, int64_t j, float scale) {
  if (s.zero_code) return static_cast<float>(at::Half(static_cast<float>(s.zero_code[j]) * scale / kZeroFraction));
  return s.zero ? static_cast<float>(s.zero[j]) : 0.0f;
}

Codes codes_of(const torch::Tensor& codes, int bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "codes must be uint8 (int8 codes viewed as uint8)");
  TORCH_CHECK(codes.dim() == 4 && codes.stride(3) == 1, "codes must be [B, h, T, bytes] with a contiguous last axis");
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, "bits has to be one of [2, 3, 4, 8] but got ", bits);
  return {codes.data_ptr<uint8_t>(), codes.stride(0), codes.stride(1), codes.stride(2), bits};
}

Scales one_byte_scales_of(const torch::Tensor& scale, const torch::Tensor& zero, const torch::Tensor& table,
                          int64_t tokens_per_row, int64_t channels_per_entry) {
  TORCH_CHECK(table.scalar_type() == torch::kHalf && table.dim() == 1 && table.numel() == 256 && table.is_contiguous(),
              "table must be a contiguous float16 tensor of 256 entries (one per scale code)");
  TORCH_CHECK(zero.scalar_type() == torch::kChar && zero.sizes() == scale.sizes() && zero.stride(3) == 1,
              "one-byte zero points must be int8 codes with the scale codes' shape and a contiguous last axis");
  Scales s{nullptr, nullptr, scale.stride(0), scale.stride(1), scale.stride(2), zero.stride(0), zero.stride(1),
           zero.stride(2), tokens_per_row, channels_per_entry, scale.size(3)};
  s.scale_code = scale.data_ptr<uint8_t>();
  s.zero_code = zero.data_ptr<int8_t>();
  s.table = table.data_ptr<at::Half>();
  return s;
}

Scales scales_of(const torch::Tensor& scale, const torch::Tensor& zero, const torch::Tensor& table,
                 int64_t tokens_per_row, int64_t channels_per_entry) {
  TORCH_CHECK((scale.scalar_type() == torch::kHalf || scale.scalar_type() == torch::kByte) && scale.dim() == 4 &&
              scale.stride(3) == 1,
              "scale must be float16 (or uint8 codes) [B, h, rows, entries] with a contiguous last axis");
  TORCH_CHECK(tokens_per_row >= 1 && channels_per_entry >= 1, "tokens_per_row and channels_per_entry must be >= 1");
  if (scale.scalar_type() == torch::kByte)
    return one_byte_scales_of(scale, zero, table, tokens_per_row, channels_per_entry);
  Scales s{scale.data_ptr<at::Half>(), nullptr, scale.stride(0), scale.stride(1), scale.stride(2), 0, 0, 0,
           tokens_per_row, channels_per_entry, scale.size(3)};
  if (zero.defined() && zero.numel() > 0) {
    TORCH_CHECK(zero.scalar_type() == torch::kHalf && zero.sizes() == scale.sizes() && zero.stride(3) == 1,
                "zero must be float16 with the scale's shape and a contiguous last axis");
    s.zero = zero.data_ptr<at::Half>();
    s.zb = zero.stride(0);
    s.zh = zero.stride(1);
    s.zr = zero.stride(2);
  }
  return s;
}

// One token's codes, dequantized: out[d] = code d * scale[d] + zero[d], in float32 as
// QuantizedTensor.dequantize computes it (a product, then a sum; zero = 0 for symmetric INT8).
//
// The unpacking is what a low-bit read costs (a 2-bit row is 4 codes per byte to shift out one by one): with
// AVX2, eight codes come from one little-endian word (INT4: 4 bytes, INT3: 3, INT2: 2) broadcast to eight
// lanes and shifted right by 0, b, 2b, ... at once, so every width costs the same few instructions per eight
// codes. Without AVX2, or for a tail shorter than eight, the scalar loop below does the same arithmetic.
template <int BITS>
inline uint32_t code_word(const uint8_t* src) {
  uint32_t word = 0;
  for (int i = 0; i < BITS; ++i) word |= static_cast<uint32_t>(src[i]) << (8 * i);  // BITS bytes per 8 codes
  return word;
}

template <int BITS>
inline int code_at(const uint8_t* src, int64_t d) {
  if (BITS == 8) return static_cast<int8_t>(src[d]);
  const uint32_t word = code_word<BITS>(src + (d / 8) * BITS);
  return static_cast<int>((word >> (BITS * (d % 8))) & ((1u << BITS) - 1));
}

#if defined(__AVX2__)
// Codes d .. d + 7 of one token, as floats.
template <int BITS>
inline __m256 codes8(const uint8_t* src, int64_t d) {
  __m256i codes;
  if (BITS == 8) {
    codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
  } else {
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    const __m256i mask = _mm256_set1_epi32(static_cast<int>((1u << (BITS % 8)) - 1));
    const int word = static_cast<int>(code_word<BITS>(src + (d / 8) * BITS));
    codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
  }
  return _mm256_cvtepi32_ps(codes);
}

// Channels d .. d + 7 of one token, dequantized.
template <int BITS>
inline __m256 dequantize8(const uint8_t* src, int64_t d, const float* scale, const float* zero) {
  const __m256 product = _mm256_mul_ps(codes8<BITS>(src, d), _mm256_loadu_ps(scale + d));
  return _mm256_add_ps(product, _mm256_loadu_ps(zero + d));
}

inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

template <int BITS>
inline void dequantize_codes(const uint8_t* src, int64_t dim, const float* scale, const float* zero, float* out) {
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, dequantize8<BITS>(src, d, scale, zero));
#endif
  for (; d < dim; ++d) out[d] = static_cast<float>(code_at<BITS>(src, d)) * scale[d] + zero[d];
}

// Query rows per pass: up to four dot products share each chunk of eight key channels. The passes take exactly
// the rows asked for (a block of one to four, its count a template constant the compiler unrolls), so three
// grouped-query rows cost three products, not four.
constexpr int64_t kRowBlock = 4;

#if defined(__AVX2__)
// sums[j] = the sum of acc[j]'s eight lanes, j < NR: four rows' sums by three horizontal adds, where one row's
// takes five operations of its own.
template <int NR>
inline void row_sums(const __m256* acc, float* sums) {
  if constexpr (NR == 1) {
    sums[0] = horizontal_sum(acc[0]);
  } else {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 a01 = _mm256_hadd_ps(acc[0], acc[1]);
    __m256 a23 = zero;
    if constexpr (NR == 3) a23 = _mm256_hadd_ps(acc[2], zero);
    if constexpr (NR == 4) a23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 both = _mm256_hadd_ps(a01, a23);  // row j's two half sums in lanes j and 4 + j
    float four[4];
    _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1)));
    for (int j = 0; j < NR; ++j) sums[j] = four[j];
  }
}

// out[j * stride] = q[j] . key, j < NR, the key's channels d .. d + 7 from load8(d).
template <int NR, typename Load8>
inline void row_block_dots(Load8& load8, int64_t dim, const float* q, float* out, int64_t stride) {
  __m256 acc[NR];
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 k = load8(d);
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * dim + d), k, acc[j]);
  }
  float sums[NR];
  row_sums<NR>(acc, sums);
  _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) out[j * stride] = sums[j];
}

template <int N>
using Rows = std::integral_constant<int, N>;

// block(Rows<NR>{}, r0) for every block of at most four rows r0 .. r0 + NR - 1 of `rows`.
template <typename Block>
inline void row_blocks(int64_t rows, Block&& block) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, rows - r0)) {
      case 4: block(Rows<4>{}, r0); break;
      case 3: block(Rows<3>{}, r0); break;
      case 2: block(Rows<2>{}, r0); break;
      default: block(Rows<1>{}, r0); break;
    }
  }
}
#endif

// out[r * stride] = q[r] . key, r < rows: the key's channels d .. d + 7 come from load8(d) (the vector path:
// codes dequantized in registers, or a key in memory), or from `key` (the scalar path, for a dim that is not a
// multiple of eight).
template <typename Load8>
inline void row_dots(Load8 load8, int64_t dim, const float* q, int64_t rows, float* out, int64_t stride,
                     const float* key) {
#if defined(__AVX2__)
  if (dim % 8 == 0) {
    row_blocks(rows, [&](auto nr, int64_t r0) {
      row_block_dots<decltype(nr)::value>(load8, dim, q + r0 * dim, out + r0 * stride, stride);
    });
    return;
  }
#endif
  (void)load8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * dim;
    float acc = 0.0f;
    // A float sum is only vectorized when the compiler may reorder it: allow that for this dot product.
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < dim; ++d) acc += qr[d] * key[d];
    out[r * stride] = acc;
  }
}

// The loader of a key already in memory (dequantized, or turned).
struct KeyInMemory {
  const float* key;
#if defined(__AVX2__)
  __m256 operator()(int64_t d) const { return _mm256_loadu_ps(key + d); }
#endif
};

template <int BITS>
inline void key_dots(const uint8_t* src, int64_t dim, const float* scale, const float* zero, const float* q,
                     int64_t rows, float* out, int64_t stride, float* key) {
#if defined(__AVX2__)
  if (dim % 8 == 0) {  // the codes dequantized in registers: the key never goes through memory
    row_dots([&](int64_t d) { return dequantize8<BITS>(src, d, scale, zero); }, dim, q, rows, out, stride, key);
    return;
  }
#endif
  dequantize_codes<BITS>(src, dim, scale, zero, key);
  row_dots(KeyInMemory{key}, dim, q, rows, out, stride, key);
}

// call(std::integral_constant<int, BITS>{}) for the code width `bits`: how every read picks its template.
template <typename Call>
inline auto by_width(int bits, Call&& call) {
  switch (bits) {
    case 8: return call(std::integral_constant<int, 8>{});
    case 4: return call(std::integral_constant<int, 4>{});
    case 3: return call(std::integral_constant<int, 3>{});
    default: return call(std::integral_constant<int, 2>{});
  }
}

inline void key_dots(const uint8_t* src, int bits, int64_t dim, const float* scale, const float* zero, const float* q,
                     int64_t rows, float* out, int64_t stride, float* key) {
  by_width(bits, [&](auto w) { key_dots<decltype(w)::value>(src, dim, scale, zero, q, rows, out, stride, key); });
}

inline void dequantize_codes(const uint8_t* src, int bits, int64_t dim, const float* scale, const float* zero,
                             float* out) {
  by_width(bits, [&](auto w) { dequantize_codes<decltype(w)::value>(src, dim, scale, zero, out); });
}

// The scale and zero point of every channel for scale row `row`, expanded over channels_per_entry channels.
inline void load_row(const Scales& s, int64_t b, int64_t h, int64_t row, int64_t dim, float* scale, float* zero) {
  const int64_t si = b * s.sb + h * s.sh + row * s.sr, zi = b * s.zb + h * s.zh + row * s.zr;
#if defined(__AVX2__)
  if (!s.table && s.channels_per_entry == 1 && s.entries >= dim && dim % 8 == 0) {  // float16 per channel
    for (int64_t d = 0; d < dim; d += 8) {
      _mm256_storeu_ps(scale + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.scale + si + d))));
      _mm256_storeu_ps(zero + d, s.zero ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.zero + zi + d)))
                                        : _mm256_setzero_ps());
    }
    return;
  }
#endif
  for (int64_t e = 0; e < s.entries; ++e) {
    const float sv = scale_value(s, si + e);
    const float zv = zero_value(s, zi + e, sv);
    const int64_t end = std::min(dim, (e + 1) * s.channels_per_entry);
    for (int64_t d = e * s.channels_per_entry; d < end; ++d) {
      scale[d] = sv;
      zero[d] = zv;
    }
  }
}

// Where a part's rows live in a layer-wide [B, H_kv, R, N] float32 tensor: its heads through a head map, its
// tokens from a column on.
struct Target {
  float* data;
  int64_t sb, sh, sr;
  const int64_t* heads;  // local head -> layer head; nullptr: the identity
  int64_t column;
  float* row(int64_t b, int64_t h) const { return data + b * sb + (heads ? heads[h] : h) * sh + column; }
};

Target target_of(const torch::Tensor& t, const torch::Tensor& heads, int64_t column, int64_t B, int64_t H,
                 int64_t R, int64_t T) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 4 && t.stride(3) == 1,
              "scores / probabilities must be float32 [B, H_kv, R, N] with a contiguous last axis");
  TORCH_CHECK(t.size(0) == B && t.size(2) == R && column >= 0 && column + T <= t.size(3),
              "a part of ", T, " tokens from column ", column, " does not fit a [", t.size(0), ", ", t.size(1), ", ",
              t.size(2), ", ", t.size(3), "] tensor");
  const int64_t* map = nullptr;
  if (heads.defined() && heads.numel() > 0) {
    TORCH_CHECK(heads.scalar_type() == torch::kLong && heads.numel() == H && heads.is_contiguous(),
                "heads must be a contiguous int64 tensor with one entry per head of the part");
    map = heads.data_ptr<int64_t>();
    for (int64_t h = 0; h < H; ++h) TORCH_CHECK(map[h] >= 0 && map[h] < t.size(1), "head index out of range");
  } else {
    TORCH_CHECK(t.size(1) == H, "a part of ", H, " heads without a head map needs ", H, " heads in the target");
  }
  return {t.data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2), map, column};
}

void check_dims(int64_t dim, int bits) {
  TORCH_CHECK(dim <= kMaxDim, "head_dim ", dim, " exceeds the kernel's bound of ", kMaxDim);
  const int64_t per_word = bits == 3 ? 8 : (bits == 8 ? 1 : 8 / bits);
  TORCH_CHECK(dim % per_word == 0, "head_dim ", dim, " must be a multiple of ", per_word, " for ", bits, "-bit codes");
}

// value_accumulate's inner loop for values grouped per token (one scale per token and group of a multiple of
// eight channels), with AVX2: for each block of four query rows and each eight channels, the four sums stay
// in registers across the block's tokens and the token's scale is one broadcast, so nothing is expanded or
// stored per token. out: [R, D], written (not added to). Token t0 + t weighs src.row(b, h)[r * sr + first + t].
// Returns false where it does not apply.
template <int BITS>
bool values_per_token(const Codes& codes, const Scales& s, const Target& src, int64_t b, int64_t h, int64_t t0,
                      int64_t t1, int64_t R, int64_t D, float* out, int64_t first) {
#if defined(__AVX2__)
  if (D % 8 != 0 || s.sr == 0 || s.tokens_per_row != 1 || s.channels_per_entry % 8 != 0) return false;
  const int64_t n = t1 - t0, entries = s.entries;
  std::vector<float> scale(n * entries), zero(n * entries, 0.0f), weight(kRowBlock * n);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < entries; ++e) {
      const float sv = scale_value(s, b * s.sb + h * s.sh + (t0 + t) * s.sr + e);
      scale[t * entries + e] = sv;
      zero[t * entries + e] = zero_value(s, b * s.zb + h * s.zh + (t0 + t) * s.zr + e, sv);
    }
  }
  const float* ph = src.row(b, h);
  const uint8_t* base = codes.data + b * codes.sb + h * codes.sh;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    for (int64_t j = 0; j < kRowBlock; ++j)  // the block's weights, zero for rows past R
      for (int64_t t = 0; t < n; ++t) weight[j * n + t] = r0 + j < R ? ph[(r0 + j) * src.sr + first + t] : 0.0f;
    for (int64_t d = 0; d < D; d += 8) {
      const int64_t e = d / s.channels_per_entry;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      for (int64_t t = 0; t < n; ++t) {
        const __m256 product = _mm256_mul_ps(codes8<BITS>(base + (t0 + t) * codes.st, d),
                                             _mm256_set1_ps(scale[t * entries + e]));
        const __m256 v = _mm256_add_ps(product, _mm256_set1_ps(zero[t * entries + e]));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(weight[t]), v, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(weight[n + t]), v, acc1);
        acc2 = _mm256_fmadd_ps(_mm256_set1_ps(weight[2 * n + t]), v, acc2);
        acc3 = _mm256_fmadd_ps(_mm256_set1_ps(weight[3 * n + t]), v, acc3);
      }
      const __m256 sums[kRowBlock] = {acc0, acc1, acc2, acc3};
      for (int64_t j = 0; j < kRowBlock && r0 + j < R; ++j) _mm256_storeu_ps(out + (r0 + j) * D + d, sums[j]);
    }
  }
  return true;
#else
  return false;
#endif
}

bool values_per_token(const Codes& codes, const Scales& s, const Target& src, int64_t b, int64_t h, int64_t t0,
                      int64_t t1, int64_t R, int64_t D, float* out, int64_t first) {
  return by_width(codes.bits, [&](auto w) {
    return values_per_token<decltype(w)::value>(codes, s, src, b, h, t0, t1, R, D, out, first);
  });
}

// The softmax-bias correction of one scale row (kvguard/score_bias.py), per query row r < R:
// -1/2 sum_d q[r, d]^2 * scale[d]^2 / 12, the rounding noise's variance weighted by the squared query.
void row_bias(const float* q, const float* scale, int64_t R, int64_t D, float* bias) {
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * D;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += qr[d] * qr[d] * (scale[d] * scale[d] / 12.0f);
    bias[r] = -0.5f * acc;
  }
}

// RoPE's rows at a part's tokens, and the rotation signs of its heads, for keys stored before RoPE.
struct Turn {
  const float* cos = nullptr;  // [T, D]; nullptr: keys stored after RoPE, read as they are
  const float* sin = nullptr;
  const float* signs = nullptr;  // [h, D]; nullptr: not rotated
  float norm = 1.0f;             // 1 / sqrt(D), the rotation's scale
};

Turn turn_of(const torch::Tensor& signs, const torch::Tensor& cos, const torch::Tensor& sin, int64_t h, int64_t T,
             int64_t D) {
  Turn turn;
  if (cos.numel() == 0) return turn;
  for (const torch::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                t->size(1) == D, "cos / sin must be contiguous float32 [T, D] (RoPE's rows at the part's tokens)");
  turn.cos = cos.data_ptr<float>();
  turn.sin = sin.data_ptr<float>();
  if (signs.numel() > 0) {
    TORCH_CHECK(signs.scalar_type() == torch::kFloat && signs.is_contiguous() && signs.dim() == 2 &&
                signs.size(0) == h && signs.size(1) == D, "signs must be contiguous float32 [h, D]");
    TORCH_CHECK((D & (D - 1)) == 0, "a rotated head needs a power-of-two head_dim, got ", D);
    turn.signs = signs.data_ptr<float>();
    turn.norm = 1.0f / std::sqrt(static_cast<float>(D));
  }
  return turn;
}

// The butterflies of rotation._fwht (x @ H in Sylvester order) in place: each stage adds and subtracts the
// pairs (j, j + half) exactly as the torch reference does. With AVX2, the first three stages (half = 1, 2, 4)
// pair lanes within each eight-float register, the later ones whole registers.
void hadamard(float* x, int64_t D) {
  int64_t half = 1;
#if defined(__AVX2__)
  if (D % 8 == 0) {
    for (int64_t d = 0; d < D; d += 8) {
      __m256 v = _mm256_loadu_ps(x + d);
      __m256 w = _mm256_permute_ps(v, 0xB1);  // lanes (1, 0, 3, 2, ...)
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xAA);  // odd lanes: top - bottom
      w = _mm256_permute_ps(v, 0x4E);  // lanes (2, 3, 0, 1, ...)
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xCC);
      w = _mm256_permute2f128_ps(v, v, 1);  // the two halves swapped
      v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xF0);
      _mm256_storeu_ps(x + d, v);
    }
    for (half = 8; half < D; half *= 2)
      for (int64_t block = 0; block < D; block += 2 * half)
        for (int64_t j = block; j < block + half; j += 8) {
          const __m256 top = _mm256_loadu_ps(x + j), bottom = _mm256_loadu_ps(x + j + half);
          _mm256_storeu_ps(x + j, _mm256_add_ps(top, bottom));
          _mm256_storeu_ps(x + j + half, _mm256_sub_ps(top, bottom));
        }
    return;
  }
#endif
  for (; half < D; half *= 2)
    for (int64_t block = 0; block < D; block += 2 * half)
      for (int64_t j = block; j < block + half; ++j) {
        const float top = x[j], bottom = x[j + half];
        x[j] = top + bottom;
        x[j + half] = top - bottom;
      }
}

// x (one dequantized key stored before RoPE) as the model reads it: rotated back where stored rotated
// (rotation.unrotate: the butterflies, times 1 / sqrt(D), times the signs), then turned to position t
// (rope.rerope: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]), written to out. Products and
// sums stay separate operations, as the torch reference computes them.
void turned_key(float* x, int64_t D, const Turn& turn, int64_t h, int64_t t, float* out) {
  if (turn.signs) {
    hadamard(x, D);
    const float* sg = turn.signs + h * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) x[d] = x[d] * turn.norm * sg[d];
  }
  const float* c = turn.cos + t * D;
  const float* s = turn.sin + t * D;
  const int64_t half = D / 2;
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + d + half);
    const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), x2);
    _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d)),
                                            _mm256_mul_ps(neg, _mm256_loadu_ps(s + d))));
    _mm256_storeu_ps(out + d + half, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + d + half)),
                                                   _mm256_mul_ps(x1, _mm256_loadu_ps(s + d + half))));
  }
#endif
  for (; d < half; ++d) {
    out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
    out[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
  }
}

// The rows of one head of a plain segment (decode_attend): float16 or float32 [T, D] with row stride `stride`,
// D contiguous.
struct PlainRows {
  const void* data;
  bool half;
  int64_t rows, stride;
};

#if defined(__AVX2__)
inline __m256 load8(const PlainRows& s, int64_t t, int64_t d) {
  if (s.half)
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const at::Half*>(s.data) + t * s.stride + d)));
  return _mm256_loadu_ps(static_cast<const float*>(s.data) + t * s.stride + d);
}
#endif

inline float plain_at(const PlainRows& s, int64_t t, int64_t d) {
  if (s.half) return static_cast<float>(static_cast<const at::Half*>(s.data)[t * s.stride + d]);
  return static_cast<const float*>(s.data)[t * s.stride + d];
}

// The row t of s as float32, for the scalar paths.
inline void plain_row(const PlainRows& s, int64_t t, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = plain_at(s, t, d);
}

// p[j] = exp(p[j] - top) for j < n; returns their sum. Eight at a time with Cephes' expf polynomial (as in
// avx_mathfun: within 2 ulp of expf over the softmax's range, x <= 0), since a scalar expf per column cost more
// than both products at 640 tokens.
inline float exp_shifted(float* p, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.0f;
#if defined(__AVX2__)
  __m256 sum = _mm256_setzero_ps();
  const __m256 shift = _mm256_set1_ps(top), lo = _mm256_set1_ps(-87.3f), one = _mm256_set1_ps(1.0f);
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + j), shift), lo);
    // x = k ln2 + r, |r| <= ln2 / 2, ln2 split in two so that k ln2 is exact
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), one);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));  // * 2^k
    _mm256_storeu_ps(p + j, y);
    sum = _mm256_add_ps(sum, y);
  }
  total = horizontal_sum(sum);
#endif
  for (; j < n; ++j) total += (p[j] = std::exp(p[j] - top));
  return total;
}

// The largest of p[0 .. n): eight lanes at a time (std::max_element's scalar compare chain cost a tenth of an
// INT4 read).
inline float row_max(const float* p, int64_t n) {
  float top = -INFINITY;
  int64_t j = 0;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(p);
    for (j = 8; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (const float x : lanes) top = std::max(top, x);
  }
#endif
  for (; j < n; ++j) top = std::max(top, p[j]);
  return top;
}

inline const char* row_address(const PlainRows& s, int64_t t) {
  return static_cast<const char*>(s.data) + t * s.stride * (s.half ? 2 : 4);
}

// scores[r, t] = q[r] . key t for every row t of `k`: each key is loaded (and converted) once for a block of up to
// four query rows. It prefetches the key eight rows ahead and the row of `v` at
// the same t (the values plain_values reads next; `k` itself where they are codes): a server's batch reads tens of
// MiB of K/V a step, out of every cache, and without the prefetches a sequence's read took 1.5x as long.
void plain_scores(const PlainRows& k, const PlainRows& v, const float* q, int64_t R, int64_t D, float* scores,
                  int64_t N) {
  constexpr int64_t kLine = 64, kAhead = 8;
  const int64_t bytes = D * (k.half ? 2 : 4);
  float key[kMaxDim];
  for (int64_t t = 0; t < k.rows; ++t) {
    for (int64_t o = 0; o < bytes; o += kLine) {
      if (t + kAhead < k.rows) __builtin_prefetch(row_address(k, t + kAhead) + o, 0, 3);
      __builtin_prefetch(row_address(v, t) + o, 0, 2);
    }
#if defined(__AVX2__)
    if (D % 8 == 0) {
      row_dots([&](int64_t d) { return load8(k, t, d); }, D, q, R, scores + t, N, key);
      continue;
    }
#endif
    plain_row(k, t, D, key);
    row_dots(KeyInMemory{key}, D, q, R, scores + t, N, key);
  }
}

// out[r] = sum_t p[r, t] v[t] for every query row (written, not added): sixteen channels at a time (eight where D
// is not a multiple of sixteen), each chunk loaded once for a block of up to four rows, which sum in registers
// over every row of `v` in order. (One pass over the rows with every output in L1 instead took 1.3x as long.)
void plain_values(const PlainRows& v, const float* p, int64_t R, int64_t N, int64_t D, float* out) {
#if defined(__AVX2__)
  if (D % 8 == 0) {
    const int64_t step = D % 16 == 0 ? 16 : 8;
    for (int64_t d0 = 0; d0 < D; d0 += step) {
      row_blocks(R, [&](auto nr, int64_t r0) {
        constexpr int NR = decltype(nr)::value;
        const float* p0 = p + r0 * N;
        __m256 a[NR], c[NR];
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) a[j] = c[j] = _mm256_setzero_ps();
        if (step == 16) {
          for (int64_t t = 0; t < v.rows; ++t) {
            const __m256 x = load8(v, t, d0), y = load8(v, t, d0 + 8);
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
              const __m256 w = _mm256_broadcast_ss(p0 + j * N + t);
              a[j] = _mm256_fmadd_ps(w, x, a[j]);
              c[j] = _mm256_fmadd_ps(w, y, c[j]);
            }
          }
        } else {
          for (int64_t t = 0; t < v.rows; ++t) {
            const __m256 x = load8(v, t, d0);
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + j * N + t), x, a[j]);
          }
        }
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
          _mm256_storeu_ps(out + (r0 + j) * D + d0, a[j]);
          if (step == 16) _mm256_storeu_ps(out + (r0 + j) * D + d0 + 8, c[j]);
        }
      });
    }
    return;
  }
#endif
  float value[kMaxDim];
  std::fill(out, out + R * D, 0.0f);
  for (int64_t t = 0; t < v.rows; ++t) {
    plain_row(v, t, D, value);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d = 0; d < D; ++d) out[r * D + d] += p[r * N + t] * value[d];
  }
}

#if defined(__AVX2__)
// Channels d .. d + 15 of one token's codes as two registers of floats, the i-th float being channel
// d + channel16<BITS>(i): INT4 takes eight bytes whose low nibbles are the even channels and high nibbles the odd
// ones (a mask and a shift for sixteen codes, where codes8's broadcast and per-lane shift cost more); other widths
// are codes8 twice, in order. The folded reads below put their query (or their sums) in the same order.
template <int BITS>
inline void codes16(const uint8_t* src, int64_t d, __m256& lo, __m256& hi) {
  if (BITS == 4) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d / 2)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  } else {
    lo = codes8<BITS>(src, d);
    hi = codes8<BITS>(src, d + 8);
  }
}

template <int BITS>
constexpr int64_t channel16(int64_t i) { return BITS == 4 ? (i < 8 ? 2 * i : 2 * (i - 8) + 1) : i; }

// Whether a read of head_dim D takes the folded reads: sixteen channels at a time, with AVX2. (Sixteen-lane
// AVX-512 registers for INT4 were tried: no faster on this machine's decode, see benchmarks/DECISIONS.md.)
inline bool folds(int64_t D) { return D % 16 == 0; }

// Keys quantized per channel share one scale row across tokens_per_row tokens, so a score
//   q . (c * s + z) = (q * s) . c + q . z
// folds the scale into the query and the zero point into one bias per row, once per scale row: each code then
// costs an unpack and one product per query row instead of a dequantization first. folded_query writes q * s in
// codes16's channel order and the biases; folded_dots scores one token.
template <int BITS>
void folded_query(const float* q, const float* scale, const float* zero, int64_t R, int64_t D, float* qs,
                  float* bias) {
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * D;
    float* out = qs + r * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 q0 = _mm256_loadu_ps(qr + d), q1 = _mm256_loadu_ps(qr + d + 8);
      acc = _mm256_fmadd_ps(q0, _mm256_loadu_ps(zero + d), acc);
      acc = _mm256_fmadd_ps(q1, _mm256_loadu_ps(zero + d + 8), acc);
      const __m256 p0 = _mm256_mul_ps(q0, _mm256_loadu_ps(scale + d));
      const __m256 p1 = _mm256_mul_ps(q1, _mm256_loadu_ps(scale + d + 8));
      if (BITS == 4) {  // even channels, then odd ones (channel16<4>): within each half, then across the halves
        const __m256d even = _mm256_castps_pd(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(2, 0, 2, 0)));
        const __m256d odd = _mm256_castps_pd(_mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm256_storeu_ps(out + d, _mm256_castpd_ps(_mm256_permute4x64_pd(even, _MM_SHUFFLE(3, 1, 2, 0))));
        _mm256_storeu_ps(out + d + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(odd, _MM_SHUFFLE(3, 1, 2, 0))));
      } else {
        _mm256_storeu_ps(out + d, p0);
        _mm256_storeu_ps(out + d + 8, p1);
      }
    }
    bias[r] = horizontal_sum(acc);
  }
}

template <int BITS>
void folded_dots(const uint8_t* src, int64_t D, const float* qs, const float* bias, int64_t R, float* out,
                 int64_t stride) {
  row_blocks(R, [&](auto nr, int64_t r0) {
    constexpr int NR = decltype(nr)::value;
    const float* q0 = qs + r0 * D;
    __m256 acc[NR];
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m256 lo, hi;
      codes16<BITS>(src, d, lo, hi);
      _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j * D + d), lo, acc[j]);
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + j * D + d + 8), hi, acc[j]);
      }
    }
    float sums[NR];
    row_sums<NR>(acc, sums);
    _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) out[(r0 + j) * stride] = sums[j] + bias[r0 + j];
  });
}

// Values quantized per token (a scale and zero point per token and group of channels_per_entry channels) fold the
// other way: sum_t p[t] (c_t * s_t + z_t) = sum_t (p[t] * s_t) c_t + sum_t p[t] z_t, the weights p * s and the
// zero sums taken once per token and group, so each code costs an unpack and one product per query row.
// out[r] = sum_t p[r * W + t - t0] value t, t0 <= t < t1 (written, not added).
template <int BITS>
void folded_values(const Codes& codes, const Scales& s, int64_t b, int64_t h, int64_t t0, int64_t t1, const float* p,
                   int64_t R, int64_t W, int64_t D, float* out) {
  const int64_t n = t1 - t0, E = s.entries, group = s.channels_per_entry;
  std::vector<float> scale(E * n), zero(E * n, 0.0f);  // [e * n + t]
  const int64_t si = b * s.sb + h * s.sh + t0 * s.sr, zi = b * s.zb + h * s.zh + t0 * s.zr;
  if (!s.table) {  // float16 scales (and zero points): converted in a loop without the one-byte case's branches
    for (int64_t e = 0; e < E; ++e)
      for (int64_t t = 0; t < n; ++t) {
        scale[e * n + t] = _cvtsh_ss(s.scale[si + t * s.sr + e].x);
        if (s.zero) zero[e * n + t] = _cvtsh_ss(s.zero[zi + t * s.zr + e].x);
      }
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t e = 0; e < E; ++e) {
        scale[e * n + t] = scale_value(s, si + t * s.sr + e);
        zero[e * n + t] = zero_value(s, zi + t * s.zr + e, scale[e * n + t]);
      }
  }
  std::vector<float> weight(E * R * n), zeros(R * E);  // weight[(e * R + r) * n + t], zeros[r * E + e]
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r) {
      const float *pr = p + r * W, *se = scale.data() + e * n, *ze = zero.data() + e * n;
      float* w = weight.data() + (e * R + r) * n;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t t = 0; t < n; ++t) {
        w[t] = pr[t] * se[t];
        acc += pr[t] * ze[t];
      }
      zeros[r * E + e] = acc;
    }
  const uint8_t* base = codes.data + b * codes.sb + h * codes.sh + t0 * codes.st;
  for (int64_t d = 0; d < D; d += 16) {
    const int64_t e = d / group;  // a block of sixteen lies in one group (segment_values: group % 16 == 0)
    row_blocks(R, [&](auto nr, int64_t r0) {
      constexpr int NR = decltype(nr)::value;
      const float* w0 = weight.data() + (e * R + r0) * n;
      __m256 lo_acc[NR], hi_acc[NR];
      _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) lo_acc[j] = hi_acc[j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        // The first pass brings the block's codes in (eight tokens ahead); the later ones find them in L1.
        if (d == 0 && r0 == 0) __builtin_prefetch(base + (t + 8) * codes.st, 0, 3);
        __m256 lo, hi;
        codes16<BITS>(base + t * codes.st, d, lo, hi);
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
          const __m256 w = _mm256_broadcast_ss(w0 + j * n + t);
          lo_acc[j] = _mm256_fmadd_ps(w, lo, lo_acc[j]);
          hi_acc[j] = _mm256_fmadd_ps(w, hi, hi_acc[j]);
        }
      }
      float sums[16];
      _Pragma("GCC unroll 4") for (int j = 0; j < NR; ++j) {
        _mm256_storeu_ps(sums, lo_acc[j]);
        _mm256_storeu_ps(sums + 8, hi_acc[j]);
        float* row = out + (r0 + j) * D + d;
        for (int64_t i = 0; i < 16; ++i) row[channel16<BITS>(i)] = sums[i] + zeros[(r0 + j) * E + e];
      }
    });
  }
}
#endif

}  // namespace

void key_scores(torch::Tensor& scores, int64_t column, const torch::Tensor& heads, const torch::Tensor& q,
                const torch::Tensor& codes_t, const torch::Tensor& scale, const torch::Tensor& zero,
                const torch::Tensor& table, int64_t bits, int64_t tokens_per_row, int64_t channels_per_entry,
                bool correct, const torch::Tensor& signs, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32 [B, h, R, D]");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = codes_t.size(2);
  check_dims(D, static_cast<int>(bits));
  const Codes codes = codes_of(codes_t, static_cast<int>(bits));
  const Scales s = scales_of(scale, zero, table, tokens_per_row, channels_per_entry);
  const Target dst = target_of(scores, heads, column, B, H, R, T);
  const Turn turn = turn_of(signs, cos, sin, H, T, D);
  TORCH_CHECK(!(turn.cos && correct), "the softmax-bias correction does not apply to keys stored before RoPE");
  const float* qp = q.data_ptr<float>();
  const int64_t blocks = (T + kTokenBlock - 1) / kTokenBlock;
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    float sc[kMaxDim], zr[kMaxDim], key[kMaxDim], turned[kMaxDim];
    std::vector<float> bias(R, 0.0f);  // per query row: the correction of the loaded scale row
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      const int64_t t0 = (task % blocks) * kTokenBlock, t1 = std::min(T, t0 + kTokenBlock);
      const float* qh = qp + bh * R * D;  // the head's query rows
      float* oh = dst.row(b, h);
      int64_t loaded = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
        if (row != loaded) {
          load_row(s, b, h, row, D, sc, zr);
          if (correct) row_bias(qh, sc, R, D, bias.data());
          loaded = row;
        }
        const uint8_t* src = codes.data + b * codes.sb + h * codes.sh + t * codes.st;
        if (turn.cos) {
          dequantize_codes(src, codes.bits, D, sc, zr, key);
          turned_key(key, D, turn, h, t, turned);
          row_dots(KeyInMemory{turned}, D, qh, R, oh + t, dst.sr, turned);
          continue;
        }
        key_dots(src, codes.bits, D, sc, zr, qh, R, oh + t, dst.sr, key);
        if (correct)
          for (int64_t r = 0; r < R; ++r) oh[r * dst.sr + t] += bias[r];
      }
    }
  });
}

torch::Tensor value_accumulate(const torch::Tensor& p, int64_t column, const torch::Tensor& heads,
                               const torch::Tensor& codes_t, const torch::Tensor& scale, const torch::Tensor& zero,
                               const torch::Tensor& table, int64_t bits, int64_t tokens_per_row,
                               int64_t channels_per_entry, int64_t head_dim) {
  const int64_t B = codes_t.size(0), H = codes_t.size(1), R = p.size(2), T = codes_t.size(2), D = head_dim;
  const Target src = target_of(p, heads, column, B, H, R, T);
  check_dims(D, static_cast<int>(bits));
  const Codes codes = codes_of(codes_t, static_cast<int>(bits));
  const Scales s = scales_of(scale, zero, table, tokens_per_row, channels_per_entry);
  // Each task sums its own block of tokens into its own slot; the slots are summed in a fixed order after, so
  // the result does not depend on the thread count.
  const int64_t blocks = std::max<int64_t>(1, (T + kTokenBlock - 1) / kTokenBlock);
  auto partial = torch::zeros({B * H, blocks, R, D}, p.options());
  float* acc = partial.data_ptr<float>();
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    float sc[kMaxDim], zr[kMaxDim], value[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      const int64_t t0 = (task % blocks) * kTokenBlock, t1 = std::min(T, t0 + kTokenBlock);
      float* oh = acc + task * R * D;
      if (values_per_token(codes, s, src, b, h, t0, t1, R, D, oh, t0)) continue;
      const float* ph = src.row(b, h);
      int64_t loaded = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
        if (row != loaded) {
          load_row(s, b, h, row, D, sc, zr);
          loaded = row;
        }
        dequantize_codes(codes.data + b * codes.sb + h * codes.sh + t * codes.st, codes.bits, D, sc, zr, value);
        for (int64_t r = 0; r < R; ++r) {
          const float w = ph[r * src.sr + t];
          float* orow = oh + r * D;
          for (int64_t d = 0; d < D; ++d) orow[d] += w * value[d];
        }
      }
    }
  });
  return partial.sum(1).view({B, H, R, D});
}

namespace {

// One side (keys or values) of a segment of decode_attend: plain float16 / float32 rows, or codes.
struct Side {
  bool quantized = false;
  const void* data = nullptr;  // plain: [B, h, T, D]
  bool half = false;
  int64_t sb = 0, sh = 0, st = 0;
  Codes codes{};
  Scales scales{};
  PlainRows rows(int64_t b, int64_t h, int64_t t0, int64_t t1) const {  // rows t0 <= t < t1
    const char* base = static_cast<const char*>(data) + (b * sb + h * sh + t0 * st) * (half ? 2 : 4);
    return {base, half, t1 - t0, st};
  }
};

// A segment of a read: columns [start, start + T) of some heads (`local`: layer head -> the segment's head, -1
// where it holds none; empty: all), each side plain or codes, a side stored rotated with its [h, D, D] matrices.
struct Segment {
  int64_t start = 0, T = 0;
  std::vector<int64_t> local;
  Side k, v;
  const float* key_rotation = nullptr;
  const float* value_rotation = nullptr;
  int64_t head(int64_t h) const { return local.empty() ? h : local[h]; }
};

Side side_of(const py::handle& obj, int64_t D, std::vector<torch::Tensor>& keep) {
  Side side;
  if (py::isinstance<py::tuple>(obj)) {  // (codes, scale, zero, table, bits, tokens_per_row, channels_per_entry)
    const auto t = obj.cast<py::tuple>();
    TORCH_CHECK(t.size() == 7, "a quantized side is (codes, scale, zero, table, bits, tokens per row, channels per entry)");
    for (int i = 0; i < 4; ++i) keep.push_back(t[i].cast<torch::Tensor>());
    const torch::Tensor* x = &keep[keep.size() - 4];
    const int bits = t[4].cast<int>();
    check_dims(D, bits);
    side.quantized = true;
    side.codes = codes_of(x[0], bits);
    side.scales = scales_of(x[1], x[2], x[3], t[5].cast<int64_t>(), t[6].cast<int64_t>());
    return side;
  }
  keep.push_back(obj.cast<torch::Tensor>());
  const torch::Tensor& x = keep.back();
  TORCH_CHECK(x.dim() == 4 && x.size(3) == D && x.stride(3) == 1 &&
                  (x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kFloat),
              "a plain side must be float16 or float32 [B, h, T, D] with D contiguous");
  side.data = x.data_ptr();
  side.half = x.scalar_type() == torch::kHalf;
  side.sb = x.stride(0), side.sh = x.stride(1), side.st = x.stride(2);
  return side;
}

const float* rotation_of(const py::handle& obj, int64_t heads, int64_t D, std::vector<torch::Tensor>& keep) {
  if (obj.is_none()) return nullptr;
  keep.push_back(obj.cast<torch::Tensor>());
  const torch::Tensor& m = keep.back();
  TORCH_CHECK(m.scalar_type() == torch::kFloat && m.is_contiguous() && m.dim() == 3 && m.size(0) == heads &&
                  m.size(1) == D && m.size(2) == D, "a rotation must be contiguous float32 [h, D, D]");
  return m.data_ptr<float>();
}

// (start, length, heads, keys, values, key rotation, value rotation): see decode_attend.
Segment segment_of(const py::handle& obj, int64_t H, int64_t D, std::vector<torch::Tensor>& keep) {
  const auto t = obj.cast<py::tuple>();
  TORCH_CHECK(t.size() == 7, "a segment is (start, length, heads, keys, values, key rotation, value rotation)");
  Segment seg;
  seg.start = t[0].cast<int64_t>(), seg.T = t[1].cast<int64_t>();
  int64_t heads = H;
  if (!t[2].is_none()) {
    const auto index = t[2].cast<torch::Tensor>();
    TORCH_CHECK(index.scalar_type() == torch::kLong && index.dim() == 1, "heads must be an int64 vector");
    heads = index.numel();
    seg.local.assign(H, -1);
    const auto* map = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < heads; ++i) {
      TORCH_CHECK(map[i] >= 0 && map[i] < H, "head index out of range");
      seg.local[map[i]] = i;
    }
  }
  seg.k = side_of(t[3], D, keep), seg.v = side_of(t[4], D, keep);
  seg.key_rotation = rotation_of(t[5], heads, D, keep), seg.value_rotation = rotation_of(t[6], heads, D, keep);
  return seg;
}

// x [R, D] (row stride D) times M [D, D] into out, M^T where `transpose`: the rotation of a query row or of a
// rotated value sum back.
void times(const float* x, const float* m, int64_t R, int64_t D, bool transpose, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t e = 0; e < D; ++e) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += x[r * D + d] * (transpose ? m[e * D + d] : m[d * D + e]);
      out[r * D + e] = acc;
    }
  }
}

// p[r * W + t - t0] = q[r] . key t of one head of a segment, t0 <= t < t1.
void segment_scores(const Segment& seg, int64_t b, int64_t h, int64_t t0, int64_t t1, const float* q, int64_t R,
                    int64_t D, float* p, int64_t W) {
  float key[kMaxDim], sc[kMaxDim], zr[kMaxDim];
  if (!seg.k.quantized) {
    const PlainRows k = seg.k.rows(b, h, t0, t1);
    plain_scores(k, seg.v.quantized ? k : seg.v.rows(b, h, t0, t1), q, R, D, p, W);
    return;
  }
  const Codes& codes = seg.k.codes;
  const Scales& s = seg.k.scales;
  const uint8_t* base = codes.data + b * codes.sb + h * codes.sh;
  int64_t loaded = -1;
#if defined(__AVX2__)
  if (folds(D) && (s.sr == 0 || s.tokens_per_row >= 4)) {  // one scale row over several tokens: fold it
    std::vector<float> qs(R * D), bias(R);
    by_width(codes.bits, [&](auto width) {
      constexpr int BITS = decltype(width)::value;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
        if (row != loaded) {
          load_row(s, b, h, row, D, sc, zr);
          folded_query<BITS>(q, sc, zr, R, D, qs.data(), bias.data());
          loaded = row;
        }
        folded_dots<BITS>(base + t * codes.st, D, qs.data(), bias.data(), R, p + t - t0, W);
      }
    });
    return;
  }
#endif
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
    if (row != loaded) load_row(s, b, h, row, D, sc, zr), loaded = row;
    key_dots(base + t * codes.st, codes.bits, D, sc, zr, q, R, p + t - t0, W, key);
  }
}

// out[r] = sum_t p[r * W + t - t0] value t of one head of a segment, t0 <= t < t1 (written, not added).
void segment_values(const Segment& seg, int64_t b, int64_t h, int64_t t0, int64_t t1, const float* p, int64_t R,
                    int64_t W, int64_t D, float* out) {
  if (!seg.v.quantized) {
    plain_values(seg.v.rows(b, h, t0, t1), p, R, W, D, out);
    return;
  }
  const Codes& codes = seg.v.codes;
  const Scales& s = seg.v.scales;
#if defined(__AVX2__)
  if (folds(D) && s.sr != 0 && s.tokens_per_row == 1 && s.channels_per_entry % 16 == 0) {
    by_width(codes.bits, [&](auto width) {
      folded_values<decltype(width)::value>(codes, s, b, h, t0, t1, p, R, W, D, out);
    });
    return;
  }
#endif
  const Target src{const_cast<float*>(p), 0, 0, W, nullptr, 0};
  if (values_per_token(codes, s, src, b, h, t0, t1, R, D, out, 0)) return;
  std::fill(out, out + R * D, 0.0f);
  float sc[kMaxDim], zr[kMaxDim], value[kMaxDim];
  int64_t loaded = -1;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
    if (row != loaded) load_row(s, b, h, row, D, sc, zr), loaded = row;
    dequantize_codes(codes.data + b * codes.sb + h * codes.sh + t * codes.st, codes.bits, D, sc, zr, value);
    for (int64_t r = 0; r < R; ++r) {
      const float w = p[r * W + t - t0];
      for (int64_t d = 0; d < D; ++d) out[r * D + d] += w * value[d];
    }
  }
}

}  // namespace

// decode_attend splits a head's columns into stretches of at most this many, each its own task, combined after: a
// lone sequence's long read (Gemma 3 has one KV head) then uses every thread. The stretches of a read are of equal
// width (4,097 columns are five of 820, not four of 1,024 and one of 1), so that no thread waits on a long task
// while the other ran short ones; the split depends only on the read's length, so a sequence's result is the same
// alone and in any batch.
constexpr int64_t kSplitColumns = 1024;

inline int64_t splits_of(int64_t columns) { return (columns + kSplitColumns - 1) / kSplitColumns; }

inline int64_t split_width(int64_t columns) {
  const int64_t S = splits_of(columns);
  return (columns + S - 1) / S;
}

// softmax(q . k) @ v of one new token for many sequences at once (a server's batch at one layer, or one sequence
// decoding alone), reading every stored segment where it lies: plain float16 / float32 rows, or codes (dequantized
// in registers, as key_scores / value_accumulate do). Item i: q[i] [B, H, R, D] float32 (scaled), N[i] columns,
// and segments[i], each (start, length, heads or None, keys, values, key rotation or None, value rotation or None)
// where a side is a [B, h, T, D] tensor or the tuple (codes, scale, zero, table, bits, tokens_per_row,
// channels_per_entry) of key_scores, and a rotation the [h, D, D] matrices R of a side stored as x R (scored
// against q R; a value sum read back by R^T). The segments' columns cover [0, N) once per head; the new token is
// a plain segment like the others; overlays[i] is None or (columns [P], keys, values [B, H, P, D]), plain rows
// served at those columns instead of the segments'. -> one [B, H, R, D] float32 per item, then, for each item whose
// `probabilities` flag is set, its softmax [B, H, R, N] (what the run-time monitor reads its entropy from). One
// task per (item, batch row, head): scores, softmax and values in one pass, every output summed in column order
// whatever the thread count, in one parallel region for the batch (a call per sequence woke the threads more
// often than they worked).
std::vector<torch::Tensor> decode_attend(const std::vector<torch::Tensor>& qs, const std::vector<int64_t>& columns,
                                         const std::vector<py::list>& segments, const std::vector<py::object>& overlays,
                                         const std::vector<bool>& probabilities) {
  TORCH_CHECK(qs.size() == columns.size() && qs.size() == segments.size() && qs.size() == overlays.size() &&
                  qs.size() == probabilities.size(),
              "one column count, segment list, overlay and probabilities flag per query");
  struct Item {
    const float* q;
    float* out;
    float* probs;  // nullptr: not asked for
    int64_t BH, H, R, D, N;  // BH: batch rows x heads
    std::vector<Segment> segments;
    std::vector<int64_t> overlay;  // columns served from the overlay's rows (ok, ov) instead of the segments
    Side ok, ov;
  };
  std::vector<torch::Tensor> keep, outs, probs;
  std::vector<Item> items;
  std::vector<int64_t> first;  // the first task of each item
  int64_t tasks = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    const auto& q = qs[i];
    TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32 [B, H, R, D]");
    const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3);
    TORCH_CHECK(D <= kMaxDim, "head_dim ", D, " is over the kernels' bound ", kMaxDim);
    Item item{q.data_ptr<float>(), nullptr, nullptr, B * H, H, R, D, columns[i], {}, {}, {}, {}};
    TORCH_CHECK(item.N > 0, "a read of no columns");
    for (const auto& obj : segments[i]) {
      item.segments.push_back(segment_of(obj, H, D, keep));
      const Segment& seg = item.segments.back();
      TORCH_CHECK(seg.start >= 0 && seg.start + seg.T <= item.N, "a segment of ", seg.T, " columns from ", seg.start,
                  " does not fit ", item.N, " columns");
    }
    if (!overlays[i].is_none()) {  // (columns [P] int64, keys, values [B, H, P, D])
      const auto t = overlays[i].cast<py::tuple>();
      TORCH_CHECK(t.size() == 3, "an overlay is (columns, keys, values)");
      const auto cols = t[0].cast<torch::Tensor>().contiguous();
      TORCH_CHECK(cols.scalar_type() == torch::kLong && cols.dim() == 1, "overlay columns must be an int64 vector");
      item.overlay.assign(cols.data_ptr<int64_t>(), cols.data_ptr<int64_t>() + cols.numel());
      for (const int64_t c : item.overlay) TORCH_CHECK(c >= 0 && c < item.N, "overlay column out of range");
      item.ok = side_of(t[1], D, keep), item.ov = side_of(t[2], D, keep);
      TORCH_CHECK(!item.ok.quantized && !item.ov.quantized, "the overlay holds plain rows");
    }
    outs.push_back(torch::empty({B, H, R, D}, q.options()));
    item.out = outs.back().data_ptr<float>();
    if (probabilities[i]) {
      probs.push_back(torch::empty({B, H, R, item.N}, q.options()));
      item.probs = probs.back().data_ptr<float>();
    }
    items.push_back(std::move(item));
    first.push_back(tasks);
    tasks += B * H * splits_of(items.back().N);
  }
  // Each task's partial result: its rows' sums of exp(score - m) * value (R x D), then m and the sum of exp(score - m)
  // (R each), at `task * stride`.
  int64_t stride = 0;
  for (const auto& it : items) stride = std::max(stride, it.R * (it.D + 2));
  std::vector<float> partial(tasks * stride);
  // The threads take tasks one at a time from a shared counter (a static share of equal counts left one thread
  // idle a sixth of a SmolLM2 step: three heads of five stretches do not divide by two). Which thread ran a task
  // does not change its result, which has its own slot.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> q, turned, p, part, back;
    for (int64_t task = next++; task < tasks; task = next++) {
      const size_t i = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
      const Item& it = items[i];
      const int64_t S = splits_of(it.N), local = task - first[i], bh = local / S, split = local % S;
      const int64_t b = bh / it.H, h = bh % it.H, D = it.D, R = it.R;
      const int64_t width = split_width(it.N), c0 = split * width, c1 = std::min(it.N, c0 + width), W = c1 - c0;
      q.assign(it.q + bh * R * D, it.q + (bh + 1) * R * D);
      p.assign(R * W, 0.0f);  // scores, then exp(score - m), of columns c0 <= c < c1
      for (const auto& seg : it.segments) {
        const int64_t sh = seg.head(h), t0 = std::max<int64_t>(0, c0 - seg.start), t1 = std::min(seg.T, c1 - seg.start);
        if (sh < 0 || t0 >= t1) continue;
        const float* qs_ = q.data();
        if (seg.key_rotation) {  // (q R) . (k R) = q . k
          turned.resize(R * D);
          times(q.data(), seg.key_rotation + sh * D * D, R, D, false, turned.data());
          qs_ = turned.data();
        }
        segment_scores(seg, b, sh, t0, t1, qs_, R, D, p.data() + seg.start + t0 - c0, W);
      }
      std::vector<int64_t> mine;  // this split's overlay entries: their keys win over the codes at their columns
      for (size_t j = 0; j < it.overlay.size(); ++j)
        if (it.overlay[j] >= c0 && it.overlay[j] < c1) mine.push_back(j);
      float key[kMaxDim];
      for (const int64_t j : mine) {
        plain_row(it.ok.rows(b, h, j, j + 1), 0, D, key);
        row_dots(KeyInMemory{key}, D, q.data(), R, p.data() + it.overlay[j] - c0, W, key);
      }
      float* o = partial.data() + task * stride;
      float *m = o + R * D, *l = m + R;
      for (int64_t r = 0; r < R; ++r) {
        float* row = p.data() + r * W;
        m[r] = row_max(row, W);
        l[r] = exp_shifted(row, W, m[r]);
        if (it.probs) std::copy(row, row + W, it.probs + (bh * R + r) * it.N + c0);  // scaled in the combine
      }
      std::fill(o, o + R * D, 0.0f);
      part.resize(R * D);
      for (const int64_t j : mine) {  // the overlay's value at its column, which the segments then read with weight 0
        plain_row(it.ov.rows(b, h, j, j + 1), 0, D, key);
        for (int64_t r = 0; r < R; ++r) {
          float& w = p[r * W + it.overlay[j] - c0];
          for (int64_t d = 0; d < D; ++d) o[r * D + d] += w * key[d];
          w = 0.0f;
        }
      }
      for (const auto& seg : it.segments) {
        const int64_t sh = seg.head(h), t0 = std::max<int64_t>(0, c0 - seg.start), t1 = std::min(seg.T, c1 - seg.start);
        if (sh < 0 || t0 >= t1) continue;
        segment_values(seg, b, sh, t0, t1, p.data() + seg.start + t0 - c0, R, W, D, part.data());
        if (seg.value_rotation) {  // (p @ v R) R^T = p @ v
          back.resize(R * D);
          times(part.data(), seg.value_rotation + sh * D * D, R, D, true, back.data());
          part.swap(back);
        }
        for (int64_t j = 0; j < R * D; ++j) o[j] += part[j];
      }
    }
  });
  // The splits of each head combined in order (flash-decoding): out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
  std::vector<float> factor;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const int64_t S = splits_of(it.N), R = it.R, D = it.D;
    for (int64_t bh = 0; bh < it.BH; ++bh) {
      const float* base = partial.data() + (first[i] + bh * S) * stride;
      for (int64_t r = 0; r < R; ++r) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t sp = 0; sp < S; ++sp) top = std::max(top, base[sp * stride + R * D + r]);
        factor.assign(S, 0.0f);
        for (int64_t sp = 0; sp < S; ++sp) {
          factor[sp] = std::exp(base[sp * stride + R * D + r] - top);
          total += base[sp * stride + R * D + R + r] * factor[sp];
        }
        const float inverse = 1.0f / total;
        float* out = it.out + (bh * R + r) * D;
        for (int64_t d = 0; d < D; ++d) {
          float acc = 0.0f;
          for (int64_t sp = 0; sp < S; ++sp) acc += base[sp * stride + r * D + d] * factor[sp];
          out[d] = acc * inverse;
        }
        if (it.probs)
          for (int64_t sp = 0; sp < S; ++sp) {
            const float scale = factor[sp] * inverse;
            float* row = it.probs + (bh * R + r) * it.N;
            const int64_t width = split_width(it.N);
            for (int64_t c = sp * width; c < std::min(it.N, (sp + 1) * width); ++c) row[c] *= scale;
          }
      }
    }
  }
  outs.insert(outs.end(), probs.begin(), probs.end());
  return outs;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("key_scores", &key_scores, "writes q . dequantized keys, read from the codes, into scores[:, heads, :, column:]");
  m.def("decode_attend", &decode_attend, "softmax(q . k) @ v of one new token over stored segments (plain rows or codes), for many sequences");
  m.def("value_accumulate", &value_accumulate, "p[:, heads, :, column:] @ dequantized values, read from the codes: [B, h, R, D]");
}
