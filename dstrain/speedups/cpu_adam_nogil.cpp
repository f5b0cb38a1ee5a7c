// DeepSpeed's CPU Adam (its csrc/adam/cpu_adam_impl.cpp, included unchanged) bound for
// dstrain/speedups/cpu_adam_nogil.py. DeepSpeed's own binding holds the GIL through each update; this one
// releases it, so an update running on dstrain's offload worker thread does not stop the training
// thread's Python (offload_overlap_zero3.py). It adds one update of our own around DeepSpeed's
// arithmetic, tile by tile: from bf16 gradients (offload_chunked_step.py), which cross the bus in half the bytes,
// and with the new weights rounded to bf16 in the same pass (offload_chunked_step_zero3.py, where the bf16
// weights live on the host).
#include <omp.h>
#include <algorithm>
#include <vector>
#include "cpu_adam_impl.cpp"

// DeepSpeed's update run tile by tile on each thread: DeepSpeed's own Step_8 on each tile, whose
// gradients `gradients_of(start, length, buffer)` points at (the caller's fp32 gradients, or a thread's
// buffer it filled). Tiles are multiples of 1,024 elements, so every element takes the vector or scalar
// path it takes in one call over the whole tensor. Threads take tiles as they finish (dynamic): beside
// a training thread and the GPU driver's threads on the same cores, a statically split pass waits for
// its slowest thread. With `rounded`, each tile's updated weights are then
// rounded to bf16 into it while the tile is still in cache (c10::BFloat16: round to nearest even, as
// torch's .to(torch.bfloat16)), instead of a separate pass or a copy to the GPU and back.
template <typename GradientsOf>
static void step_in_tiles(Adam_Optimizer* opt,
                          float* weights,
                          float* moments,
                          float* squares,
                          c10::BFloat16* rounded,
                          int64_t n,
                          int64_t tile,
                          GradientsOf gradients_of)
{
    const int64_t tiles = (n + tile - 1) / tile;
#pragma omp parallel
    {
        std::vector<float> buffer(static_cast<size_t>(std::min(tile, n)));
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t start = t * tile;
            const int64_t length = std::min(tile, n - start);
            float* tile_grads = gradients_of(start, length, buffer.data());
            opt->Step_8(weights + start,
                        tile_grads,
                        moments + start,
                        squares + start,
                        static_cast<size_t>(length),
                        false);
            if (rounded != nullptr) {
                for (int64_t k = 0; k < length; ++k) {
                    rounded[start + k] = c10::BFloat16(weights[start + k]);
                }
            }
        }
    }
}

// DeepSpeed's update of fp32 weights and states, tile by tile, from gradients held in bf16 or fp32.
// Each thread widens a tile of bf16 gradients, times grad_factor (the unscale/clip factor) when it is
// not 1, into its buffer, which stays in its cache; fp32 gradients are read in place, or multiplied into
// the buffer (the caller's gradients are left as they are). The weights and moments equal DeepSpeed's
// update of the widened, multiplied gradients. With `rounded`, the new weights also land there in bf16.
static int adam_update_tiles(int optimizer_id,
                             size_t step,
                             float lr,
                             float beta1,
                             float beta2,
                             float epsilon,
                             float weight_decay,
                             bool bias_correction,
                             torch::Tensor& params,
                             torch::Tensor& grads,
                             torch::Tensor& exp_avg,
                             torch::Tensor& exp_avg_sq,
                             double grad_factor,
                             int64_t tile,
                             c10::optional<torch::Tensor> rounded)
{
    const bool half = grads.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(half || grads.scalar_type() == torch::kFloat32,
                "adam_update_tiles: gradients must be bfloat16 or float32");
    TORCH_CHECK(params.scalar_type() == torch::kFloat32 && exp_avg.scalar_type() == torch::kFloat32 &&
                    exp_avg_sq.scalar_type() == torch::kFloat32,
                "adam_update_tiles: weights and moments must be float32");
    TORCH_CHECK(params.is_contiguous() && grads.is_contiguous() && exp_avg.is_contiguous() &&
                    exp_avg_sq.is_contiguous(),
                "adam_update_tiles: tensors must be contiguous");
    const int64_t n = params.numel();
    TORCH_CHECK(grads.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
                "adam_update_tiles: tensors must have the same size");
    TORCH_CHECK(!rounded || (rounded->scalar_type() == torch::kBFloat16 && rounded->is_contiguous() &&
                             rounded->numel() == n && rounded->device().is_cpu()),
                "adam_update_tiles: the rounded weights must be a contiguous bf16 host tensor of the same size");
    TORCH_CHECK(tile > 0 && tile % 1024 == 0, "adam_update_tiles: tile must be a multiple of 1024");
    auto found = s_optimizers.find(optimizer_id);
    TORCH_CHECK(found != s_optimizers.end(), "adam_update_tiles: no optimizer with this id");
    Adam_Optimizer* opt = static_cast<Adam_Optimizer*>(found->second.get());
    opt->IncrementStep(step, beta1, beta2);
    opt->update_state(lr, epsilon, weight_decay, bias_correction);
    const float factor = static_cast<float>(grad_factor);
    const bool scale = factor != 1.0f;
    const c10::BFloat16* half_grads = half ? grads.data_ptr<c10::BFloat16>() : nullptr;
    float* full_grads = half ? nullptr : grads.data_ptr<float>();
    step_in_tiles(opt,
                  params.data_ptr<float>(),
                  exp_avg.data_ptr<float>(),
                  exp_avg_sq.data_ptr<float>(),
                  rounded ? rounded->data_ptr<c10::BFloat16>() : nullptr,
                  n,
                  tile,
                  [&](int64_t start, int64_t length, float* buffer) {
                      if (!half) {
                          if (!scale) { return full_grads + start; }
                          for (int64_t k = 0; k < length; ++k) { buffer[k] = full_grads[start + k] * factor; }
                          return buffer;
                      }
                      for (int64_t k = 0; k < length; ++k) {
                          const float value = static_cast<float>(half_grads[start + k]);
                          buffer[k] = scale ? value * factor : value;
                      }
                      return buffer;
                  });
    return 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed's CPU Adam: create an optimizer by id");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed's CPU Adam: destroy an optimizer by id");
    m.def("adam_update",
          &ds_adam_step,
          "DeepSpeed's CPU Adam update, with the GIL released",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("adam_update_tiles",
          &adam_update_tiles,
          "DeepSpeed's CPU Adam update of fp32 weights from bf16 or fp32 gradients, tile by tile (and the new "
          "weights' bf16 rounding, if given a tensor for it), with the GIL released",
          pybind11::arg("optimizer_id"), pybind11::arg("step"), pybind11::arg("lr"), pybind11::arg("beta1"),
          pybind11::arg("beta2"), pybind11::arg("epsilon"), pybind11::arg("weight_decay"),
          pybind11::arg("bias_correction"), pybind11::arg("params"), pybind11::arg("grads"),
          pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"), pybind11::arg("grad_factor"),
          pybind11::arg("tile"), pybind11::arg("rounded") = pybind11::none(),
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
