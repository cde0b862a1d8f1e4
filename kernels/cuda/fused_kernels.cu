// Placeholder until the kernels land.
namespace laprox::kernels::cuda {}
