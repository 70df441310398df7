//! What tch does not expose of libtorch's compute: a backward pass given the upstream
//! gradient (activation checkpointing chains the blocks' gradients with it), the TF32
//! switches of CUDA matmuls, and the fused multi-tensor AdamW update. All go through
//! trainer/shim/compute_shim.cpp.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

use tch::{TchError, Tensor};

extern "C" {
    fn hr_backward_with_grad(
        output: *const torch_sys::C_tensor,
        grad: *const torch_sys::C_tensor,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
    fn hr_set_tf32(allow: c_int, err: *mut c_char, len: usize) -> c_int;
    fn hr_fused_adamw(
        params: *const *const torch_sys::C_tensor,
        grads: *const *const torch_sys::C_tensor,
        exp_avgs: *const *const torch_sys::C_tensor,
        exp_avg_sqs: *const *const torch_sys::C_tensor,
        steps: *const *const torch_sys::C_tensor,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut c_char,
        len: usize,
    ) -> c_int;
}

fn checked(call: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), TchError> {
    // Room for libtorch's whole message: the out-of-memory test reads its words.
    let mut buf = vec![0 as c_char; 4096];
    if call(buf.as_mut_ptr(), buf.len()) == 0 {
        return Ok(());
    }
    // SAFETY: the shim wrote a NUL-terminated message of at most buf.len() bytes.
    let msg = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Err(TchError::Torch(msg.to_string_lossy().into_owned()))
}

/// `output.backward(grad)`: accumulates d(output·grad) into the `.grad` of every leaf
/// `output` depends on, and frees `output`'s graph.
pub fn backward_with(output: &Tensor, grad: &Tensor) -> Result<(), TchError> {
    if output.size() != grad.size() {
        return Err(TchError::Shape(format!(
            "backward: gradient of shape {:?} for an output of shape {:?}",
            grad.size(),
            output.size()
        )));
    }
    // SAFETY: both pointers are live tch tensors for the duration of the call; the shim
    // catches every C++ exception.
    checked(|err, len| unsafe { hr_backward_with_grad(output.as_ptr(), grad.as_ptr(), err, len) })
}

/// Whether CUDA float32 matmuls and convolutions may use TF32 (process-wide).
pub fn set_tf32(allow: bool) -> Result<(), TchError> {
    // SAFETY: the shim catches every C++ exception.
    checked(|err, len| unsafe { hr_set_tf32(c_int::from(allow), err, len) })
}

/// One group of parameters for [`fused_adamw`], index-aligned; `step` is a float32
/// scalar on the parameters' device holding the number of the step being taken.
pub struct AdamWGroup<'a> {
    pub params: Vec<&'a Tensor>,
    pub grads: Vec<&'a Tensor>,
    pub exp_avgs: Vec<&'a Tensor>,
    pub exp_avg_sqs: Vec<&'a Tensor>,
    pub step: &'a Tensor,
}

/// The AdamW hyper-parameters of one [`fused_adamw`] call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWArgs {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// `torch._fused_adamw_`, the update `torch.optim.AdamW(fused=True)` makes: parameters
/// and moments updated in place, one pass over each parameter's elements, nothing
/// allocated.
pub fn fused_adamw(group: &AdamWGroup, a: AdamWArgs) -> Result<(), TchError> {
    let n = group.params.len();
    if [&group.grads, &group.exp_avgs, &group.exp_avg_sqs]
        .iter()
        .any(|l| l.len() != n)
    {
        return Err(TchError::Shape(
            "fused AdamW: parameter, gradient and moment lists differ in length".into(),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let ptrs = |l: &[&Tensor]| l.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let (p, g, m, v) = (
        ptrs(&group.params),
        ptrs(&group.grads),
        ptrs(&group.exp_avgs),
        ptrs(&group.exp_avg_sqs),
    );
    // The kernel reads one step per parameter; they all take the same one.
    let s = vec![group.step.as_ptr(); n];
    // SAFETY: every pointer is a live tch tensor borrowed for the call, each array holds
    // n of them; the shim catches every C++ exception.
    checked(|err, len| unsafe {
        hr_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            a.lr,
            a.beta1,
            a.beta2,
            a.weight_decay,
            a.eps,
            err,
            len,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn backward_with_a_gradient_matches_backward_of_the_weighted_sum() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let g = Tensor::from_slice(&[0.5f32, -1.0, 2.0]);
        let y = x.square();
        backward_with(&y, &g).unwrap();
        // d(sum(g · x²))/dx = 2 g x
        let want = Tensor::from_slice(&[1.0f32, -4.0, 12.0]);
        assert!(x.grad().equal(&want), "{:?}", x.grad());
        let wrong = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        assert!(backward_with(&x.square(), &wrong).is_err());
        set_tf32(true).unwrap();
    }
}
