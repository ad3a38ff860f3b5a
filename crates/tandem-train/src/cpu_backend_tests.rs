//! The CPU backend of the jobs (`CpuBackend`: burn-flex since session 39) against burn-ndarray
//! (the CPU backend before, and still the reference of the tests that train tiny heads): one
//! EAGLE-3 head, the same initial weights (a host RNG), the same batch, three TTT steps of
//! forward and backward through burn's autodiff on each. The loss and the gradients of seven
//! weights (fc, q/k/o, gate/down, lm_head) must agree to 1e-5 relative L2 (measured: <= 1e-6;
//! the two backends sum in different orders, nothing else differs). `tandem train --device cpu`
//! trains on `CpuBackend`.

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::TensorData;
use tandem_model::backend::CpuBackend;
use tandem_model::testing::rel_l2;

use crate::gpu_check::{GradientFixture, gradient_fixture, linear_grad};
use crate::objective::{BatchTargets, draft_id_tensor, objective};

/// The loss and seven weight gradients of one TTT unroll on backend `C`.
fn loss_and_gradients<C: Backend>() -> (f64, Vec<Vec<f32>>) {
    let device: C::Device = Default::default();
    let GradientFixture {
        head,
        vocab,
        model,
        fc_in,
        batch,
    } = gradient_fixture::<C>(&device);
    let (b, w) = (batch.size(), batch.width);
    let draft_ids = draft_id_tensor::<C>(&vocab, &device);
    let targets = BatchTargets::<C>::compute(&head, &batch, &draft_ids);
    let aux = Tensor::<Autodiff<C>, 3>::from_data(
        TensorData::new(batch.aux.clone(), [b, w, fc_in]),
        &device,
    );
    let outputs = model
        .forward_ttt(aux, &batch.input_ids, &batch.lengths, 3)
        .unwrap();
    let targets = BatchTargets::<Autodiff<C>> {
        probs: Tensor::from_inner(targets.probs),
        argmax: targets.argmax,
    };
    let (loss, _) = objective(&outputs, &targets, &batch, &model.vocab);
    let value = loss.clone().into_scalar().elem::<f64>();
    let grads = loss.backward();
    let gradient = |l| linear_grad::<Autodiff<C>>(l, &grads);
    let m = &model.midlayer;
    let gradients = [
        &model.fc,
        &m.self_attn.q_proj,
        &m.self_attn.k_proj,
        &m.self_attn.o_proj,
        &m.mlp.gate_proj,
        &m.mlp.down_proj,
        &model.lm_head,
    ]
    .map(gradient)
    .to_vec();
    (value, gradients)
}

#[test]
fn the_cpu_backend_trains_as_burn_ndarray_does() {
    let (reference_loss, reference) = loss_and_gradients::<burn::backend::NdArray<f32>>();
    let (loss, gradients) = loss_and_gradients::<CpuBackend>();
    assert!(
        ((loss - reference_loss) / reference_loss).abs() < 1e-6,
        "loss {loss} against {reference_loss}"
    );
    for (i, (g, r)) in gradients.iter().zip(&reference).enumerate() {
        assert!(r.iter().any(|&v| v != 0.0), "gradient {i} is all zeros");
        let err = rel_l2(g, r);
        assert!(err < 1e-5, "gradient {i}: relative L2 {err:e}");
    }
}
