// Which variant this build is (build.py's names), from the compiler's own ISA macros: build.py
// checks it after loading, so a stale or foreign build never runs code for the wrong CPU.
//   compiled_isa() -> str: "amx" (the avx512 flags + AMX-TILE/BF16/INT8), "avx512" (AVX-512
//   F/BW/VL/DQ + BF16 + VNNI) or "avx2"
#include <torch/library.h>

#include <string>

namespace {

std::string compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  return "amx";
#else
  return "avx512";
#endif
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) { m.def("compiled_isa", &compiled_isa); }
