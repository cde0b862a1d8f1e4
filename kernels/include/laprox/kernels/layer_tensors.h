// The five tensors of one layer's keep-plan inputs — keys, values, window_queries,
// window_attention, window_lse — listed once. Every layer that names, converts, resolves, checks
// or stages them (the wire conversion, the service core, the backends, the clients) walks this
// list instead of spelling the five out, so a sixth tensor is added in one place.
#ifndef LAPROX_KERNELS_LAYER_TENSORS_H_
#define LAPROX_KERNELS_LAYER_TENSORS_H_

#include "absl/status/status.h"

namespace laprox::kernels {

// One of the five: its field name (as in laprox.v1 LayerInputs and every C++ struct of them)
// and whether every request must give it (keys, values; of the window tensors the request gives
// queries or attention, and the log-sum-exp only with queries), and whether it may be paged
// (TensorView::Paged: keys and values, which an engine keeps in its block pool).
struct LayerTensor {
  const char* name;
  bool required;
  bool pageable;
};

// Calls f(tensor, layers.<member>...) for each of the five tensors, in the order above, of all
// `layers` at once — structs with members of those names (LayerInputs, the service's and the
// client's LayerRefs, or a struct of accessors of the proto message) — and returns the first
// status that is not OK (then the rest are not visited). f returns absl::Status.
template <typename F, typename... Layers>
absl::Status ForEachLayerTensor(F&& f, Layers&... layers) {
  absl::Status s = f(LayerTensor{"keys", true, true}, layers.keys...);
  if (s.ok()) s = f(LayerTensor{"values", true, true}, layers.values...);
  if (s.ok()) s = f(LayerTensor{"window_queries", false, false}, layers.window_queries...);
  if (s.ok()) s = f(LayerTensor{"window_attention", false, false}, layers.window_attention...);
  if (s.ok()) s = f(LayerTensor{"window_lse", false, false}, layers.window_lse...);
  return s;
}

}  // namespace laprox::kernels

#endif  // LAPROX_KERNELS_LAYER_TENSORS_H_
