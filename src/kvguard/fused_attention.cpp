// Decode attention over kvguard's quantized KV codes, without dequantizing the stored history into a tensor.
//
// Two kernels, each reading a part's codes exactly once per decode step (kvguard/fused_attention.py merges
// them with the full-precision segments and does the softmax in between). A part holds h of the layer's H_kv
// heads (``heads`` maps them, empty = all) and T tokens stored from column ``column`` of the layer's N columns:
//
//   key_scores(scores [B, H_kv, R, N] f32, column, heads, q [B, h, R, D] f32, codes, scale, zero, bits,
//              tokens_per_row, channels_per_entry)
//       writes scores[b, heads[i], r, column + t] = sum_d q[b, i, r, d] * (code[t, d] * s(t, d) + z(t, d))
//   value_accumulate(p [B, H_kv, R, N] f32, column, heads, codes, scale, zero, bits, tokens_per_row,
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
// A row is dequantized into a small buffer exactly as QuantizedTensor.dequantize does (code * s + z in
// float32), so the results equal the reference up to float summation order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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
};

Codes codes_of(const torch::Tensor& codes, int bits) {
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8, "codes must be uint8 (int8 codes viewed as uint8)");
  TORCH_CHECK(codes.dim() == 4 && codes.stride(3) == 1, "codes must be [B, h, T, bytes] with a contiguous last axis");
  TORCH_CHECK(bits == 2 || bits == 3 || bits == 4 || bits == 8, "bits has to be one of [2, 3, 4, 8] but got ", bits);
  return {codes.data_ptr<uint8_t>(), codes.stride(0), codes.stride(1), codes.stride(2), bits};
}

Scales scales_of(const torch::Tensor& scale, const torch::Tensor& zero, int64_t tokens_per_row,
                 int64_t channels_per_entry) {
  TORCH_CHECK(scale.scalar_type() == torch::kHalf && scale.dim() == 4 && scale.stride(3) == 1,
              "scale must be float16 [B, h, rows, entries] with a contiguous last axis");
  TORCH_CHECK(tokens_per_row >= 1 && channels_per_entry >= 1, "tokens_per_row and channels_per_entry must be >= 1");
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

// One token's codes as floats: out[d] = code d.
inline void unpack_row(const uint8_t* src, int bits, int64_t dim, float* out) {
  switch (bits) {
    case 8: {
      const int8_t* s = reinterpret_cast<const int8_t*>(src);
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(s[d]);
      break;
    }
    case 4:
      for (int64_t i = 0; i < dim / 2; ++i) {
        const uint8_t b = src[i];
        out[2 * i] = static_cast<float>(b & 0xF);
        out[2 * i + 1] = static_cast<float>(b >> 4);
      }
      break;
    case 2:
      for (int64_t i = 0; i < dim / 4; ++i) {
        const uint8_t b = src[i];
        out[4 * i] = static_cast<float>(b & 0x3);
        out[4 * i + 1] = static_cast<float>((b >> 2) & 0x3);
        out[4 * i + 2] = static_cast<float>((b >> 4) & 0x3);
        out[4 * i + 3] = static_cast<float>(b >> 6);
      }
      break;
    default:  // 3: eight codes per 24-bit little-endian word
      for (int64_t w = 0; w < dim / 8; ++w) {
        const uint32_t word = static_cast<uint32_t>(src[3 * w]) | (static_cast<uint32_t>(src[3 * w + 1]) << 8) |
                              (static_cast<uint32_t>(src[3 * w + 2]) << 16);
        for (int j = 0; j < 8; ++j) out[8 * w + j] = static_cast<float>((word >> (3 * j)) & 0x7);
      }
  }
}

// The scale and zero point of every channel for scale row `row`, expanded over channels_per_entry channels.
inline void load_row(const Scales& s, int64_t b, int64_t h, int64_t row, int64_t dim, float* scale, float* zero) {
  const at::Half* sp = s.scale + b * s.sb + h * s.sh + row * s.sr;
  const at::Half* zp = s.zero ? s.zero + b * s.zb + h * s.zh + row * s.zr : nullptr;
  for (int64_t e = 0; e < s.entries; ++e) {
    const float sv = static_cast<float>(sp[e]);
    const float zv = zp ? static_cast<float>(zp[e]) : 0.0f;
    const int64_t end = std::min(dim, (e + 1) * s.channels_per_entry);
    for (int64_t d = e * s.channels_per_entry; d < end; ++d) {
      scale[d] = sv;
      zero[d] = zv;
    }
  }
}

// code * s + z, in float32 as QuantizedTensor.dequantize computes it (z = 0 for symmetric INT8).
inline void dequantize_row(const float* code, const float* scale, const float* zero, int64_t dim, float* out) {
  for (int64_t d = 0; d < dim; ++d) out[d] = code[d] * scale[d] + zero[d];
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

}  // namespace

void key_scores(torch::Tensor& scores, int64_t column, const torch::Tensor& heads, const torch::Tensor& q,
                const torch::Tensor& codes_t, const torch::Tensor& scale, const torch::Tensor& zero, int64_t bits,
                int64_t tokens_per_row, int64_t channels_per_entry) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous() && q.dim() == 4, "q must be contiguous float32 [B, h, R, D]");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = codes_t.size(2);
  check_dims(D, static_cast<int>(bits));
  const Codes codes = codes_of(codes_t, static_cast<int>(bits));
  const Scales s = scales_of(scale, zero, tokens_per_row, channels_per_entry);
  const Target dst = target_of(scores, heads, column, B, H, R, T);
  const float* qp = q.data_ptr<float>();
  const int64_t blocks = (T + kTokenBlock - 1) / kTokenBlock;
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    float code[kMaxDim], sc[kMaxDim], zr[kMaxDim], key[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      const int64_t t0 = (task % blocks) * kTokenBlock, t1 = std::min(T, t0 + kTokenBlock);
      const float* qh = qp + bh * R * D;
      float* oh = dst.row(b, h);
      int64_t loaded = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
        if (row != loaded) {
          load_row(s, b, h, row, D, sc, zr);
          loaded = row;
        }
        unpack_row(codes.data + b * codes.sb + h * codes.sh + t * codes.st, codes.bits, D, code);
        dequantize_row(code, sc, zr, D, key);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qh + r * D;
          float acc = 0.0f;
          // A float sum is only vectorized when the compiler may reorder it: allow that for this dot product.
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qr[d] * key[d];
          oh[r * dst.sr + t] = acc;
        }
      }
    }
  });
}

torch::Tensor value_accumulate(const torch::Tensor& p, int64_t column, const torch::Tensor& heads,
                               const torch::Tensor& codes_t, const torch::Tensor& scale, const torch::Tensor& zero,
                               int64_t bits, int64_t tokens_per_row, int64_t channels_per_entry, int64_t head_dim) {
  const int64_t B = codes_t.size(0), H = codes_t.size(1), R = p.size(2), T = codes_t.size(2), D = head_dim;
  const Target src = target_of(p, heads, column, B, H, R, T);
  check_dims(D, static_cast<int>(bits));
  const Codes codes = codes_of(codes_t, static_cast<int>(bits));
  const Scales s = scales_of(scale, zero, tokens_per_row, channels_per_entry);
  // Each task sums its own block of tokens into its own slot; the slots are summed in a fixed order after, so
  // the result does not depend on the thread count.
  const int64_t blocks = std::max<int64_t>(1, (T + kTokenBlock - 1) / kTokenBlock);
  auto partial = torch::zeros({B * H, blocks, R, D}, p.options());
  float* acc = partial.data_ptr<float>();
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    float code[kMaxDim], sc[kMaxDim], zr[kMaxDim], value[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      const int64_t t0 = (task % blocks) * kTokenBlock, t1 = std::min(T, t0 + kTokenBlock);
      const float* ph = src.row(b, h);
      float* oh = acc + task * R * D;
      int64_t loaded = -1;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = s.sr == 0 ? 0 : t / s.tokens_per_row;
        if (row != loaded) {
          load_row(s, b, h, row, D, sc, zr);
          loaded = row;
        }
        unpack_row(codes.data + b * codes.sb + h * codes.sh + t * codes.st, codes.bits, D, code);
        dequantize_row(code, sc, zr, D, value);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("key_scores", &key_scores, "writes q . dequantized keys, read from the codes, into scores[:, heads, :, column:]");
  m.def("value_accumulate", &value_accumulate, "p[:, heads, :, column:] @ dequantized values, read from the codes: [B, h, R, D]");
}
