// Which variant this build is (build.py's names), from the compiler's own ISA macros: build.py
// checks it after loading, so a stale or foreign build never runs code for the wrong CPU.
//   compiled_isa() -> str: "avx512" (AVX-512 F/BW/VL/DQ + BF16 + VNNI) or "avx2"
#include <torch/library.h>

#include <string>

namespace {

std::string compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return "avx512";
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inferlab, m) { m.def("compiled_isa", &compiled_isa); }
