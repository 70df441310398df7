// C ABI for two things libtorch's C++ API has and tch does not expose: a backward pass
// given the upstream gradient (activation checkpointing chains blocks' gradients with
// it), and the TF32 switches for CUDA matmuls. Every entry point catches all C++
// exceptions: an exception crossing into Rust is UB.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <cstring>
#include <exception>

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

}  // extern "C"
