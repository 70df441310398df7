// C ABI for what libtorch's C++ API has and tch does not expose: a backward pass given
// the upstream gradient (activation checkpointing chains blocks' gradients with it), the
// TF32 switches for CUDA matmuls, and the fused multi-tensor AdamW update (tch skips ops
// over tensor lists). Every entry point catches all C++ exceptions: an exception crossing
// into Rust is UB.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>
#include <cstring>
#include <exception>
#include <vector>

extern "C" {

static void copy_err(const char* what, char* err, size_t err_len) {
  if (err == nullptr || err_len == 0) return;
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}

// output.backward(grad): accumulates into the .grad of every leaf that output depends
// on. `output` and `grad` are tch tensors (at::Tensor*). 0 on success, -1 with a message.
int hr_backward_with_grad(const at::Tensor* output, const at::Tensor* grad, char* err,
                          size_t err_len) {
  try {
    output->backward(*grad);
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
    return -1;
  } catch (...) {
    copy_err("unknown C++ exception in backward", err, err_len);
    return -1;
  }
}

// TF32 for CUDA float32 matmuls (cuBLAS) and convolutions (cuDNN).
int hr_set_tf32(int allow, char* err, size_t err_len) {
  try {
    at::globalContext().setAllowTF32CuBLAS(allow != 0);
    at::globalContext().setAllowTF32CuDNN(allow != 0);
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
    return -1;
  } catch (...) {
    copy_err("unknown C++ exception setting TF32", err, err_len);
    return -1;
  }
}

// torch.optim.AdamW(fused=True)'s update, in place, over `n` parameters at once: one
// pass over each parameter's elements instead of a dozen. Every array holds `n` tch
// tensors (at::Tensor*); `steps` are float32 scalars holding the step number being taken
// (bias correction reads them). Allocates nothing: no out-of-memory error can strike
// half-way through the update.
int hr_fused_adamw(const at::Tensor* const* params, const at::Tensor* const* grads,
                   const at::Tensor* const* exp_avgs, const at::Tensor* const* exp_avg_sqs,
                   const at::Tensor* const* steps, size_t n, double lr, double beta1,
                   double beta2, double weight_decay, double eps, char* err, size_t err_len) {
  try {
    auto list = [n](const at::Tensor* const* ts) {
      std::vector<at::Tensor> out;
      out.reserve(n);
      for (size_t i = 0; i < n; i++) out.push_back(*ts[i]);
      return out;
    };
    auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs),
         s = list(steps);
    at::NoGradGuard no_grad;
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    return 0;
  } catch (const std::exception& e) {
    copy_err(e.what(), err, err_len);
    return -1;
  } catch (...) {
    copy_err("unknown C++ exception in the fused AdamW update", err, err_len);
    return -1;
  }
}

}  // extern "C"
