//! Every kernel source compiles with NVRTC, as the GPU paths compile them at start-up. Needs
//! libnvrtc but no GPU: `scripts/test.sh` installs the `nvidia-cuda-nvrtc` wheel, puts its
//! library on LD_LIBRARY_PATH and sets TANDEM_REQUIRE_NVRTC=1, so in CI a kernel that does not
//! compile fails here instead of at the start of a GPU session. Without the library (a plain
//! `cargo test` elsewhere) the test says so and passes.

/// Whether libnvrtc can be loaded; without it (and without TANDEM_REQUIRE_NVRTC) the test says
/// that `what` is not checked and passes.
fn nvrtc_or_skip(what: &str) -> bool {
    if tandem_cuda::nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
        "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("libnvrtc not found: {what} not checked");
    false
}

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    if !nvrtc_or_skip("kernel compilation") {
        return;
    }
    match tandem_cuda::compile_all_kernels() {
        Ok(sources) => assert_eq!(
            sources,
            [
                "kernels/llama.cu",
                "kernels/train.cu",
                "kernels/attention_mma.cu",
                "kernels/rows_mma.cu"
            ]
        ),
        Err(e) => panic!("{e}"),
    }
}

/// The tensor-core attention's `mma.sync` is inline PTX, which NVRTC passes into its PTX output
/// unchecked; ptxas (run by NVRTC when it makes machine code) is what would refuse a wrong
/// shape, type or operand count. Assembled for the two architectures it runs on here: sm_80
/// (the least it needs) and sm_90 (the H100/H200).
#[test]
fn the_tensor_core_attention_assembles_for_sm_80_and_sm_90() {
    if !nvrtc_or_skip("kernel assembly") {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        match tandem_cuda::assemble_mma_attention(arch) {
            // Two kernels (head_dim 64 and 128) of a few thousand instructions each.
            Ok(a) => assert!(
                a.cubin_bytes > 10_000,
                "{arch}: a cubin of only {} bytes",
                a.cubin_bytes
            ),
            Err(e) => panic!("{e}"),
        }
    }
}

/// The same for the fused small steps' tensor-core products (`kernels/rows_mma.cu`), which
/// must also keep every value in registers: they are latency bound, and a spill is a trip to
/// local memory inside the k loop.
#[test]
fn the_tensor_core_small_steps_assemble_for_sm_80_and_sm_90_without_spills() {
    if !nvrtc_or_skip("kernel assembly") {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        match tandem_cuda::assemble_mma_rows(arch) {
            // Four kernels of a few hundred to a few thousand instructions each.
            Ok(a) => {
                eprintln!("{arch}:\n{}", a.ptxas_log);
                assert!(
                    a.cubin_bytes > 10_000,
                    "{arch}: a cubin of only {} bytes",
                    a.cubin_bytes
                );
                assert!(
                    a.ptxas_log.matches("Function properties for").count() >= 4,
                    "{arch}: ptxas reported on fewer than four kernels:\n{}",
                    a.ptxas_log
                );
                assert_eq!(a.spills(), Vec::<String>::new(), "{arch}: spills");
            }
            Err(e) => panic!("{e}"),
        }
    }
}
