// Restricted builds: a build that holds only the kernels a test needs (a planted-bug build, a
// sanitizer run over a few kernels), in the same single compilation unit. The loader turns
// FLASHMOE_BUILD_ONLY, or `build --only`, into these defines, each a '+'-separated list; a
// dimension whose define is absent is not restricted:
//   FLASHMOE_ONLY_OPS               kernel families: fwd (configurations 1, 2, 4), fwd_sm90a (5 to
//                                   7), decode (3), combine, varlen (1, 2, 4, 5 and the offsets
//                                   check), paged (3), bwd (backward 1, 2), bwd_sm90a (backward 3)
//   FLASHMOE_ONLY_HEAD_DIMS         64+128
//   FLASHMOE_ONLY_CONFIGS           forward tile configurations (config=)
//   FLASHMOE_ONLY_BACKWARD_CONFIGS  backward tile configurations (backward_config=)
//   FLASHMOE_ONLY_DTYPES            fp16+bf16
// Each launch site names its kernel through FLASHMOE_KERNEL, or FLASHMOE_VISIT where it hands the
// kernel to a visitor: in a restricted build a kernel outside the restriction is never
// instantiated, and a call that needs it raises one line naming the restriction instead of
// launching. A visitor wrapped in FLASHMOE_TRAITS_ONLY reads only the traits (tile shapes, shared
// memory), which every configuration keeps. Without the defines each macro is its arguments' call,
// so the default build's unit is, token for token, the unit without this header.
#ifndef FLASHMOE_BUILD_ONLY_CUH_
#define FLASHMOE_BUILD_ONLY_CUH_

#if defined(FLASHMOE_ONLY_OPS) || defined(FLASHMOE_ONLY_HEAD_DIMS) ||            \
    defined(FLASHMOE_ONLY_CONFIGS) || defined(FLASHMOE_ONLY_BACKWARD_CONFIGS) || \
    defined(FLASHMOE_ONLY_DTYPES)

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <type_traits>

#include "attention_ops.h"

#define FLASHMOE_ONLY_STR_(...) #__VA_ARGS__
#define FLASHMOE_ONLY_STR(...)  FLASHMOE_ONLY_STR_(__VA_ARGS__)

namespace flashmoe::cuda::only {

// The kernel families, one bit each: a launch site may name several (the backward's pre- and
// post-passes serve both backward families).
enum Op : unsigned {
  fwd = 1u << 0,
  fwd_sm90a = 1u << 1,
  decode = 1u << 2,
  combine = 1u << 3,
  varlen = 1u << 4,
  paged = 1u << 5,
  bwd = 1u << 6,
  bwd_sm90a = 1u << 7,
};
constexpr int kNumOps = 8;
constexpr const char* kOpNames[kNumOps] = {"fwd",    "fwd_sm90a", "decode", "combine",
                                           "varlen", "paged",     "bwd",    "bwd_sm90a"};
constexpr const char* kDtypeNames[2] = {"fp16", "bf16"};

// The restriction's lists as the defines spell them; nullptr: that dimension is not restricted.
#ifdef FLASHMOE_ONLY_OPS
constexpr const char* kOps = FLASHMOE_ONLY_STR(FLASHMOE_ONLY_OPS);
#define FLASHMOE_ONLY_OPS_TEXT " -DFLASHMOE_ONLY_OPS=" FLASHMOE_ONLY_STR(FLASHMOE_ONLY_OPS)
#else
constexpr const char* kOps = nullptr;
#define FLASHMOE_ONLY_OPS_TEXT ""
#endif
#ifdef FLASHMOE_ONLY_HEAD_DIMS
constexpr const char* kHeadDims = FLASHMOE_ONLY_STR(FLASHMOE_ONLY_HEAD_DIMS);
#define FLASHMOE_ONLY_HEAD_DIMS_TEXT \
  " -DFLASHMOE_ONLY_HEAD_DIMS=" FLASHMOE_ONLY_STR(FLASHMOE_ONLY_HEAD_DIMS)
#else
constexpr const char* kHeadDims = nullptr;
#define FLASHMOE_ONLY_HEAD_DIMS_TEXT ""
#endif
#ifdef FLASHMOE_ONLY_CONFIGS
constexpr const char* kConfigs = FLASHMOE_ONLY_STR(FLASHMOE_ONLY_CONFIGS);
#define FLASHMOE_ONLY_CONFIGS_TEXT \
  " -DFLASHMOE_ONLY_CONFIGS=" FLASHMOE_ONLY_STR(FLASHMOE_ONLY_CONFIGS)
#else
constexpr const char* kConfigs = nullptr;
#define FLASHMOE_ONLY_CONFIGS_TEXT ""
#endif
#ifdef FLASHMOE_ONLY_BACKWARD_CONFIGS
constexpr const char* kBackwardConfigs = FLASHMOE_ONLY_STR(FLASHMOE_ONLY_BACKWARD_CONFIGS);
#define FLASHMOE_ONLY_BACKWARD_CONFIGS_TEXT \
  " -DFLASHMOE_ONLY_BACKWARD_CONFIGS=" FLASHMOE_ONLY_STR(FLASHMOE_ONLY_BACKWARD_CONFIGS)
#else
constexpr const char* kBackwardConfigs = nullptr;
#define FLASHMOE_ONLY_BACKWARD_CONFIGS_TEXT ""
#endif
#ifdef FLASHMOE_ONLY_DTYPES
constexpr const char* kDtypes = FLASHMOE_ONLY_STR(FLASHMOE_ONLY_DTYPES);
#define FLASHMOE_ONLY_DTYPES_TEXT " -DFLASHMOE_ONLY_DTYPES=" FLASHMOE_ONLY_STR(FLASHMOE_ONLY_DTYPES)
#else
constexpr const char* kDtypes = nullptr;
#define FLASHMOE_ONLY_DTYPES_TEXT ""
#endif
// The defines, for the error: what the build was restricted to.
constexpr const char* kRestriction = FLASHMOE_ONLY_OPS_TEXT FLASHMOE_ONLY_HEAD_DIMS_TEXT
    FLASHMOE_ONLY_CONFIGS_TEXT FLASHMOE_ONLY_BACKWARD_CONFIGS_TEXT FLASHMOE_ONLY_DTYPES_TEXT;

// Whether the item of `list` that starts at `at` (it ends at '+' or the end) spells `name`.
constexpr bool item_is(const char* at, const char* name) {
  while (*at != '\0' && *at != '+' && *at == *name)
    ++at, ++name;
  return *name == '\0' && (*at == '\0' || *at == '+');
}
constexpr const char* next_item(const char* at) {
  while (*at != '\0' && *at != '+')
    ++at;
  return *at == '+' ? at + 1 : at;
}
constexpr bool listed(const char* list, const char* name) {
  for (const char* at = list; *at != '\0'; at = next_item(at)) {
    if (item_is(at, name)) return true;
  }
  return false;
}
constexpr bool listed(const char* list, int value) {
  for (const char* at = list; *at != '\0'; at = next_item(at)) {
    int number = 0;
    const char* digit = at;
    for (; *digit >= '0' && *digit <= '9'; ++digit)
      number = number * 10 + (*digit - '0');
    if (digit != at && (*digit == '\0' || *digit == '+') && number == value) return true;
  }
  return false;
}
// Every item of `list` is one of `names` (or a number, with names == nullptr): a misspelt define,
// or a list item some header defines as a macro, fails the build instead of selecting nothing.
constexpr bool well_formed(const char* list, const char* const* names, int count) {
  if (list == nullptr) return true;
  if (*list == '\0') return false;
  for (const char* at = list; *at != '\0'; at = next_item(at)) {
    bool known = false;
    if (names == nullptr) {
      const char* digit = at;
      while (*digit >= '0' && *digit <= '9')
        ++digit;
      known = digit != at && (*digit == '\0' || *digit == '+');
    }
    for (int i = 0; names != nullptr && i < count; ++i)
      known = known || item_is(at, names[i]);
    if (!known) return false;
  }
  return true;
}
static_assert(well_formed(kOps, kOpNames, kNumOps),
              "FLASHMOE_ONLY_OPS: '+'-separated kernel families (fwd, fwd_sm90a, decode, combine, "
              "varlen, paged, bwd, bwd_sm90a)");
static_assert(well_formed(kDtypes, kDtypeNames, 2),
              "FLASHMOE_ONLY_DTYPES: fp16, bf16 or fp16+bf16");
static_assert(well_formed(kHeadDims, nullptr, 0) && well_formed(kConfigs, nullptr, 0) &&
                  well_formed(kBackwardConfigs, nullptr, 0),
              "FLASHMOE_ONLY_HEAD_DIMS, _CONFIGS, _BACKWARD_CONFIGS: '+'-separated numbers");

constexpr unsigned op_mask() {
  unsigned mask = kOps == nullptr ? ~0u : 0u;
  for (int i = 0; kOps != nullptr && i < kNumOps; ++i)
    mask |= listed(kOps, kOpNames[i]) ? 1u << i : 0u;
  return mask;
}

template <typename T>
constexpr const char* dtype_of() {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);
  return std::is_same_v<T, __half> ? "fp16" : "bf16";
}

constexpr bool is_backward(unsigned ops) { return (ops & (bwd | bwd_sm90a)) != 0; }

// Whether this build holds the kernel of family `ops` (any of them, when several) for dtype T,
// head dim `head_dim` and tile configuration `config` (the backward's for the backward families;
// 0 where one kernel serves every configuration).
template <typename T>
constexpr bool built(unsigned ops, int head_dim, int config) {
  const char* configs = is_backward(ops) ? kBackwardConfigs : kConfigs;
  return (ops & op_mask()) != 0 && (kDtypes == nullptr || listed(kDtypes, dtype_of<T>())) &&
         (kHeadDims == nullptr || listed(kHeadDims, head_dim)) &&
         (configs == nullptr || config == 0 || listed(configs, config));
}

// The call needs a kernel this build left out: one line, before anything is launched.
template <typename T>
void not_built(unsigned ops, int head_dim, int config) {
  std::string families;
  for (int i = 0; i < kNumOps; ++i) {
    if (ops & (1u << i)) families += std::string(families.empty() ? "" : " or ") + kOpNames[i];
  }
  const std::string tile = config == 0        ? std::string()
                           : is_backward(ops) ? ", backward_config " + std::to_string(config)
                                              : ", config " + std::to_string(config);
  TORCH_CHECK(false, error_text("ValueError: this build holds only the kernels of", kRestriction,
                                ", not the ", families, " kernel for ", dtype_of<T>(),
                                ", head_dim ", head_dim, tile,
                                ": rebuild without the restriction (unset FLASHMOE_BUILD_ONLY, or "
                                "build without --only)"));
}

// A visitor that reads only the traits: a configuration outside the restriction hands it a null
// kernel with the configuration's traits (the tile shape of a launch that will then use a built
// kernel, or the build report's table of every configuration).
template <typename F>
struct TraitsOnly {
  F f;
  template <typename Kernel, typename Traits>
  void operator()(Kernel kernel, Traits traits) {
    f(kernel, traits);
  }
};
template <typename F>
TraitsOnly<F> traits_only(F f) {
  return {f};
}
template <typename F>
struct IsTraitsOnly : std::false_type {};
template <typename F>
struct IsTraitsOnly<TraitsOnly<F>> : std::true_type {};

template <typename T, typename F, typename Traits>
void excluded(F&& f, Traits traits, unsigned ops, int head_dim, int config) {
  if constexpr (IsTraitsOnly<std::decay_t<F>>::value) {
    f(nullptr, traits);
  } else {
    not_built<T>(ops, head_dim, config);
  }
}

}  // namespace flashmoe::cuda::only

// `statement` launches the kernel of family `ops` for (T, D, config).
#define FLASHMOE_KERNEL(ops, T, D, config, ...)                       \
  do {                                                                \
    if constexpr (::flashmoe::cuda::only::built<T>(ops, D, config)) { \
      __VA_ARGS__;                                                    \
    } else {                                                          \
      ::flashmoe::cuda::only::not_built<T>(ops, D, config);           \
    }                                                                 \
  } while (0)
// f(kernel, Traits{}): the visitor `f` gets the kernel of family `ops` for (T, D, config).
#define FLASHMOE_VISIT(ops, T, D, config, f, Traits, ...)               \
  do {                                                                  \
    if constexpr (::flashmoe::cuda::only::built<T>(ops, D, config)) {   \
      f(__VA_ARGS__, Traits{});                                         \
    } else {                                                            \
      ::flashmoe::cuda::only::excluded<T>(f, Traits{}, ops, D, config); \
    }                                                                   \
  } while (0)
#define FLASHMOE_TRAITS_ONLY(...) ::flashmoe::cuda::only::traits_only(__VA_ARGS__)

#else  // the default build: every kernel, and these macros are their arguments' tokens

#define FLASHMOE_KERNEL(ops, T, D, config, ...)           __VA_ARGS__
#define FLASHMOE_VISIT(ops, T, D, config, f, Traits, ...) f(__VA_ARGS__, Traits{})
#define FLASHMOE_TRAITS_ONLY(...)                         __VA_ARGS__

#endif
#endif  // FLASHMOE_BUILD_ONLY_CUH_
