// DeepSpeed's CPU Adam (its csrc/adam/cpu_adam_impl.cpp, included unchanged) bound for
// dstrain/rank/adam_nogil.py. DeepSpeed's own binding holds the GIL through each update; this one
// releases it, so an update running on dstrain's offload worker thread does not stop the training
// thread's Python (dstrain/rank/offload_overlap_zero3.py). It adds one update of our own: Adam on
// fp32 weights from bf16 gradients (offload_step.py), which sends half the bytes over the bus.
#include <omp.h>
#include <algorithm>
#include <vector>
#include "cpu_adam_impl.cpp"

// DeepSpeed's update, for fp32 weights and states, with the gradients held in bf16: each thread widens
// one tile of them (times grad_factor, the unscale/clip factor, when it is not 1) into a buffer that
// stays in its cache and runs DeepSpeed's own Step_8 on the tile. Tiles are multiples of 1,024
// elements, so every element takes the vector or scalar path it takes in one call over the whole
// tensor: the weights and moments equal DeepSpeed's update of the widened, multiplied gradients.
static int adam_update_bf16_grads(int optimizer_id,
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
                                  int64_t tile)
{
    TORCH_CHECK(params.scalar_type() == torch::kFloat32 && exp_avg.scalar_type() == torch::kFloat32 &&
                    exp_avg_sq.scalar_type() == torch::kFloat32,
                "adam_update_bf16_grads: weights and moments must be float32");
    TORCH_CHECK(grads.scalar_type() == torch::kBFloat16, "adam_update_bf16_grads: gradients must be bfloat16");
    TORCH_CHECK(params.is_contiguous() && grads.is_contiguous() && exp_avg.is_contiguous() &&
                    exp_avg_sq.is_contiguous(),
                "adam_update_bf16_grads: tensors must be contiguous");
    const int64_t n = params.numel();
    TORCH_CHECK(grads.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
                "adam_update_bf16_grads: tensors must have the same size");
    TORCH_CHECK(tile > 0 && tile % 1024 == 0, "adam_update_bf16_grads: tile must be a multiple of 1024");
    auto found = s_optimizers.find(optimizer_id);
    TORCH_CHECK(found != s_optimizers.end(), "adam_update_bf16_grads: no optimizer with this id");
    std::shared_ptr<Adam_Optimizer> opt = std::static_pointer_cast<Adam_Optimizer>(found->second);
    opt->IncrementStep(step, beta1, beta2);
    opt->update_state(lr, epsilon, weight_decay, bias_correction);

    float* weights = params.data_ptr<float>();
    const c10::BFloat16* half_grads = grads.data_ptr<c10::BFloat16>();
    float* moments = exp_avg.data_ptr<float>();
    float* squares = exp_avg_sq.data_ptr<float>();
    const float factor = static_cast<float>(grad_factor);
    const bool scale = factor != 1.0f;
    const int64_t tiles = (n + tile - 1) / tile;
#pragma omp parallel
    {
        std::vector<float> widened(static_cast<size_t>(std::min(tile, n)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t start = t * tile;
            const int64_t length = std::min(tile, n - start);
            for (int64_t k = 0; k < length; ++k) {
                const float value = static_cast<float>(half_grads[start + k]);
                widened[k] = scale ? value * factor : value;
            }
            opt->Step_8(weights + start,
                        widened.data(),
                        moments + start,
                        squares + start,
                        static_cast<size_t>(length),
                        false);
        }
    }
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
    m.def("adam_update_bf16_grads",
          &adam_update_bf16_grads,
          "DeepSpeed's CPU Adam update of fp32 weights from bf16 gradients, with the GIL released",
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
