// DeepSpeed's CPU Adam (its csrc/adam/cpu_adam_impl.cpp, compiled unchanged beside this file) bound for
// dstrain/rank/adam_nogil.py. DeepSpeed's own binding holds the GIL through each update; this one
// releases it, so an update running on dstrain's offload worker thread does not stop the training
// thread's Python (dstrain/rank/offload_overlap_zero3.py).
#include "cpu_adam.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed's CPU Adam: create an optimizer by id");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed's CPU Adam: destroy an optimizer by id");
    m.def("adam_update",
          &ds_adam_step,
          "DeepSpeed's CPU Adam update, with the GIL released",
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
