//! The GPU trainer against burn's autodiff on the CPU (`tandem_train::gpu_check`). Needs an
//! NVIDIA GPU, so it is ignored in CI:
//! `cargo test -p tandem-train --release --test gpu_trainer -- --ignored`
//! (`tandem train-check` runs the same check from the binary).

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_trainer_matches_burn_autodiff() {
    match tandem_train::gpu_check::gpu_parity_check() {
        Ok(lines) => lines.iter().for_each(|l| eprintln!("{l}")),
        Err(e) => panic!("{e}"),
    }
}
