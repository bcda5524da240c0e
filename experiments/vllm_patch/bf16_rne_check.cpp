// experiments/vllm_patch/bf16_rne_check.cpp: the float32 -> bf16 conversions of vLLM's
// csrc/cpu/cpu_types_x86.hpp as cpu_types_x86.diff patches them (round to nearest even, NaNs
// blended back as a quiet NaN), checked against c10::BFloat16's round_to_nearest_even on all
// 2^32 float32 bit patterns: the AVX2 path (BF16Vec8's helper), the AVX-512F path (BF16Vec16
// and BF16Vec8 with AVX-512VL), and the scalar storeFP32. Each path's function is the diff's
// text; the unpatched (truncating) AVX2 path is counted too, so the check is seen to fail it.
//
//   g++ -O2 -o /tmp/bf16_rne_check experiments/vllm_patch/bf16_rne_check.cpp && /tmp/bf16_rne_check
//
// (check.py compiles and runs it, and writes its JSON.) Subnormals are rounded as torch rounds
// them: by the same integer arithmetic, never flushed. Paths the chip cannot run are skipped.
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

// c10::BFloat16's round_to_nearest_even (c10/util/BFloat16.h): every NaN becomes 0x7FC0
static uint16_t reference(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  if (f != f) return 0x7FC0;
  uint32_t rounding_bias = ((u >> 16) & 1) + 0x7FFF;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// --- the patched conversions, as in cpu_types_x86.diff ---

// storeFP32<c10::BFloat16> without __AVX512BF16__: c10::BFloat16(v), which is reference()
static uint16_t scalar_patched(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return reference(u);
}

// FP32Vec8_to_BF16Vec8_avx2, patched: + 0x7FFF + the kept lsb, NaNs back, then as before
__attribute__((target("avx2"))) static __m128i avx2_patched(__m256 a) {
  __m256i ai = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ai, 16), _mm256_set1_epi32(1));
  ai = _mm256_add_epi32(ai, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  ai = _mm256_blendv_epi8(ai, _mm256_set1_epi32(0x7FC00000), nan);
  ai = _mm256_srli_epi32(ai, 16);
  ai = _mm256_packus_epi32(ai, ai);
  ai = _mm256_permute4x64_epi64(ai, 0b00111001);
  return _mm256_extracti128_si256(ai, 0);
}

// The same helper unpatched (vLLM today): the high 16 bits kept, truncation
__attribute__((target("avx2"))) static __m128i avx2_today(__m256 a) {
  __m256i ai = _mm256_castps_si256(a);
  ai = _mm256_srli_epi32(ai, 16);
  ai = _mm256_packus_epi32(ai, ai);
  ai = _mm256_permute4x64_epi64(ai, 0b00111001);
  return _mm256_extracti128_si256(ai, 0);
}

// BF16Vec16(const FP32Vec16 &) with __AVX512F__, patched
__attribute__((target("avx512f,avx512bw"))) static __m256i avx512_patched(__m512 a) {
  __m512i ai = _mm512_castps_si512(a);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 16), _mm512_set1_epi32(1));
  ai = _mm512_add_epi32(ai, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  ai = _mm512_mask_mov_epi32(ai, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(ai, 16));
}

// BF16Vec8(const FP32Vec8 &) with __AVX512F__ (its _mm256_ intrinsics need AVX-512VL), patched
__attribute__((target("avx512f,avx512bw,avx512vl"))) static __m128i avx512vl_patched(__m256 a) {
  __m256i ai = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(ai, 16), _mm256_set1_epi32(1));
  ai = _mm256_add_epi32(ai, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  __mmask8 nan = _mm256_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  ai = _mm256_mask_mov_epi32(ai, nan, _mm256_set1_epi32(0x7FC00000));
  return _mm256_cvtepi32_epi16(_mm256_srli_epi32(ai, 16));
}

// --- the exhaustive checks: every pattern u in [0, 2^32), in vector-sized blocks ---

static uint64_t mismatches_of(const uint16_t *got, uint32_t base, int n) {
  uint64_t bad = 0;
  for (int i = 0; i < n; i++) bad += got[i] != reference(base + static_cast<uint32_t>(i));
  return bad;
}

template <typename Convert8>
__attribute__((target("avx2"))) static uint64_t check8(Convert8 convert) {
  uint64_t bad = 0;
  alignas(32) uint32_t in[8];
  alignas(16) uint16_t out[8];
  for (uint64_t base = 0; base < (1ULL << 32); base += 8) {
    for (int i = 0; i < 8; i++) in[i] = static_cast<uint32_t>(base + i);
    __m128i r = convert(_mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<__m256i *>(in))));
    _mm_store_si128(reinterpret_cast<__m128i *>(out), r);
    bad += mismatches_of(out, static_cast<uint32_t>(base), 8);
  }
  return bad;
}

__attribute__((target("avx512f,avx512bw"))) static uint64_t check16() {
  uint64_t bad = 0;
  alignas(64) uint32_t in[16];
  alignas(32) uint16_t out[16];
  for (uint64_t base = 0; base < (1ULL << 32); base += 16) {
    for (int i = 0; i < 16; i++) in[i] = static_cast<uint32_t>(base + i);
    __m256i r = avx512_patched(_mm512_castsi512_ps(_mm512_load_si512(in)));
    _mm256_store_si256(reinterpret_cast<__m256i *>(out), r);
    bad += mismatches_of(out, static_cast<uint32_t>(base), 16);
  }
  return bad;
}

static uint64_t check_scalar() {
  uint64_t bad = 0;
  for (uint64_t u = 0; u < (1ULL << 32); u++) {
    float f;
    uint32_t bits = static_cast<uint32_t>(u);
    std::memcpy(&f, &bits, 4);
    bad += scalar_patched(f) != reference(bits);
  }
  return bad;
}

static void report(const char *path, uint64_t bad) {
  std::printf("%-34s patterns 4294967296 mismatches %llu\n", path,
              static_cast<unsigned long long>(bad));
}

int main() {
  __builtin_cpu_init();
  report("scalar storeFP32 (patched)", check_scalar());
  if (__builtin_cpu_supports("avx2")) {
    report("AVX2 BF16Vec8 (patched)", check8(avx2_patched));
    report("AVX2 BF16Vec8 (vLLM today)", check8(avx2_today));
  } else {
    std::printf("AVX2: this chip has no avx2, skipped\n");
  }
  bool vl = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl");
  if (vl) {
    report("AVX-512F BF16Vec16 (patched)", check16());
    report("AVX-512F BF16Vec8 (patched)", check8(avx512vl_patched));
  } else {
    std::printf("AVX-512F: this chip has no avx512f/bw/vl, skipped\n");
  }
  return 0;
}
